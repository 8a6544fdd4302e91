"""Data parallelism and ZeRO: gradient synchronisation, weight gathers and the optimizer step.

The ranks holding the same parameters are the dp x cp x hp ranks of a pipeline stage (CP and
Ulysses ranks hold whole weights, as DP replicas do); they are the ZeRO group of ``shard_n`` ranks
(Rajbhandari et al. 2020). Gradients are accumulated over a step's micro-batches and reduced once, in
the last backward, in ``grad_reduce_dtype`` (fp32 under 16-bit compute), at every ZeRO stage (one
reduce-scatter a step from ZeRO-1 on, not one per micro-batch as DeepSpeed's ZeRO-2 does: why, and
what it costs in memory, ``grads_accumulate_unsharded`` and ``autotune/runtime/sharding.py``);
weights are gathered in the compute dtype. What each stage moves per step (``step_transfers``; P the
rank's parameters, L its blocks of ``b`` parameters each, R = P - L*b the rest: embedding, final
norm, LM head):

* ZeRO 0: all-reduce of the gradients (P);
* ZeRO 1 (Megatron's distributed optimizer, the runtime's ``zero_stage 1``): reduce-scatter of the
  gradients (P), then all-gather of the updated weights (P) after the optimizer step: exposed;
* ZeRO 2 (FSDP2 ``reshard_after_forward=False``, ``autotune/runtime/sharding.py``): reduce-scatter of
  the gradients (P); the weights are gathered once per step, at the first micro-batch's forward,
  each block prefetched behind the previous block's forward (only the excess is exposed), the rest
  (R) before any compute (exposed), and kept until the last backward;
* ZeRO 3 (FSDP2 ``reshard_after_forward=True``): reduce-scatter of the gradients (P); every block's
  weights gathered in every micro-batch's forward and again in its backward, each prefetched
  behind the neighbouring block's compute (forward: the previous block's forward; backward: the
  next block's backward including its recomputation: FSDP2's pre-backward gather serves the
  recomputed forward too, so recomputation adds no third gather, only a longer window), and R
  once per micro-batch. When the DP replicas run different micro-batch counts the runtime gathers
  per step instead (each block once for the forwards, once again for the last backward): so is it
  priced.

The gradient reduction overlaps with the last micro-batch's backward (Megatron
``overlap_grad_reduce``) and starts when every replica of the stage has finished; the rest is
exposed. Under ZeRO-2/3 with pipelining nothing of it overlaps: torch's pipeline stages run every
backward without gradient sync and reduce-scatter after the last one (``perform_reduce_grad``), so
the runtime's reduction follows the stage's compute. The optimizer step is memory-bound Adam over
the rank's (ZeRO-sharded) parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.cost.compute import DTYPE_BYTES
from autotune.plan import GRAD_REDUCE_DTYPE, Plan

if TYPE_CHECKING:  # typing only: context.py builds on the dimension modules
    from autotune.cost.context import RankContext

ADAM_BYTES_PER_PARAM = 30.0
"""Adam step traffic per parameter: reads 16-bit weight and grad, fp32 master, m, v (16 B), writes
weight, master, m, v (14 B)."""


def grad_reduce_dtype(dtype: str, grad_reduce: str = GRAD_REDUCE_DTYPE) -> str:
    """The precision gradients are accumulated and reduced in over the data-parallel ranks for a plan
    computing in ``dtype``: under 16-bit compute the plan's ``grad_reduce`` (``Plan.grad_reduce``:
    ``autotune.plan.GRAD_REDUCE_DTYPE``, fp32, by default, Megatron's default under ``--bf16``/``--fp16``
    and what the runtime's mixed precision does; bf16 as Megatron's ``--grad-reduce-in-bf16`` keeps and
    reduces them), the compute dtype itself otherwise."""
    return grad_reduce if DTYPE_BYTES[dtype] < DTYPE_BYTES[GRAD_REDUCE_DTYPE] else dtype


def stage_params(model: Any, plan: Plan, chunks: tuple[tuple[int, ...], ...] | None = None
                 ) -> tuple[tuple[float, float, float], ...]:
    """(parameters held by each pipeline rank before tp sharding, one block's parameters, those
    outside its blocks): its blocks, the embedding on the first rank, the final norm and LM head
    with the last model chunk (and a copy of a tied embedding with it when the model is in more than one
    chunk: the runtime's last chunk holds its own copy, also where a V placement puts it on the first
    chunk's rank; ``runtime/tied.py``).
    ``chunks``: ``plan.stages_of_rank`` of every pipeline rank when the caller has them already."""
    lp = float(model.layer_params())
    emb, head = float(model.embedding_params()), float(model.head_params())
    p, n_chunks = plan.degrees.pp, len(plan.shares.layers)
    moe_blocks = _moe_chunk_params(model, plan.shares.layers) if getattr(model, "moe", None) is not None else None
    out = []
    for pp_i in range(p):
        mine = chunks[pp_i] if chunks is not None else plan.stages_of_rank(pp_i)  # the schedule's placement
        if moe_blocks is None:
            params, rest = sum(plan.shares.layers[j] for j in mine) * lp, 0.0
        else:  # a MoE model: its blocks' dense parameters, layer by layer (expert_data_parallel: the experts)
            params, rest = sum(moe_blocks[j] for j in mine), 0.0
        if 0 in mine:
            params += emb
            rest += emb
        if n_chunks - 1 in mine:  # the last chunk: final norm and LM head
            params += head
            rest += head
            if model.tied_embeddings and n_chunks > 1:
                params += model.vocab * model.hidden  # a copy of the tied embedding with the last chunk
                rest += model.vocab * model.hidden
        out.append((params, lp, rest))
    return tuple(out)


def _moe_chunk_params(model: Any, layers: tuple[int, ...]) -> list[float]:
    """Each model chunk's parameters outside the routed experts (the dense layers' FFNs, the MoE
    layers' shared experts and routers, every attention): what the dense data parallelism reduces."""
    out, i = [], 0
    for n in layers:
        out.append(float(sum(model.layer_params(k) for k in range(i, i + n))))
        i += n
    return out


@dataclass(frozen=True)
class Transfer:
    """One kind of collective a rank's ZeRO group runs in a step."""

    op: str
    """``all_reduce``, ``reduce_scatter`` or ``all_gather``."""
    nbytes: float
    """The whole (unsharded) buffer of one call, bytes."""
    calls: int
    """Calls per step."""
    what: str


def grads_accumulate_unsharded(zero: int, pp: int, microbatches: int) -> bool:
    """Whether a ZeRO-2/3 rank holds whole (unsharded) gradients in ``grad_reduce_dtype`` through its
    step: the runtime (FSDP2, ``autotune/runtime/sharding.py``) accumulates the micro-batches'
    gradients unsharded and reduce-scatters once, in the last backward, so a rank running more than
    one micro-batch keeps an accumulation buffer of all its parameters; under pipelining torch's
    stages always accumulate so (every backward runs without gradient sync, the reduction follows the
    last), even for one micro-batch. Only one micro-batch without pipelining reduce-scatters as it
    goes and holds gradient shards alone. Below ZeRO-2 gradients are whole anyway."""
    return zero >= 2 and (pp > 1 or microbatches > 1)


def gathers_per_microbatch(s: Any) -> bool:
    """ZeRO-3 gathers every micro-batch when every DP replica runs as many (the runtime's collectives
    are matched by order over the group), else once per step."""
    return len(set(s.microbatches)) == 1


def zero3_gathers(ctx: RankContext) -> int:
    """1 where each block's weights are all-gathered in every forward and again in every backward
    (ZeRO-3 over more than one rank, gathering per micro-batch: ``gathers_per_microbatch``), else 0.
    Each gather is a collective over the gradient group matched by order, so on a CPU a rank waits
    there for the one that drifted behind, as at a tp all-reduce (``cpu.sync_waits``: FSDP2
    prefetches the transfer, not the meeting). Trial (``benchmarks/bench_zero_cpu.py``, small dp=2
    bf16, load 0.4-1.9): the wall clock exceeded the slowest rank's CPU seconds by 74 ms a step under
    ZeRO-3 at two micro-batches, by 20 ms under ZeRO-0."""
    s = ctx.step
    return int(s.zero >= 3 and s.shard_n > 1 and gathers_per_microbatch(s))


def zero3_weights_gathered(s: Any) -> bool:
    """Whether a ZeRO-3 rank (``s`` a ``StepContext``) holds all its weights gathered at some point of
    the step, as ZeRO-2 does, rather than one block and the prefetched next: when the replicas run
    different micro-batch counts the runtime gathers once a step and keeps the weights over the
    forwards (``gathers_per_microbatch``). Under pipelining the runtime frees each block after its
    backward too (autotune/runtime/worker.py ``_reshard_in_every_backward``), so that is all."""
    return s.zero >= 3 and not gathers_per_microbatch(s)


def step_transfers(ctx: RankContext) -> list[Transfer]:
    """What the ZeRO group of the rank of ``ctx`` moves in one step (the module docstring's table)."""
    s = ctx.step
    if s.shard_n <= 1:
        return []
    g, w = DTYPE_BYTES[grad_reduce_dtype(s.dtype, s.grad_reduce)], s.bpe
    # replicas of different tp (per-stage plans) reduce piece by piece: every rank waits for the
    # replica of the smallest tp, which holds the most pieces (autotune/stages.py ``pieces``)
    tp = ctx.links.dp_tp or s.tp
    params, block, rest, n_blocks = ctx.params / tp, ctx.layer_params / tp, ctx.rest_params / tp, sum(ctx.layers)
    if s.zero == 0:
        return [Transfer("all_reduce", g * params, 1, "gradients")]
    out = [Transfer("reduce_scatter", g * params, 1, "gradients")]
    if s.zero == 1:
        return out + [Transfer("all_gather", w * params, 1, "updated weights")]
    per_step = s.zero == 2 or not gathers_per_microbatch(s)
    rounds = (1 if s.zero == 2 else 2) if per_step else 2 * ctx.microbatches
    out.append(Transfer("all_gather", w * block, rounds * n_blocks, "block weights"))
    if rest > 0:
        rest_rounds = (1 if s.zero == 2 else 2) if per_step else ctx.microbatches
        out.append(Transfer("all_gather", w * rest, rest_rounds, "embedding, norm and head weights"))
    return out


def _seconds(ctx: RankContext, op: str, nbytes: float) -> float:
    s = ctx.step
    return ctx.mf * getattr(ctx.collectives, op)(ctx.links.dp, s.shard_n, nbytes)


def _block_gather(ctx: RankContext) -> float:
    """Seconds to all-gather one block's weights over the ZeRO group."""
    s = ctx.step
    return _seconds(ctx, "all_gather", s.bpe * ctx.layer_params / s.tp)


def zero3_block_exposed(ctx: RankContext, comp_f: float, comp_b: float, extra: float = 0.0) -> tuple[float, float]:
    """(forward, backward) seconds of one block's ZeRO-3 weight gather per micro-batch beyond the
    compute it is prefetched behind (``comp_f``, ``comp_b``: a block's forward and backward compute,
    recomputation included); 0 below ZeRO-3, without sharding, or when the gathers are per step.
    ``extra``: seconds of the block's other gathers (a MoE layer's experts over edp,
    ``expert_data_parallel.zero3_gather``), prefetched with it."""
    s = ctx.step
    if s.zero < 3 or not gathers_per_microbatch(s) or (s.shard_n <= 1 and extra <= 0.0):
        return 0.0, 0.0
    gather = (_block_gather(ctx) if s.shard_n > 1 else 0.0) + extra
    return _beyond(ctx, gather, comp_f), _beyond(ctx, gather, comp_b)


def _beyond(ctx: RankContext, gather: float, comp: float) -> float:
    """Seconds of a prefetched weight gather the compute it runs behind (``comp``) leaves exposed.
    On a CPU, all of it: as ``cpu.exposed_grad_sync`` says of the gradient reduction, a local trial
    runs one compute thread per core, so gloo's thread copies on a busy core, not beside it. Measured
    (``benchmarks/bench_zero_cpu.py``, small, dp=2 bf16, trial CPU clock, load ~3): ZeRO-3 over
    ZeRO-2 took 30-90 ms more a step at two micro-batches, which priced the gathers as hidden (23 ms of
    them) left short."""
    if ctx.rates.cpu is not None:
        return gather
    return max(0.0, gather - comp)


def grad_sync(ctx: RankContext, comp_f: float, comp_b: float, transfers: list[Transfer] | None = None
              ) -> tuple[float, float]:
    """(seconds that can overlap the last backward, seconds exposed) of the step's gradient
    reduction and of the weight gathers not priced inside the blocks (``comp_f``, ``comp_b`` as in
    ``zero3_block_exposed``; ``transfers``: ``step_transfers`` when known)."""
    s = ctx.step
    if s.shard_n <= 1:
        return 0.0, 0.0
    t = step_transfers(ctx) if transfers is None else transfers
    overl = _seconds(ctx, t[0].op, t[0].nbytes)
    exposed_reduction = 0.0
    if s.pp > 1:  # the runtime reduces after the last backward under pipelining, not in it: torch's
        # stages reduce-scatter after it (ZeRO-2/3), and the DDP-style overlap of ZeRO-0/1 and HelixPipe
        # needs a backward of its own (runtime/worker.py: overlap only where pp == 1)
        overl, exposed_reduction = 0.0, overl
    if s.zero == 0:
        return overl, exposed_reduction
    if s.zero == 1:
        return overl, exposed_reduction + _seconds(ctx, "all_gather", t[1].nbytes)
    n_blocks = sum(ctx.layers)
    fixed = 0.0
    if s.zero == 2 or not gathers_per_microbatch(s):  # block gathers once (twice under ZeRO-3) a step
        gather = _block_gather(ctx)
        fixed = n_blocks * _beyond(ctx, gather, comp_f)
        if s.zero >= 3:
            fixed += n_blocks * _beyond(ctx, gather, comp_b)
    for x in t[2:]:  # the weights outside the blocks: nothing to hide behind
        fixed += x.calls * _seconds(ctx, "all_gather", x.nbytes)
    return overl, fixed + exposed_reduction


def step_comm(ctx: RankContext, transfers: list[Transfer] | None = None) -> float:
    """Seconds of all DP communication in a step, hidden or not (``transfers``: ``step_transfers``
    when known)."""
    return sum(x.calls * _seconds(ctx, x.op, x.nbytes) for x in (step_transfers(ctx) if transfers is None else transfers))


def optimizer_time(ctx: RankContext) -> float:
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
                exposed = max(0.0, c.dp_overlappable - (window - c.dp_in_window)) + c.dp_exposed_fixed
                exposed_of[(d, cid)] = exposed
                worst = max(worst, exposed + c.optimizer)
        stage_end.append(done + worst)
        step = max(step, done + worst)
    return step, stage_end, exposed_of
