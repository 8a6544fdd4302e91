"""Validation: run a study's best predicted plans for real, calibrate the cost model, re-rank.

For the top K plans the local runtime can run (``autotune.runtime.trial``), a short real trial
measures step time, memory and the per-rank split of compute and communication. Those figures are
stored on the trial beside the prediction (trial user attrs ``measured``, ``losses``, ``failure``,
``prediction_error``); a failed run is recorded with its reason and the next plan runs.

Calibration (contract: ``{device_type: {"compute": f, "comm": f}}``, multiplying predicted times):
per device type, the median over validated ranks of measured / predicted compute seconds, and the
same for communication, where the cost model's breakdown gives per-rank figures; where it does not,
one factor from step times. Those are one starting point of a robust fit on step times
(``refine_calibration``: L1 on log step time, never worse than no calibration), which absorbs what
the per-kind ratios miss (overlap, waits, launch overheads). The study then re-ranks its best plans
with the calibration and records the best measured plan (``best_measured_trial``).

Where: only on the study's own cluster (``autotune.machines``): a mismatch is refused before
anything runs or is written. Each measurement records where it was made (``measured_on``: the
machine and the runtime version); an earlier measurement is reused only when it was made on the same
machine and runtime. The calibration is keyed by what was measured (``calibration_measured``:
device types, precision, runtime version) and applied only to plans of that precision on those
devices (the cost model applies a device type's factors only to that type's ranks).

Memory: each validated plan's predicted memory per rank (the cost model's ``memory_bytes``) beside
the peak the trial measured on that rank, the relative error per rank and its median
(``memory_error``; docs/validation.md says what a CPU figure can and cannot tell about GPU memory).

Errors: before (the search's prediction), after (calibration fitted on every validated plan:
in-sample), and held out (``leave_one_out``: each plan priced with the calibration fitted on the
others, from ``MIN_HELD_OUT`` plans on), the last being what a new plan can expect.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from autotune.errors import InputError, WorkError
from autotune.machines import Machine, check_machines, runtime_version, this_machine
from autotune.objective import cost_at, of_study, sort_key
from autotune.plan import Plan
from autotune.plan_record import PlanRecord
from autotune.study import (
    open_study,
    set_trial_attrs,
    study_documents,
    study_workload,
    trial_plans,
    trial_record,
)

RERANK = 20


@dataclass(frozen=True, kw_only=True)
class ValidateOptions:
    top: int = 3
    steps: int = 3
    warmup: int = 1
    timeout_s: float = 300.0
    device: str = "auto"
    seed: int = 0
    diverse: bool = True
    """Prefer the best plan of each distinct layout before near-copies of one (see validate())."""
    data: str | None = None
    """Token file the trials train on (autotune.runtime.data); None: the synthetic stream."""
    data_dtype: str = "auto"


def _rel_error(pred: float | None, meas: float | None) -> float | None:
    if not pred or not meas:
        return None
    return (pred - meas) / meas


def _rank_terms(breakdown: Any) -> list[dict[str, float]] | None:
    """Per-rank predicted compute and comm seconds from a cost-model breakdown, if it has them."""
    if not isinstance(breakdown, dict):
        return None
    for key in ("ranks", "per_rank", "rank"):
        rows = breakdown.get(key)
        if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
            out = []
            for r in rows:
                comp = r.get("compute_s", r.get("compute"))
                comm = r.get("comm_s")
                if comm is None:
                    comm = sum(float(v) for k, v in r.items() if isinstance(v, (int, float)) and "comm" in k
                               and "exposed" not in k)
                if not isinstance(comp, (int, float)):
                    return None
                out.append({"compute": float(comp), "comm": float(comm or 0.0)})
            return out
    return None


def fit_calibration(runs: list[dict[str, Any]], cluster: Any) -> dict[str, dict[str, float]]:
    """Factors per device type and kind of work from validated runs (see the module docstring).

    Each run: ``plan`` (Plan), ``predicted`` (dict), ``breakdown``, ``measured`` (runtime dict)."""
    ratios: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    step: dict[str, list[float]] = defaultdict(list)
    for run in runs:
        plan, meas = run["plan"], run["measured"]
        split = {s["rank"]: s for s in meas.get("time_split") or []}
        terms = _rank_terms(run.get("breakdown"))
        types = {cluster.devices[plan.device_index(r, cluster)].spec.name for r in range(plan.world)}
        for t in types:
            ps, ms = run["predicted"].get("step_time_s"), meas.get("step_time_s")
            if ps and ms:
                step[t].append(ms / ps)
        if terms is None or len(terms) != plan.world:
            continue
        for r in range(plan.world):
            s = split.get(r)
            if s is None:
                continue
            t = cluster.devices[plan.device_index(r, cluster)].spec.name
            comp = float(s.get("compute_s", 0.0)) - float(s.get("emulated_s", 0.0) or 0.0)
            if terms[r]["compute"] > 0 and comp > 0:
                ratios[t]["compute"].append(comp / terms[r]["compute"])
            if terms[r]["comm"] > 0 and s.get("comm_s", 0) > 0:
                ratios[t]["comm"].append(float(s["comm_s"]) / terms[r]["comm"])
    cal: dict[str, dict[str, float]] = {}
    for t in set(step) | set(ratios):
        fallback = statistics.median(step[t]) if step[t] else 1.0
        cal[t] = {k: (statistics.median(ratios[t][k]) if ratios[t][k] else fallback) for k in ("compute", "comm")}
    return cal


def _scale(cal: dict[str, dict[str, float]], f: float) -> dict[str, dict[str, float]]:
    return {t: {k: v * f for k, v in kinds.items()} for t, kinds in cal.items()}


ANCHOR_WEIGHT = 0.01
"""Weight of |log(factor / start)| beside the data's sum of |log error| (see refine_calibration)."""
FACTOR_BOUNDS = (1 / 50, 50.0)
"""A calibration factor outside these means the model is wrong, not off: it is clamped."""


def _identity(cal: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {t: {k: 1.0 for k in kinds} for t, kinds in cal.items()}


def refine_calibration(cal: dict[str, dict[str, float]], runs: list[dict[str, Any]],
                       step_of: Callable[[dict[str, Any], dict], float | None], rounds: int = 3) -> dict[str, dict[str, float]]:
    """Robust fit on log step time: the factors (device type x kind) that minimise
    sum_i |log(calibrated_i / measured_i)| over the validated plans (L1: the median error is what
    the target measures, and one plan the model gets badly wrong must not drag the others).

    Starts from the best of: no calibration, the per-rank medians (``fit_calibration``), and each
    scaled by the median step ratio; then coordinate search by multiplicative steps, factors kept
    within ``FACTOR_BOUNDS``. So the fitted loss is never worse than the uncalibrated model's. The
    per-rank ratios alone miss what the model does not see per rank (overlap, waits, launch and
    framework overheads)."""
    import math

    lo, hi = FACTOR_BOUNDS

    def loss(c: dict) -> float:
        total = 0.0
        for r in runs:
            s = step_of(r, c)
            if not s:
                return math.inf
            total += abs(math.log(s / r["measured"]["step_time_s"]))
        return total

    def clamp(c: dict) -> dict:
        return {t: {k: min(hi, max(lo, v)) for k, v in kinds.items()} for t, kinds in c.items()}

    starts = [_identity(cal), clamp(cal)]
    for c in list(starts):
        ratios = [r["measured"]["step_time_s"] / s for r in runs if (s := step_of(r, c))]
        if ratios:  # the overall level
            starts.append(clamp(_scale(c, statistics.median(ratios))))
    scored = [(loss(c), i, c) for i, c in enumerate(starts)]
    _, _, anchor = min(scored)

    # a small pull towards the chosen start: where the plans cannot tell two factors apart (three
    # near-identical plans), the data are flat along that direction and the fit must not wander
    # off it, or a held-out plan with another compute/comm mix is priced with arbitrary factors
    def penalised(c: dict) -> float:
        return loss(c) + ANCHOR_WEIGHT * sum(abs(math.log(c[t][k] / anchor[t][k])) for t in c for k in c[t])

    cal = anchor
    best = penalised(cal)
    for step in [2.0, 1.41, 1.19, 1.09, 1.04, 1.02][:max(1, rounds + 3)]:
        improved = True
        while improved:
            improved = False
            for t in cal:
                for k in ("compute", "comm"):
                    for f in (step, 1 / step):
                        trial = {tt: dict(v) for tt, v in cal.items()}
                        trial[t][k] = min(hi, max(lo, trial[t][k] * f))
                        if trial[t][k] == cal[t][k]:
                            continue
                        val = penalised(trial)
                        if val < best - 1e-12:
                            cal, best, improved = trial, val, True
    return cal


def calibrate_runs(runs: list[dict[str, Any]], cluster: Any,
                   step_of: Callable[[dict[str, Any], dict], float | None]) -> dict[str, dict[str, float]]:
    """The calibration validate fits: per-rank medians (``fit_calibration``) refined on step times
    (``refine_calibration``). ``step_of(run, calibration)`` prices a run's plan under a calibration."""
    return refine_calibration(fit_calibration(runs, cluster), runs, step_of)


def leave_one_out(runs: list[dict[str, Any]], cluster: Any,
                  step_of: Callable[[dict[str, Any], dict], float | None]) -> list[float | None]:
    """Held-out error of each run: (calibrated - measured) / measured with the calibration fitted on
    the runs of *other* plans only, i.e. the error a plan that took no part in the fit sees: its
    twins (``_twin``: the same layout at the same price, e.g. the same plan measured twice) are held
    out with it. None where the calibrated model cannot price the run or every run is its twin."""
    out: list[float | None] = []
    for r in runs:
        others = [q for q in runs if _twin(q) != _twin(r)]
        if not others:
            out.append(None)
            continue
        cal = calibrate_runs(others, cluster, step_of)
        out.append(_rel_error(step_of(r, cal), r["measured"]["step_time_s"]))
    return out


def _twin(run: dict[str, Any]) -> tuple[Any, Any]:
    """What makes two runs one plan to the fit: the same layout (``Plan.layout``) priced the same."""
    return run["plan"].layout(), (run.get("predicted") or {}).get("step_time_s")


def held_out_errors(runs: list[dict[str, Any]], cluster: Any,
                    step_of: Callable[[dict[str, Any], dict], float | None]) -> list[float]:
    """|leave-one-out error| (``leave_one_out``: by plan) of every run that has one (empty with fewer
    than 2 plans)."""
    return [abs(e) for e in leave_one_out(runs, cluster, step_of) if e is not None]


def memory_errors(predicted: dict[str, Any], measured: dict[str, Any] | None) -> dict[str, Any] | None:
    """Predicted vs measured peak memory per rank: ``{"predicted_bytes", "measured_bytes", "error"
    (per rank, (pred - meas) / meas), "median_error" (of |error|)}``; None without both figures."""
    pred = predicted.get("memory_bytes") if predicted else None
    meas = (measured or {}).get("peak_memory_bytes")
    if not isinstance(pred, list) or not isinstance(meas, list) or not pred or len(pred) != len(meas):
        return None
    errs = [_rel_error(float(p), float(m)) for p, m in zip(pred, meas, strict=True)]
    known = [abs(e) for e in errs if e is not None]
    return {"predicted_bytes": [float(p) for p in pred], "measured_bytes": [float(m) for m in meas],
            "error": errs, "median_error": statistics.median(known) if known else None}


def calibration_for(user_attrs: dict[str, Any], plan: Plan) -> dict[str, dict[str, float]] | None:
    """The study's calibration if it applies to ``plan`` (same precision and runtime as measured;
    the cost model restricts it to the device types it names), else None (price uncalibrated)."""
    cal, key = user_attrs.get("calibration"), user_attrs.get("calibration_measured")
    if not cal or not isinstance(key, dict):
        return None
    if key.get("precision") != plan.dtype or key.get("runtime") != runtime_version():
        return None
    return cal


def _same_place(before: Any, now: dict[str, Any]) -> bool:
    """Whether an earlier measurement was made where this validation runs (same machines, runtime)."""
    return isinstance(before, dict) and all(before.get(k) == now[k] for k in ("machine", "runtime"))


MIN_HELD_OUT = 3
"""validate reports the leave-one-out error from this many successful runs on (each fit >= 2 plans)."""


def validate(study_name: str, storage: str, *, options: ValidateOptions | None = None,
             runner: Callable[..., Any] | None = None, estimator: Callable[..., Any] | None = None,
             progress: Callable[[str], None] | None = None, machines: list[Machine] | None = None,
             prepare: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Run the top K runnable plans of the study, store measured beside predicted, calibrate, re-rank.

    ``machines``: the nodes the trials launch on (default: this machine as ``options.device`` uses
    it); they must be the study's cluster (``autotune.machines.check_machines``), else a
    ``ClusterMismatch`` (exit 2) before anything runs or is written. ``runner`` (run_trial's
    signature) and ``prepare`` (raises InputError for a plan it cannot run) launch elsewhere than
    local processes: across hosts, ``autotune.runtime.control.Leader``.

    Longer than a screen: each phase is a helper below (``_documents_and_data``, ``_choose_plans``,
    ``_run_plans``, ``_calibrate``, ``_rerank``, ``_store_best``); what stays here is their order."""
    opts = options or ValidateOptions()
    if opts.top < 1:
        raise InputError(f"must be >= 1, got {opts.top}", field="--top")
    if opts.steps < 1:
        raise InputError(f"must be >= 1, got {opts.steps}", field="--steps")
    say = progress or (lambda _m: None)
    if runner is None or estimator is None:
        from autotune.search import default_estimator

        estimator = estimator or default_estimator()
    if runner is None:
        from autotune.runtime.trial import prepare, run_trial
    else:
        run_trial = runner
    study = open_study(study_name, storage)
    model, cluster, seq_len, global_batch = study_workload(study, storage)
    estimator, opts, data_kw = _documents_and_data(study, study_name, opts, estimator, runner, model, seq_len,
                                                   global_batch)
    machines = machines if machines is not None else [this_machine(opts.device)]
    check_machines(study.user_attrs, cluster, storage, machines, study_name)
    measured_on = {"machine": "; ".join(m.describe() for m in machines), "hosts": [m.host for m in machines],
                   "runtime": runtime_version()}
    ranked = trial_plans(study)
    if not ranked:
        raise WorkError(f"study {study_name!r} has no feasible plan to validate; run `autotune search` first")
    chosen, skipped = _choose_plans(ranked, opts, measured_on, prepare, model, seq_len, global_batch)
    runs, rows = _run_plans(chosen, study, opts, run_trial, say, model, seq_len, global_batch, data_kw, measured_on)
    out = _report(study_name, measured_on, rows, skipped)
    out["load_note"] = load_note(cluster, rows)
    if not runs:
        say("every validated plan failed; no calibration")
        return out
    ctx = (model, cluster, seq_len, global_batch)
    # the calibration is fitted on one precision (the one most validated plans ran in): factors
    # measured in bf16 say nothing about an fp32 plan
    precisions = [r["plan"].dtype for r in runs]
    precision = max(sorted(set(precisions)), key=precisions.count)
    measured_here, runs = runs, [r for r in runs if r["plan"].dtype == precision]

    def calibrated_step(plan: Plan, c: dict | None) -> float:
        # no catch-all: an estimator that raises is an error with its own message
        return float(estimator(plan, *ctx, calibration=c).predicted["step_time_s"])

    cal = _calibrate(out, runs, cluster, calibrated_step)
    key = {"devices": sorted(cal), "precision": precision, "runtime": measured_on["runtime"],
           "machine": measured_on["machine"], "plans": len(runs)}
    out["calibration_measured"] = key
    study.set_user_attr("calibration", cal)
    study.set_user_attr("calibration_measured", key)
    study.set_user_attr("calibration_errors", out["calibration_errors"])
    out["reranked"] = _rerank(study, ranked, precision, cal, calibrated_step, seq_len, global_batch)
    study.set_user_attr("calibrated_ranking", [x["trial"] for x in out["reranked"]])
    _store_best(study, out, measured_here, rows)
    return out


def load_note(cluster: Any, rows: list[dict[str, Any]]) -> str | None:
    """One line when the machine's load while its profile was measured and while the trials ran
    differ enough to make predicted against measured unreliable (autotune/machine_load.py)."""
    from autotune import machine_load

    profiled = next((g.device.profile["load"] for g in cluster.groups
                     if isinstance(g.device.profile, dict) and g.device.profile.get("load")), None)
    return machine_load.note(profiled, [(r["measured"] or {}).get("load") for r in rows if r["measured"]])


def _report(study_name: str, measured_on: dict[str, Any], rows: list[dict[str, Any]],
            skipped: list[dict[str, Any]]) -> dict[str, Any]:
    """validate's report before any calibration (what it returns when every plan failed)."""
    mem = [r["memory"]["median_error"] for r in rows if r["memory"] and r["memory"]["median_error"] is not None]
    return {"study": study_name, "measured_on": measured_on, "validated": rows, "skipped": skipped,
            "median_memory_error": statistics.median(mem) if mem else None, "calibration": None,
            "calibration_measured": None,
            "median_error_before": None, "median_error_after": None,
            "median_error_held_out": None, "calibration_errors": None, "best_measured": None,
            "reranked": []}


def _store_best(study: Any, out: dict[str, Any], measured_here: list[dict[str, Any]],
                rows: list[dict[str, Any]]) -> None:
    """The best measured plan into the report and the study, with the trials validated."""
    # every run here was measured on the study's own cluster (checked above), whatever its precision;
    # ranked by the study's objective (autotune/objective.py), its cost figures at the measured step
    obj, trials = of_study(study), {t.number: t for t in study.get_trials(deepcopy=False)}
    best = min(measured_here, key=lambda r: sort_key(obj, r["measured"]["tokens_per_s"], cost_at(
        trials[r["row"]["trial"]].user_attrs, r["measured"]["step_time_s"])))
    out["best_measured"] = {**best["row"]["plan"], "predicted": best["predicted"]}
    out["best_measured_trial"] = best["row"]["trial"]
    study.set_user_attr("best_measured_trial", best["row"]["trial"])
    study.set_user_attr("validated_trials", [r["trial"] for r in rows])


def _documents_and_data(study: Any, study_name: str, opts: ValidateOptions, estimator: Callable[..., Any],
                        runner: Callable[..., Any] | None, model: Any, seq_len: int,
                        global_batch: int) -> tuple[Callable[..., Any], ValidateOptions, dict[str, Any]]:
    """(estimator, options, the trials' data arguments): the study's documents and the token file,
    checked once before any trial starts."""
    data_kw: dict[str, Any] = {}
    docs = study_documents(study)
    if docs is not None and study.user_attrs["documents"].get("doc_mask", True):
        # the study's documents: trials train on the same windows, re-ranking prices them the same way
        from functools import partial

        if runner is not None:
            raise InputError(f"study {study_name!r} masks documents; its trials run on local processes (not yet "
                             "across hosts)", field="--hosts")
        estimator = partial(estimator, documents=docs.dist)
        data_kw["documents"] = docs
        if docs.data is not None and opts.data is None:
            opts = replace(opts, data=docs.data)
    if opts.data is not None or opts.data_dtype != "auto":  # checked once, before any trial starts
        from autotune.runtime.data import prepare_data

        prepare_data(opts.data, model.vocab, seq_len, global_batch, opts.warmup + opts.steps, dtype=opts.data_dtype)
        data_kw.update({"data": opts.data, "data_dtype": opts.data_dtype})
    return estimator, opts, data_kw


def _choose_plans(ranked: list[tuple[Any, Plan]], opts: ValidateOptions, measured_on: dict[str, Any],
                  prepare: Callable[..., Any] | None, model: Any, seq_len: int, global_batch: int
                  ) -> tuple[list[tuple[Any, Plan, bool]], list[dict[str, Any]]]:
    """(chosen (trial, plan, measured here before), skipped): the top K plans this machine can run."""
    chosen, skipped, refused = [], [], set()
    # Two passes: first the best plan of each distinct layout (degrees, schedule, micro-batch),
    # then, if K is not reached, the next best plans whatever their layout. The top
    # of a search is often one layout with small share variations; measuring different layouts is
    # what lets the calibration separate compute from communication and tells the user which layout
    # really wins, and a held-out error over near-copies of one plan would say little.
    for distinct in ((True, False) if opts.diverse else (False,)):
        layouts = {p.layout() for _, p, _ in chosen}
        for t, plan in ranked:
            if len(chosen) >= opts.top:
                break
            if any(c[0].number == t.number for c in chosen) or t.number in refused:
                continue
            if distinct and plan.layout() in layouts:
                continue
            if (t.user_attrs.get("measured") or t.user_attrs.get("failure")) and _same_place(
                    t.user_attrs.get("measured_on"), measured_on):
                chosen.append((t, plan, True))  # validated before here: reuse, do not run again
                layouts.add(plan.layout())
                continue
            if prepare is not None:
                try:
                    prepare(plan, model, seq_len, global_batch, device=opts.device)
                except InputError as e:
                    refused.add(t.number)
                    skipped.append({"trial": t.number, "degrees": plan.degrees.inline(), "reason": e.message})
                    continue
            chosen.append((t, plan, False))
            layouts.add(plan.layout())
    chosen.sort(key=lambda c: -float(c[0].value or 0.0))
    if not chosen:
        why = "; ".join(f"trial {s['trial']} ({s['degrees']}): {s['reason']}" for s in skipped[:3])
        raise WorkError(f"none of the study's plans can run on this machine: {why}")
    return chosen, skipped


def _run_plans(chosen: list[tuple[Any, Plan, bool]], study: Any, opts: ValidateOptions, run_trial: Callable[..., Any],
               say: Callable[[str], None], model: Any, seq_len: int, global_batch: int, data_kw: dict[str, Any],
               measured_on: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(runs that measured a step, a row per chosen plan): each plan run for real (or its earlier
    measurement here reused), its figures stored on its trial beside the prediction."""
    runs, rows = [], []
    for t, plan, done_before in chosen:
        pred = dict(trial_record(t).predicted or {})
        if done_before:
            measured, failure, losses = t.user_attrs.get("measured"), t.user_attrs.get("failure"), t.user_attrs.get(
                "losses") or []
        else:
            say(f"trial {t.number}: running {plan.degrees.inline()} for real ({opts.warmup}+{opts.steps} steps)")
            try:
                res = run_trial(plan, model, seq_len, global_batch, steps=opts.steps, warmup=opts.warmup,
                                seed=opts.seed, timeout_s=opts.timeout_s, device=opts.device, **data_kw)
                measured, failure, losses = res.measured, res.failure, res.losses
            except InputError as e:  # refused before launch: recorded, the study goes on
                measured, failure, losses = None, {"kind": "refused", "rank": None, "message": e.message}, []
        err = _rel_error(pred.get("step_time_s"), (measured or {}).get("step_time_s"))
        memory = memory_errors(pred, measured) if failure is None else None
        attrs = {"measured": measured, "losses": losses, "failure": failure, "prediction_error": err,
                 "memory_error": memory, "measured_on": measured_on}
        if not done_before:
            t = set_trial_attrs(study, t, attrs)
        rows.append({"trial": t.number, "plan": PlanRecord(plan, predicted=pred, measured=measured).to_dict(),
                     "predicted": pred,
                     "measured": measured, "failure": failure, "error": err, "memory": memory})
        if measured and failure is None:
            runs.append({"plan": plan, "predicted": pred, "breakdown": t.user_attrs.get("breakdown"),
                         "measured": measured, "row": rows[-1]})
    return runs, rows


def _calibrate(out: dict[str, Any], runs: list[dict[str, Any]], cluster: Any,
               calibrated_step: Callable[[Plan, dict | None], float]) -> dict[str, dict[str, float]]:
    """Fit the calibration on ``runs`` and write each run's calibrated and held-out error and the
    medians before / after / held out into ``out`` and the runs' rows; returns the calibration."""

    def run_step(run: dict[str, Any], c: dict) -> float | None:
        return calibrated_step(run["plan"], c)

    cal = calibrate_runs(runs, cluster, run_step)
    steps = [calibrated_step(r["plan"], cal) for r in runs]
    before, after = [], []
    for r, s in zip(runs, steps, strict=True):
        e0 = r["row"]["error"]
        e1 = _rel_error(s, r["measured"]["step_time_s"])
        r["row"]["calibrated_step_time_s"] = s
        r["row"]["error_calibrated"] = e1
        if e0 is not None:
            before.append(abs(e0))
        if e1 is not None:
            after.append(abs(e1))
    held: list[float] = []
    if len(runs) >= MIN_HELD_OUT:
        for r, e in zip(runs, leave_one_out(runs, cluster, run_step), strict=True):
            r["row"]["error_held_out"] = e
            if e is not None:
                held.append(abs(e))
    out["calibration"] = cal
    out["median_error_before"] = statistics.median(before) if before else None
    out["median_error_after"] = statistics.median(after) if after else None
    out["median_error_held_out"] = statistics.median(held) if held else None
    out["calibration_errors"] = {"before": out["median_error_before"], "after": out["median_error_after"],
                                 "held_out": out["median_error_held_out"], "plans": len(runs)}
    return cal


def _rerank(study: Any, ranked: list[tuple[Any, Plan]], precision: str, cal: dict[str, dict[str, float]],
            calibrated_step: Callable[[Plan, dict | None], float], seq_len: int, global_batch: int
            ) -> list[dict[str, Any]]:
    """The best predicted plans re-ranked under the calibration (plans of another precision
    uncalibrated), by the study's objective (``objective.sort_key``) at the calibrated step."""
    reranked = []
    for t, plan in ranked[:RERANK]:
        applies = plan.dtype == precision
        s = calibrated_step(plan, cal if applies else None)
        if s:
            reranked.append({"trial": t.number, "degrees": plan.degrees.inline(), "calibrated_step_time_s": s,
                             "calibrated_tokens_per_s": global_batch * seq_len / s, "calibrated": applies,
                             "predicted_tokens_per_s": trial_record(t).tokens_per_s()})
    obj, attrs = of_study(study), {t.number: t.user_attrs for t, _ in ranked[:RERANK]}
    reranked.sort(key=lambda x: sort_key(obj, x["calibrated_tokens_per_s"],
                                         cost_at(attrs[x["trial"]], x["calibrated_step_time_s"])))
    return reranked
