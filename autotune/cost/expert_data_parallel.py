"""Expert data parallelism: the routed experts' gradients are reduced over the edp ranks that hold
the same experts (not over dp, as the dense parameters are), and their optimizer step runs over the
rank's expert shard.

A rank holds, per MoE layer of its pipeline rank, its EP rank's experts split over etp: ``expert
params * share / etp``. Their gradients are reduced once a step over the edp group, in the
gradient-reduction dtype (the plan's, fp32 by default, under 16-bit compute: ``data_parallel.grad_reduce_dtype``), as the
dense ones are over dp: an all-reduce under ZeRO-0, a reduce-scatter from ZeRO-1 on (Megatron-Core's
distributed optimizer shards the expert optimizer states over edp), then under ZeRO-1 the all-gather
of the updated weights in the compute dtype. As for the dense gradients, the reduction may overlap
the last backward without pipelining and is exposed with it (``data_parallel.grad_sync``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.cost.compute import DTYPE_BYTES
from autotune.cost.data_parallel import ADAM_BYTES_PER_PARAM, grad_reduce_dtype

if TYPE_CHECKING:
    from autotune.cost.context import RankContext


def expert_params_on_rank(ctx: RankContext) -> float:
    """Routed-expert parameters the rank holds (its pipeline rank's MoE layers, its EP rank's
    experts, its etp slice)."""
    x = ctx.step.experts
    n_moe = sum(x.chunk_moe_layers[ctx.pp_index])
    return n_moe * x.shares[ctx.expert_links.ep_index] * ctx.step.model.expert_params() / x.etp


def grad_sync(ctx: RankContext) -> tuple[float, float]:
    """(seconds that can overlap the last backward, seconds exposed) of the expert gradients'
    reduction over edp (and the ZeRO-1 gather)."""
    s, x = ctx.step, ctx.step.experts
    if x.edp <= 1:
        return 0.0, 0.0
    p = expert_params_on_rank(ctx)
    link, coll = ctx.expert_links.edp, ctx.collectives
    grads = p * DTYPE_BYTES[grad_reduce_dtype(s.dtype, s.grad_reduce)]
    if s.zero == 0:
        red, fixed = coll.all_reduce(link, x.edp, grads), 0.0
    else:
        red = coll.reduce_scatter(link, x.edp, grads)
        fixed = coll.all_gather(link, x.edp, p * s.bpe) if s.zero == 1 else 0.0
    red, fixed = ctx.mf * red, ctx.mf * fixed
    if s.pp > 1:
        return 0.0, red + fixed
    return red, fixed


def zero3_gather(ctx: RankContext) -> float:
    """Seconds to all-gather one MoE layer's routed experts of the rank over edp under ZeRO-3 (FSDP
    shards the experts' weights over the ranks that hold the same experts: torchtitan's
    ``dp_shard_mod_ep`` mesh), once before the forward and once before the backward of each
    micro-batch, as the dense blocks' (``data_parallel.zero3_block_exposed``)."""
    s, x = ctx.step, ctx.step.experts
    if s.zero < 3 or x.edp <= 1:
        return 0.0
    per_layer = x.shares[ctx.expert_links.ep_index] * s.model.expert_params() / x.etp
    return ctx.mf * ctx.collectives.all_gather(ctx.expert_links.edp, x.edp, per_layer * s.bpe)


def optimizer_time(ctx: RankContext) -> float:
    """Seconds of the Adam step over the rank's expert parameters (sharded over edp from ZeRO-1 on)."""
    s = ctx.step
    shard = s.experts.edp if s.zero >= 1 else 1
    return ctx.cf * ctx.rates.memory_time(ADAM_BYTES_PER_PARAM * expert_params_on_rank(ctx) / shard)
