"""`autotune apply`: not built yet (issue #7)."""

from __future__ import annotations

import typer

from autotune.errors import WorkError

HELP = "Export a plan for Megatron, torchtitan, DeepSpeed, Accelerate or JSON, or launch it."


def command(ctx: typer.Context) -> None:
    """Export a plan for Megatron, torchtitan, DeepSpeed, Accelerate or JSON, or launch it."""
    raise WorkError("`autotune apply` is not built yet (issue #7)")


command.__doc__ = HELP
PLACEHOLDER = True
