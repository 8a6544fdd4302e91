"""A study read into plain rows for the views (terminal, HTML report, JSON).

The study's shape is docs/contracts.md, "Study": trial user attrs ``plan`` (Plan.to_dict() with
``predicted``), ``breakdown``, ``infeasible_reason``, ``baseline``, ``measured``, ``failure``; study
user attrs ``model``/``model_spec``, ``cluster``/``cluster_spec``, ``seq_len``, ``global_batch``,
``baseline_best_trial``, ``best_measured_trial``. The trial value is predicted tokens/s. Every view
reads the same ``StudyView`` so the terminal, the report and ``--json`` never disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune import dims
from autotune.errors import InputError
from autotune.plan_parts import stored_plan_is_even

DIMS = tuple(n for n in dims.WRITTEN if not dims.dimension(n).folds)  # as plans write them (autotune/dims.py)


def optuna_storage(url: str) -> Any:
    """The Optuna storage for ``--storage``: a SQLAlchemy URL, or a journal file path ending in .log
    (as the shared ``--storage`` option documents). A SQLite path that does not exist is refused:
    Optuna would silently create an empty database there."""
    try:  # the search's own storage opener (issue 6), when present: same URLs, same refusals
        from autotune.study import storage_for
    except ImportError:
        storage_for = None
    if storage_for is not None:
        return storage_for(url, create=False)
    import optuna

    if "://" not in url and url.endswith(".log"):
        if not Path(url).exists():
            raise InputError(f"no such journal file {url!r}; run `autotune search` first or pass --storage",
                             field="--storage")
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        return JournalStorage(JournalFileBackend(url))
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///"):]
        if path and path != ":memory:" and not Path(path).exists():
            raise InputError(f"no such database file {path!r}; run `autotune search` first or pass --storage",
                             field="--storage")
    try:
        return optuna.storages.RDBStorage(url)
    except Exception as exc:  # noqa: BLE001 - bad URL, unreachable server, not an Optuna database
        raise InputError(f"cannot open storage {url!r}: {type(exc).__name__}: {exc}".split("\n")[0],
                         field="--storage") from None


def study_names(storage: Any) -> list[str]:
    import optuna

    return sorted(optuna.get_all_study_names(storage=storage))


def open_study(name: str, storage_url: str) -> Any:
    """The Optuna study ``name``; a missing one is an InputError listing the studies that exist."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna_storage(storage_url)
    try:
        return optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        names = study_names(storage)
        known = ("; studies in this storage: " + ", ".join(names)) if names else " (the storage holds no study)"
        raise InputError(f"no study named {name!r} in {storage_url}{known}", field="--study") from None


@dataclass
class TrialRow:
    """One trial as the views show it. Throughputs in tokens/s, memory in bytes."""

    number: int
    state: str
    """COMPLETE, FAIL, RUNNING, PRUNED or WAITING (Optuna's trial states)."""
    feasible: bool
    predicted_tps: float | None
    measured_tps: float | None
    error: float | None
    """(predicted - measured) / measured: +0.10 means the cost model was 10% optimistic."""
    degrees: dict[str, int] = field(default_factory=dict)
    shares: dict[str, list[int] | None] = field(default_factory=dict)
    memory_bytes: list[float] = field(default_factory=list)
    """Predicted memory per rank."""
    measured_memory_bytes: list[float] = field(default_factory=list)
    """Measured peak memory per rank (after a real trial)."""
    capacity_bytes: list[float] = field(default_factory=list)
    reason: str | None = None
    """Why the trial is infeasible or failed (None when fine)."""
    baseline: str | None = None
    even: bool | None = None
    """True when every share is an even split (the Megatron/torchtitan shape)."""
    step_time_s: float | None = None
    run_failed: bool = False
    """The short real run (validate) of this plan failed; ``reason`` says how."""
    plan: dict[str, Any] | None = None
    breakdown: dict[str, Any] | None = None
    cost: dict[str, Any] | None = None
    """What the plan costs (``objective.figures``: per hour, per step, per million tokens) where the
    search priced it (a pool search)."""

    @property
    def memory_fraction(self) -> float | None:
        """The worst rank's peak (measured where known, else predicted) over its capacity."""
        mem = self.measured_memory_bytes or self.memory_bytes
        if not mem or not self.capacity_bytes or len(self.capacity_bytes) != len(mem):
            return None
        return max(m / c for m, c in zip(mem, self.capacity_bytes, strict=True) if c)

    def state_text(self) -> str:
        if self.state == "COMPLETE":
            return "run failed" if self.run_failed else ("ok" if self.feasible else "infeasible")
        return self.state.lower()

    def settings_text(self) -> str:
        """``1f1b 1x12 rc=selective zero1 sp``: schedule, micro-batch size x micro-batches, and what
        is not the default (recomputation, ZeRO stage, sequence parallelism, dtype)."""
        p = self.plan or {}
        if not p:
            return "-"
        vs = p.get("virtual_stages") or 1
        parts = [str(p.get("schedule", "1f1b")) + (f"/v{vs}" if vs > 1 else ""),
                 f"{p.get('micro_batch_size', 1)}x{p.get('num_microbatches')}"]
        if p.get("recompute") not in (None, "none"):
            parts.append(f"rc={p['recompute']}")
        if p.get("zero_stage"):
            parts.append(f"zero{p['zero_stage']}")
        if p.get("sequence_parallel"):
            parts.append("sp")
        if p.get("dtype") not in (None, "bf16"):
            parts.append(str(p["dtype"]))
        return " ".join(parts)

    def degrees_text(self) -> str:
        """The one plan description (``stages.degrees_text``: a mesh's degrees or each stage's own);
        "-" for a trial without a plan."""
        from autotune.stages import degrees_text

        return degrees_text(self.plan) if self.plan else "-"

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, "state": self.state, "feasible": self.feasible,
                "predicted_tokens_per_s": self.predicted_tps, "measured_tokens_per_s": self.measured_tps,
                "error": self.error, "degrees": self.degrees, "shares": self.shares,
                "stages": (self.plan or {}).get("stages"),
                "memory_bytes": self.memory_bytes, "measured_memory_bytes": self.measured_memory_bytes,
                "capacity_bytes": self.capacity_bytes, "memory_fraction": self.memory_fraction,
                "reason": self.reason, "baseline": self.baseline, "even": self.even,
                "step_time_s": self.step_time_s, "run_failed": self.run_failed, "cost": self.cost}


@dataclass
class StudyView:
    name: str
    storage: str
    user_attrs: dict[str, Any]
    rows: list[TrialRow]
    """Best first (see ``order``)."""
    best: TrialRow | None
    even_best: TrialRow | None
    """The best feasible even-split plan (the study's ``baseline_best_trial`` when it names one)."""
    states: dict[str, int]
    direction: str = "maximize"
    context: Any = None
    """The ``StudyContext`` (model and cluster rebuilt from the study's user attrs)."""

    def to_dict(self) -> dict[str, Any]:
        return {"study": self.name, "storage": self.storage, "trials": len(self.rows), "states": self.states,
                "model": self.user_attrs.get("model"), "cluster": self.user_attrs.get("cluster"),
                "seq_len": self.user_attrs.get("seq_len"), "global_batch": self.user_attrs.get("global_batch"),
                "best": self.best.to_dict() if self.best else None,
                "even_best": self.even_best.to_dict() if self.even_best else None,
                "speedup_vs_even": speedup(self.best, self.even_best),
                "rows": [r.to_dict() for r in self.rows]}


def plan_key(plan: dict[str, Any]) -> str:
    """What makes two trials the same plan (as autotune.study.plan_key: not predictions or provenance)."""
    import json

    return json.dumps({k: v for k, v in plan.items() if k not in ("predicted", "measured", "provenance", "workload")},
                      sort_keys=True, default=str)


def distinct(rows: list[TrialRow]) -> list[tuple[TrialRow, list[TrialRow]]]:
    """Rows grouped by plan, in the given (best-first) order: (first row of the plan, all its rows).
    The search records a trial each time its sampler proposes a plan it has already priced, so a
    study holds many copies of its best plans; the tables show each plan once."""
    groups: dict[str, tuple[TrialRow, list[TrialRow]]] = {}
    out: list[tuple[TrialRow, list[TrialRow]]] = []
    for r in rows:
        if r.plan is None or r.state != "COMPLETE":
            out.append((r, [r]))
            continue
        k = plan_key(r.plan)
        if k in groups:
            groups[k][1].append(r)
        else:
            groups[k] = (r, [r])
            out.append(groups[k])
    return out


def speedup(best: TrialRow | None, even: TrialRow | None) -> float | None:
    """best / even-split throughput, measured when both were measured, else predicted."""
    if best is None or even is None:
        return None
    if best.measured_tps and even.measured_tps:
        return best.measured_tps / even.measured_tps
    if best.predicted_tps and even.predicted_tps:
        return best.predicted_tps / even.predicted_tps
    return None


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _nums(x: Any) -> list[float]:
    if not isinstance(x, list):
        return []
    return [float(v) for v in x if _num(v) is not None]


def _constraints_ok(t: Any) -> bool:
    cons = getattr(t, "constraints", None) or t.system_attrs.get("constraints") or []
    values = cons.values() if isinstance(cons, dict) else cons  # optuna 5: {name: value}; 4: [values]
    return not any(c > 0 for c in values)


def _is_even(plan: dict[str, Any]) -> bool | None:
    """Plan.is_even on the stored plan (without rebuilding it: old rows may not validate); None when
    it records no shares."""
    shares = plan.get("shares") or {}
    if all(v is None for v in shares.values()):
        return None
    return stored_plan_is_even(plan)


def _failure_text(t: Any, ua: dict[str, Any]) -> str | None:
    f = ua.get("failure")
    if isinstance(f, dict) and f:
        where = f" on rank {f['rank']}" if f.get("rank") is not None else ""
        return f"{f.get('kind', 'error')}{where}: {f.get('message', '')}".strip()
    if ua.get("infeasible_reason"):
        return str(ua["infeasible_reason"])
    if t.state.name == "FAIL":
        return str(t.system_attrs.get("fail_reason") or ua.get("fail_reason") or "failed (no reason recorded)")
    if t.state.name == "COMPLETE" and not _constraints_ok(t):
        return "violates a constraint"
    return None


def trial_row(t: Any, capacity_of: Any = None) -> TrialRow:
    """``capacity_of(plan_dict) -> [bytes per rank]`` fills capacity when ``predicted`` lacks it."""
    ua = t.user_attrs
    plan = ua.get("plan") if isinstance(ua.get("plan"), dict) else None
    pred = (plan or {}).get("predicted") or {}
    meas = ua.get("measured") if isinstance(ua.get("measured"), dict) else (plan or {}).get("measured") or None
    state = t.state.name
    pred_tps = _num(pred.get("tokens_per_s"))
    if pred_tps is None and state == "COMPLETE":
        pred_tps = _num(t.value)
    meas_tps = _num((meas or {}).get("tokens_per_s"))
    failed_run = isinstance(ua.get("failure"), dict) and bool(ua.get("failure"))
    if failed_run:
        meas_tps = None
    error = (pred_tps - meas_tps) / meas_tps if pred_tps is not None and meas_tps else None
    feasible = (state == "COMPLETE" and _constraints_ok(t) and not ua.get("infeasible_reason")
                and pred.get("feasible", True) is not False and plan is not None)
    capacity = _nums(pred.get("capacity_bytes"))
    if not capacity and plan is not None and capacity_of is not None:
        capacity = capacity_of(plan) or []
    shares = dict((plan or {}).get("shares") or {})
    return TrialRow(
        number=t.number, state=state, feasible=feasible, predicted_tps=pred_tps, measured_tps=meas_tps,
        error=error, degrees={k: int((plan or {}).get("degrees", {}).get(k, 1)) for k in DIMS} if plan else {},
        shares=shares, memory_bytes=_nums(pred.get("memory_bytes")),
        measured_memory_bytes=_nums((meas or {}).get("peak_memory_bytes")), capacity_bytes=capacity,
        reason=_failure_text(t, ua), baseline=ua.get("baseline"), even=_is_even(plan or {}),
        step_time_s=_num(pred.get("step_time_s")), run_failed=failed_run and state == "COMPLETE", plan=plan,
        breakdown=ua.get("breakdown") if isinstance(ua.get("breakdown"), dict) else None,
        cost=ua.get("cost") if isinstance(ua.get("cost"), dict) else None)


_STATE_ORDER = {"COMPLETE": 0, "RUNNING": 2, "WAITING": 3, "PRUNED": 4, "FAIL": 5}


def order(rows: list[TrialRow], best: TrialRow | None, by_cost: bool = False) -> list[TrialRow]:
    """Best first: the chosen best, then feasible trials by measured (else predicted) tokens/s (by
    cost per token first in a study searched for cost), then infeasible ones (nearest to fitting in
    memory first), then running, waiting, pruned and failed trials by number."""
    from autotune.objective import cost_of

    def key(r: TrialRow) -> tuple:
        group = 0 if r is best else (1 if r.feasible else 2 + _STATE_ORDER.get(r.state, 6))
        tps = r.measured_tps if r.measured_tps is not None else (r.predicted_tps or 0.0)
        # infeasible plans: the nearest to fitting in memory first, then the fastest
        near = (r.memory_fraction if r.memory_fraction is not None else math.inf) if group == 2 else 0.0
        if by_cost and group == 1:
            near = cost_of({"cost": r.cost}) if r.cost else math.inf
        return (group, near, -tps if group <= 2 else 0.0, r.number)

    return sorted(rows, key=key)


def _choose_best(study: Any, rows: list[TrialRow]) -> TrialRow | None:
    """The study's ``best_measured_trial`` when validate set one, else ``study.best_feasible`` (the
    fastest prediction, ties to the simpler plan), as ``search`` and ``apply`` choose."""
    from autotune.study import best_feasible

    by_number = {r.number: r for r in rows}
    measured = study.user_attrs.get("best_measured_trial")
    if isinstance(measured, int) and measured in by_number and by_number[measured].plan is not None:
        return by_number[measured]
    t = best_feasible(study)
    return by_number.get(t.number) if t is not None else None


def _choose_even(study: Any, rows: list[TrialRow], best: TrialRow | None) -> TrialRow | None:
    by_number = {r.number: r for r in rows}
    named = study.user_attrs.get("baseline_best_trial")  # the search's pick among its baselines
    if isinstance(named, int) and named in by_number and by_number[named].feasible and by_number[named].even:
        return by_number[named]
    ok = [r for r in rows if r.feasible and r.even and r.predicted_tps is not None]
    return max(ok, key=lambda r: (r.measured_tps or 0.0, r.predicted_tps, -r.number)) if ok else None


def load_view(name: str, storage_url: str, *, allow_empty: bool = False) -> StudyView:
    """Read study ``name``. An empty study is an InputError unless ``allow_empty`` (``--watch`` waits
    for a search that has just created its study). The study's context (model, cluster) supplies
    device capacities for rows whose prediction lacks them."""
    from autotune.dashboard.context import StudyContext
    from autotune.objective import of_study

    study = open_study(name, storage_url)
    trials = study.get_trials(deepcopy=False)
    if not trials and not allow_empty:
        raise InputError(f"study {name!r} in {storage_url} has no trials yet; run `autotune search --study "
                         f"{name}` first (or watch it with --watch)", field="--study")
    context = StudyContext(dict(study.user_attrs), storage_url)
    capacity_of = context.capacity_of
    # Journal and in-memory storages cannot update a finished trial, so validate stores a copy that
    # carries the measurement and ``validated_from`` (autotune.study.set_trial_attrs): show the copy only.
    superseded = {t.user_attrs.get("validated_from") for t in trials} - {None}
    rows = [trial_row(t, capacity_of) for t in trials if t.number not in superseded]
    best = _choose_best(study, rows)
    even = _choose_even(study, rows, best)
    states: dict[str, int] = {}
    for r in rows:
        states[r.state] = states.get(r.state, 0) + 1
    # a multi-objective study has no single direction (Optuna raises on ``study.direction``): said so
    direction = study.direction.name.lower() if len(study.directions) == 1 else "multi-objective"
    return StudyView(name=name, storage=storage_url, user_attrs=dict(study.user_attrs), rows=order(rows, best, by_cost=of_study(study).kind == "cost"),
                     best=best, even_best=even, states=states, direction=direction, context=context)
