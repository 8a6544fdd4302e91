"""Data parallelism and ZeRO: gradient synchronisation, parameter gathers and the optimizer step.

The ranks holding the same parameters are the dp x cp x hp ranks of a pipeline stage (CP and
Ulysses ranks hold whole weights, as DP replicas do); their ``shard_n`` is the ZeRO group
(Rajbhandari et al. 2020). Per step:

* ZeRO 0: all-reduce of the gradients;
* ZeRO 1 and 2: reduce-scatter of the gradients, then an all-gather of the updated weights;
* ZeRO 3 (FSDP): reduce-scatter of the gradients, and each block's weights gathered in forward and
  again in backward, prefetched behind the previous block's compute (only the excess is exposed).

The gradient reduction overlaps with the last micro-batch's backward (Megatron
``overlap_grad_reduce``) and starts when every replica of the stage has finished; the rest is
exposed. The optimizer step is memory-bound Adam over the rank's (ZeRO-sharded) parameters.
"""

from __future__ import annotations

from typing import Any

from autotune.cost.compute import DTYPE_BYTES, LayerCompute
from autotune.plan import GRAD_REDUCE_DTYPE, Plan

ADAM_BYTES_PER_PARAM = 30.0
"""Adam step traffic per parameter: reads 16-bit weight and grad, fp32 master, m, v (16 B), writes
weight, master, m, v (14 B)."""


def grad_reduce_dtype(dtype: str) -> str:
    """The precision gradients are accumulated and reduced in over the data-parallel ranks for a plan
    computing in ``dtype``: ``autotune.plan.GRAD_REDUCE_DTYPE`` (fp32, Megatron's default under
    ``--bf16``/``--fp16``, what the runtime's mixed precision does; the exporters emit the matching
    flag) under 16-bit compute, the compute dtype itself otherwise."""
    return GRAD_REDUCE_DTYPE if DTYPE_BYTES[dtype] < DTYPE_BYTES[GRAD_REDUCE_DTYPE] else dtype


def stage_params(model: Any, plan: Plan) -> tuple[tuple[float, float], ...]:
    """(parameters held by each pipeline rank before tp sharding, one block's parameters): its
    blocks, the embedding on the first rank, the final norm and LM head with the last model chunk
    (and a copy of a tied embedding there when that is another rank)."""
    lp = float(model.layer_params())
    emb, head = float(model.embedding_params()), float(model.head_params())
    p, n_chunks = plan.degrees.pp, len(plan.shares.layers)
    out = []
    for pp_i in range(p):
        mine = plan.stages_of_rank(pp_i)  # the schedule's placement
        params = sum(plan.layers_of_stage(pp_i)) * lp
        if 0 in mine:
            params += emb
        if n_chunks - 1 in mine:  # the last chunk: final norm and LM head
            params += head
            if model.tied_embeddings and 0 not in mine:
                params += model.vocab * model.hidden  # a copy of the tied embedding on the last stage
        out.append((params, lp))
    return tuple(out)


def _block_gather(ctx: Any) -> float:
    """Seconds to all-gather one block's weights over the ZeRO group (ZeRO-3)."""
    s = ctx.step
    return ctx.mf * ctx.collectives.all_gather(ctx.links.dp, s.shard_n, s.bpe * ctx.layer_params / s.tp)


def zero3_block_exposed(ctx: Any, lc: LayerCompute) -> tuple[float, float]:
    """(forward, backward) seconds of one block's ZeRO-3 weight gather beyond the compute of the
    block it is prefetched behind (0 below ZeRO-3 or without sharding)."""
    s = ctx.step
    if s.zero < 3 or s.shard_n <= 1:
        return 0.0, 0.0
    gather = _block_gather(ctx)
    return max(0.0, gather - ctx.cf * lc.fwd), max(0.0, gather - ctx.cf * lc.bwd)


def grad_sync(ctx: Any) -> tuple[float, float]:
    """(seconds that can overlap the last backward, seconds exposed after it) of the step's
    gradient synchronisation and weight all-gather."""
    s = ctx.step
    if s.shard_n <= 1:
        return 0.0, 0.0
    K, link, n, mf = ctx.collectives, ctx.links.dp, s.shard_n, ctx.mf
    params = ctx.params / s.tp
    grad_bytes = DTYPE_BYTES[grad_reduce_dtype(s.dtype)] * params  # reduced in fp32 under 16-bit compute
    if s.zero == 0:
        return mf * K.all_reduce(link, n, grad_bytes), 0.0
    if s.zero in (1, 2):  # updated weights back to every rank, in the compute dtype
        return mf * K.reduce_scatter(link, n, grad_bytes), mf * K.all_gather(link, n, s.bpe * params)
    return mf * K.reduce_scatter(link, n, grad_bytes), 0.0


def step_comm(ctx: Any, overlappable: float, fixed: float) -> float:
    """Seconds of all DP communication in a step (hidden or not): the gradient sync, and with
    ZeRO-3 every block's two gathers per micro-batch."""
    s = ctx.step
    raw = overlappable + fixed
    if s.zero >= 3 and s.shard_n > 1:
        gather = ctx.collectives.all_gather(ctx.links.dp, s.shard_n, s.bpe * ctx.layer_params / s.tp)
        raw += ctx.microbatches * sum(ctx.layers) * 2.0 * ctx.mf * gather
    return raw


def optimizer_time(ctx: Any) -> float:
    """Seconds of the Adam step over the rank's parameters (sharded from ZeRO-1 on)."""
    s = ctx.step
    shard = s.shard_n if s.zero >= 1 else 1
    return ctx.cf * ctx.rates.memory_time(ADAM_BYTES_PER_PARAM * (ctx.params / s.tp) / shard)


def exposure(p: int, dp: int, sims: list[Any], per_rep_stage: dict[tuple[int, int], dict[int, Any]]
             ) -> tuple[float, list[float], dict[tuple[int, int], float]]:
    """(step time, end of each pipeline stage, {(replica, id(cost)): exposed DP seconds}).

    A stage's sync starts when every replica of it has finished its pipeline; what the reduction
    cannot hide behind the last micro-batch's backward of chunk 0, plus the weight gather, plus the
    optimizer step, ends the stage."""
    step = 0.0
    stage_end = []
    exposed_of: dict[tuple[int, int], float] = {}
    for s in range(p):
        done = max(sim.rank_finish[s] for sim in sims)
        worst = 0.0
        for d in range(dp):
            window = sims[d].bwd[s]  # the last micro-batch's backward of chunk 0
            for cid, c in per_rep_stage[(d, s)].items():
                exposed = max(0.0, c.dp_overlappable - window) + c.dp_exposed_fixed
                exposed_of[(d, cid)] = exposed
                worst = max(worst, exposed + c.optimizer)
        stage_end.append(done + worst)
        step = max(step, done + worst)
    return step, stage_end, exposed_of
