"""`autotune search`: not built yet (issue #6)."""

from __future__ import annotations

import typer

from autotune.errors import WorkError

HELP = "Search parallel plans with Optuna over degrees and uneven shares using the cost model."


def command(ctx: typer.Context) -> None:
    """Search parallel plans with Optuna over degrees and uneven shares using the cost model."""
    raise WorkError("`autotune search` is not built yet (issue #6)")


command.__doc__ = HELP
PLACEHOLDER = True
