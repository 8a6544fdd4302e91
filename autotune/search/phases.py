"""The phases of a search, in the order ``search`` runs them (the grid, a sampler of its own, is in
autotune/search/grid.py):

1. ``run_baselines``: the space's even splits (the plans people write by hand), so the answer is
   never worse than them.
2. ``run_starts``: one speed-balanced start per degree layout, and its least-memory variant where it
   does not fit, so every layout gets a fair first price.
3. ``run_sampler``: TPE (multivariate, Watanabe 2023) or random sampling.
4. ``run_polish``: a variable-neighbourhood hill climb from the best plan of each of the best
   layouts. This, not TPE, is what reaches the grid optimum (measured: TPE + a one-step climb
   reached 93.8% on 16 A100: ZeRO 1 -> 3 needs a pair move).

Each phase prices points through the Evaluator (autotune/search/pricing.py) and records them in
the Workspace (autotune/search/workspace.py); each stops at ``deadline`` (time.monotonic()).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from typing import Any

from autotune.search.pricing import Evaluator
from autotune.search.signals import stop_requested
from autotune.search.workspace import Row, Workspace

Moves = Callable[[dict[str, Any]], Iterable[dict[str, Any]]]  # a point -> the points one move away


def deadline_passed(deadline: float | None) -> bool:
    """The time is up, or this process was asked to stop (a search worker's Ctrl-C or SIGTERM)."""
    import time

    return stop_requested() or (deadline is not None and time.monotonic() >= deadline)


def pkey(params: dict[str, Any]) -> tuple:
    """What makes two points of a space the same point."""
    return tuple(sorted(params.items()))


def run_baselines(ws: Workspace, ev: Evaluator, deadline: float | None) -> int:
    have = {r.attrs.get("baseline_key") for r in ws.rows}
    n = 0
    for name, params in ev.space.baselines():
        key = f"{name}:{sorted(params.items())}"
        if key in have or deadline_passed(deadline):
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
    if not hasattr(ev.space, "starts"):
        return 0
    have = {pkey(r.params) for r in ws.rows}
    n = 0
    calls0 = ev.calls
    starts = ev.space.starts()
    random.Random(seed).shuffle(starts)
    for p in starts:
        for q in (p, ev.space.memory_fallback(p)):
            if deadline_passed(deadline) or ev.calls - calls0 >= budget:
                return n
            k = pkey(q)
            if k in have:
                break
            have.add(k)
            out = ev.evaluate(q)
            ws.record(q, out, {"start": True})
            n += 1
            if out.constraints.get("memory", 0) <= 0:  # fits (or is no plan at all): no fallback
                if out.feasible and hasattr(ev.space, "filled_starts"):
                    n += _grow(ws, ev, q, out, have, budget - (ev.calls - calls0))
                break
    return n


def _grow(ws: Workspace, ev: Evaluator, p: dict[str, Any], out: Any, have: set, budget: int) -> int:
    """Start ``p`` (it fits) at the larger micro-batches its memory leaves room for
    (``space.filled_starts``), the first that fits: so a climb starts near where the best plans
    run instead of walking there from micro-batch 1 (measured on issue 26's mixed clusters)."""
    n = 0
    for q in ev.space.filled_starts(p, out.attrs):
        k = pkey(q)
        if k in have or n >= budget:
            break
        have.add(k)
        got = ev.evaluate(q)
        ws.record(q, got, {"start": True})
        n += 1
        if got.feasible:
            break
    return n


def run_sampler(ws: Workspace, ev: Evaluator, n: int, deadline: float | None, patience: int | None = None) -> int:
    """Up to ``n`` sampler trials; with ``patience``, stop after that many in a row that beat no plan
    priced so far (the study's best when the phase began, then its own): past the baselines and the
    balanced starts, TPE's late trials rarely lead anywhere the polish does not (measured: issue 26's
    mixed clusters found their sampler best within the first dozen of 100)."""
    done = since_best = 0
    best = max((r.value for r in ws.rows if r.feasible and r.value is not None), default=0.0)
    while done < n and not deadline_passed(deadline):
        if patience is not None and since_best >= patience:
            break
        t = ws.mem.ask(ws.dists)
        out = ev.evaluate(dict(t.params))
        ws.record(t.params, out, trial=t)
        done += 1
        since_best += 1
        if out.feasible and out.value > best:
            best, since_best = out.value, 0
    return done


def _seeds(rows: list[Row], starts: int) -> list[tuple[dict[str, Any], float]]:
    """The best trial of each of the best ``starts`` degree layouts: diverse starts, not near-copies.
    Per-stage plans (``stages`` in the plan) are one layout whatever their stages: the stage program
    chose those from the same knobs, so their climbs all meet at one program optimum (measured on
    issue 26's mixed clusters: up to five of eight seeds, each climb re-running the program)."""
    best: dict[str, Row] = {}
    for r in rows:
        if not (r.feasible and r.params and r.value is not None):
            continue
        plan = r.attrs["plan"]
        k = "stages" if plan.get("stages") else json.dumps(plan["degrees"], sort_keys=True)
        if k not in best or r.value > best[k].value:
            best[k] = r
    ranked = sorted(best.values(), key=lambda r: -r.value)[:starts]
    return [(dict(r.params), float(r.value)) for r in ranked]


class _Climb:
    """The polish's shared state: values known per point, and the cost-model calls left."""

    def __init__(self, ws: Workspace, ev: Evaluator, budget: int, deadline: float | None):
        self.ws, self.ev = ws, ev
        self.known: dict[tuple, float] = {pkey(r.params): (r.value if r.feasible else -1.0) for r in ws.rows}
        # points over memory: the tokens/s they would reach if they fitted (what memory repair is for)
        self.would: dict[tuple, float] = {}
        for r in ws.rows:
            if not r.feasible:
                self._note(pkey(r.params), r.attrs)
        self.calls0, self.budget, self.deadline = ev.calls, budget, deadline
        self.done = 0

    def _note(self, k: tuple, attrs: dict[str, Any]) -> None:
        if attrs.get("infeasible_kind") == "memory":
            tps = ((attrs.get("plan") or {}).get("predicted") or {}).get("tokens_per_s")
            if tps:
                self.would[k] = float(tps)

    def spent(self) -> bool:
        return self.ev.calls - self.calls0 >= self.budget or deadline_passed(self.deadline)

    def value(self, q: dict[str, Any]) -> float | None:
        """The value of point ``q`` (-1: no feasible plan), pricing it if new; None: out of budget."""
        k = pkey(q)
        v = self.known.get(k)
        if v is not None:
            return v
        if self.spent():
            return None
        out, new = self.ev.evaluate_new(q)
        if new:  # a point that is no plan or repeats a plan is not worth a trial
            self.ws.record(q, out, {"polish": True}, sampler=False)  # no sampler after this
            self.done += 1
        v = self.known[k] = out.value if out.feasible else -1.0
        if not out.feasible:
            self._note(k, out.attrs)
        return v

    def best_move(self, params: dict[str, Any], value: float, movesets: list[tuple[Moves, Moves | None]]
                  ) -> tuple[Any, float]:
        """The best improving move of the first move set that has one (single moves before pairs).
        A set's ``repairs``: a move over memory that would beat the best so far if it fitted is
        priced again with each of them (one knob towards less memory), and counts as a move. Of the
        single moves, the other improving ones are then added on top (``_compound``)."""
        best_p, best_v = None, value * (1 + 1e-9)
        improving: list[tuple[float, dict[str, Any]]] = []
        for i, (moves, repairs) in enumerate(movesets):
            for q in moves(params):
                v = self.value(q)
                if v is None:
                    break
                if v > value * (1 + 1e-9):
                    improving.append((v, q))
                if v > best_v:
                    best_p, best_v = q, v
                elif repairs is not None and v < 0 and self.would.get(pkey(q), 0.0) > best_v:
                    for r in repairs(q):
                        v = self.value(r)
                        if v is not None and v > best_v:
                            best_p, best_v = r, v
            if best_p is not None:
                if i == 0:
                    best_p, best_v = self._compound(params, best_p, best_v, improving)
                break  # a single move helps: no need for pairs
        return best_p, best_v

    def _compound(self, params: dict[str, Any], best_p: dict[str, Any], best_v: float,
                  improving: list[tuple[float, dict[str, Any]]]) -> tuple[dict[str, Any], float]:
        """The best single move with each other improving single move of the same scan added on top,
        best first, kept where the sum beats the best so far (one price each; a move that changes a
        knob already changed is skipped). A climb otherwise scans the whole neighbourhood (25-65
        prices) to take one of the moves it has already seen improve (recomputation, then the
        schedule, then ZeRO: measured on the bench's mixed A100 + V100 setups), so it reached its
        optimum at about half the polish's prices (OPT-350M 16+16: at 152 instead of 242) with the
        same or a better plan on every setup of benchmarks/bench_search.py compared."""
        changed = {k for k, v in best_p.items() if params.get(k) != v}
        for _v, q in sorted(improving, key=lambda vq: -vq[0]):
            diff = {k: v for k, v in q.items() if params.get(k) != v}
            if not diff or changed & diff.keys():
                continue
            cand = {**best_p, **diff}
            v = self.value(cand)
            if v is None:
                break
            if v > best_v:
                best_p, best_v = cand, v
                changed |= diff.keys()
        return best_p, best_v


def run_polish(ws: Workspace, ev: Evaluator, budget: int, deadline: float | None, starts: int = 8,
               finals: int = 3) -> int:
    """Variable-neighbourhood hill climb in two rounds. First from the best plan of each of the best
    ``starts`` degree layouts, one-parameter moves only (the best while one helps); then from the
    best ``finals`` points those climbs reached, also moves of two coupled parameters where no
    single move helps (space.pair_moves, or the first of space.pair_movesets() that has one), and
    single moves again after each. The pair moves cost ~60-100 prices a step and mostly confirm a
    local optimum: spent on every seed they took most of the budget, and the seeds that did not
    lead to the best plan took as much as the one that did (measured on issue 26's mixed clusters).
    ``budget`` counts cost-model calls (a point that is no plan or repeats a priced plan costs
    none, and is not recorded: the study would fill with them). Returns the plans priced."""
    climb = _Climb(ws, ev, budget, deadline)
    movesets: list[tuple[Moves, Moves | None]] = [(ev.space.neighbours, getattr(ev.space, "memory_repairs", None))]
    if hasattr(ev.space, "pair_movesets"):
        movesets += [(moves, None) for moves in ev.space.pair_movesets()]
    elif hasattr(ev.space, "pair_moves"):
        movesets.append((ev.space.pair_moves, None))
    ends: dict[tuple, tuple[dict[str, Any], float]] = {}
    for params, value in _seeds(ws.rows, starts):
        params, value = _climb_from(climb, params, value, movesets[:1])
        ends[pkey(params)] = (params, value)
    for params, value in sorted(ends.values(), key=lambda pv: -pv[1])[:finals]:
        _climb_from(climb, params, value, movesets)
    return climb.done


def _climb_from(climb: _Climb, params: dict[str, Any], value: float,
                movesets: list[tuple[Moves, Moves | None]]) -> tuple[dict[str, Any], float]:
    """Take the best improving move (``_Climb.best_move``) while there is one and budget left."""
    while not climb.spent():
        best_p, best_v = climb.best_move(params, value, movesets)
        if best_p is None:
            break
        params, value = best_p, best_v
    return params, value
