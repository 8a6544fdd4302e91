"""The grid: every discrete point of the space priced directly, without a sampler in the loop.

Exhaustive where the space has at most GRID_LIMIT points (search_spaces/default.py); otherwise the
first ``--trials N`` points, and the search says it was not exhaustive.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from autotune.search.phases import deadline_passed, pkey
from autotune.search.pricing import Evaluator, Outcome
from autotune.search.workspace import Workspace

GRID_KEEP = 2000  # distinct feasible plans a grid study keeps as trials (the best; see run_grid)


@dataclass
class GridCount:
    points: int = 0
    recorded: int = 0
    plans: int = 0  # distinct plans priced
    repeats: int = 0  # points whose plan an earlier point already gave
    no_plan: int = 0  # points rejected before pricing (divisibility, batch)
    resumed: int = 0  # points the study already held
    not_kept: int = 0  # feasible plans below the best GRID_KEEP when priced
    infeasible: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # plans per limit kind


class _Keep:
    """Which grid points become trials: the best GRID_KEEP feasible values so far (a min-heap), the
    first plan of each family per limit, the first point of each reason for being no plan."""

    def __init__(self, ws: Workspace):
        self.reasons = {r.attrs.get("infeasible_reason") for r in ws.rows if "plan" not in r.attrs}
        self.ruled = {(r.attrs.get("family"), r.attrs.get("infeasible_kind")) for r in ws.rows
                      if "plan" in r.attrs and not r.feasible}
        self.kept = [r.value for r in ws.rows if r.feasible and r.value is not None]
        heapq.heapify(self.kept)
        while len(self.kept) > GRID_KEEP:
            heapq.heappop(self.kept)

    def wants(self, out: Outcome, new: bool, c: GridCount) -> bool:
        if "plan" not in out.attrs:
            c.no_plan += 1
            reason = out.attrs.get("infeasible_reason")
            if reason in self.reasons:
                return False
            self.reasons.add(reason)
            return True
        if not new:
            c.repeats += 1
            return False
        c.plans += 1
        if out.feasible:
            if len(self.kept) < GRID_KEEP:
                heapq.heappush(self.kept, out.value)
            elif out.value > self.kept[0]:
                heapq.heapreplace(self.kept, out.value)
            else:
                c.not_kept += 1
                return False
            return True
        kind = out.attrs.get("infeasible_kind") or ("error" if out.failed else "model")
        c.infeasible[kind] += 1
        if (out.attrs.get("family"), kind) in self.ruled:
            return False
        self.ruled.add((out.attrs.get("family"), kind))
        return True


def run_grid(ws: Workspace, ev: Evaluator, points: Any, deadline: float | None) -> GridCount:
    """Price every point directly (no sampler in the loop) and keep what the study needs: a
    feasible plan when it is among the best GRID_KEEP priced so far (at most ~GRID_KEEP x ln(N /
    GRID_KEEP) trials, written as the grid goes, so an interrupt keeps them), the first plan of each
    family that each limit (memory, model) rules out, and the first point of each distinct reason
    for being no plan; the rest are counted. Persisting every point would cost more than pricing it."""
    have = {pkey(r.params) for r in ws.rows}
    keep = _Keep(ws)
    c = GridCount()
    for p in points:
        if deadline_passed(deadline):
            break
        c.points += 1
        k = pkey(p)
        if k in have:
            c.resumed += 1
            continue
        out, new = ev.evaluate_new(p)
        if not keep.wants(out, new, c):
            continue
        have.add(k)
        ws.record(p, out, sampler=False)
        c.recorded += 1
    return c


def grid_note(size: int, limit: int | None, c: GridCount | None, n_main: int) -> str:
    """What the grid covered, in one note."""
    what = (f"grid: {size:,} points, enumerating the first {limit:,} (NOT exhaustive)"
            if limit else f"grid: exhaustive over all {size:,} points of the space")
    if c is None:
        return what
    bad = ", ".join(f"{n:,} {k}" for k, n in sorted(c.infeasible.items()))
    what += (f"; {c.plans:,} distinct plans priced ({bad or 'none'} infeasible), "
             f"{c.repeats:,} points repeat a plan, {c.no_plan:,} are no plan (divisibility, batch)"
             + (f", {c.resumed:,} were in the study" if c.resumed else "")
             + f"; the study keeps {c.recorded:,} trials: the best {GRID_KEEP:,} feasible plans as "
             "found, one plan per family and limit, one point per reason for no plan")
    if c.points < n_main:
        what += f"; STOPPED after {c.points:,} points (timeout)"
    return what
