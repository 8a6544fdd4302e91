"""The search: Optuna over a search space, every point priced by the cost model.

Phases (all trials of one study, docs/contracts.md "Study"):

1. **Baselines** first (the space's even splits: Megatron-style tp x pp x dp, pure CP, pure Ulysses,
   every even CP x Ulysses mix), so the answer is never worse than them.
2. **Balanced starts** (tpe/random): one start per degree layout with speed-balanced shares, and the
   least-memory variant where it does not fit (run_starts), so every layout gets a fair price.
3. **Sampler**: TPE (default; multivariate, Watanabe 2023) or random, ``--workers K`` processes on
   one study; or the grid (every discrete point with even and speed-balanced shares, priced directly
   without a sampler, exhaustive where it has at most GRID_LIMIT points; says so where not).
4. **Polish**: a variable-neighbourhood hill climb from the best plan of each of the best layouts:
   every value of one parameter, then two coupled parameters at once (recompute x ZeRO x micro-batch,
   degrees x micro-batch / placement). This, not TPE, is what reaches the grid optimum (measured:
   the old TPE + one-step climb reached 93.8% on 16 A100: ZeRO 1 -> 3 needs a pair move).

Speed. Optuna's in-memory storage deep-copies every trial it adds or returns, TPE's cost per trial
grows with the trials in its study, and RDB storage costs ~25 ms per trial write (SQLite): so TPE
samples on a private study of params and values only, full trials (plan, breakdown) go to the real
study in batches (at least every ``batch_s`` seconds, at the end, and on Ctrl-C / SIGTERM; spill
file against SIGKILL, autotune/spill.py), their big attrs shared rather than copied (_Shared), and
only priced plans become trials in the polish and the grid. Equal plans are priced once (cache).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import multiprocessing as mp
import os
import signal
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autotune.errors import InputError, WorkError
from autotune.plan import Placement, Plan, shares_are_even
from autotune.spill import Spill, recover
from autotune.study import (
    MEMORY_URL,
    StudyRecord,
    create_or_open,
    is_feasible,
    iter_trial_plans,
    plan_key,
    storage_for,
    worker_count_ok,
)

SAMPLERS = ("tpe", "random", "grid")
DEFAULT_TRIALS = 100
POLISH_FACTOR = 8  # the hill climb may price up to this many times the sampler's trials (it converges
# sooner; each of its points costs one estimate, no sampler work, so it is the cheap part of the search)
TIMELINE_LIMIT = 4000  # events kept per trial; larger timelines are stored for the best plans only


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    trials: int | None = None
    """Sampler trials (baselines and the polish's hill climb, up to POLISH_FACTOR x, come on top);
    None: DEFAULT_TRIALS, or the whole grid."""
    timeout_s: float | None = None
    sampler: str = "tpe"
    workers: int = 1
    seed: int = 0
    top: int = 5
    space: str = "default"
    batch_s: float = 1.0
    polish: bool = True
    dtype: str = "bf16"


@dataclass
class SearchResult:
    study_name: str
    storage: str
    best: Plan
    top: list[Plan]
    baseline_best: Plan | None
    trials: int
    new_trials: int
    elapsed_s: float
    notes: list[str] = field(default_factory=list)
    why: str = ""
    best_trial: int = -1
    baseline_trial: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"best": self.best.to_dict(), "top": [p.to_dict() for p in self.top],
                "baseline_best": self.baseline_best.to_dict() if self.baseline_best else None,
                "trials": self.trials, "new_trials": self.new_trials, "elapsed_s": self.elapsed_s,
                "study": self.study_name, "storage": self.storage, "best_trial": self.best_trial,
                "baseline_trial": self.baseline_trial, "notes": self.notes, "why": self.why}


def space_names() -> list[str]:
    import pkgutil

    import search_spaces

    return sorted({m.name for m in pkgutil.iter_modules(list(search_spaces.__path__))
                   if not m.name.startswith("_") and m.name != "base"})


def load_space(name: str) -> Any:
    """The module ``search_spaces.<name>`` (works whether search_spaces is installed as a regular or,
    by an old editable install, a namespace package)."""
    import importlib

    from autotune.errors import suggest

    names = space_names()
    if name not in names:
        raise InputError(f"unknown search space {name!r}" + suggest(name, names), field="--space")
    return importlib.import_module(f"search_spaces.{name}")


# ---- pricing one point -------------------------------------------------------------------------
def default_estimator() -> Callable[..., Any]:
    try:
        from autotune.cost import estimate
    except ImportError as exc:
        raise WorkError(f"the cost model (autotune.cost) is not available in this build: {exc}") from None
    return estimate


@dataclass
class Outcome:
    """What one point of the space became: the trial value, user attrs and constraints."""

    value: float
    attrs: dict[str, Any]
    constraints: dict[str, float]
    failed: bool = False


RANKS_LIMIT = 64  # per-rank rows kept up to this world (what validate calibrates from); stages always


def _trim_breakdown(bd: Any) -> Any:
    """Keep stored trials small: the copies Optuna makes of every trial's attrs dominate the search
    time at scale (measured: deepcopy was half of a grid search's time at 8 devices)."""
    if not isinstance(bd, dict):
        return bd
    if isinstance(bd.get("timeline"), list) and len(bd["timeline"]) > TIMELINE_LIMIT:
        bd = {**bd, "timeline": None, "timeline_events": len(bd["timeline"])}
    if isinstance(bd.get("ranks"), list) and len(bd["ranks"]) > RANKS_LIMIT:
        bd = {**bd, "ranks": None, "ranks_dropped": len(bd["ranks"])}
    return bd


# attrs that belong to one trial, not to the plan it priced (not copied from a cached plan)
_PER_TRIAL_ATTRS = ("origin", "baseline", "baseline_key", "polish", "measured", "losses", "failure",
                    "prediction_error", "validated_from")


class Evaluator:
    """Prices points of a space, once per distinct plan."""

    def __init__(self, space: Any, estimator: Callable[..., Any], calibration: dict | None = None):
        import inspect

        self.space, self.estimator, self.calibration = space, estimator, calibration
        self.cache: dict[Any, Outcome] = {}  # by the (frozen, hashable) resolved Plan
        self.calls = 0
        self.best = 0.0
        self._primed: set[int] = set()
        # The Gantt timeline costs a third of an estimate at scale: price without it, and draw it
        # again only for a plan that beats every plan so far (so the best plan always has one).
        try:
            self.has_timeline = "timeline" in inspect.signature(estimator).parameters
        except (TypeError, ValueError):
            self.has_timeline = False

    def _estimate(self, plan: Plan, timeline: bool) -> Any:
        ctx = self.space.ctx
        kw: dict[str, Any] = {"calibration": self.calibration}
        if self.has_timeline:
            kw["timeline"] = timeline
        return self.estimator(plan, ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch, **kw)

    def evaluate(self, params: dict[str, Any]) -> Outcome:
        return self.evaluate_new(params)[0]

    def evaluate_new(self, params: dict[str, Any]) -> tuple[Outcome, bool]:
        """The outcome and whether it was priced now (False: no plan, or a plan priced before)."""
        from search_spaces.base import Infeasible

        built = self.space.build(params)
        if isinstance(built, Infeasible):
            return Outcome(0.0, {"infeasible_reason": f"{built.kind}: {built.reason}", "infeasible_kind": built.kind,
                                 "family": built.family or None, "baseline": None},
                           {"memory": 0.0, "divisibility": 1.0}), False
        hit = self.cache.get(built)
        if hit is not None:
            return hit, False
        return self._price(built), True

    def _price(self, built: Plan) -> Outcome:
        from search_spaces.base import family_of

        key = built
        self.calls += 1
        try:
            est = self._estimate(built, timeline=not self.has_timeline)
            if self.has_timeline and est.predicted.get("feasible", True) and \
                    float(est.predicted.get("tokens_per_s") or 0) > self.best:
                self.best = float(est.predicted["tokens_per_s"])
                est = self._estimate(built, timeline=True)
        except InputError as e:  # the cost model refused the plan: a limit, recorded
            out = Outcome(0.0, {"plan": plan_dict(built), "infeasible_reason": f"divisibility: {e.message}",
                                "infeasible_kind": "divisibility", "family": family_of(built), "baseline": None},
                          {"memory": 0.0, "divisibility": 1.0})
            self.cache[key] = out
            return out
        except Exception as e:  # noqa: BLE001 - a failed trial never kills a study
            out = Outcome(0.0, {"plan": plan_dict(built), "failure": {"kind": "error", "rank": None,
                                                                      "message": f"{type(e).__name__}: {e}"},
                                "family": family_of(built), "baseline": None}, {}, failed=True)
            self.cache[key] = out
            return out
        pred = dict(est.predicted)
        plan = est.plan if est.plan is not None else built.replace(predicted=pred)
        bd = _trim_breakdown(getattr(est, "breakdown", None))
        attrs = {"plan": plan_dict(plan), "breakdown": _Shared(bd) if isinstance(bd, dict) else bd,
                 "infeasible_reason": None, "family": family_of(plan), "baseline": None}
        mem, cap = pred.get("memory_bytes") or [], pred.get("capacity_bytes") or []
        over = max((m - c) / c for m, c in zip(mem, cap, strict=False)) if mem and cap else -1.0
        if pred.get("feasible", True):
            out = Outcome(float(pred["tokens_per_s"]), attrs, {"memory": min(over, 0.0), "divisibility": 0.0})
        else:
            reason = str(pred.get("infeasible_reason") or "infeasible")
            kind = "memory" if "memory" in reason.lower() or over > 0 else "model"
            attrs["infeasible_reason"] = f"{kind}: {reason}"
            attrs["infeasible_kind"] = kind
            out = Outcome(0.0, attrs, {"memory": max(over, 1e-9) if kind == "memory" else 0.0,
                                       "divisibility": 0.0 if kind == "memory" else 1.0})
        self.cache[key] = out
        return out

    def prime(self, rows: list[Row]) -> None:
        """Seed the cache from trials already in the study (resume costs no re-pricing)."""
        for r in rows:
            if r.mine or id(r) in self._primed:
                continue
            self._primed.add(id(r))
            if "plan" in r.attrs and r.value is not None:
                try:
                    key = Plan.from_dict(r.attrs["plan"]).replace(predicted=None, measured=None, provenance=None)
                except InputError:
                    continue
                if key in self.cache:
                    continue
                self.cache[key] = Outcome(float(r.value), {k: v for k, v in r.attrs.items()
                                                           if k not in _PER_TRIAL_ATTRS}, dict(r.constraints))
                if r.feasible:
                    self.best = max(self.best, float(r.value))


_PLACEMENT_FIELDS = tuple(f.name for f in dataclasses.fields(Placement))


def plan_dict(plan: Plan) -> _Shared:
    """``plan.to_dict()``, shared (see _Shared), without ``dataclasses.asdict`` on every placement
    entry (3 ms of a 5 ms estimate at 128 devices; tests/unit/test_search_study.py checks equality)."""
    if plan.placement is None:
        return _Shared(plan.to_dict())
    d = plan.replace(placement=None).to_dict()
    d["placement"] = [{f: getattr(e, f) for f in _PLACEMENT_FIELDS} for e in plan.placement]
    return _Shared(d)


# ---- a process's view of the study: in-memory, persisted in batches ------------------------------
class _Shared(dict):
    """A user-attr value that the trials pricing one plan share instead of copying.

    Optuna's in-memory storage deep-copies every trial it adds (and ``tell`` returns a deep copy);
    a plan with its breakdown is thousands of nested objects, so those copies, not the cost model,
    were half of a search's time at 128 devices (measured: 13 s of 33 s). The values are never
    mutated once priced; RDB and journal storages serialise them to JSON like any dict."""

    def __deepcopy__(self, memo: dict) -> _Shared:
        return self


@dataclass
class Row:
    """One finished trial as this process knows it: what the phases rank and skip by."""

    params: dict[str, Any]
    value: float | None
    feasible: bool
    attrs: dict[str, Any]
    constraints: dict[str, float]
    mine: bool = False  # recorded by this process (its plan is in this process's cache already)


class Workspace:
    """This process's view of the study.

    The sampler (TPE) works on a private in-memory study that holds only params and values, so
    Optuna's per-trial copies stay small; the full trials (plan, breakdown, reasons) go to the real
    study in batches (at least every ``batch_s`` seconds, at the end, and on Ctrl-C / SIGTERM).
    ``rows`` lists every trial this process has seen (its own and, on a shared storage, the ones
    other workers persisted, pulled before every batch so TPE learns from them too)."""

    def __init__(self, name: str, storage: str, distributions: dict[str, Any], sampler: Any, batch_s: float):
        import optuna

        self.name, self.storage_url, self.batch_s = name, storage, batch_s
        self.dists = _Shared(distributions)  # shared by every trial (never mutated; see _Shared)
        self.origin = uuid.uuid4().hex[:12]
        self.local = 0
        self.persistent = None if storage == MEMORY_URL else optuna.load_study(study_name=name,
                                                                                storage=storage_for(storage))
        # where the full trials go: the shared storage, or the :memory: study itself
        self.dest = self.persistent if self.persistent is not None else \
            optuna.load_study(study_name=name, storage=storage_for(storage))
        self.mem = optuna.create_study(direction="maximize", sampler=sampler)  # the sampler's, params only
        self.rows: list[Row] = []
        self.pending: list[Any] = []
        self.seen_ids: set[int] = set()
        self.persisted_mine: set[str] = set()  # origins of this process's trials the storage holds
        self.last_flush = time.monotonic()
        # every finished trial is also in this file until its batch is persisted (autotune/spill.py)
        self.spill = Spill(storage, name, self.origin) if self.persistent is not None else None
        self._take(self.dest.get_trials(deepcopy=False))

    def _take(self, trials: list[Any]) -> list[Any]:
        """Trials found in the storage (a resumed study, other workers) into rows and the sampler."""
        import optuna

        new, light = [], []
        for t in trials:
            if t._trial_id in self.seen_ids or t.state not in (optuna.trial.TrialState.COMPLETE,
                                                               optuna.trial.TrialState.FAIL):
                continue
            self.seen_ids.add(t._trial_id)
            origin = str(t.user_attrs.get("origin", ""))
            if origin.startswith(self.origin + ":"):
                self.persisted_mine.add(origin)
                continue
            new.append(t)
            self.rows.append(Row(dict(t.params), t.value, is_feasible(t), t.user_attrs,
                                    dict(getattr(t, "constraints", None) or {})))
            if t.params and all(k in self.dists for k in t.params):
                light.append(optuna.trial.create_trial(params=t.params, distributions=t.distributions,
                                                       value=t.value, state=t.state))
        if light:
            self.mem.add_trials(light)
        return new

    def pull(self) -> list[Any]:
        """Take the trials other processes persisted since the last pull."""
        if self.persistent is None:
            return []
        return self._take(self.persistent.get_trials(deepcopy=False))  # _take keeps finished trials only

    def record(self, params: dict[str, Any], out: Outcome, extra: dict[str, Any] | None = None,
               trial: Any = None, sampler: bool = True) -> None:
        """A finished point: into rows, the sampler's study (``sampler=False``: not, e.g. for the
        grid, whose points TPE never learns from) and the next batch for the real study."""
        import optuna

        attrs = {"baseline": None, **out.attrs, **(extra or {}), "origin": f"{self.origin}:{self.local}"}
        state = optuna.trial.TrialState.FAIL if out.failed else optuna.trial.TrialState.COMPLETE
        value = None if out.failed else out.value
        dists = self.dists
        if trial is not None:  # asked from the sampler: tell it
            dists = _Shared(trial.distributions)
            self.mem.tell(trial, value, state=state)
        elif sampler:
            self.mem.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=value,
                                                         state=state))
        frozen = optuna.trial.create_trial(params=params, distributions=dists if len(dists) == len(params) else
                                           _Shared({k: dists[k] for k in params}),
                                           value=value, user_attrs=attrs, constraints=out.constraints or None,
                                           state=state)
        self.rows.append(Row(dict(params), value, _outcome_feasible(out), attrs, out.constraints, mine=True))
        self.local += 1  # after the trial exists: the origins of one process stay gap-free
        self.pending.append(frozen)  # first: an interrupt inside the spill write loses nothing
        if self.spill is not None:
            self.spill.append(frozen)
        if time.monotonic() - self.last_flush >= self.batch_s:
            self.flush()

    def flush(self) -> None:
        """Persist the pending batch. Safe to repeat after an interrupt part-way: trials the storage
        already holds (by origin) are not written twice, and the spill is emptied only after."""
        if not self.pending:
            self.last_flush = time.monotonic()
            return
        if self.persistent is None:  # :memory: one process, nothing to pull or spill
            batch, self.pending = self.pending, []
            self.dest.add_trials(batch)
            self.last_flush = time.monotonic()
            return
        self.pull()
        batch = [t for t in self.pending if t.user_attrs["origin"] not in self.persisted_mine]
        self.persistent.add_trials(batch)  # pull() skips them again by their origin
        self.persisted_mine.update(t.user_attrs["origin"] for t in batch)
        self.pending = []
        self.spill.clear()
        self.last_flush = time.monotonic()

    def close(self) -> None:
        """The last flush, shielded from a second Ctrl-C or the parent's SIGTERM (which would
        otherwise interrupt it inside a database transaction); then the spill file goes."""
        with _signals_deferred():
            self.flush()
            if self.spill is not None:
                self.spill.close()

    @property
    def study(self) -> Any:
        return self.dest


def _outcome_feasible(out: Outcome) -> bool:
    return not out.failed and "plan" in out.attrs and not out.attrs.get("infeasible_reason") and \
        all(c <= 0 for c in out.constraints.values())


@contextlib.contextmanager
def _signals_deferred():
    """Ignore SIGINT and SIGTERM inside the block (main thread only; elsewhere nothing changes)."""
    try:
        old = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: signals are not ours to handle
        yield
        return
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def make_sampler(name: str, seed: int) -> Any:
    import optuna

    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # grid points are added as fixed trials; TPE stays the sampler of record
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=16)


# ---- phases -------------------------------------------------------------------------------------
def _deadline_passed(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _pkey(params: dict[str, Any]) -> tuple:
    return tuple(sorted(params.items()))


def run_baselines(ws: Workspace, ev: Evaluator, deadline: float | None) -> int:
    have = {r.attrs.get("baseline_key") for r in ws.rows}
    n = 0
    for name, params in ev.space.baselines():
        key = f"{name}:{sorted(params.items())}"
        if key in have or _deadline_passed(deadline):
            continue
        have.add(key)
        out = ev.evaluate(params)
        ws.record(params, out, {"baseline": name, "baseline_key": key})
        n += 1
    return n


def run_starts(ws: Workspace, ev: Evaluator, deadline: float | None, budget: int, seed: int = 0) -> int:
    """One balanced start per degree layout (``space.starts()``), and where it does not fit in
    memory the same layout with the least memory: every layout that can run gets a fair first
    price, so the polish can start from the best of each (TPE alone samples a few of them).
    ``budget`` caps the cost-model calls: at 1024 devices there are ~800 layouts at ~10-30 ms an
    estimate, so a seeded random subset of them gets a start there (at 8-128 devices all do)."""
    import random

    if not hasattr(ev.space, "starts"):
        return 0
    have = {_pkey(r.params) for r in ws.rows}
    n = 0
    calls0 = ev.calls
    starts = ev.space.starts()
    random.Random(seed).shuffle(starts)
    for p in starts:
        for q in (p, ev.space.memory_fallback(p)):
            if _deadline_passed(deadline) or ev.calls - calls0 >= budget:
                return n
            k = _pkey(q)
            if k in have:
                break
            have.add(k)
            out = ev.evaluate(q)
            ws.record(q, out, {"start": True})
            n += 1
            if out.constraints.get("memory", 0) <= 0:  # fits (or is no plan at all): no fallback
                break
    return n


def run_sampler(ws: Workspace, ev: Evaluator, n: int, deadline: float | None) -> int:
    done = 0
    while done < n and not _deadline_passed(deadline):
        t = ws.mem.ask(ws.dists)
        out = ev.evaluate(dict(t.params))
        ws.record(t.params, out, trial=t)
        done += 1
    return done


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


def run_grid(ws: Workspace, ev: Evaluator, points: Any, deadline: float | None) -> GridCount:
    """Price every point directly (no sampler in the loop) and keep what the study needs: a
    feasible plan when it is among the best GRID_KEEP priced so far (at most ~GRID_KEEP x ln(N /
    GRID_KEEP) trials, written as the grid goes, so an interrupt keeps them), the first plan of each
    family that each limit (memory, model) rules out, and the first point of each distinct reason
    for being no plan; the rest are counted. Persisting every point would cost more than pricing it
    (SQLite: ~25 ms per trial against ~1 ms per estimate at 32 devices)."""
    import heapq

    have = {_pkey(r.params) for r in ws.rows}
    reasons = {r.attrs.get("infeasible_reason") for r in ws.rows if "plan" not in r.attrs}
    ruled = {(r.attrs.get("family"), r.attrs.get("infeasible_kind")) for r in ws.rows
             if "plan" in r.attrs and not r.feasible}
    kept = [r.value for r in ws.rows if r.feasible and r.value is not None]
    heapq.heapify(kept)
    while len(kept) > GRID_KEEP:
        heapq.heappop(kept)
    c = GridCount()
    for p in points:
        if _deadline_passed(deadline):
            break
        c.points += 1
        k = _pkey(p)
        if k in have:
            c.resumed += 1
            continue
        out, new = ev.evaluate_new(p)
        if "plan" not in out.attrs:
            c.no_plan += 1
            reason = out.attrs.get("infeasible_reason")
            if reason in reasons:
                continue
            reasons.add(reason)
        elif not new:
            c.repeats += 1
            continue
        else:
            c.plans += 1
            if _outcome_feasible(out):
                if len(kept) < GRID_KEEP:
                    heapq.heappush(kept, out.value)
                elif out.value > kept[0]:
                    heapq.heapreplace(kept, out.value)
                else:
                    c.not_kept += 1
                    continue
            else:
                kind = out.attrs.get("infeasible_kind") or ("error" if out.failed else "model")
                c.infeasible[kind] += 1
                if (out.attrs.get("family"), kind) in ruled:
                    continue
                ruled.add((out.attrs.get("family"), kind))
        have.add(k)
        ws.record(p, out, sampler=False)
        c.recorded += 1
    return c


def _seeds(ws: Workspace, starts: int) -> list[tuple[dict[str, Any], float]]:
    """The best trial of each of the best ``starts`` degree layouts: diverse starts, not near-copies."""
    best: dict[str, Row] = {}
    for r in ws.rows:
        if not (r.feasible and r.params and r.value is not None):
            continue
        k = json.dumps(r.attrs["plan"]["degrees"], sort_keys=True)
        if k not in best or r.value > best[k].value:
            best[k] = r
    ranked = sorted(best.values(), key=lambda r: -r.value)[:starts]
    return [(dict(r.params), float(r.value)) for r in ranked]


def run_polish(ws: Workspace, ev: Evaluator, budget: int, deadline: float | None, starts: int = 8) -> int:
    """Variable-neighbourhood hill climb from the best plan of each of the best ``starts`` degree
    layouts: take the best one-parameter move while one helps; where none does, the best move of two
    coupled parameters (space.pair_moves). ``budget`` counts cost-model calls (a point that is no plan
    or repeats a priced plan costs none, and is not recorded: the study would fill with them). Returns
    the plans priced."""
    known: dict[tuple, float] = {_pkey(r.params): (r.value if r.feasible else -1.0) for r in ws.rows}
    calls0 = ev.calls
    done = 0

    def spent() -> bool:
        return ev.calls - calls0 >= budget or _deadline_passed(deadline)

    movesets = [ev.space.neighbours] + ([ev.space.pair_moves] if hasattr(ev.space, "pair_moves") else [])
    for params, value in _seeds(ws, starts):
        while not spent():
            best_p, best_v = None, value * (1 + 1e-9)
            for moves in movesets:
                for q in moves(params):
                    k = _pkey(q)
                    v = known.get(k)
                    if v is None:
                        if spent():
                            break
                        out, new = ev.evaluate_new(q)
                        if new:  # a point that is no plan or repeats a plan is not worth a trial
                            ws.record(q, out, {"polish": True}, sampler=False)  # no sampler after this
                            done += 1
                        v = known[k] = out.value if _outcome_feasible(out) else -1.0
                    if v > best_v:
                        best_p, best_v = q, v
                if best_p is not None:
                    break  # a single move helps: no need for pairs
            if best_p is None:
                break
            params, value = best_p, best_v
    return done


# ---- worker processes ---------------------------------------------------------------------------
def _sigterm_to_interrupt(*_: Any) -> None:
    # The first of Ctrl-C (to the whole process group) and the parent's SIGTERM stops the worker;
    # the other must not interrupt the final flush that follows.
    signal.signal(signal.SIGINT, _ignore)
    signal.signal(signal.SIGTERM, _ignore)
    raise KeyboardInterrupt


def _ignore(*_: Any) -> None:
    """A handler that does nothing. Not SIG_IGN: a signal already pending when the handler changes
    would then raise OSError ("ignored due to race condition") in whatever code runs next."""


def _worker(args: dict[str, Any]) -> None:
    """One of --workers K processes: the sampler (or a slice of the grid) on the shared study."""
    signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    signal.signal(signal.SIGINT, _sigterm_to_interrupt)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by the parent around start()
    ctx, space, ev = _setup(args["model"], args["cluster"], args["seq_len"], args["global_batch"], args["opts"],
                            args["estimator"])
    opts: SearchOptions = args["opts"]
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ws = Workspace(args["name"], args["storage"], space.distributions(), make_sampler(opts.sampler, args["seed"]),
                   opts.batch_s)
    ev.prime(ws.rows)
    try:
        if args.get("grid") is not None:
            g = args["grid"]
            points = itertools.islice(itertools.islice(space.grid_points(), g["limit"]), g["index"], None, g["of"])
            run_grid(ws, ev, points, args["deadline_wall"] and _to_monotonic(args["deadline_wall"]))
        else:
            run_sampler(ws, ev, args["n"], args["deadline_wall"] and _to_monotonic(args["deadline_wall"]))
    except KeyboardInterrupt:
        pass
    finally:
        ws.close()


def _to_monotonic(wall: float) -> float:
    return time.monotonic() + (wall - time.time())


def _setup(model: Any, cluster: Any, seq_len: int, global_batch: int, opts: SearchOptions,
           estimator: Callable[..., Any] | None) -> tuple[Any, Any, Evaluator]:
    from search_spaces.base import SearchContext

    ctx = SearchContext(model=model, cluster=cluster, seq_len=seq_len, global_batch=global_batch, dtype=opts.dtype)
    space = load_space(opts.space).space(ctx)
    return ctx, space, Evaluator(space, estimator or default_estimator())


def check_options(opts: SearchOptions, storage: str) -> None:
    if opts.sampler not in SAMPLERS:
        from autotune.errors import suggest

        raise InputError(f"unknown sampler {opts.sampler!r}" + suggest(opts.sampler, SAMPLERS), field="--sampler")
    if opts.trials is not None and opts.trials < 1:
        raise InputError(f"must be >= 1, got {opts.trials}", field="--trials")
    if opts.timeout_s is not None and not opts.timeout_s > 0:
        raise InputError(f"must be > 0 seconds, got {opts.timeout_s}", field="--timeout")
    if opts.workers < 1:
        raise InputError(f"must be >= 1, got {opts.workers}", field="--workers")
    if opts.top < 1:
        raise InputError(f"must be >= 1, got {opts.top}", field="--top")
    worker_count_ok(storage, opts.workers)


def search(model: Any, cluster: Any, seq_len: int, global_batch: int, *, study_name: str, storage: str,
           options: SearchOptions | None = None, estimator: Callable[..., Any] | None = None,
           progress: Callable[[str], None] | None = None) -> SearchResult:
    """Run (or resume) the search and return the best plans. Picklable ``estimator`` for workers > 1."""
    opts = options or SearchOptions()
    check_options(opts, storage)
    t0 = time.monotonic()
    deadline = t0 + opts.timeout_s if opts.timeout_s else None
    say = progress or (lambda _m: None)
    ctx, space, ev = _setup(model, cluster, seq_len, global_batch, opts, estimator)
    record = StudyRecord(model=model, cluster=cluster, seq_len=seq_len, global_batch=global_batch, space=opts.space)
    create_or_open(study_name, storage, record)  # once, in the parent, before any worker starts
    notes: list[str] = []
    ws = Workspace(study_name, storage, space.distributions(), make_sampler(opts.sampler, opts.seed), opts.batch_s)
    if ws.persistent is not None:
        got = recover(storage, ws.persistent)
        if got:
            ws.pull()
            notes.append(f"recovered {got} finished trials that a killed search process had not persisted")
    before = len(ws.rows)
    if before:
        notes.append(f"resumed study {study_name!r} with {before} trials")
    ev.prime(ws.rows)
    if storage != MEMORY_URL:
        notes.append(f"searched in memory, persisted to {storage} in batches of <= {opts.batch_s:g} s "
                     "(Optuna's storage writes cost more than the cost model)")
    interrupted = False
    try:
        nb = run_baselines(ws, ev, deadline)
        say(f"baselines: {nb} trials")
        grid, gc = None, None
        if opts.sampler == "grid":
            from search_spaces.default import GRID_LIMIT

            size = space.grid_size(GRID_LIMIT)
            if opts.trials is None and size > GRID_LIMIT:
                raise InputError(f"the grid has more than {GRID_LIMIT:,} points; too large to enumerate, use "
                                 "--sampler tpe or give --trials N to enumerate the first N", field="--sampler")
            limit = opts.trials if opts.trials is not None and opts.trials < size else None
            grid = {"index": 0, "of": 1, "limit": limit}
            n_main, n_polish = limit or size, 0
        else:
            n_main = opts.trials or DEFAULT_TRIALS
            n_polish = POLISH_FACTOR * n_main if opts.polish else 0
            if opts.polish:  # the starts take at most as many cost-model calls as the polish
                say(f"balanced starts: {run_starts(ws, ev, deadline, n_polish, opts.seed)} trials")
        if opts.workers > 1:
            ws.flush()
            _run_workers(study_name, storage, model, cluster, seq_len, global_batch, opts, estimator, n_main, grid,
                         deadline)
            ws.pull()
        elif grid is not None:
            gc = run_grid(ws, ev, itertools.islice(space.grid_points(), grid["limit"]), deadline)
        else:
            run_sampler(ws, ev, n_main, deadline)
        say("sampler done")
        if grid is not None:
            what = (f"grid: {size:,} points, enumerating the first {grid['limit']:,} (NOT exhaustive)"
                    if grid["limit"] else f"grid: exhaustive over all {size:,} points of the space")
            if gc is not None:
                bad = ", ".join(f"{n:,} {k}" for k, n in sorted(gc.infeasible.items()))
                what += (f"; {gc.plans:,} distinct plans priced ({bad or 'none'} infeasible), "
                         f"{gc.repeats:,} points repeat a plan, {gc.no_plan:,} are no plan (divisibility, batch)"
                         + (f", {gc.resumed:,} were in the study" if gc.resumed else "")
                         + f"; the study keeps {gc.recorded:,} trials: the best {GRID_KEEP:,} feasible plans as "
                         "found, one plan per family and limit, one point per reason for no plan")
                if gc.points < n_main:
                    what += f"; STOPPED after {gc.points:,} points (timeout)"
            notes.append(what)
        if n_polish:
            ev.prime(ws.rows)
            run_polish(ws, ev, n_polish, deadline)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        ws.close()
    if interrupted:
        raise KeyboardInterrupt
    return collect(ws.study, storage, opts.top, time.monotonic() - t0, before, notes)


def _run_workers(name: str, storage: str, model: Any, cluster: Any, seq_len: int, global_batch: int,
                 opts: SearchOptions, estimator: Any, n_main: int, grid: dict | None, deadline: float | None) -> None:
    ctxm = mp.get_context("spawn")
    k = opts.workers
    deadline_wall = time.time() + (deadline - time.monotonic()) if deadline else None
    procs = []
    for i in range(k):
        args = {"name": name, "storage": storage, "model": model, "cluster": cluster, "seq_len": seq_len,
                "global_batch": global_batch, "opts": opts, "estimator": estimator, "seed": opts.seed + 1 + i,
                "n": math.ceil(n_main / k), "grid": {**grid, "index": i, "of": k} if grid is not None else None,
                "deadline_wall": deadline_wall}
        p = ctxm.Process(target=_worker, args=(args,), daemon=False)
        # The child inherits a blocked SIGINT (the mask survives fork and exec) and unblocks it once
        # _worker has its handler: a Ctrl-C while it imports then stops it cleanly, not in a traceback.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        procs.append(p)
    try:
        for p in procs:
            p.join()
    except KeyboardInterrupt:
        for p in procs:  # our own children: ask them to flush and stop
            if p.is_alive() and p.pid:
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            p.join(30)
        raise
    bad = [p.exitcode for p in procs if p.exitcode not in (0, None)]
    if bad:
        raise WorkError(f"{len(bad)} of {k} search workers exited with codes {bad}; their persisted trials are kept")


# ---- results ------------------------------------------------------------------------------------
def collect(study: Any, storage: str, top: int, elapsed: float, before: int, notes: list[str]) -> SearchResult:
    trials = study.get_trials(deepcopy=False)
    ranked = list(itertools.islice(iter_trial_plans(study), top))
    if not ranked:
        raise WorkError("no feasible plan: " + infeasibility_report(trials))
    best_t, best = ranked[0]
    # the best even plan: parse only the stored plans whose shares are even (Plan.is_even's rule)
    base_t, base = next(iter_trial_plans(study, where=_looks_even), (None, None))
    if base_t is not None:
        try:
            study.set_user_attr("baseline_best_trial", base_t.number)
        except Exception:  # noqa: BLE001 - informational
            pass
    res = SearchResult(study_name=study.study_name, storage=storage, best=best, top=[p for _, p in ranked],
                       baseline_best=base, trials=len(trials), new_trials=len(trials) - before, elapsed_s=elapsed,
                       notes=notes, best_trial=best_t.number, baseline_trial=base_t.number if base_t else None)
    res.why = why_best(best, base, best_t.user_attrs.get("breakdown"), base_t.user_attrs.get("breakdown")
                       if base_t else None)
    return res


def _looks_even(plan: dict[str, Any]) -> bool:
    """Plan.is_even on a stored plan dict (its shares are resolved), without parsing the plan."""
    sh = plan.get("shares") or {}
    return shares_are_even(sh.get("layers"), sh.get("tokens"), sh.get("heads"), sh.get("samples"))


def infeasibility_report(trials: list[Any]) -> str:
    """Per family, the limit that rules it out (the commonest kind) and its closest example."""
    fams: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for t in trials:
        reason = t.user_attrs.get("infeasible_reason")
        fam = t.user_attrs.get("family")
        if not reason or not fam:
            continue
        fams[fam][t.user_attrs.get("infeasible_kind") or reason.split(":", 1)[0]].append(reason)
    if not fams:
        return "no trial produced a plan (every point was rejected before pricing)"
    parts = []
    for fam in sorted(fams):
        kinds = fams[fam]
        kind = max(kinds, key=lambda k: len(kinds[k]))
        parts.append(f"{fam}: {kind} ({len(kinds[kind])} plans; e.g. {kinds[kind][0]})")
    return "; ".join(parts)


def _num(d: Any, key: str) -> float | None:
    v = d.get(key) if isinstance(d, dict) else None
    return float(v) if isinstance(v, (int, float)) else None


def why_best(best: Plan, base: Plan | None, bd_best: Any, bd_base: Any) -> str:
    """One sentence: how much faster the best plan is than the best even-split plan, and where from."""
    if base is None:
        return "no even-split plan is feasible here; the best plan needs uneven shares or options they lack"
    pb, pe = best.predicted or {}, base.predicted or {}
    tb, te = _num(pb, "step_time_s"), _num(pe, "step_time_s")
    if tb is None or te is None or tb <= 0:
        return ""
    if plan_key(best.to_dict()) == plan_key(base.to_dict()):
        return "the best plan is itself an even split"
    diffs = []
    if best.degrees != base.degrees:
        diffs.append(f"degrees {best.degrees.inline()} instead of {base.degrees.inline()}")
    for k in ("layers", "tokens", "heads", "samples"):
        v = getattr(best.shares, k)
        if v is not None and len(set(v)) > 1:
            diffs.append(f"uneven {k} {list(v)}")
    for k in ("micro_batch_size", "schedule", "recompute", "zero_stage", "sequence_parallel"):
        if getattr(best, k) != getattr(base, k):
            diffs.append(f"{k} {getattr(best, k)}")
    terms = ""
    if isinstance(bd_best, dict) and isinstance(bd_base, dict):
        deltas = [(k, _num(bd_base, k) - _num(bd_best, k)) for k in bd_best  # time terms only (seconds)
                  if k.endswith("_s") and k != "step_time_s" and _num(bd_best, k) is not None
                  and _num(bd_base, k) is not None]
        deltas = [d for d in deltas if d[1] > 0]
        if deltas:
            k, d = max(deltas, key=lambda x: x[1])
            terms = f"; the largest saving is {k} ({d:.3g} s less)"
    return (f"{te / tb:.2f}x the best even-split plan ({base.degrees.inline()}): step {tb:.4g} s vs {te:.4g} s, "
            "from " + (", ".join(diffs) or "placement") + terms)
