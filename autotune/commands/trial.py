"""`autotune trial`: not built yet (issue #5)."""

from __future__ import annotations

import typer

from autotune.errors import WorkError

HELP = "Run a plan for real on local processes (torch.distributed) and measure it."


def command(ctx: typer.Context) -> None:
    """Run a plan for real on local processes (torch.distributed) and measure it."""
    raise WorkError("`autotune trial` is not built yet (issue #5)")


command.__doc__ = HELP
PLACEHOLDER = True
