"""One MoE rank's layers priced as they compute: the attention and the FFN the attention's ranks run
(a dense layer's FFN, or a MoE layer's shared experts) as a dense block of that FFN width, plus in
each MoE layer the router, the routed experts and their token exchange (``MoETerms``).

The routed experts' work on the busiest EP rank: the EP group's ``ep * etp`` ranks route
``tokens`` each (their sequence-parallel slices), ``top_k`` copies per token; the busiest EP rank,
holding ``share`` experts, receives ``imbalance`` times its even part of them
(``moe_imbalance.py``) and, with etp > 1, its etp ranks gather them and compute 1/etp of each
expert's width (``grouped_gemm.py``). Under even shares and balanced routing each rank computes
``tokens * top_k`` copies at the full expert width: the dense model's work with ``top_k`` FFNs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from autotune.cost import expert_dispatch as XD
from autotune.cost import expert_ranks as ER
from autotune.cost import grouped_gemm as GG
from autotune.cost import kernels as K
from autotune.cost import moe_memory as MM
from autotune.cost import moe_router as MR
from autotune.cost import recompute_modules as RMOD
from autotune.cost.activations import layer_activation_bytes
from autotune.cost.compute import LayerCompute, layer_compute, rescaled_block
from autotune.plan_parts import FP8_RECIPES

if TYPE_CHECKING:
    from autotune.cost.context import RankContext


@lru_cache(maxsize=256)
def ffn_model(model: Any, width: int) -> Any:
    """``model`` as a dense model whose every FFN has ``width`` (0: attention alone): what the
    attention's ranks compute of a layer whose FFN is that wide. Memoised, so the kernel-price memo
    (keyed by the model's identity) meets the same object again."""
    return dataclasses.replace(model, ffn_hidden=width, moe=None)


@dataclass(frozen=True)
class MoETerms:
    """Seconds and bytes of one MoE layer beyond its dense block, per micro-batch, busiest rank."""

    comp_f: float
    """Router, permutation, routed experts' GEMMs and activation, forward."""
    comp_b: float
    ep_f: float
    """Token exchange (all-to-all and expert-TP collectives) not hidden, forward."""
    ep_b: float
    exchange_raw: float
    """All of the exchange, forward and backward."""
    router_s: float
    host_s: float
    """Host time of the layer's own kernels and synchronisations, forward and backward (``kernels.moe_layer_host``)."""
    experts_s: float
    """Routed experts' compute, forward and backward."""
    imbalance: float
    tokens_per_expert: float
    routed_kept: float
    routed_full: float
    buffers: float
    recompute_b: float = 0.0
    """Of ``comp_b``: the named ``recompute_modules``' routed work run again (``recompute_modules.py``)."""


def tokens_in(ctx: RankContext) -> float:
    """Tokens one rank holds entering a MoE layer per micro-batch: its sequence-parallel slice
    (Megatron-Core runs MoE under tp with sequence parallelism)."""
    return ctx.tokens_local / ctx.step.tp


def base_block(ctx: RankContext, width: int) -> tuple[LayerCompute, float, float, float]:
    """(compute, kept, full, scores) of the attention plus an FFN of ``width`` on this rank."""
    s = ctx.step
    m = ffn_model(s.model, width)
    kept, full, scores = layer_activation_bytes(
        m, micro_batch=s.mbs, tokens_local=ctx.tokens / s.hp, cp_tokens=ctx.tokens, seq_len=s.seq_len,
        heads_local=ctx.heads, tp=s.tp, sequence_parallel=s.sp, recompute=s.recompute, act_bytes=s.bpe,
        fused_attention=ctx.spec.fused_attention())
    lc = layer_compute(m, ctx.rates, tokens=ctx.tokens_local, tp=s.tp, heads_local=ctx.heads, keysum=ctx.keysum,
                       block_seq=ctx.block_seq, blocks=ctx.ring, micro_batch=s.mbs, act_bytes=full - scores)
    return lc, kept, full, scores


def moe_terms(ctx: RankContext, shared_fwd: float, shape: tuple[ER.RankLoad, ...] | None = None) -> MoETerms:
    """The router, routed experts and exchange of one MoE layer on this rank (``shared_fwd``: the
    shared experts' forward GEMM seconds, what Megatron-Core overlaps the exchange with). Every EP
    rank of its group is priced on its own device at its own share, and the layer waits for the
    slowest (``expert_ranks.py``); ``shape``: every EP rank on this rank's device at these loads
    instead (``measured_moe``: the shape a layer profile timed)."""
    s, x, m = ctx.step, ctx.step.experts, ctx.step.model
    e = m.moe
    n = tokens_in(ctx)
    width = e.expert_ffn_hidden / x.etp
    loads = shape or ER.loads(e, x.ep, x.etp, n, x.shares)
    peers = (None if shape else ctx.expert_peers) or ((ctx.rates, ctx.cf),) * x.ep
    secs = [cf * ER.expert_seconds(r, m, ld, width, s.bpe) for (r, cf), ld in zip(peers, loads, strict=True)]
    slow = loads[ER.pace(secs)]
    own = loads[ctx.expert_links.ep_index]
    r_gemm, r_mem = MR.router_time(ctx.rates, m, n, s.bpe)
    split = ER.exchange_split(e, (n,) * x.ep, loads, ctx.expert_links.ep_nodes, flex=x.flex)
    a2a, etp_t = XD.exchange_times(ctx.collectives, ctx.expert_links, etp=x.etp, split=split, hidden=m.hidden,
                                   bpe=s.bpe, received=max(ld.received for ld in loads))
    one_way = ctx.mf * (a2a + etp_t)  # dispatch; the combine moves as much back
    # the shared experts' forward runs beside the forward's dispatch and combine, their backward (twice
    # the GEMM work) beside the backward's
    exp_f = XD.exposed(2.0 * one_way, x.overlap, ctx.cf * shared_fwd)
    exp_b = XD.exposed(2.0 * one_way, x.overlap, 2.0 * ctx.cf * shared_fwd)
    g, cf = secs[ER.pace(secs)], ctx.cf
    # the layer's own kernels: the EP rank holding the most experts issues the most (one GEMM launch each)
    host_f, host_b = layer_host(ctx, max(ld.share for ld in loads))
    comp_f = g + cf * (r_gemm + r_mem) + host_f
    comp_b = 2.0 * g + cf * (2.0 * r_gemm + r_mem) + host_b
    kept = MM.routed_activation_bytes(m, received=own.received, tokens=n, etp=x.etp, bpe=s.bpe,
                                      recompute=s.recompute, dtype=s.dtype, modules=s.recompute_modules)
    full = MM.routed_activation_bytes(m, received=own.received, tokens=n, etp=x.etp, bpe=s.bpe, recompute="none",
                                      dtype=s.dtype)
    # the named modules' forward work again in the backward (the whole layer under ``moe``: the caller)
    again = cf * RMOD.routed_seconds(m, ctx.rates, s.recompute_modules, received=slow.received, etp=x.etp,
                                     bpe=s.bpe)
    if MM.recomputes_routed_gemms(MM.M.framework_of(s), s.recompute):
        # torchtitan's per-op checkpointing saves no grouped-GEMM output and recomputes the router's
        # gate (op_sac.py): the experts' forward and the gate's GEMM again
        kept = MM.op_sac_routed_bytes(m, received=own.received, tokens=n, ep=x.ep, bpe=s.bpe)
        again += g + cf * r_gemm
    return MoETerms(comp_f=comp_f, comp_b=comp_b + again, ep_f=exp_f, ep_b=exp_b, exchange_raw=4.0 * one_way,
                    router_s=cf * (3.0 * r_gemm + 2.0 * r_mem), host_s=host_f + host_b, experts_s=3.0 * g,
                    imbalance=slow.imbalance, tokens_per_expert=slow.received / slow.share, routed_kept=kept,
                    routed_full=full, buffers=MM.dispatch_buffer_bytes(m, own.received, s.bpe), recompute_b=again)


def layer_host(ctx: RankContext, local_experts: int) -> tuple[float, float]:
    """(forward, backward) host seconds of a MoE layer's own kernels on this rank, as the runtime that
    prices the dense blocks issues them (``rates.host`` on a profiled GPU, the datasheet's kernels
    otherwise); none where no runtime's kernels are priced (a CPU)."""
    r = ctx.rates
    k = r.host if r.host is not None else (r.size.kernels if r.size is not None else None)
    if k is None:
        return 0.0, 0.0
    return K.moe_layer_host(k, local_experts, FP8_RECIPES.get(ctx.step.dtype), ctx.step.experts.graphed,
                            dropless=ctx.step.model.moe.router.dropless)


def shared_gemm_fwd(ctx: RankContext) -> float:
    """Forward GEMM seconds of the shared experts on this rank (tp-split, as the dense FFN)."""
    s, m = ctx.step, ctx.step.model
    return GG.mlp_gemm_time(ctx.rates, m, ctx.tokens_local, m.moe.shared_width / s.tp)


def even_terms(ctx: RankContext, shared_fwd: float) -> MoETerms:
    """``moe_terms`` of the shape a layer profile times: every EP rank at ``experts / ep`` experts on
    its mean load (imbalance 1), on this rank's device."""
    x, e = ctx.step.experts, ctx.step.model.moe
    share = e.experts // x.ep
    routed = x.ep * x.etp * tokens_in(ctx)
    mean = ER.RankLoad(share=share, imbalance=1.0, received=routed * e.top_k * share / e.experts)
    return moe_terms(ctx, shared_fwd, shape=(mean,) * x.ep)


def measured_moe(ctx: RankContext, lc: LayerCompute, t: MoETerms, fwd: float, bwd: float,
                 shared_fwd: float) -> tuple[LayerCompute, MoETerms]:
    """The MoE block (``lc``: attention and shared experts; ``t``: router and routed experts) on the
    scale of a layer profile's ``moe`` piece (``fwd``/``bwd`` seconds, ``layers.moe_piece``), as
    ``layers.reconciled_block`` puts a block on a profile's scale: the piece timed one EP rank of
    even shares on its mean load, so both are multiplied by measured / this model's price of that
    shape (``share = experts / ep``, imbalance 1). On that shape the price is the measurement; the
    busiest rank's extra experts or load (uneven shares, the dropless spread, capacity padding) keep
    their modelled share on the measured scale. Exchange terms are left as they are (not timed)."""
    even = even_terms(ctx, shared_fwd)
    cf = ctx.cf
    rf = fwd / max(lc.fwd + even.comp_f / cf, 1e-30)
    rb = bwd / max(lc.bwd + even.comp_b / cf, 1e-30)
    both = (rf * t.comp_f + rb * t.comp_b) / max(t.comp_f + t.comp_b, 1e-30)
    scaled = dataclasses.replace(t, comp_f=rf * t.comp_f, comp_b=rb * t.comp_b, router_s=both * t.router_s,
                                 host_s=both * t.host_s, experts_s=both * t.experts_s)
    return rescaled_block(lc, rf * lc.fwd, rb * lc.bwd), scaled
