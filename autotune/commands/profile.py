"""`autotune profile`: not built yet (issue #4)."""

from __future__ import annotations

import typer

from autotune.errors import WorkError

HELP = "Measure this machine's devices and links (GEMM, attention, p2p matrix, collectives) and store a profile."


def command(ctx: typer.Context) -> None:
    """Measure this machine's devices and links (GEMM, attention, p2p matrix, collectives) and store a profile."""
    raise WorkError("`autotune profile` is not built yet (issue #4)")


command.__doc__ = HELP
PLACEHOLDER = True
