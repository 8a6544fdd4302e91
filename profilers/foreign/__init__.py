"""Readers for the per-layer profiles other planners' users have measured.

One module per format, each a ``read(paths, ctx) -> layer-profile document`` (the shape
``profilers/layers.py`` measures and ``profilers/store.py`` stores): ``sailor`` (Sailor, eth-easl),
``metis`` (Metis, SamsungLabs), ``galvatron`` (Hetu-Galvatron, PKU-DAIR). Each module's docstring
says where in its repository the format was read and what every number means; what a format does
not say (the sequence length of Sailor and Metis files, the split of Metis' forward + backward) the
user gives on the command line or the reader fills by that planner's own rule, and the document's
``meta.assumed`` names every such choice. A file that does not parse is one InputError naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.errors import InputError
from profilers.foreign.common import ImportContext, fail  # noqa: F401  (ImportContext: the commands build it)


def readers() -> dict[str, Callable[[list[Path], ImportContext], dict[str, Any]]]:
    from profilers.foreign import galvatron, metis, sailor

    return {"sailor": sailor.read, "metis": metis.read, "galvatron": galvatron.read}


FORMATS = ("sailor", "metis", "galvatron")


def read_foreign(fmt: str, paths: list[Path], ctx: ImportContext) -> dict[str, Any]:
    """The layer-profile document of ``paths`` in format ``fmt``."""
    table = readers()
    if fmt not in table:
        raise InputError(f"must be one of {', '.join(FORMATS)}, got {fmt!r}", field="--format")
    if not paths:
        raise InputError("give at least one file", field="FILE")
    for p in paths:
        if not Path(p).is_file():
            raise fail(p, "no such file")
    return table[fmt]([Path(p) for p in paths], ctx)
