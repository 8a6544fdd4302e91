"""The default space's HeterMoE points (``Plan.disaggregate``, priced by ``cost/disaggregation.py``).

A MoE study on a mixed cluster has the categorical knob ``disaggregate``. Its True points build one
plan shape: data and expert parallelism over every device (dp = ep = devices, node order), the
fastest device type's replicas taking the samples (~ speed**samples_speed over them), the other
devices holding routed experts only, the experts over all devices ~ speed**experts_speed; the
micro-batch size, recomputation and ZeRO stage from the point. Every other knob is idle there.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from autotune.plan import RECOMPUTE, Degrees, Plan, PlanError, Shares
from search_spaces import _balance as B
from search_spaces.base import Infeasible

KNOB = "disaggregate"
USED = ("mbs_exp", "recompute", "zero_stage", "samples_speed", "experts_speed", KNOB)
"""The knobs a disaggregated point's plan depends on (the others are idle, ``idle``)."""
FAMILY = "dp+ep (experts-only ranks)"


def applies(moe: Any, heterogeneous: bool) -> bool:
    """Whether the study gets the knob: a MoE model on devices of more than one type."""
    return moe is not None and heterogeneous


def build(ctx: Any, moe: Any, speeds: np.ndarray, p: dict[str, Any]) -> Plan | Infeasible:
    """The disaggregated plan of point ``p`` (module docstring), resolved, or why there is none."""
    n, mbs = len(speeds), 2 ** p["mbs_exp"]
    attention = speeds >= speeds.max()
    if attention.all():
        return Infeasible("divisibility", "disaggregate: one device type, no older devices to hold experts only", FAMILY)
    if moe.experts < n:
        return Infeasible("divisibility", f"disaggregate: moe.experts({moe.experts}) < devices({n}) (ep == dp)", FAMILY)
    if ctx.global_batch % mbs:
        return Infeasible("batch", f"global_batch({ctx.global_batch}) not divisible by micro_batch_size({mbs})", FAMILY)
    ones = np.ones(int(attention.sum()))
    got = B.proportional_split(ctx.global_batch // mbs, B.weights(speeds[attention], ones, float(p["samples_speed"]),
                                                                  0.0), 1)
    experts = B.proportional_split(moe.experts, B.weights(speeds, np.ones(n), float(p["experts_speed"]), 0.0), 1)
    if got is None or experts is None:
        return Infeasible("batch", "disaggregate: too few samples or experts for every rank", FAMILY)
    samples = np.zeros(n, dtype=int)
    samples[attention] = np.asarray(got) * mbs
    plan = Plan(degrees=Degrees(dp=n, ep=n), micro_batch_size=mbs, recompute=p["recompute"],
                zero_stage=int(p["zero_stage"]), dtype=ctx.dtype, disaggregate=True,
                shares=Shares(samples=tuple(int(x) for x in samples), experts=tuple(experts)))
    try:
        return plan.resolve(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)
    except PlanError as e:
        return Infeasible("divisibility", e.message, FAMILY)


def idle(knobs: Any) -> set[str]:
    """The knobs of a disaggregated point that do not change its plan."""
    return {k for k in knobs if k not in USED}


def grid(params: Any, mbs_max_exp: int) -> Any:
    """The disaggregated points of the grid: every micro-batch size, recomputation and ZeRO stage,
    shares even (0) or speed-balanced (1)."""
    for e, rc, z, bal in itertools.product(range(mbs_max_exp + 1), RECOMPUTE, (0, 1, 2, 3), (0.0, 1.0)):
        yield {**params(mbs=2 ** e, recompute=rc, zero=z, balance=bal), KNOB: True}
