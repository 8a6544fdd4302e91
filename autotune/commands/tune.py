"""`autotune tune`: not built yet (issue #6)."""

from __future__ import annotations

import typer

from autotune.errors import WorkError

HELP = "The whole loop on this machine: profile, search, validate the top 3, export the best plan."


def command(ctx: typer.Context) -> None:
    """The whole loop on this machine: profile, search, validate the top 3, export the best plan."""
    raise WorkError("`autotune tune` is not built yet (issue #6)")


command.__doc__ = HELP
PLACEHOLDER = True
