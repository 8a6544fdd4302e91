"""The search's estimator for a workload of documents (``cost/documents.py`` prices one plan's
masked windows; ``cost/estimate.py`` composes them into a step): a callable like ``estimate`` that
prices each plan with document masks and picks its balance, over DP replicas (windows dealt by
count or by cost) and over CP ranks (token shares by count or by cost, ``cp_balanced``). Above
both, so the estimate and the document pricing never import each other.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autotune import documents as W
from autotune.cost import cp_shares as CPS
from autotune.cost.estimate import estimate

CP_STEPS = (1 / 3, 2 / 3, 1.0)
"""Points priced on the line from the count shares to the attention-balanced ones (``cp_balanced``):
the attention is not all of a rank's time, so the best split lies between them."""


SCREEN = 1.10
"""A plan whose first price (its own CP shares, the faster balance) is slower than the best plan
this estimator has priced by more than this factor, or does not fit, is not priced again with
other CP shares: they move attention work between ranks and gained at most 1.1% on 126 plans of
the benchmark setups (llama3-8b on 8 H100 + 8 A100, log-normal documents at 32k and the two-mode
file at 8k; the largest gain measured in trials is 5%, README: whole-window files among snippets),
and do not free memory (every window is S tokens; CP shares by cost are uneven, so some rank holds
more). The plan keeps the price it was given (a true price of the plan it records). Both balances
are priced on every plan: they share the priced steps (``estimate``'s ``balances``)."""


def cp_balanced(plan: Any, model: Any, cluster: Any, seq_len: int, global_batch: int, dist: W.LengthDistribution,
                base: Any = None, **kw: Any) -> Any:
    """The ``Estimate`` of ``plan`` (doc_mask on) with its CP token shares by cost: the fastest of its
    own shares and ``CP_STEPS`` of the way to the shares whose expected masked attention stands in
    their ratio (``cp_shares.cost_tokens``), each priced by the cost model with the distribution.
    A plan without CP, or whose shares cannot move by a granule, prices as it is. ``base``: the
    ``Estimate`` of ``plan`` as it is, when already priced; ``kw`` reaches ``estimate`` (``balances``
    among them: each share's fastest balance)."""
    if base is None:
        base = estimate(plan, model, cluster, seq_len, global_batch, documents=dist, **kw)
    rp = base.plan
    if rp.degrees.cp == 1:
        return base
    zig, g = rp.cp_layout == "zigzag", rp.token_granule()
    start = rp.shares.tokens
    target = _target(dist, seq_len, start, zig, g)
    best = base
    tried = {start}
    for frac in CP_STEPS:
        tokens = CPS.toward(start, target, frac, g)
        if tokens in tried:
            continue
        tried.add(tokens)
        cand = rp.replace(shares=dataclasses.replace(rp.shares, tokens=tokens))
        est = estimate(cand, model, cluster, seq_len, global_batch, documents=dist, beat=_beat(best), **kw)
        if est is not None and est.predicted.get("tokens_per_s", 0) > best.predicted.get("tokens_per_s", 0):
            best = est
    if best is not base:
        best.breakdown["documents"]["cp_tokens"] = {"by": "cost", "count_shares": list(start),
                                                    "attention_balanced": list(target),
                                                    "count_shares_step_s": base.predicted["step_time_s"]}
    return best


def _beat(best: Any) -> float | None:
    """The step time a candidate must get below to be kept (``estimate``'s ``beat``: a candidate at
    or above it is not reported, nor, where the typical work's step already shows it, priced at the
    heavy work): tokens/s is the batch's tokens over the step time, so a step no shorter has no
    more tokens/s and is not kept. None (price and report it) where the best has no positive step."""
    t = best.predicted.get("step_time_s")
    return float(t) if isinstance(t, (int, float)) and t > 0 else None


def _target(dist: W.LengthDistribution, seq_len: int, start: tuple[int, ...], zig: bool, granule: int
            ) -> tuple[int, ...]:
    """``cp_shares.cost_tokens`` of the distribution's key profile, once per distribution (digest),
    window, count shares, layout and granule: the profile is a window long (131,072 floats at 128k),
    and a search asks for a few dozen targets hundreds of times."""
    key = (dist.digest(), seq_len, start, zig, granule)
    got = _TARGETS.get(key)
    if got is None:
        got = _TARGETS[key] = CPS.cost_tokens(CPS.key_profile(dist, seq_len), start, zig, granule)
    return got


_TARGETS: dict[tuple, tuple[int, ...]] = {}


class DocumentsEstimator:
    """The search's estimator for a workload of documents: prices every plan with ``doc_mask`` on,
    both balances where there are replicas to balance (the search may choose either: the faster
    is recorded on the plan) and, with CP, token shares by count or by cost (``cp_balanced``: the
    plan then carries the shares that won). Picklable (worker processes)."""

    def __init__(self, dist: W.LengthDistribution, balance: str = "auto", cp_balance: bool = True):
        self.dist, self.balance, self.cp_balance = dist, balance, cp_balance
        self.best = 0.0  # the best feasible tokens/s this estimator has returned (``SCREEN``)

    def __call__(self, plan, model, cluster, seq_len, global_batch, *, calibration=None, timeline=False,
                 kernels=None):
        """``estimate``'s signature: ``kernels`` (the target runtime's kernel costs, ``--target``) reach
        every priced step, as they reach a plain estimate's."""
        choices = ("count", "cost") if self.balance == "auto" else (self.balance,)
        if plan.degrees.dp == 1:
            choices = choices[:1]
        kw = {"calibration": calibration, "timeline": timeline, "kernels": kernels, "balances": choices}
        first = estimate(plan.replace(doc_mask=True, balance=choices[0]), model, cluster, seq_len, global_batch,
                         documents=self.dist, **kw)
        best = first
        if self.cp_balance and first.predicted.get("feasible", True) and self._tps(first) * SCREEN >= self.best:
            best = cp_balanced(first.plan, model, cluster, seq_len, global_batch, self.dist, base=first, **kw)
        if best.predicted.get("feasible", True):
            self.best = max(self.best, self._tps(best))
        return best

    @staticmethod
    def _tps(est: Any) -> float:
        return float(est.predicted.get("tokens_per_s", 0) or 0)
