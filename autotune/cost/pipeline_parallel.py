"""Pipeline parallelism: what each model chunk takes per micro-batch, the sends between stages,
and one schedule simulation per DP replica (the simulation itself is ``pipeline.py``).

Model chunk ``j`` (which pipeline rank holds it is the schedule's placement, ``StepContext.chunks``:
``j = c * pp + s`` for the looped schedules, a V for ZB-V) runs its blocks; the first chunk also the
embedding lookup (and its tp reduction), the last the LM head and loss. Each chunk's backward has a
weight-gradient part (W, ``wgt``) that zero-bubble schedules run apart: one GEMM of the forward's
size per weight matrix (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", table 1: W = 24bsh^2,
the forward's GEMM FLOPs); the input-gradient part (I) keeps the other GEMM, attention's backward,
the elementwise work, recomputation and every collective. A stage of one DP
replica runs at the pace of its slowest rank (its TP/CP/HP ranks synchronise every block), so the
replica's schedule is simulated over the slowest rank's chunk times and the slowest sends. Sends
are priced as the runtime sends them (``hop_bytes``): each tp rank its whole copy of the activation
(its sequence slice with sequence parallelism), as megatron-core's p2p communication does too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from autotune import stages as ST
from autotune.cost.pipeline import simulate_cached

if TYPE_CHECKING:
    from autotune.cost.context import RankContext, StepContext


@dataclass(frozen=True)
class ChunkTimes:
    """Per-micro-batch seconds of each chunk on one rank and the totals over one micro-batch."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    compute: float
    tp: float
    hp: float
    cp_raw: float
    exposed: float
    """Communication inside the chunks that compute does not hide (tp, hp, the ring's excess,
    ZeRO-3 gathers' excess)."""
    wgt: tuple[float, ...] = ()
    """Weight-gradient part of each chunk's backward (see the module docstring)."""
    ep: float = 0.0
    """A MoE model's token exchange (all-to-all, expert-TP), hidden or not."""


def chunk_times(ctx: RankContext, b: Any, embedding_tp: float, head: tuple[float, float],
                head_tp: tuple[float, float], embed: tuple[float, float] | None = None,
                layer_w: Any = 0.0) -> ChunkTimes:
    """Chunk times from one block's times ``b`` (``rank.BlockTimes``): the blocks of each chunk, the
    embedding (memory-bound lookup, or ``embed`` (fwd, bwd) measured by a layer profile, and
    ``embedding_tp``) on chunk 0, the LM head's compute ``head`` and its small collectives
    ``head_tp`` on the last chunk; ``layer_w`` one block's weight-gradient seconds (the LM head's:
    its backward less its forward, one GEMM). A MoE rank gives ``b`` and ``layer_w`` per chunk
    (tuples: each chunk's mean block, its dense and MoE layers mixed)."""
    s = ctx.step
    blocks, layer_ws = b, layer_w
    cf, act = ctx.cf, ctx.hidden_bytes
    fwd, bwd, wgt = [], [], []
    comp_total = tp_total = hp_total = cp_raw_total = exposed = ep_total = 0.0
    per_chunk = isinstance(b, tuple)  # a MoE rank: each chunk its own mean block (rank._moe_blocks)
    for c, (j, n) in enumerate(zip(s.chunks[ctx.pp_index], ctx.layers, strict=True)):
        if per_chunk:
            b, w = blocks[c], layer_ws[c]
            ep_total += n * b.ep_raw
            exposed += n * (b.ep_f + b.ep_b)
        else:
            w = layer_w
        f, bw = n * b.layer_f, n * b.layer_b
        wgt.append(n * w + (cf * (head[1] - head[0]) if j == s.n_chunks - 1 else 0.0))
        comp = n * (b.comp_f + b.comp_b)
        tpc = n * (b.tp_f + b.tp_b)
        if j == 0:  # embedding lookup and its tp reduction (vocab-parallel embedding)
            ef, eb = embed if embed is not None else (ctx.rates.memory_time(act), 0.0)
            f += cf * ef + embedding_tp
            bw += cf * eb
            comp += cf * (ef + eb)
            tpc += embedding_tp
        if j == s.n_chunks - 1:
            f += cf * head[0] + head_tp[0]
            bw += cf * head[1] + head_tp[1]
            comp += cf * (head[0] + head[1])
            tpc += head_tp[0] + head_tp[1]
        fwd.append(f)
        bwd.append(bw)
        comp_total += comp
        tp_total += tpc
        hp_total += n * (b.hp_f + b.hp_b)
        cp_raw_total += n * (b.cp_raw_f + b.cp_raw_b)
        exposed += tpc + n * (b.hp_f + b.hp_b + b.cp_f + b.cp_b + b.z3_f + b.z3_b)
    return ChunkTimes(fwd=tuple(fwd), bwd=tuple(bwd), compute=comp_total, tp=tp_total, hp=hp_total,
                      cp_raw=cp_raw_total, exposed=exposed, wgt=tuple(wgt), ep=ep_total)


def hop_bytes(ctx: RankContext) -> tuple[tuple[float, float, float], ...]:
    """Per chunk of this rank, bytes one hop moves per micro-batch as ``runtime/stages.py`` sends it:
    (its output forward, sent by this stage's busiest tp rank; the gradient of that output coming
    back, sent by the next stage's busiest tp rank; its input gradient, sent back by this stage's
    busiest tp rank). A tp rank holds the whole hidden state of its tokens (1/tp of it with sequence
    parallelism, which keeps it split along the sequence: ``PipelineStage`` then sends that slice)
    and sends it whole to each rank of the peer stage it serves (``stages.hop_copies``: one between
    stages of equal tp, ceil(b / a) from a stage at tp a to one at tp b; ``Links.hop_tps``)."""
    s = ctx.step
    held = ctx.hidden_bytes / s.tp if s.sp else ctx.hidden_bytes
    a, tps = s.tp, ctx.links.hop_tps or ((s.tp, s.tp),) * len(ctx.links.pp_hops)
    return tuple((held * _copies(a, nxt), held * _copies(nxt, a), held * _copies(a, prv)) for nxt, prv in tps)


_copies = lru_cache(maxsize=1024)(ST.hop_copies)
"""``stages.hop_copies`` of two tp degrees, once per pair (it counts each sender's receivers)."""


def chunk_send_times(ctx: RankContext) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Seconds of one send of each chunk of this rank (``hop_bytes``' three, each a tuple over the
    chunks), all on the link its sends take (``Links.pp_hops``)."""
    s = ctx.step
    if s.pp == 1:
        return ((0.0,) * s.v,) * 3
    p2p, mf = ctx.collectives.p2p, ctx.mf
    times = [tuple(mf * p2p(link, n) for n in sizes) for (link, _, _), sizes in zip(ctx.links.pp_hops, hop_bytes(ctx),
                                                                                    strict=True)]
    return tuple(tuple(t[k] for t in times) for k in range(3))


def sends_per_microbatch(ctx: RankContext, fwd: tuple[float, ...], grad: tuple[float, ...]) -> float:
    """Seconds of the sends of one micro-batch on this rank (per chunk, ``fwd`` its output's send,
    ``grad`` its input gradient's): out of every chunk whose successor sits on another rank (forward),
    out of every chunk whose predecessor does (its input gradient, backward)."""
    total = 0.0
    for t, g, (_, fwd_out, bwd_out) in zip(fwd, grad, ctx.links.pp_hops, strict=True):
        total += (t if fwd_out else 0.0) + (g if bwd_out else 0.0)
    return total


def replica_stages(groups: list[tuple[int, int, RankContext, Any]]) -> dict[tuple[int, int], dict[int, Any]]:
    """{(replica, pipeline rank): {id(cost): cost}} from (first rank, DP index, context, cost) per
    tp group: the distinct rank costs of each stage."""
    per_rep_stage: dict[tuple[int, int], dict[int, Any]] = {}
    for _, dp_i, ctx, cost in groups:
        per_rep_stage.setdefault((dp_i, ctx.pp_index), {})[id(cost)] = cost
    return per_rep_stage


def simulate_replicas(s: StepContext, per_rep_stage: dict[tuple[int, int], dict[int, Any]]) -> list[Any]:
    """One schedule simulation per DP replica over its stages' slowest chunk and send times, with
    the replica's own micro-batch count (identical replicas share one cached simulation); a
    schedule that splits the backward also gets the weight-gradient part of each chunk's."""
    p, v, n_chunks = s.pp, s.v, s.n_chunks
    split = s.schedule.splits_backward
    sims = []
    seen: dict[tuple, Any] = {}  # a replica whose stages hold the same cost objects: the same simulation
    for d in range(s.dp):
        same = (s.microbatches[d], *(tuple(per_rep_stage[(d, st)]) for st in range(p)))
        hit = seen.get(same)
        if hit is not None:
            sims.append(hit)
            continue
        fwd, bwd, p2p = [0.0] * n_chunks, [0.0] * n_chunks, [0.0] * max(n_chunks - 1, 0)
        wgt, back = [0.0] * n_chunks, [0.0] * max(n_chunks - 1, 0)
        for st in range(p):
            for c in per_rep_stage[(d, st)].values():
                cf_, cb_, cw_, cp_, ck_ = c.fwd, c.bwd, c.wgt, c.p2p_chunks, c.p2p_back_chunks
                for ci, j in enumerate(s.chunks[st]):
                    if cf_[ci] > fwd[j]:
                        fwd[j] = cf_[ci]
                    if cb_[ci] > bwd[j]:
                        bwd[j] = cb_[ci]
                        wgt[j] = cw_[ci]  # of the slowest backward, so I = bwd - wgt >= 0
                    if j < n_chunks - 1:
                        p2p[j], back[j] = max(p2p[j], cp_[ci]), max(back[j], ck_[ci])
        sims.append(simulate_cached(s.schedule, p, v, s.microbatches[d], tuple(fwd), tuple(bwd), tuple(p2p),
                                    tuple(wgt) if split else None, None if back == p2p else tuple(back)))
        seen[same] = sims[-1]
    return sims


def bubble_fraction(sims: list[Any], p: int) -> float:
    """Idle share of the pipeline (fill, drain, waiting for a slower stage), averaged over stages and
    replicas, of the pipeline's makespan."""
    distinct: dict[int, list] = {}  # identical replicas share one (cached) simulation
    for sim in sims:
        distinct.setdefault(id(sim), [sim, 0])[1] += 1
    total = sum(n * sum(sim.bubble_fraction(s) for s in range(p)) for sim, n in distinct.values())
    return total / (len(sims) * p) if sims else 0.0
