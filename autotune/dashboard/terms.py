"""Where a plan's step time goes, per pipeline stage, for the "best against best even split" chart.

Preferred source: the cost model's own per-stage figures, ``breakdown["stages"]`` (autotune/cost/
estimate.py), for the pacing rank of each stage: ``compute_s`` (fwd + bwd work), ``exposed_comm_s``
(tp/cp/hp collectives not hidden behind compute), ``pipeline_s`` (when the stage's last backward
ends), ``end_s`` (then the exposed part of the DP gradient sync and ``optimizer_s``). The stack is

    compute + exposed comm + bubble = pipeline_s        (bubble: idle inside the stage's own span)
    pipeline_s + dp sync exposed + optimizer = end_s
    end_s + waiting for the step's last stage = step time

so every stage's bar reaches the step time. (The cost model's ``bubble_s`` counts up to the pipeline
makespan, i.e. also the wait at the end; here that wait is shown after the optimizer.) When a
breakdown has no stages, the seconds per kind of the simulated timeline (timeline.time_by_kind) are
used instead. Stored figures come before recomputed ones, so the chart and the Gantt chart show the
same simulation.
"""

from __future__ import annotations

from typing import Any

from autotune.dashboard.timeline import Timeline, time_by_kind

COST_TERMS = ("compute", "comm (exposed)", "bubble", "dp sync (exposed)", "optimizer", "wait for step end")
TIMELINE_TERMS = ("fwd", "bwd", "comm (exposed)", "bubble", "idle")
DETAIL = ("tp_comm_s", "cp_comm_s", "hp_comm_s", "pp_comm_s", "dp_comm_s")
"""Total (hidden or not) communication per kind, shown on hover."""


def _f(d: dict[str, Any], k: str) -> float:
    v = d.get(k)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def from_cost_stages(bd: dict[str, Any] | None) -> dict[int, dict[str, float]] | None:
    """Per stage seconds of COST_TERMS (plus DETAIL keys) from ``breakdown["stages"]``, or None."""
    stages = (bd or {}).get("stages")
    if not isinstance(stages, list) or not stages:
        return None
    if not all(isinstance(s, dict) and "compute_s" in s and "bubble_s" in s for s in stages):
        return None
    ends = [_f(s, "end_s") for s in stages]
    step = _f(bd, "step_time_s") or max(ends)
    out: dict[int, dict[str, float]] = {}
    for i, s in enumerate(stages):
        compute, exposed, opt = _f(s, "compute_s"), _f(s, "exposed_comm_s"), _f(s, "optimizer_s")
        if "pipeline_s" in s and "end_s" in s:
            pipeline, end = _f(s, "pipeline_s"), _f(s, "end_s")
            bubble = max(0.0, pipeline - compute - exposed)
            dp_exposed = max(0.0, end - pipeline - opt)
            wait = max(0.0, step - end)
        else:  # an older breakdown: the cost model's bubble as it is
            bubble, dp_exposed, wait = _f(s, "bubble_s"), 0.0, 0.0
        row = {"compute": compute, "comm (exposed)": exposed, "bubble": bubble, "dp sync (exposed)": dp_exposed,
               "optimizer": opt, "wait for step end": wait}
        row.update({k: _f(s, k) for k in DETAIL})
        out[int(s.get("stage", i))] = row
    return out


def from_timeline(tl: Timeline) -> dict[int, dict[str, float]]:
    per = time_by_kind(tl)
    return {s: {"fwd": d["fwd"], "bwd": d["bwd"] + d["wgrad"], "comm (exposed)": d["comm"], "bubble": d["bubble"],
                "idle": d["idle"], "comm_overlapped": d["comm_overlapped"]} for s, d in per.items()}


def stage_times(row: Any, context: Any, tl: Timeline | None) -> tuple[dict[int, dict[str, float]] | None, str]:
    """(per-stage seconds, where they come from) for a TrialRow, or (None, why there are none)."""
    if row is None:
        return None, "no feasible plan"
    # what was stored with the trial first (the Gantt chart then shows the same simulation)
    per = from_cost_stages(row.breakdown)
    if per is not None:
        return per, "cost model breakdown stored with the trial"
    if tl is not None and tl.source == "study":
        return from_timeline(tl), "simulated timeline stored with the trial"
    if row.plan is not None and context is not None:
        bd, _why = context.estimate_breakdown(row.plan)
        per = from_cost_stages(bd)
        if per is not None:
            return per, "cost model breakdown recomputed"
    if tl is not None:
        return from_timeline(tl), "simulated timeline"
    return None, "the trial stores no breakdown or timeline, and the cost model cannot recompute it"
