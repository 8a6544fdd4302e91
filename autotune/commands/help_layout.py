"""How ``--help`` is laid out: every ``typer.Typer`` of the CLI is made with ``**PLAIN_HELP`` and every
command with ``cls=Command``.

Plain help is click's layout (typer's ``rich_markup_mode=None``), not typer's rich panels. The panels
share the terminal's width among seven table columns (required mark, long and short names, negative
names, type, help) and cut whatever does not fit: ``--emulate-slowd…`` at 80 columns, ``-b,
--global-batch`` at 60, a default storage URL to ``sqlite:///results/autot…``; and they read help
text as rich markup, so ``layers:ID`` printed as an emoji. Click's list writes an option's names
whole, on a line of their own when they are long, and wraps only the help beside or below them.

Click cuts a command's description in a group's list to what fits on one line ("Search parallel
plans with Optuna over degrees and uneven..."); ``Command`` and ``Group`` give it whole, wrapped.
``tests/unit/test_help_width.py`` runs every command's help at 80 and 60 columns.
"""

from __future__ import annotations

import sys
from typing import Any

from typer.core import TyperCommand, TyperGroup


class _WholeDescription:
    def get_short_help_str(self, limit: int = 45) -> str:
        # no limit: click's make_default_short_help then keeps the first sentence and cuts nothing
        return super().get_short_help_str(limit=sys.maxsize)  # type: ignore[misc]


class Command(_WholeDescription, TyperCommand):
    """A command whose description its group's help lists whole."""


class Group(_WholeDescription, TyperGroup):
    """A command group (``autotune``, ``autotune profile``) whose description is listed whole."""


PLAIN_HELP: dict[str, Any] = {"rich_markup_mode": None, "cls": Group}
