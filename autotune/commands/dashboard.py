"""`autotune dashboard`: not built yet (issue #8)."""

from __future__ import annotations

import typer

from autotune.errors import WorkError

HELP = "Show a study: terminal view, self-contained HTML report, or optuna-dashboard."


def command(ctx: typer.Context) -> None:
    """Show a study: terminal view, self-contained HTML report, or optuna-dashboard."""
    raise WorkError("`autotune dashboard` is not built yet (issue #8)")


command.__doc__ = HELP
PLACEHOLDER = True
