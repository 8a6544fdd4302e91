"""`autotune estimate`: not built yet (issue #3)."""

from __future__ import annotations

import typer

from autotune.errors import WorkError

HELP = "Predict step time, tokens/s, MFU and per-device memory of one plan on a cluster."


def command(ctx: typer.Context) -> None:
    """Predict step time, tokens/s, MFU and per-device memory of one plan on a cluster."""
    raise WorkError("`autotune estimate` is not built yet (issue #3)")


command.__doc__ = HELP
PLACEHOLDER = True
