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
3. **Refinement**: the subsets that matter (on a larger pool ``REFINE`` of them: the best by the
   objective after screening, then the other points of the screening front of step time against
   cost, or devices without prices, then the next best; every candidate on a pool of at most
   ``SMALL_POOL`` devices) get the phases of a plain search
   (autotune/search/run.py): baselines, balanced starts, the sampler and the polish. The first
   (the screening's best by the objective) gets a plain search's budget, and so does every subset
   of a small pool; on a larger pool the others share a quarter of one (at least ``MIN_POLISH``
   starts and polish calls each) and skip the baselines (their balanced starts already price every
   degree layout once) and the sampler. At 128 devices of four types that is 15 subsets
   screened and 3 refined (docs/pools.md has the measured cost against a plain search).

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
from autotune.search.options import DEFAULT_TRIALS, POLISH_FACTOR, SearchOptions, SearchResult, check_options
from autotune.search.phases import run_baselines, run_polish, run_sampler, run_starts
from autotune.search.pricing import Evaluator, Outcome, plan_dict
from autotune.specs import pool as P

MAX_SUBSETS = 32
SMALL_POOL = 16  # devices: every candidate subset gets the whole search
REFINE = 3  # subsets refined on a larger pool
MIN_SCREEN = 24  # cost-model calls a subset's screening may spend at least
MIN_POLISH = 100  # a refined subset's balanced starts and polish calls at least


def uses_key(uses: tuple[int, ...]) -> str:
    return P.uses_text(uses)


def candidates(pool: Any, model: Any, obj: Objective, dtype: str = "bf16") -> tuple[list[tuple[int, ...]], list[str]]:
    """The subsets to search, most devices first, and notes on what was left unsearched and why (a
    subset whose memory cannot hold the model states fully sharded in ``dtype``: ``memory.sharded_bytes_per_param``)."""
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
    out, over, small = [], 0, 0
    state_bytes = sharded_bytes_per_param(dtype)
    need = state_bytes * model.param_count()
    for uses in itertools.product(*ranges):
        if not any(uses):
            continue
        if obj.budget is not None and (P.hourly(pool, uses) or 0.0) > obj.budget * (1 + 1e-12):
            over += 1
            continue
        mem = sum(n * g.devices_per_node * g.device.memory_bytes for g, n in zip(pool.groups, uses, strict=True))
        if mem < need:
            small += 1
            continue
        out.append(tuple(uses))
    if over:
        notes.append(f"{over} subsets cost more than the budget ({obj.budget:g}{obj.currency}/h): not searched")
    if small:
        notes.append(f"{small} subsets hold less memory than the model's weights, gradients and Adam states "
                     f"({state_bytes:g} bytes a parameter) fully sharded: not searched")
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
        return res
    check_options(opts, storage)
    from autotune.plan import choose_dtype

    opts = dataclasses.replace(opts, dtype=choose_dtype(opts.dtype, pool))  # ``auto`` as --dtype means it
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
        self.stored: list[Any] = []  # the study's trials before this run (each subset takes its own)

    def _setup(self, uses: tuple[int, ...]) -> tuple[Any, Any]:
        """The space, evaluator and workspace of one subset."""
        from autotune.search.options import load_space
        from autotune.search.pricing import default_estimator
        from autotune.search.workspace import Workspace, make_sampler
        from search_spaces.base import SearchContext

        sub = P.subset(self.pool, uses)
        ctx = SearchContext(model=self.model, cluster=sub, seq_len=self.seq_len, global_batch=self.global_batch,
                            dtype=self.opts.dtype)
        space = load_space(self.opts.space).space(ctx)
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
        from autotune.study import StudyRecord, create_or_open

        t0 = time.monotonic()
        deadline = t0 + self.opts.timeout_s if self.opts.timeout_s else None
        subsets, notes = candidates(self.pool, self.model, self.obj, self.opts.dtype)
        self.notes += notes
        if not subsets:
            raise WorkError("no subset of the pool can be searched: " + "; ".join(notes))
        record = StudyRecord(model=self.model, cluster=self.pool, seq_len=self.seq_len,
                             global_batch=self.global_batch, space=self.opts.space, target=self.opts.target,
                             documents=self.opts.documents)
        study = create_or_open(self.name, self.storage, record)
        study.set_user_attr(STUDY_KEY, self.obj.attrs())
        self.stored = study.get_trials(deepcopy=False)
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
        self._within_limits(trials)
        known = StudyView(study, trials)
        res = collect(known, self.storage, self.opts.top, time.monotonic() - t0, before, self.notes,
                      (self.model, self.pool, self.seq_len, self.global_batch))
        res.objective = self.obj.attrs()
        res.front = front_of(res, self.pool, self.seq_len, self.global_batch, trials)
        res.left_out = why_left_out(res, self.pool, trials, self.obj)
        study.set_user_attr("front", res.front)
        study.set_user_attr("left_out", res.left_out)
        study.set_user_attr("left_out_trial", res.best_trial)
        return res

    def _screen_and_refine(self, subsets: list[tuple[int, ...]], state: dict, best: dict, deadline: float | None,
                           screen: int, n_main: int, n_polish: int) -> list[tuple[int, ...]]:
        """Screen every subset with its balanced starts, then run a plain search's phases on the ones
        worth refining (module docstring); returns those."""
        if self.display is not None:
            self.display.phase(f"screening {len(subsets)} subsets")
        for uses in subsets:
            ev, ws = state[uses] = self._setup(uses)
            run_starts(ws, ev, deadline, screen, self.opts.seed)
            best[uses] = _best_of(ws.rows, self.obj)
            ws.flush()
        chosen = self._to_refine(subsets, best)
        self.say(f"screened {len(subsets)} subsets; refining {len(chosen)}: "
                 + ", ".join(P.describe_uses(self.pool, u) for u in chosen))
        if self.display is not None:
            self.display.phase(f"refining {len(chosen)} subsets")
        # a small pool: each subset gets a plain search's budget; else the refined share it
        k = 1 if P.devices_of(self.pool, None) <= SMALL_POOL else len(chosen)
        for i, uses in enumerate(chosen):  # the phases of a plain search (autotune/search/run.py)
            ev, ws = state[uses]
            if i == 0 or k == 1:  # the screening's best by the objective (or a small pool): a plain budget
                n_k, polish_k = n_main, n_polish
                run_baselines(ws, ev, deadline)
            else:  # a quarter of a plain budget shared, no baselines (the starts price each layout)
                # and no sampler (its ~25 trials each cost 5x a polish call's CPU): at 128 devices
                # (llama3-70b 128k b=16) 13.0 -> 10.0 s CPU in process against half a budget shared
                # with the sampler, the same best plan and front there and at 32k b=256
                share = 4 * (k - 1)
                n_k = 0
                polish_k = max(MIN_POLISH, n_polish // share) if n_polish else 0
            if polish_k:
                run_starts(ws, ev, deadline, polish_k, self.opts.seed)
            run_sampler(ws, ev, n_k, deadline)
            if polish_k:
                ev.prime(ws.rows)
                run_polish(ws, ev, polish_k, deadline)
            ws.flush()
        return chosen

    def _within_limits(self, trials: list[Any]) -> None:
        """Feasible plans exist but none within ``--max-step-time``: say so, with the fastest found."""
        from autotune.study import is_feasible

        ok = [t for t in trials if is_feasible(t) and "cost" in t.user_attrs]
        if ok and self.obj.max_step_time is not None and not any(admissible(self.obj, t.user_attrs) for t in ok):
            fastest = min(step_of(t.user_attrs) or math.inf for t in ok)
            raise WorkError(f"no plan steps within --max-step-time {self.obj.max_step_time:g} s; the fastest found "
                            f"takes {fastest:.4g} s")

    def _to_refine(self, subsets: list[tuple[int, ...]], best: dict[tuple[int, ...], Any]) -> list[tuple[int, ...]]:
        if P.devices_of(self.pool, None) <= SMALL_POOL:
            return list(subsets)
        ok = {u: v for u, v in best.items() if v is not None}
        ranked = sorted(ok, key=lambda u: _objective_key(self.obj, *ok[u]))
        front = pareto({u: ok[u] for u in ok})
        # the objective's best, then the other front points (the front's other ends), then the next best
        chosen = list(dict.fromkeys([*ranked[:1], *[u for u in ranked if u in front], *ranked[1:]]))[:REFINE]
        return chosen or subsets[:1]


def _objective_key(obj: Objective, step: float, cost: float | None) -> tuple[float, float]:
    return figure_key(obj, step, cost)  # the objective's one ordering (autotune/objective.py)


def _best_of(rows: list[Any], obj: Objective) -> tuple[float, float | None] | None:
    """(step, cost) of the best admissible feasible row by the objective."""
    pts = [(step_of(r.attrs), cost_of(r.attrs)) for r in rows if r.feasible and admissible(obj, r.attrs)]
    pts = [p for p in pts if p[0] is not None]
    return min(pts, key=lambda p: _objective_key(obj, *p)) if pts else None


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
                    "plan": dict(pd)})
    return out


def why_left_out(res: SearchResult, pool: Any, trials: list[Any], obj: Objective) -> list[str]:
    """For the chosen plan, one line per node group it leaves nodes of out: what the best plan with
    them back costs in step time (and per token, with prices), and what paces that plan."""
    from autotune.study import is_feasible

    uses = res.best.plan.uses
    if uses is None:
        return []
    full = P.full_uses(pool)
    chosen_step = (res.best.predicted or {}).get("step_time_s")
    chosen_cost = cost_of({"cost": figures(pool, uses, res.best.predicted or {}, res.best.plan.workload.seq_len,
                                           res.best.plan.workload.global_batch)}) if res.best.plan.workload else None
    by_uses: dict[tuple[int, ...], Any] = {}
    for t in trials:
        if not is_feasible(t) or "cost" not in t.user_attrs:
            continue
        u = t.user_attrs["plan"].get("uses")
        u = tuple(u) if u is not None else full
        s = step_of(t.user_attrs)
        if s is not None and (u not in by_uses or s < step_of(by_uses[u].user_attrs)):
            by_uses[u] = t
    lines = []
    for g, n_out, name in P.left_out(pool, uses):
        back = tuple(full[i] if i == g else uses[i] for i in range(len(uses)))
        # the subset with the group back; else the searched subset with the group whole closest to it
        alts = [u for u in by_uses if u[g] == full[g]]
        alt = back if back in by_uses else min(alts, key=lambda u: sum(abs(a - b) for a, b in zip(u, back, strict=True)),
                                               default=None)
        head = f"{n_out} {name} left out"
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
        pace = _pace(t.user_attrs.get("breakdown"), name, t.user_attrs["plan"])
        if pace:
            parts.append(pace)
        lines.append(f"{head}: " + "; ".join(parts))
    return lines


def _pace(bd: Any, name: str, plan: dict[str, Any]) -> str:
    """What the left-out devices do in the best plan with them: the slowest stage when theirs is,
    else their stage's layers and compute against the others', or that they pace a mixed stage."""
    if not isinstance(bd, dict) or not bd.get("stages"):
        return ""
    stages = bd["stages"]
    deg = ",".join(f"{k}={v}" for k, v in (plan.get("degrees") or {}).items() if v > 1) or "dp=1"
    theirs = [s for s in stages if set(s.get("devices") or []) == {name}]
    others = [s for s in stages if name not in (s.get("devices") or [])]
    slow = max(stages, key=lambda s: float(s.get("compute_s") or 0.0))
    if all(set(s.get("devices") or []) <= {name} for s in stages):
        return ""  # one device type: nothing paces it but its own count
    if not theirs:
        return (f"in that plan ({deg}) the faster ranks wait for the {name} ranks they work beside"
                if any(name in (s.get("devices") or []) for s in stages) else "")
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
