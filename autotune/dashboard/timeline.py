"""The pipeline timeline of a plan and the time it spends per kind of work, per stage.

Events come from the cost model's pipeline simulation, ``breakdown["timeline"]`` (docs/contracts.md,
cost model): ``{"stage", "rank", "kind" (fwd|bwd|comm|bubble), "microbatch", "start", "end"}`` in
seconds. A trial stored without one is recomputed through ``autotune.cost.estimate`` when the cost
model is importable; otherwise there is no timeline, and the report says so rather than drawing a
made-up one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = ("fwd", "bwd", "comm", "bubble")


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


def time_by_kind(tl: Timeline) -> dict[int, dict[str, float]]:
    """Seconds of each kind per stage, plus ``idle`` (step time no event covers). Where a stage's events come from several ranks (tp/dp/cp
    copies of the same stage), the ranks' times are averaged so a stage counts once per step."""
    per: dict[tuple[int, Any], dict[str, float]] = {}
    for e in tl.events:
        key = (int(e["stage"]), e.get("rank"))
        d = per.setdefault(key, dict.fromkeys(KINDS, 0.0))
        kind = e["kind"] if e["kind"] in KINDS else "comm"
        d[kind] += float(e["end"]) - float(e["start"])
    out: dict[int, dict[str, float]] = {}
    counts: dict[int, int] = {}
    for (stage, _), d in per.items():
        acc = out.setdefault(stage, dict.fromkeys(KINDS, 0.0))
        counts[stage] = counts.get(stage, 0) + 1
        for k in KINDS:
            acc[k] += d[k]
    span = tl.makespan
    result = {}
    for s, d in sorted(out.items()):
        avg = {k: v / counts[s] for k, v in d.items()}
        # time inside the step that no event covers (a simulation without explicit bubble events)
        avg["idle"] = max(0.0, span - sum(avg.values()))
        result[s] = avg
    return result
