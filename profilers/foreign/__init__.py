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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import InputError

MiB = 2.0**20


@dataclass
class ImportContext:
    """What the command line adds to a foreign file."""

    model: Any
    """The ModelSpec the profile was measured on (its shape gates where the cost model uses it)."""
    device: str | None = None
    """Catalogue device name the files were measured on (None: inferred from the file where it can be)."""
    seq: int | None = None
    """Sequence length of the measurement where the format does not record it."""
    dtype: str | None = None
    """Precision of the measurement where the format does not record it."""


def fail(path: str | Path, message: str, field: str | None = None) -> InputError:
    return InputError(message, source=str(path), field=field)


def number(v: Any, path: str | Path, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
        raise fail(path, f"expected a non-negative number, got {v!r}", field)
    return float(v)


def as_mapping(v: Any, path: str | Path, field: str | None, what: str) -> dict:
    if not isinstance(v, dict):
        raise fail(path, f"expected {what}, got {type(v).__name__}", field)
    return v


def document(fmt: str, ctx: ImportContext, device: str, dtype: str, points: list[dict], sources: list[str],
             assumed: list[str], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A layer-profile document from converted points (validated again by the store)."""
    from profilers.layers import LAYER_DOC_KIND, LAYER_SCHEMA_VERSION, LAYER_UNITS, model_dict

    return {"kind": LAYER_DOC_KIND, "schema_version": LAYER_SCHEMA_VERSION, "units": LAYER_UNITS,
            "device_kind": "cuda", "device_name": device, "model": model_dict(ctx.model), "dtype": dtype,
            "origin": fmt, "source": ", ".join(sources),
            "meta": {"format": fmt, "files": sources, "assumed": assumed, **(extra or {})},
            "points": sorted(points, key=lambda p: (p["piece"], p["tp"], p["micro_batch"], p["seq"]))}


def need(value: Any, option: str, fmt: str, what: str) -> Any:
    if value is None:
        raise InputError(f"{fmt} files do not record {what}; give it with {option}", field=option)
    return value


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


def load_json(path: Path) -> Any:
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(path, f"not a readable JSON file ({str(e).splitlines()[0]})") from None
