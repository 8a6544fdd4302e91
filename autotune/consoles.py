"""The two consoles everything for people goes through (``--json`` output goes to stdout alone,
``autotune.commands.common.emit_json``): the commands print tables with them, the dashboard's
terminal views and the progress lines too. A module of its own so a lower layer can print without
importing the commands.
"""

from __future__ import annotations

from rich.console import Console

# The terminal's width, or COLUMNS when piped (80 when neither says): tables fit it by leaving
# columns out (autotune/dashboard/tables.py), never by cutting cells.
console = Console()
err_console = Console(stderr=True)
