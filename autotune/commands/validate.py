"""`autotune validate`: not built yet (issue #6)."""

from __future__ import annotations

import typer

from autotune.errors import WorkError

HELP = "Run a study's top plans as real trials, calibrate the cost model and re-rank."


def command(ctx: typer.Context) -> None:
    """Run a study's top plans as real trials, calibrate the cost model and re-rank."""
    raise WorkError("`autotune validate` is not built yet (issue #6)")


command.__doc__ = HELP
PLACEHOLDER = True
