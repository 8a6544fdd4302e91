"""A live progress display on stderr for long commands (search, validate, profile).

One line per phase that rich redraws in place: the phase, how many of its steps are done (of how
many when that is known), the best result so far, the elapsed time and, where the work or the time
budget is known, the time left. It is off (every call does nothing and nothing is printed) when the
console is not a terminal or the command prints JSON, so pipes and ``--json`` stay clean; it leaves
nothing on screen when it ends (``transient``), the command's own output follows.

    with Progress(err_console, enabled=not json_) as p:
        p.phase("sampler", total=100)           # a new phase; total=None: no bar, no ETA
        p.advance(best="41,200 tok/s")          # one step done; best: the best so far, as text
        p.deadline(time.monotonic() + 60)       # a time budget: the ETA is the lesser of both
        p.say("baselines: 24 trials")           # a line kept above the display (a terminal only)
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, ProgressColumn, SpinnerColumn, Task, TextColumn
from rich.progress import Progress as RichProgress
from rich.text import Text


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--"
    s = int(max(0.0, seconds) + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class _Times(ProgressColumn):
    """``elapsed 0:12, ETA 0:30``: the ETA from the rate of the phase (steps known) or the deadline."""

    def __init__(self, owner: Progress):
        super().__init__()
        self.owner = owner

    def render(self, task: Task) -> Text:
        eta = self.owner.eta(task)
        text = f"elapsed {_clock(time.monotonic() - self.owner.t0)}"
        return Text(text + (f", ETA {_clock(eta)}" if eta is not None else ""), style="dim")


class Progress:
    """The display (see the module docstring). ``enabled=None``: on when ``console`` is a terminal."""

    def __init__(self, console: Console, *, enabled: bool | None = None, unit: str = "trials",
                 opening: str | None = None):
        self.console = console
        self._opening = opening
        self.on = bool(console.is_terminal) if enabled is None else bool(enabled and console.is_terminal)
        self.unit, self.t0, self._deadline = unit, time.monotonic(), None
        self._rich: RichProgress | None = None
        self._task: Any = None
        self._phase_t0 = self.t0

    # ---- lifetime ---------------------------------------------------------------------------
    def __enter__(self) -> Progress:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        if not self.on or self._rich is not None:
            return
        self._rich = RichProgress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(bar_width=20),
                                  MofNCompleteColumn(), TextColumn("{task.fields[unit]}"),
                                  TextColumn("{task.fields[best]}"), _Times(self),
                                  console=self.console, transient=True, refresh_per_second=8)
        self._rich.start()

    def stop(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
            self._task = None

    # ---- what the command reports ---------------------------------------------------------
    def opened(self) -> None:
        """The work has begun (a search: its study is open): ``opening`` is printed, once, on a
        terminal or not. What is refused before (a bad --space, a budget below every subset) then
        prints its one error line and no line announcing a study it never wrote."""
        if self._opening is not None:
            text, self._opening = self._opening, None
            self.console.print(text, highlight=False)

    def phase(self, name: str, total: int | None = None) -> None:
        """Start phase ``name`` (the previous one ends); ``total``: its steps, when known."""
        if self._rich is None:
            return
        best = self._rich.tasks[-1].fields.get("best", "") if self._task is not None else ""
        if self._task is not None:
            self._rich.remove_task(self._task)
        self._phase_t0 = time.monotonic()
        self._task = self._rich.add_task(name, total=total, unit=self.unit, best=best)

    def advance(self, n: int = 1, best: str | None = None) -> None:
        """``n`` steps of the phase done; ``best``: the best result so far, as the user reads it."""
        if self._task is None or self._rich is None:
            return
        kw: dict[str, Any] = {"advance": n}
        if best is not None:
            kw["best"] = f"best {best}"
        self._rich.update(self._task, **kw)

    def deadline(self, at: float | None) -> None:
        """A time budget (``time.monotonic()`` when the command stops): an ETA even without a total."""
        self._deadline = at

    def say(self, text: str) -> None:
        """A line kept above the display (only where the display is on: it is progress, not output)."""
        if self._rich is not None:
            self._rich.console.print(text, highlight=False)

    def eta(self, task: Task) -> float | None:
        """Seconds left: the phase's own rate where its total is known, capped by the deadline."""
        left = None
        if task.total and task.completed:
            rate = task.completed / max(1e-9, time.monotonic() - self._phase_t0)
            left = (task.total - task.completed) / rate
        if self._deadline is not None:
            until = self._deadline - time.monotonic()
            left = until if left is None else min(left, until)
        return left
