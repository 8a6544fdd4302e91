"""The search on a pool: which devices to use and how many, and the plan on them.

How subsets enter the search (and how the work is divided):

1. **Candidates** (``candidates``): every combination of node counts the pool's groups offer
   (``available``) when there are at most ``MAX_SUBSETS``; else per group 0, the powers of two and
   all of it; else each group whole or half or not at all; else each group whole or not at all.
   Subsets over ``--budget`` and subsets whose devices cannot hold the model's weights, gradients
   and optimizer states even fully sharded are never searched (named in the notes).
2. **Screening**: each candidate subset gets its balanced starts (one speed-balanced plan per
   degree layout, autotune/search/phases.py), at most ``screen_calls`` cost-model calls each
   (a seeded sample of its layouts where it has more).
3. **Refinement**: the subsets that matter (every candidate on a pool of at most ``SMALL_POOL``
   devices, each with a plain search's budget; on a larger pool ``REFINE`` of them: the screening's
   fastest, its cheapest, then the other points of its front of step time against cost, then the
   next fastest) get the phases of a plain search (autotune/search/run.py). On a larger pool they
   share one plain search's budget of balanced starts and polish calls (at least ``MIN_POLISH``
   each, the screening's calls counted in); the fastest also gets the baselines and the sampler
   (with the plain search's patience), the others skip both (their balanced starts price every
   degree layout once; a sampler trial costs several polish calls' CPU). Nothing here reads the
   objective, only its limits: ``--objective time`` and ``cost`` do the same work, store the same
   trials and so the same front, and the objective picks its point on it (issue 39). At 32 devices
   (16 H100 + 16 A100, llama2-7b 64k) that is 1,079 trials against the plain search's 689 of all
   32 devices (docs/pools.md has the measured times).

Each subset is a search of its own on ``subset(pool, uses)`` (the same space, evaluator and
phases as a plain search), recorded in the one study with its plans' ``uses`` and ``cost``; its
workspace sees only its own trials (``Workspace(keep=...)``), so its sampler and de-duplication
work as on a cluster of those devices. Within one subset the cost of a plan is its step time times
a constant, so the front's points are the best plan of each subset that no other beats on both.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from typing import Any

from autotune.errors import InputError, WorkError
from autotune.objective import STUDY_KEY, Objective, admissible, cost_of, figure_key, figures, step_of
from autotune.search.options import (
    DEFAULT_TRIALS,
    POLISH_FACTOR,
    SAMPLER_PATIENCE,
    SearchOptions,
    SearchResult,
    check_grad_reduce,
    check_options,
)
from autotune.search.phases import run_baselines, run_polish, run_sampler, run_starts
from autotune.search.pricing import Evaluator, Outcome, plan_dict
from autotune.specs import pool as P

MAX_SUBSETS = 32
SMALL_POOL = 16  # devices: every candidate subset gets the whole search
REFINE = 3  # subsets refined on a larger pool
MIN_SCREEN = 24  # cost-model calls a subset's screening may spend at least
MIN_POLISH = 100  # a refined subset's balanced starts and polish calls at least
MAX_EXACT = 100_000  # subsets enumerated to find the cheapest (else the searched node counts)


def uses_key(uses: tuple[int, ...]) -> str:
    return P.uses_text(uses)


def not_searched(pool: Any, model: Any, obj: Objective, uses: tuple[int, ...],
                 dtype: str = "bf16") -> tuple[str, str] | None:
    """Why a subset is never searched, as (kind, text): ``budget`` (its devices cost more per hour
    than ``--budget``) or ``memory`` (they cannot hold the model states fully sharded in ``dtype``:
    ``memory.sharded_bytes_per_param``); None: it is searched. The one rule ``candidates`` filters
    by and the left-out lines name."""
    from autotune.cost.memory import sharded_bytes_per_param

    per_h = P.hourly(pool, uses)
    if obj.budget is not None and (per_h or 0.0) > obj.budget * (1 + 1e-12):
        return "budget", (f"{P.describe_uses(pool, uses)} cost {per_h:.4g}{obj.currency}/h, over the budget "
                          f"({obj.budget:g}{obj.currency}/h)")
    mem = sum(n * g.devices_per_node * g.device.memory_bytes for g, n in zip(pool.groups, uses, strict=True))
    state_bytes = sharded_bytes_per_param(dtype)
    if mem < state_bytes * model.param_count():
        return "memory", (f"{P.describe_uses(pool, uses)} hold less memory than the model's weights, gradients "
                          f"and Adam states ({state_bytes:g} bytes a parameter) fully sharded")
    return None


def cheapest_within_memory(pool: Any, model: Any, dtype: str = "bf16") -> tuple[tuple[int, ...], float] | None:
    """The cheapest subset per hour whose devices can hold the model (``not_searched``'s memory
    rule), over every subset (the searched node counts on a pool of more than ``MAX_EXACT``)."""
    ranges = [list(r) for r in P.choices(pool)]
    if math.prod(len(r) for r in ranges) > MAX_EXACT:
        ranges = [sorted({r.start, r.stop - 1, *(x for x in r if x & (x - 1) == 0)}) for r in P.choices(pool)]
    best = None
    for uses in itertools.product(*ranges):
        per_h = P.hourly(pool, uses)
        if not any(uses) or per_h is None or not_searched(pool, model, Objective(), uses, dtype) is not None:
            continue
        if best is None or per_h < best[1]:
            best = (tuple(uses), per_h)
    return best


def candidates(pool: Any, model: Any, obj: Objective, dtype: str = "bf16") -> tuple[list[tuple[int, ...]], list[str]]:
    """The subsets to search, most devices first, and notes on what was left unsearched and why
    (``not_searched``, memory counted in ``dtype``). A budget below every subset that can hold the
    model is refused (InputError naming the cheapest)."""
    from autotune.cost.memory import sharded_bytes_per_param

    ranges = P.choices(pool)
    notes = []
    size = math.prod(len(r) for r in ranges)
    if size > MAX_SUBSETS:
        def powers(r: range) -> list[int]:
            return sorted({x for x in r if x == r.stop - 1 or x == r.start or (x > 0 and x & (x - 1) == 0)})
        for pick in (powers, lambda r: sorted({r.start, max(r.start, (r.stop - 1) // 2), r.stop - 1}),
                     lambda r: sorted({r.start, r.stop - 1})):
            ranges = [pick(r) for r in P.choices(pool)]
            if math.prod(len(r) for r in ranges) <= MAX_SUBSETS:
                break
        notes.append(f"{size:,} subsets of the pool; searched node counts per group: "
                     + "; ".join(f"{g.device.name} {'/'.join(map(str, r))}" for g, r in zip(pool.groups, ranges,
                                                                                          strict=True)))
    out = []
    why = {"budget": 0, "memory": 0}
    for uses in itertools.product(*ranges):
        if not any(uses):
            continue
        skip = not_searched(pool, model, obj, tuple(uses), dtype)
        if skip is not None:
            why[skip[0]] += 1
            continue
        out.append(tuple(uses))
    if why["budget"]:
        notes.append(f"{why['budget']} subsets cost more than the budget ({obj.budget:g}{obj.currency}/h): "
                     "not searched")
    if why["memory"]:
        notes.append(f"{why['memory']} subsets hold less memory than the model's weights, gradients and Adam "
                     f"states ({sharded_bytes_per_param(dtype):g} bytes a parameter) fully sharded: not searched")
    if not out and why["budget"]:
        cheap = cheapest_within_memory(pool, model, dtype)
        where = (f"the cheapest subset of {pool.name} that can hold {model.name} is {P.describe_uses(pool, cheap[0])} "
                 f"at {cheap[1]:.4g}{obj.currency}/h" if cheap else f"no subset of {pool.name} can hold {model.name}")
        raise InputError(f"{obj.budget:g}{obj.currency}/h is below every subset: {where}", field="--budget")
    out.sort(key=lambda u: (-P.devices_of(pool, u), u))
    return out, notes


class SubsetEvaluator(Evaluator):
    """An Evaluator on ``subset(pool, uses)`` whose plans say ``uses`` and whose trials carry the
    plan's ``cost`` (autotune/objective.py) and ``uses``."""

    def __init__(self, space: Any, estimator: Any, pool: Any, uses: tuple[int, ...], target: str | None = None):
        super().__init__(space, estimator, target=target)
        self.pool, self.uses, self.key = pool, uses, uses_key(uses)
        self.plain = uses == P.full_uses(pool)

    def evaluate_new(self, params: dict[str, Any]) -> tuple[Outcome, bool]:
        out, new = super().evaluate_new(params)
        out.attrs.setdefault("uses", self.key)
        return out, new

    def _price(self, built: Any) -> Outcome:
        out = super()._price(built)
        pd = out.attrs.get("plan")
        if pd is not None:
            plan = pd.plan if self.plain else pd.plan.replace(uses=self.uses)
            pred = pd.get("predicted")
            out.attrs["plan"] = plan_dict(plan, pred)
            c = self.space.ctx
            out.attrs["cost"] = figures(self.pool, self.uses, pred or {}, c.seq_len, c.global_batch)
        return out


def pool_search(model: Any, pool: Any, seq_len: int, global_batch: int, *, study_name: str, storage: str,
                options: SearchOptions | None = None, objective: Objective | None = None,
                estimator: Callable[..., Any] | None = None, progress: Callable[[str], None] | None = None,
                display: Any = None) -> SearchResult:
    """Search the pool's subsets and the plans on each (module docstring); a plain cluster with the
    plain objective is ``autotune.search.search`` unchanged."""
    from autotune.search.run import search

    opts = options or SearchOptions()
    obj = objective or Objective()
    if not P.is_pool(pool) and obj.plain:
        res = search(model, pool, seq_len, global_batch, study_name=study_name, storage=storage, options=opts,
                     estimator=estimator, progress=progress, display=display)
        res.front = front_of(res, pool, seq_len, global_batch)
        res.costs = costs_of(res, pool, seq_len, global_batch)
        return res
    check_options(opts, storage)
    from autotune.plan import choose_dtype

    if opts.dtype != "auto":  # an explicit precision is refused up front where a device lacks it; ``auto``
        choose_dtype(opts.dtype, pool)  # is chosen per subset (subset_dtype), as --dtype's auto means
    # --grad-reduce bf16 needs bf16 weights on every subset: the whole pool's precision is asked
    check_grad_reduce(dataclasses.replace(opts, dtype=choose_dtype(opts.dtype, pool)), model, pool, seq_len, global_batch)
    if opts.workers > 1 or opts.sampler == "grid":
        raise InputError("a pool search runs one process with the tpe or random sampler", field="--workers/--sampler")
    from autotune.search.run import documents_estimator

    estimator = documents_estimator(opts, estimator)  # --data/--lengths price every subset's plans masked
    return _PoolRun(model, pool, seq_len, global_batch, study_name, storage, opts, obj, estimator,
                    progress or (display.say if display is not None else (lambda _m: None)), display).run()


class _PoolRun:
    def __init__(self, model, pool, seq_len, global_batch, name, storage, opts, obj, estimator, say, display):
        self.model, self.pool, self.seq_len, self.global_batch = model, pool, seq_len, global_batch
        self.name, self.storage, self.opts, self.obj = name, storage, opts, obj
        self.estimator, self.say, self.display = estimator, say, display
        self.notes: list[str] = []
        self.workspaces: list[Any] = []
        self.spaces: dict[tuple[int, ...], Any] = {}  # each subset's space (built by _open_study)
        self.stored: list[Any] = []  # the study's trials before this run (each subset takes its own)

    def _space(self, uses: tuple[int, ...]) -> Any:
        """One subset's search space: ``space(ctx)`` checked (``build_space``: an InputError naming --space)."""
        from autotune.search.options import load_space
        from autotune.search.spaces import build_space
        from search_spaces.base import SearchContext

        sub = P.subset(self.pool, uses)
        ctx = SearchContext(model=self.model, cluster=sub, seq_len=self.seq_len, global_batch=self.global_batch,
                            dtype=subset_dtype(self.opts.dtype, sub), target=self.opts.target,
                            grad_reduce=self.opts.grad_reduce)
        return build_space(load_space(self.opts.space), ctx, self.opts.space)

    def _setup(self, uses: tuple[int, ...]) -> tuple[Any, Any]:
        """The space (built by ``_open_study``), evaluator and workspace of one subset."""
        from autotune.search.pricing import default_estimator
        from autotune.search.workspace import Workspace, make_sampler

        space = self.spaces[uses]
        ev = SubsetEvaluator(space, self.estimator or default_estimator(), self.pool, uses, target=self.opts.target)
        key = uses_key(uses)
        ws = Workspace(self.name, self.storage, space.distributions(), make_sampler(self.opts.sampler, self.opts.seed),
                       self.opts.batch_s, keep=lambda t: t.user_attrs.get("uses") == key, stored=self.stored)
        ws.on_record = self._recorded
        ev.prime(ws.rows)
        self.workspaces.append(ws)
        return ev, ws

    def _recorded(self, out: Outcome) -> None:
        if self.display is not None:
            self.display.advance()

    def run(self) -> SearchResult:
        from autotune.search.report import collect
        from autotune.search.workspace import StudyView

        t0 = time.monotonic()
        deadline = t0 + self.opts.timeout_s if self.opts.timeout_s else None
        # the memory rule in the pool's precision (the states' bytes are the same in bf16 and fp16)
        subsets, notes = candidates(self.pool, self.model, self.obj, subset_dtype(self.opts.dtype, self.pool))
        self.notes += notes
        self._reachable(subsets)
        if not subsets:
            raise WorkError("no subset of the pool can be searched: " + "; ".join(notes))
        study = self._open_study(subsets)
        before = len(self.stored)
        n_main = self.opts.trials or DEFAULT_TRIALS
        n_polish = POLISH_FACTOR * n_main if self.opts.polish else 0
        screen = max(MIN_SCREEN, 2 * n_main // len(subsets))
        best: dict[tuple[int, ...], tuple[float, float | None]] = {}  # uses -> (step, cost) of its best
        state: dict[tuple[int, ...], tuple[Any, Any]] = {}
        interrupted = False
        try:
            chosen = self._screen_and_refine(subsets, state, best, deadline, screen, n_main, n_polish)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            for ws in self.workspaces:
                ws.close()
        if interrupted:
            raise KeyboardInterrupt
        if deadline is not None and time.monotonic() >= deadline:
            self.notes.append(f"--timeout {self.opts.timeout_s:g} s stopped the pool search")
        self.notes.append(f"searched {len(subsets)} subsets of {self.pool.name} ({self.obj.text()}); screening "
                          f"<= {screen} cost-model calls each, then the whole search on {len(chosen)}")
        trials = _union(self.workspaces, study, self.storage)
        self._within_limits(trials, study, before)
        known = StudyView(study, trials)
        res = collect(known, self.storage, self.opts.top, time.monotonic() - t0, before, self.notes,
                      (self.model, self.pool, self.seq_len, self.global_batch))
        res.objective = self.obj.attrs()
        res.front = front_of(res, self.pool, self.seq_len, self.global_batch, trials)
        res.costs = costs_of(res, self.pool, self.seq_len, self.global_batch)
        res.left_out = why_left_out(res, self.pool, trials, self.obj, self.model)
        study.set_user_attr("front", res.front)
        study.set_user_attr("left_out", res.left_out)
        study.set_user_attr("left_out_trial", res.best_trial)
        return res

    def _open_study(self, subsets: list[tuple[int, ...]]) -> Any:
        """The study (created once, before any subset is searched) with the objective recorded; the
        trials it held before this run are kept in ``self.stored`` (each subset takes its own). Every
        subset's space is built first: a ``--space`` that raises or returns no space is refused
        before anything is stored, as the plain search refuses it."""
        from autotune.study import StudyRecord, create_or_open

        self.spaces = {uses: self._space(uses) for uses in subsets}

        record = StudyRecord(model=self.model, cluster=self.pool, seq_len=self.seq_len,
                             global_batch=self.global_batch, space=self.opts.space, target=self.opts.target,
                             documents=self.opts.documents)
        study = create_or_open(self.name, self.storage, record)
        study.set_user_attr(STUDY_KEY, self.obj.attrs())
        self.stored = study.get_trials(deepcopy=False)
        if self.display is not None:
            self.display.opened()
        return study

    def _screen_and_refine(self, subsets: list[tuple[int, ...]], state: dict, best: dict, deadline: float | None,
                           screen: int, n_main: int, n_polish: int) -> list[tuple[int, ...]]:
        """Screen every subset with its balanced starts, then run a plain search's phases on the ones
        worth refining (module docstring); returns those. Nothing here reads the objective (only its
        limits): the front is the same whichever plan the objective then chooses on it."""
        if self.display is not None:
            self.display.phase(f"screening {len(subsets)} subsets")
        for uses in subsets:
            ev, ws = state[uses] = self._setup(uses)
            run_starts(ws, ev, deadline, screen, self.opts.seed)
            best[uses] = _best_of(ws.rows, self.obj)
            ws.flush()  # each subset's trials stored as one run: the same numbers whatever the timing
        chosen = self._to_refine(subsets, best)
        self.say(f"screened {len(subsets)} subsets; refining {len(chosen)}: "
                 + ", ".join(P.describe_uses(self.pool, u) for u in chosen))
        if self.display is not None:
            self.display.phase(f"refining {len(chosen)} subsets")
        k = 1 if P.devices_of(self.pool, None) <= SMALL_POOL else len(chosen)  # small: a plain budget each
        patience = SAMPLER_PATIENCE if self.opts.trials is None else None
        for i, uses in enumerate(chosen):  # the phases of a plain search (autotune/search/run.py)
            ev, ws = state[uses]
            # the fastest after screening (and every subset of a small pool): a plain search's
            # baselines, starts and sampler; the refined share a plain search's polish (at least
            # MIN_POLISH calls each); the others get as many starts (the screening's counted), no
            # baselines (their balanced starts price each layout) and no sampler (its trials each
            # cost several polish calls' CPU, for what the polish finds anyway)
            whole = i == 0 or k == 1
            polish = n_polish if k == 1 else max(MIN_POLISH, n_polish // k)
            starts = n_polish if whole else polish - screen
            if whole:
                run_baselines(ws, ev, deadline)
            if n_polish:
                run_starts(ws, ev, deadline, starts, self.opts.seed)
            if whole:
                run_sampler(ws, ev, n_main, deadline, patience)
            if n_polish:
                ev.prime(ws.rows)
                run_polish(ws, ev, polish, deadline)
            ws.flush()
        return chosen

    def _reachable(self, subsets: list[tuple[int, ...]]) -> None:
        """A ``--max-step-time`` below what any candidate subset could step in at its devices' peak
        throughput (``step_floor``) is refused before anything is searched or stored."""
        lim = self.obj.max_step_time
        if lim is None:
            return
        floors = {u: step_floor(self.model, self.pool, u, self.seq_len, self.global_batch,
                                subset_dtype(self.opts.dtype, P.subset(self.pool, u))) for u in subsets}
        u = min(floors, key=lambda k: floors[k])
        if floors[u] > lim:
            raise InputError(f"{lim:g} s is unreachable: even at its devices' peak throughput the fastest subset "
                             f"({P.describe_uses(self.pool, u)}) needs at least {floors[u]:.4g} s for the weights' "
                             f"FLOPs of one step ({self.global_batch} x {self.seq_len} tokens); nothing was searched",
                             field="--max-step-time")

    def _within_limits(self, trials: list[Any], study: Any, before: int) -> None:
        """Feasible plans exist but none within ``--max-step-time``: say so, with the fastest found,
        and keep no study of plans none of which was asked for (a study that held trials before
        this run keeps them, and this run's, and the line says so)."""
        from autotune.study import is_feasible, storage_for

        ok = [t for t in trials if is_feasible(t) and "cost" in t.user_attrs]
        if ok and self.obj.max_step_time is not None and not any(admissible(self.obj, t.user_attrs) for t in ok):
            import optuna

            fastest = min(step_of(t.user_attrs) or math.inf for t in ok)
            if before == 0:
                optuna.delete_study(study_name=self.name, storage=storage_for(self.storage))
                kept = f"study {self.name!r} was not kept"
            else:
                kept = (f"study {self.name!r} keeps its {before} earlier trials and this run's "
                        f"{len(trials) - before}")
            raise WorkError(f"no plan steps within --max-step-time {self.obj.max_step_time:g} s; the fastest found "
                            f"takes {fastest:.4g} s ({kept})")

    def _to_refine(self, subsets: list[tuple[int, ...]], best: dict[tuple[int, ...], Any]) -> list[tuple[int, ...]]:
        """Every subset of a small pool; else the screening's fastest and cheapest, then the other
        points of its front (fastest first), then the next fastest: ``REFINE`` of them."""
        if P.devices_of(self.pool, None) <= SMALL_POOL:
            return list(subsets)
        ok = {u: v for u, v in best.items() if v is not None}
        by_step = sorted(ok, key=lambda u: (ok[u][0], u))
        by_cost = sorted(ok, key=lambda u: (math.inf if ok[u][1] is None else ok[u][1], ok[u][0], u))
        front = pareto({u: ok[u] for u in ok})
        chosen = list(dict.fromkeys([*by_step[:1], *by_cost[:1], *[u for u in by_step if u in front],
                                     *by_step]))[:REFINE]
        return chosen or subsets[:1]


def _objective_key(obj: Objective, step: float, cost: float | None) -> tuple[float, float]:
    return figure_key(obj, step, cost)  # the objective's one ordering (autotune/objective.py)


def _best_of(rows: list[Any], obj: Objective) -> tuple[float, float | None] | None:
    """(step, cost) of the best admissible feasible row by the objective."""
    pts = [(step_of(r.attrs), cost_of(r.attrs)) for r in rows if r.feasible and admissible(obj, r.attrs)]
    pts = [p for p in pts if p[0] is not None]
    return min(pts, key=lambda p: _objective_key(obj, *p)) if pts else None


def subset_dtype(option: str, sub: Any) -> str:
    """The precision a subset searches in: ``--dtype auto`` chooses per subset (bf16 where every
    device of the subset has it: a subset without the pool's V100s trains in bf16), any other
    option is the whole pool's, as given (``search`` checked it against every device)."""
    from autotune.plan import choose_dtype

    return choose_dtype(option, sub) if option == "auto" else option


def step_floor(model: Any, pool: Any, uses: tuple[int, ...], seq_len: int, global_batch: int, dtype: str) -> float:
    """No plan on ``uses`` steps faster than this: the FLOPs of the weights' matrix products of one
    training step (forward and backward, attention left out, so document masks cannot lower it)
    at the sum of the devices' peak throughput in ``dtype``. 0 (no floor) where a device is priced
    from a measured profile, whose fitted rate is not bounded by the datasheet's peak."""
    if any(n and (getattr(g.device, "profile", None) is not None or g.device.kind == "cpu")
           for g, n in zip(pool.groups, uses, strict=True)):
        return 0.0
    flops = 3.0 * (model.layers * model.layer_matmul_flops_fwd() + model.head_flops_fwd()) * seq_len * global_batch
    peak = sum(n * g.devices_per_node * g.device.flops(dtype) for g, n in zip(pool.groups, uses, strict=True) if n)
    return flops / peak


def pareto(points: dict[Any, tuple[float, float | None]]) -> set[Any]:
    """Keys whose (step, cost) no other point beats on both (ties: the first key in order stays)."""
    out = set()
    items = list(points.items())
    for k, (s, c) in items:
        c = c if c is not None else math.inf
        dominated = False
        for k2, (s2, c2) in items:
            c2 = c2 if c2 is not None else math.inf
            if k2 != k and s2 <= s and c2 <= c and (s2 < s or c2 < c or str(k2) < str(k)):
                dominated = True
                break
        if not dominated:
            out.add(k)
    return out


def _union(workspaces: list[Any], study: Any, storage: str) -> list[Any]:
    """Every finished trial the workspaces know (each sees its own subset's), once, by number."""
    from autotune.study import MEMORY_URL

    if storage == MEMORY_URL:
        return study.get_trials(deepcopy=False)
    seen, out = set(), []
    for ws in workspaces:
        for t in ws.finished().get_trials(deepcopy=False):
            if t._trial_id not in seen:
                seen.add(t._trial_id)
                out.append(t)
    return sorted(out, key=lambda t: t.number)


def costs_of(res: SearchResult, pool: Any, seq_len: int, global_batch: int) -> list[dict[str, Any] | None]:
    """The ``cost`` of the best plan and of each of the top (``SearchResult.costs``) where the
    cluster has prices or the search chose devices (a pool); else nothing."""
    if not (P.priced(pool) or P.is_pool(pool)):
        return []
    return [figures(pool, rec.plan.uses, rec.predicted or {}, seq_len, global_batch) for rec in [res.best, *res.top]]


def front_of(res: SearchResult, pool: Any, seq_len: int, global_batch: int,
             trials: list[Any] | None = None) -> list[dict[str, Any]]:
    """The Pareto front of step time against cost (per million tokens with prices, else devices
    used): per subset its fastest feasible plan, kept when no other beats it on both. Each point
    names its trial (``apply --study S --trial N`` exports it) and its plan."""
    from autotune.study import is_feasible

    priced = P.priced(pool)
    if trials is None:  # a plain search: one subset, its best plan
        rec = res.best
        c = figures(pool, None, rec.predicted or {}, seq_len, global_batch)
        return [{"trial": res.best_trial, "uses": None, "devices": c["devices"], "step_time_s":
                 (rec.predicted or {}).get("step_time_s"), "cost": c, "chosen": True,
                 "left_out": "", "plan": rec.to_dict()}]
    best: dict[str, Any] = {}
    for t in trials:
        if not is_feasible(t) or "cost" not in t.user_attrs:
            continue
        s = step_of(t.user_attrs)
        k = str(t.user_attrs.get("uses"))
        if s is not None and (k not in best or s < step_of(best[k].user_attrs)):
            best[k] = t
    chosen = next((t for t in trials if t.number == res.best_trial), None)
    if chosen is not None and is_feasible(chosen) and "cost" in chosen.user_attrs:
        best[str(chosen.user_attrs.get("uses"))] = chosen  # its subset's point is the chosen plan (a tie-break
        # may prefer a simpler plan within 1% of the fastest)
    pts = {k: (step_of(t.user_attrs), (t.user_attrs["cost"].get("per_mtok") if priced
                                       else float(t.user_attrs["cost"]["devices"]))) for k, t in best.items()}
    keep = pareto(pts)
    out = []
    for k in sorted(keep, key=lambda k: pts[k][0]):
        t = best[k]
        pd = t.user_attrs["plan"]
        uses = tuple(pd["uses"]) if pd.get("uses") is not None else None
        out.append({"trial": t.number, "uses": list(uses) if uses else None, "devices": t.user_attrs["cost"]["devices"],
                    "step_time_s": pts[k][0], "cost": dict(t.user_attrs["cost"]),
                    "chosen": t.number == res.best_trial, "using": P.describe_uses(pool, uses),
                    "dtype": pd.get("dtype"),
                    "plan": dict(pd)})
    return out


def why_left_out(res: SearchResult, pool: Any, trials: list[Any], obj: Objective, model: Any = None) -> list[str]:
    """For the chosen plan, one line per node group it leaves nodes of out: what the best plan with
    them back costs in step time (and per token, with prices), and what paces that plan; or, when
    the subset with them back was never searched, why (``not_searched``: the budget, memory)."""
    uses = res.best.plan.uses
    if uses is None:
        return []
    full = P.full_uses(pool)
    chosen_step = (res.best.predicted or {}).get("step_time_s")
    chosen_cost = cost_of({"cost": figures(pool, uses, res.best.predicted or {}, res.best.plan.workload.seq_len,
                                           res.best.plan.workload.global_batch)}) if res.best.plan.workload else None
    by_uses = _fastest_by_uses(trials, full)
    lines = []
    for g, n_out, name in P.left_out(pool, uses):
        back = tuple(full[i] if i == g else uses[i] for i in range(len(uses)))
        head = f"{n_out} {name} left out"
        skipped = not_searched(pool, model, obj, back, res.best.plan.dtype) if model is not None else None
        if skipped is not None:  # never searched: the budget (or memory) is the reason
            lines.append(f"{head}: with them {skipped[1]}: not searched")
            continue
        # the subset with the group back; else the searched subset with the group whole closest to it
        alts = [u for u in by_uses if u[g] == full[g]]
        alt = back if back in by_uses else min(alts, key=lambda u: sum(abs(a - b) for a, b in zip(u, back, strict=True)),
                                               default=None)
        if alt is None or not chosen_step:
            lines.append(f"{head}: no plan with them was found feasible (memory or divisibility)")
            continue
        t = by_uses[alt]
        s = step_of(t.user_attrs)
        with_what = "with them" if alt == back else f"with them ({P.describe_uses(pool, alt)})"
        parts = [f"{with_what} the step takes {s / chosen_step:.2f}x " + ("longer" if s >= chosen_step else "as long")
                 + f" ({s:.3g} s vs {chosen_step:.3g} s)"]
        c = cost_of(t.user_attrs)
        if obj.kind == "cost" and c is not None and chosen_cost:
            parts.append(f"each token costs {c / chosen_cost:.3g}x as much")
        if obj.budget is not None:
            per_h = (t.user_attrs.get("cost") or {}).get("per_hour")
            if per_h is not None and per_h > obj.budget:
                parts.append(f"they would cost {per_h:.4g}{obj.currency}/h, over the budget")
        pace = _pace(t.user_attrs.get("breakdown"), name, t.user_attrs["plan"], pool)
        if pace:
            parts.append(pace)
        lines.append(f"{head}: " + "; ".join(parts))
    return lines


def _fastest_by_uses(trials: list[Any], full: tuple[int, ...]) -> dict[tuple[int, ...], Any]:
    """The fastest feasible priced trial of each subset (``uses``; a plan without uses is the whole pool)."""
    from autotune.study import is_feasible

    by_uses: dict[tuple[int, ...], Any] = {}
    for t in trials:
        if not is_feasible(t) or "cost" not in t.user_attrs:
            continue
        u = t.user_attrs["plan"].get("uses")
        u = tuple(u) if u is not None else full
        s = step_of(t.user_attrs)
        if s is not None and (u not in by_uses or s < step_of(by_uses[u].user_attrs)):
            by_uses[u] = t
    return by_uses


def _slowest(names: set[str], pool: Any, dtype: str) -> str:
    """The device type among ``names`` with the least peak throughput in ``dtype`` (the one the
    others wait for where they work side by side)."""
    speed = {g.device.name: g.device.peak_flops.get(dtype, min(g.device.peak_flops.values())) for g in pool.groups}
    return min(sorted(names), key=lambda n: speed.get(n, math.inf))


def _pace(bd: Any, name: str, plan: dict[str, Any], pool: Any) -> str:
    """What the left-out devices do in the best plan with them: the slowest stage when theirs is,
    else their stage's layers and compute against the others', or which devices pace a mixed stage."""
    from autotune.stages import degrees_text

    if not isinstance(bd, dict) or not bd.get("stages"):
        return ""
    stages = bd["stages"]
    deg = degrees_text(plan)  # a per-stage plan by its stages' own degrees, not its outer shape
    theirs = [s for s in stages if set(s.get("devices") or []) == {name}]
    others = [s for s in stages if name not in (s.get("devices") or [])]
    slow = max(stages, key=lambda s: float(s.get("compute_s") or 0.0))
    if all(set(s.get("devices") or []) <= {name} for s in stages):
        return ""  # one device type: nothing paces it but its own count
    if not theirs:
        mixed = [set(s.get("devices") or []) for s in stages if name in (s.get("devices") or [])]
        if not mixed:
            return ""
        slowest = _slowest(set().union(*mixed), pool, str(plan.get("dtype") or "bf16"))
        if slowest == name:
            return f"in that plan ({deg}) the faster ranks wait for the {name} ranks they work beside"
        return f"in that plan ({deg}) the {name} ranks wait for the slower {slowest} ranks they work beside"
    if slow in theirs:
        return f"their share of layers would make the {name} stage the slowest ({deg})"
    mine = sum(sum(s.get("layers") or []) for s in theirs)
    total = sum(sum(s.get("layers") or []) for s in stages)
    c_mine = max(float(s.get("compute_s") or 0.0) for s in theirs)
    c_other = max((float(s.get("compute_s") or 0.0) for s in others), default=0.0)
    bubble = max(float(s.get("bubble_s") or 0.0) for s in stages)
    other = others[0]["devices"][0] if others and others[0].get("devices") else "other"
    return (f"in that plan ({deg}) the {name} stage holds {mine} of {total} layers and still computes "
            f"{c_mine:.3g} s against {c_other:.3g} s on the {other} stage" + (
                f", and the pipeline waits {bubble:.3g} s" if bubble > 0.01 * max(c_mine, c_other) else ""))
