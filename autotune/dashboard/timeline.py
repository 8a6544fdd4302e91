"""The pipeline timeline of a plan and the time it spends per kind of work, per stage.

Events come from the cost model's pipeline simulation, ``breakdown["timeline"]`` (docs/contracts.md,
cost model): ``{"stage", "rank", "kind" (fwd|bwd|wgrad|comm|bubble), "microbatch", "start", "end"}``
in seconds, one per operation of the schedule's own order (``autotune/schedules``: the order the
simulation times and the runtime runs); ``wgrad`` is the weight-gradient half of a backward that a
zero-bubble schedule runs apart (``bwd`` is then the input-gradient half). A trial stored without one is recomputed through ``autotune.cost.estimate`` when the cost
model is importable; otherwise there is no timeline, and the report says so rather than drawing a
made-up one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = ("fwd", "bwd", "wgrad", "comm", "bubble")
COMPUTE_KINDS = ("fwd", "bwd", "wgrad")
"""Kinds that are work of the rank (drawn as full bars; the rest of the step is comm or idle)."""


@dataclass
class Timeline:
    events: list[dict[str, Any]]
    source: str
    """"study" (stored with the trial) or "recomputed" (through autotune.cost.estimate)."""

    @property
    def stages(self) -> list[int]:
        return sorted({int(e["stage"]) for e in self.events})

    @property
    def makespan(self) -> float:
        return max((float(e["end"]) for e in self.events), default=0.0)


def _valid(events: Any) -> list[dict[str, Any]] | None:
    if not isinstance(events, list) or not events:
        return None
    out = []
    for e in events:
        if not isinstance(e, dict) or not {"stage", "kind", "start", "end"} <= set(e):
            return None
        try:
            start, end = float(e["start"]), float(e["end"])
            int(e["stage"])
        except (TypeError, ValueError):
            return None
        if end < start:
            return None
        out.append(e)
    return out


def timeline_of(row: Any, context: Any) -> tuple[Timeline | None, str | None]:
    """(Timeline, None) for a ``TrialRow``, or (None, why there is none)."""
    if row is None:
        return None, "no feasible plan"
    events = _valid((row.breakdown or {}).get("timeline"))
    if events:
        return Timeline(events, "study"), None
    if row.plan is None or context is None:
        return None, "the trial stores no plan"
    bd, why = context.estimate_breakdown(row.plan)
    if bd is None:
        return None, f"the trial stores no timeline and {why}"
    events = _valid(bd.get("timeline"))
    if not events:
        return None, "the trial stores no timeline and the cost model's breakdown has none"
    return Timeline(events, "recomputed"), None


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _uncovered(a: float, b: float, covered: list[tuple[float, float]]) -> float:
    """Length of [a, b] outside the merged intervals ``covered``."""
    inside = sum(max(0.0, min(b, y) - max(a, x)) for x, y in covered)
    return max(0.0, (b - a) - inside)


def time_by_kind(tl: Timeline) -> dict[int, dict[str, float]]:
    """Seconds of each kind per stage, summing to the step time: fwd, bwd, wgrad, bubble, exposed comm
    (the part of a send that no fwd/bwd/wgrad/bubble of the same rank covers: the simulation overlaps p2p sends
    with the next operation), idle (the rest of the step no event covers), and ``comm_overlapped``
    beside them (hidden sends, not part of the sum). Where a stage's events come from several ranks
    (tp/dp/cp copies of the same stage) the ranks are averaged, so a stage counts once per step."""
    by_rank: dict[tuple[int, Any], list[dict[str, Any]]] = {}
    for e in tl.events:
        by_rank.setdefault((int(e["stage"]), e.get("rank")), []).append(e)
    span = tl.makespan
    sums: dict[int, dict[str, float]] = {}
    counts: dict[int, int] = {}
    for (stage, _), evs in by_rank.items():
        d = dict.fromkeys((*KINDS, "idle", "comm_overlapped"), 0.0)
        busy = _merge([(float(e["start"]), float(e["end"])) for e in evs if e["kind"] in (*COMPUTE_KINDS, "bubble")])
        for e in evs:
            a, b = float(e["start"]), float(e["end"])
            if e["kind"] in (*COMPUTE_KINDS, "bubble"):
                d[e["kind"]] += b - a
            else:  # comm, or a kind this dashboard does not know: time beside the compute
                exposed = _uncovered(a, b, busy)
                d["comm"] += exposed
                d["comm_overlapped"] += (b - a) - exposed
        covered = _merge([(float(e["start"]), float(e["end"])) for e in evs])
        d["idle"] = max(0.0, span - sum(y - x for x, y in covered))
        acc = sums.setdefault(stage, dict.fromkeys(d, 0.0))
        counts[stage] = counts.get(stage, 0) + 1
        for k, v in d.items():
            acc[k] += v
    return {s: {k: v / counts[s] for k, v in d.items()} for s, d in sorted(sums.items())}
