"""Tables that fit the terminal: the columns that matter first, empty columns hidden, no cut cells.

A table is a list of ``Col`` in display order, each with a priority (0 = always shown). ``fit``
drops columns whose every cell is empty (``-``, ``0ns``, ...), then, unless ``wide``, the
lowest-priority columns until the table's natural width fits the console (the terminal's width, or
``COLUMNS`` when piped; rich's 80 otherwise). Cells fold rather than end in ``...``, so nothing a user
needs is cut: what does not fit is left out whole and the caption says how to see it (``--wide``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

EMPTY = frozenset({"", "-", "0ns", "0B", "0", "0.0%", "0%"})


@dataclass(frozen=True)
class Col:
    header: str
    justify: str = "right"
    priority: int = 1
    """0: always shown (unless empty); higher numbers leave first when the table is too wide."""


def _plain(cell: Any) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


def fit(console: Console, cols: list[Col], rows: list[list[Any]], *, title: str | None = None,
        wide: bool = False, caption: str | None = None) -> Table:
    """The rich Table of ``rows`` with the columns that fit ``console.width`` (all with ``wide``)."""
    keep = [i for i, _ in enumerate(cols) if any(_plain(r[i]).strip() not in EMPTY for r in rows)] if rows \
        else list(range(len(cols)))
    dropped: list[str] = []
    if not wide:
        by_priority = sorted(keep, key=lambda i: (cols[i].priority, i))
        while len(by_priority) > 1 and _width(console, cols, rows, sorted(by_priority), title) > console.width:
            victim = by_priority[-1]
            if cols[victim].priority == 0:
                break
            by_priority.pop()
            dropped.append(cols[victim].header)
        keep = sorted(by_priority)
    notes = [caption] if caption else []
    if dropped:
        notes.append(f"{len(dropped)} more columns with --wide ({', '.join(reversed(dropped))})")
    return _build(cols, rows, keep, title, "; ".join(notes) or None)


def _build(cols: list[Col], rows: list[list[Any]], keep: list[int], title: str | None,
           caption: str | None) -> Table:
    t = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for i in keep:
        t.add_column(cols[i].header, justify=cols[i].justify, overflow="fold")  # type: ignore[arg-type]
    for r in rows:
        t.add_row(*[r[i] if isinstance(r[i], Text) else str(r[i]) for i in keep])
    return t


def _width(console: Console, cols: list[Col], rows: list[list[Any]], keep: list[int], title: str | None) -> int:
    """The width the table wants with nothing folded (title and caption wrap, so they do not count)."""
    t = _build(cols, rows, keep, None, None)
    return console.measure(t, options=console.options.update_width(10_000)).maximum
