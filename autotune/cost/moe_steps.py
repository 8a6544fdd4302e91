"""An MoE layer priced from its measured steps: what ``profile --layers`` timed of it, term by term.

Where the rank's device has a layer profile whose ``moe`` points carry the FFN's steps
(``profilers/moe_parts.py``: router, dispatch, experts, combine, and shared for a model with shared
experts) at the rank's ep and etp, one MoE layer per micro-batch is:

* **the attention side** (norms, attention, residuals): the ``moe`` piece less the ``ffn`` reference
  timed beside it, where the profile times the rank's block (cp = hp = 1, even heads:
  ``layers.moe_piece``); else the kernel model's attention on the profile's one scale
  (``layers.block_scale``: the dense block's measured over modelled time), or the kernel model alone
  where the profile has no dense block;
* **the FFN**: the sum of its measured steps at the rank's tokens (``layers.moe_step``: a cp or hp
  shard at the micro-batch of whole sequences holding as many tokens), the experts' step times the
  model's busiest over even-mean ratio (``moe_layers.even_terms``: uneven shares, the routing's
  imbalance; the profile timed the mean load of an even split), and the named
  ``recompute_modules``' routed work as the model prices it;
* **the exchange** as ``moe_layers.moe_terms`` prices it over the device's collectives (the gloo
  table on a profiled CPU), and on a CPU the runtime's small collectives around it and the waits
  at every blocking one (``cpu.moe_comm``, ``cpu.moe_sync_waits``, added by ``rank.moe_block``).

So on the shape the profile timed the block's compute is the measured ``moe`` piece less the
``ffn`` reference plus the steps' sum (the reference and the sum agree within ~10% on this
project's CPU; ``tests/unit/test_moe_steps.py`` pins the price to the stored steps).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from autotune.cost import layers as LY
from autotune.cost import moe_layers as ML
from autotune.cost.compute import LayerCompute, rescaled_block

if TYPE_CHECKING:
    from autotune.cost.context import RankContext

STEPS = ("router", "dispatch", "experts", "combine")
"""The measured steps every MoE FFN runs (``profilers/moe_parts.PARTS``); ``shared`` besides where the
model has shared experts."""
REFERENCE = "ffn"


def measured_steps(ctx: RankContext) -> dict[str, LY.Lookup] | None:
    """{step: (fwd, bwd) seconds} of this rank's MoE FFN for its micro-batch, or None where the
    profile lacks one of them at the rank's ep and etp."""
    names = STEPS + (("shared",) if ctx.step.model.moe.shared_experts else ())
    got = {n: LY.moe_step(ctx, n) for n in names}
    return None if any(v is None for v in got.values()) else got


def attention_side(ctx: RankContext) -> tuple[LayerCompute, str]:
    """The MoE layer's attention side (no FFN) on this rank, and what priced it (module docstring)."""
    att = ML.base_block(ctx, 0)[0]
    block, ffn = LY.moe_piece(ctx), LY.moe_step(ctx, REFERENCE)
    if block is not None and ffn is not None:
        return rescaled_block(att, max(0.0, block.fwd - ffn.fwd), max(0.0, block.bwd - ffn.bwd)), \
            f"{block.source} less its ffn"
    sc = LY.block_scale(ctx)
    if sc is not None:
        return rescaled_block(att, att.fwd * sc[0], att.bwd * sc[1]), sc[2]
    return att, ctx.rates.source


def priced(ctx: RankContext, t: ML.MoETerms, shared_fwd: float,
           steps: dict[str, LY.Lookup]) -> tuple[LayerCompute, ML.MoETerms]:
    """(attention side, the MoE terms with their compute from ``steps``): ``t`` is the model's
    ``moe_terms`` of this rank (its exchange, imbalance and memory stay)."""
    even = ML.even_terms(ctx, shared_fwd)
    busy = t.experts_s / even.experts_s if even.experts_s > 0 else 1.0
    cf = ctx.cf
    f = {n: v.fwd * (busy if n == "experts" else 1.0) for n, v in steps.items()}
    b = {n: v.bwd * (busy if n == "experts" else 1.0) for n, v in steps.items()}
    lc, _ = attention_side(ctx)
    terms = dataclasses.replace(
        t, comp_f=cf * sum(f.values()), comp_b=cf * sum(b.values()) + t.recompute_b, host_s=0.0,
        router_s=cf * (f["router"] + b["router"]), experts_s=cf * (f["experts"] + b["experts"]))
    return lc, terms


def source(ctx: RankContext) -> str | None:
    """What priced this rank's MoE layers from their steps (None: the steps are not in its profile)."""
    steps = measured_steps(ctx)
    if steps is None:
        return None
    x = ctx.step.experts
    how = steps["experts"].source.split(", ")[-1]
    return f"{LY.table_for(ctx.spec, ctx.step.model, ctx.step.dtype).ref} steps ({how}; ep {x.ep}, etp {x.etp}); " \
           f"attention side {attention_side(ctx)[1]}"
