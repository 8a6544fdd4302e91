"""The study in the terminal (rich): a summary line and the trials best first, optionally refreshed
live while a search writes the same storage (``--watch``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.text import Text

from autotune.dashboard.data import StudyView, TrialRow, distinct, load_view, speedup
from autotune.dashboard.tables import Col, fit
from autotune.objective import cost_of, cost_text
from autotune.stages import shares_text
from autotune.units import counted, fmt_bytes, fmt_count


def per_mtok_text(c: dict[str, Any] | None) -> str:
    """A plan's cost per million tokens (``objective.figures``), ``-`` without prices."""
    c = c or {}
    return f"{c['per_mtok']:.4g}{c.get('currency') or ''}/Mtok" if c.get("per_mtok") is not None else "-"


def _tps(x: float | None) -> str:
    return fmt_count(x) if x is not None else "-"


def _memory(r: TrialRow) -> Text:
    mem = r.measured_memory_bytes or r.memory_bytes
    if not mem:
        return Text("-")
    peak = max(mem)
    frac = r.memory_fraction
    if frac is None:
        return Text(fmt_bytes(peak))
    cap = r.capacity_bytes[mem.index(peak)] if len(r.capacity_bytes) == len(mem) else max(r.capacity_bytes)
    style = "red" if frac > 1 else ("yellow" if frac > 0.9 else "")
    return Text(f"{fmt_bytes(peak)} / {fmt_bytes(cap)} ({frac:.0%})", style=style)


_STATE_STYLE = {"ok": "green", "infeasible": "yellow", "run failed": "red", "fail": "red", "running": "cyan"}


def _state(r: TrialRow) -> Text:
    s = r.state_text()
    return Text(s, style=_STATE_STYLE.get(s, "dim"))


def table(view: StudyView, limit: int | None = None, console: Console | None = None,
          wide: bool = False) -> Group:
    """The trials, one line per distinct plan, best first, fitted to ``console``'s width (all columns
    without a console or with ``wide``); why a trial failed or is infeasible is written under the
    table, one line each, so a long reason never squeezes the columns."""
    cols = [Col("#", priority=0), Col("degrees", "left", 0), Col("shares", "left", 2),
            Col("schedule mbs x m", "left", 3), Col("predicted tok/s", priority=0), Col("measured tok/s", priority=1),
            Col("error", priority=1), Col("peak memory / capacity", priority=2), Col("state", "left", 0)]
    groups = distinct(view.rows)
    shown = groups if limit is None else groups[:limit]
    priced = any(cost_text(r.cost) for r, _ in shown)  # a priced pool search: what each plan costs
    if priced:
        cols.insert(5, Col("cost per Mtok", priority=0))
    rows, reasons = [], []
    for r, members in shown:
        mark = "*" if any(m is view.best for m in members) else ""
        tag = " (even best)" if any(m is view.even_best for m in members) else ""
        same = f" +{len(members) - 1}" if len(members) > 1 else ""
        err = Text(f"{r.error:+.1%}", style="yellow" if abs(r.error) > 0.2 else "") if r.error is not None else "-"
        row = [f"{r.number}{mark}{same}", r.degrees_text() + tag, shares_text(r.plan, sep=" "),
               r.settings_text(), _tps(r.predicted_tps), _tps(r.measured_tps), err, _memory(r), _state(r)]
        if priced:
            row.insert(5, per_mtok_text(r.cost))
        rows.append(row)
        if r.reason:
            reasons.append(Text(f"#{r.number} {r.state_text()}: {r.reason}", style="dim"))
    notes = []
    if len(shown) < len(groups):
        notes.append(f"{len(groups) - len(shown)} more plans not shown (--limit)")
    if len(groups) < len(view.rows):
        notes.append("+N: N more trials of the same plan")
    fitted = fit(console or Console(width=10_000), cols, rows, wide=wide or console is None,
                 title=f"study {view.name}: trials, best first (* best)", caption="; ".join(notes) or None)
    return Group(fitted, *reasons)


def summary(view: StudyView) -> Text:
    ua = view.user_attrs
    states = ", ".join(f"{n} {s.lower()}" for s, n in sorted(view.states.items())) or "no trials yet"
    txt = Text()
    txt.append(f"{view.name}", style="bold")
    what = " ".join(str(x) for x in (ua.get("model"), ua.get("cluster")) if x)
    if what:
        txt.append(f"  {what}")
    if ua.get("seq_len"):
        txt.append(f"  seq {ua['seq_len']}  batch {ua.get('global_batch')}")
    txt.append(f"\n{counted(len(view.rows), 'trial')}: {states}\n")
    b, e = view.best, view.even_best
    if b is None:
        txt.append("no feasible plan yet", style="yellow")
        near = next((r for r in view.rows if r.state == "COMPLETE" and r.memory_fraction is not None), None)
        if near is not None:
            txt.append(f"; nearest to fitting: #{near.number} {near.degrees_text()} at {near.memory_fraction:.0%} "
                       "of device memory")
        return txt
    which = "measured" if b.measured_tps else "predicted"
    by_cost = (ua.get("objective") or {}).get("kind") == "cost"
    txt.append("best ", style="bold")
    txt.append(f"#{b.number} {b.degrees_text()}: {_tps(b.measured_tps or b.predicted_tps)} tok/s ({which})"
               + (f", {per_mtok_text(b.cost)} (cheapest per token)" if by_cost else ""), style="green")
    if not by_cost:  # a cost study's best is the cheapest, not the fastest: nothing to explain by speed
        txt.append(_best_why(view))
    sp = speedup(b, e)
    if e is not None and e is not b and sp is not None:
        # in a study searched for cost the best may be slower than the even split: the cost says why
        costs = (cost_of({"cost": b.cost}), cost_of({"cost": e.cost})) if by_cost else (None, None)
        txt.append(f"; {sp:.2f}x the {'speed of the ' if by_cost else ''}best even split #{e.number} "
                   f"{e.degrees_text()} ({_tps(e.measured_tps or e.predicted_tps)} tok/s"
                   + (f", {per_mtok_text(e.cost)}: {costs[0] / costs[1]:.2f}x its cost per token)" if all(costs) else ")"))
    elif e is b:
        txt.append("; it is an even split")
    targets = ua.get("best_per_target")
    if targets:  # written by the search (autotune/search/report.py, per_target)
        from autotune.targets import per_target_text

        txt.append("\n" + per_target_text(targets))
    return txt


def _best_why(view: StudyView) -> str:
    """Why the best is not the fastest prediction in the table, when it is not: validate measured it,
    or it ties with a faster plan (within ``TIE_TOLERANCE``) and is the simpler one, as the search and
    ``apply`` choose (cost/tiebreak.py)."""
    from autotune.cost.tiebreak import TIE_TOLERANCE

    b = view.best
    ok = [r for r in view.rows if r.feasible and r.predicted_tps]
    fastest = max(ok, key=lambda r: r.predicted_tps, default=None)
    if b is None or fastest is None or fastest.predicted_tps <= (b.predicted_tps or 0.0):
        return ""
    if b.measured_tps:
        return " (the fastest measured by validate)"
    return (f" ({b.predicted_tps / fastest.predicted_tps - 1:+.1%} against #{fastest.number}'s prediction: "
            f"within {TIE_TOLERANCE:.0%} plans tie and the simpler one is chosen, as search and apply choose)")


def render(view: StudyView, limit: int | None = None, console: Console | None = None, wide: bool = False) -> Group:
    parts: list[Any] = [summary(view), table(view, limit, console, wide)]
    front = view.user_attrs.get("front") or []
    if len(front) > 1 or any(p.get("uses") for p in front):  # a pool search (autotune/search/pool.py)
        from autotune.dashboard.front import front_table

        parts.append(front_table(front, wide=wide))
    parts += [Text(line) for line in view.user_attrs.get("left_out") or []]
    return Group(*parts)


def show(name: str, storage: str, console: Console, limit: int | None = None, wide: bool = False) -> StudyView:
    view = load_view(name, storage)
    console.print(render(view, limit, console, wide))
    return view


def watch(name: str, storage: str, console: Console, *, interval: float = 2.0, limit: int | None = 30,
          max_refreshes: int | None = None, sleep: Callable[[float], Any] = time.sleep) -> StudyView:
    """Re-read the study every ``interval`` seconds and redraw in place until Ctrl-C (or
    ``max_refreshes`` reads). Storage is read fresh each time, so trials another process (a running
    ``autotune search``) commits appear on the next refresh."""
    from rich.live import Live

    view = load_view(name, storage, allow_empty=True)
    reads = 1

    def frame(v: StudyView) -> Group:
        stamp = Text(f"refreshing every {interval:g}s (Ctrl-C to stop); last read {time.strftime('%H:%M:%S')}",
                     style="dim")
        return Group(render(v, limit, console), stamp)

    try:
        with Live(frame(view), console=console, auto_refresh=False, transient=False) as live:
            while max_refreshes is None or reads < max_refreshes:
                sleep(interval)
                view = load_view(name, storage, allow_empty=True)
                reads += 1
                live.update(frame(view), refresh=True)
    except KeyboardInterrupt:  # the normal way to stop watching
        pass
    return view
