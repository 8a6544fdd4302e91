"""What a finished search answers: the best plans of the study, the best even split beside them,
one sentence on why the best wins, and, when nothing is feasible, what rules each family out."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

from autotune.advice import nothing_fits
from autotune.cost.tiebreak import rank
from autotune.errors import WorkError
from autotune.plan import Plan
from autotune.plan import stored_plan_is_even as looks_even
from autotune.plan_record import PlanRecord
from autotune.search.options import SearchResult
from autotune.study import iter_trial_plans, trial_record
from autotune.units import counted


def collect(study: Any, storage: str, top: int, elapsed: float, before: int, notes: list[str],
            workload: tuple[Any, Any, int, int] | None = None) -> SearchResult:
    trials = study.get_trials(deepcopy=False)
    # the tie-break rule (autotune.cost.tiebreak) over enough of the best to fill ``top`` places
    from autotune.objective import of_study

    if of_study(study).plain:
        ranked = rank(list(itertools.islice(iter_trial_plans(study), 4 * top + 20)), plan=lambda tp: tp[1],
                      tokens_per_s=lambda tp: float(tp[0].value or 0.0), top=top)
    else:  # a pool search's objective orders the plans (autotune/objective.py)
        ranked = list(itertools.islice(iter_trial_plans(study), top))
    if not ranked:
        memory_bound = [t for t in trials if t.user_attrs.get("infeasible_kind") == "memory"]
        raise WorkError(nothing_fits(memory_bound, workload) or "no feasible plan: " + infeasibility_report(trials))
    best_t = ranked[0][0]
    # one order for all the result shows: the ranked plans (the tie-break's) first, then the study's.
    # The best is #1 of the layouts, the best even split is the best itself when it is one, and the
    # targets are measured against it (not against a plan 0.1% faster the tie-break passed over).
    # The even plans after the ranked ones: parse only those whose shares are even (Plan.is_even's rule)
    base_t, base = next(itertools.chain(((t, p) for t, p in ranked if looks_even(t.user_attrs["plan"])),
                                        iter_trial_plans(study, where=looks_even)), (None, None))
    if base_t is not None:
        study.set_user_attr("baseline_best_trial", base_t.number)
    res = SearchResult(study_name=study.study_name, storage=storage, best=trial_record(best_t),
                       top=[trial_record(t) for t, _ in ranked],
                       baseline_best=trial_record(base_t) if base_t is not None else None, trials=len(trials), new_trials=len(trials) - before, elapsed_s=elapsed,
                       notes=notes, best_trial=best_t.number, baseline_trial=base_t.number if base_t else None)
    res.layouts = best_layouts(itertools.chain(ranked, iter_trial_plans(study)), top)
    if workload is not None:
        res.targets = per_target(study, workload, first=ranked)
    res.why = why_best(res.best, res.baseline_best, best_t.user_attrs.get("breakdown"),
                       base_t.user_attrs.get("breakdown") if base_t else None)
    return res


TARGET_SCAN = 300
"""How many of the study's best plans ``per_target`` reads to find each target's best (each costs
parsing and every exporter's rules: ~1 s for 300 on 2 cores); a target with none among them is None."""


def per_target(study: Any, workload: tuple[Any, Any, int, int], first: Any = ()) -> dict[str, Any]:
    """Per target, the best plan among the study's best TARGET_SCAN it can run (autotune/targets.py),
    ``first`` (the search's ranked plans, the best first) before the others, stored on the study
    (``best_per_target``: trial, tokens/s, ratio to the first plan) for the dashboard too."""
    from autotune.targets import best_per_target, context

    ranked = itertools.chain(first, iter_trial_plans(study))
    found = best_per_target(itertools.islice(ranked, TARGET_SCAN), context(*workload))
    study.set_user_attr("best_per_target", {t: ({k: v[k] for k in ("trial", "tokens_per_s", "ratio")} if v else None)
                                            for t, v in found.items()})
    return found


def best_layouts(ranked: Any, n: int) -> list[tuple[dict[str, Any], Any]]:
    """The best plan of each of the ``n`` best layouts (``Plan.layout``, the rule ``validate`` uses),
    best first, as (plan dict, stored breakdown), from ``(trial, Plan)`` pairs best first."""
    seen: set[Any] = set()
    out = []
    for t, plan in ranked:
        if plan.layout() in seen:
            continue
        seen.add(plan.layout())
        pd = t.user_attrs["plan"]  # with its cost where the search priced one (a pool search)
        out.append(({**pd, "cost": t.user_attrs["cost"]} if "cost" in t.user_attrs else pd, t.user_attrs.get("breakdown")))
        if len(out) >= n:
            break
    return out


def failure_summary(trials: list[Any]) -> str | None:
    """``N plans`` the cost model raised on and the first message, or None when it never raised."""
    msgs = [t.user_attrs["failure"].get("message", "") for t in trials
            if isinstance(t.user_attrs.get("failure"), dict) and t.user_attrs.get("validated_from") is None]
    if not msgs:
        return None
    return f"the cost model raised on {len(msgs)} plan{'s' if len(msgs) > 1 else ''} (e.g. {msgs[0]})"


def infeasibility_report(trials: list[Any]) -> str:
    """Per family, the limit that rules it out (the commonest kind) and its closest example; first,
    when the cost model raised, how often and with what message (a crash is not a limit)."""
    fams: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for t in trials:
        reason = t.user_attrs.get("infeasible_reason")
        fam = t.user_attrs.get("family")
        if not reason or not fam:
            continue
        fams[fam][t.user_attrs.get("infeasible_kind") or reason.split(":", 1)[0]].append(reason)
    failed = failure_summary(trials)
    if not fams:
        return failed or "no trial produced a plan (every point was rejected before pricing)"
    parts = [failed] if failed else []
    for fam in sorted(fams):
        kinds = fams[fam]
        kind = max(kinds, key=lambda k: len(kinds[k]))
        parts.append(f"{fam}: {kind} ({counted(len(kinds[kind]), 'plan')}; e.g. {kinds[kind][0]})")
    return "; ".join(parts)


def _num(d: Any, key: str) -> float | None:
    v = d.get(key) if isinstance(d, dict) else None
    return float(v) if isinstance(v, (int, float)) else None


def _layout_text(plan: Plan) -> str:
    """``dp=2,pp=2``, or a per-stage plan's stages with their own degrees: the one plan description
    (``stages.degrees_text``)."""
    from autotune.stages import degrees_text

    return degrees_text(plan.to_dict())


def _differences(best: Plan, base: Plan) -> list[str]:
    diffs = []
    if _layout_text(best) != _layout_text(base):
        diffs.append(f"{_layout_text(best)} instead of {_layout_text(base)}")
    for k in ("layers", "tokens", "heads", "samples"):
        v = getattr(best.shares, k)
        if v is not None and len(set(v)) > 1:
            diffs.append(f"uneven {k} {list(v)}")
    for k in ("micro_batch_size", "schedule", "recompute", "zero_stage", "sequence_parallel"):
        if getattr(best, k) != getattr(base, k):
            diffs.append(f"{k} {getattr(best, k)}")
    return diffs


def _largest_saving(bd_best: Any, bd_base: Any) -> str:
    if not (isinstance(bd_best, dict) and isinstance(bd_base, dict)):
        return ""
    deltas = [(k, _num(bd_base, k) - _num(bd_best, k)) for k in bd_best  # time terms only (seconds)
              if k.endswith("_s") and k != "step_time_s" and _num(bd_best, k) is not None
              and _num(bd_base, k) is not None]
    deltas = [d for d in deltas if d[1] > 0]
    if not deltas:
        return ""
    k, d = max(deltas, key=lambda x: x[1])
    return f"; the largest saving is {k} ({d:.3g} s less)"


def why_best(best_rec: PlanRecord, base_rec: PlanRecord | None, bd_best: Any, bd_base: Any) -> str:
    """One sentence: how much faster the best plan is than the best even-split plan, and where from."""
    if base_rec is None:
        return "no even-split plan is feasible here; the best plan needs uneven shares or options they lack"
    tb, te = _num(best_rec.predicted or {}, "step_time_s"), _num(base_rec.predicted or {}, "step_time_s")
    if tb is None or te is None or tb <= 0:
        return ""
    best, base = best_rec.plan, base_rec.plan
    if best == base:
        return "the best plan is itself an even split"
    return (f"{te / tb:.2f}x the best even-split plan ({_layout_text(base)}): step {tb:.4g} s vs {te:.4g} s, "
            "from " + (", ".join(_differences(best, base)) or "placement") + _largest_saving(bd_best, bd_base))
