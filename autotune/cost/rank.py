"""One tensor-parallel group's costs: the per-dimension terms of a block composed, then its chunks,
its step-level terms and its memory.

A block's forward takes its compute plus what each dimension's communication leaves exposed: TP
collectives (not overlapped), Ulysses all-to-alls, the ring's excess over the attention it hides
behind, the ZeRO-3 gather's excess over the block it prefetches for. Recomputation adds its forward
work (``full``: the whole block and its collectives; ``selective``: the attention core) to backward.
On a CPU the waits at the block's blocking collectives (``cpu.sync_waits``) are charged to the
dimension that synchronises, as the runtime's comm clock does. Calibration (``cf``, ``mf``)
multiplies compute and communication per device type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.cost import context_parallel as CP
from autotune.cost import cpu as _cpu
from autotune.cost import data_parallel as DP
from autotune.cost import expert_data_parallel as EDP
from autotune.cost import expert_dispatch as XD
from autotune.cost import layers as LY
from autotune.cost import memory as M
from autotune.cost import moe_layers as ML
from autotune.cost import moe_memory as MM
from autotune.cost import moe_steps as MS
from autotune.cost import op_sac as OS
from autotune.cost import pipeline_parallel as PP
from autotune.cost import recompute_modules as RMOD
from autotune.cost import tensor_parallel as TP
from autotune.cost import ulysses as U
from autotune.cost import windows as WIN
from autotune.cost.compute import LayerCompute, head_compute, layer_compute
from autotune.cost.context import RankContext


@dataclass
class BlockTimes:
    """Seconds of one block for one micro-batch on one rank, per term, forward and backward."""

    comp_f: float
    comp_b: float
    tp_f: float
    tp_b: float
    hp_f: float
    hp_b: float
    cp_f: float
    """The ring's exposed part (``cp_raw_f`` is all of it)."""
    cp_b: float
    cp_raw_f: float
    cp_raw_b: float
    z3_f: float
    z3_b: float
    ep_f: float = 0.0
    """A MoE layer's token exchange the target runtime does not hide (``expert_dispatch.py``)."""
    ep_b: float = 0.0
    ep_raw: float = 0.0
    """All of the exchange, forward and backward."""

    @property
    def layer_f(self) -> float:
        return self.comp_f + self.tp_f + self.hp_f + self.cp_f + self.z3_f + self.ep_f

    @property
    def layer_b(self) -> float:
        return self.comp_b + self.tp_b + self.hp_b + self.cp_b + self.z3_b + self.ep_b


@dataclass(frozen=True)
class RankCost:
    """Everything the estimate needs of one tensor-parallel group's ranks."""

    spec: Any
    fwd: tuple[float, ...]
    """Seconds per micro-batch of each model chunk on the rank, forward."""
    bwd: tuple[float, ...]
    p2p: float
    """Seconds of one send to the next stage (of the rank's first chunk; ``p2p_chunks`` per chunk)."""
    compute_s: float
    tp_comm_s: float
    hp_comm_s: float
    cp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    comm_s: float
    exposed_in_ops: float
    busy: float
    """Seconds of forward and backward work over the step (pipeline bubbles excluded)."""
    dp_overlappable: float
    dp_exposed_fixed: float
    dp_in_window: float
    """ZeRO-3 gathers inside the backward of chunk 0 (the window the gradient reduction overlaps
    with): the same link, so they do not hide it."""
    optimizer: float
    memory_total: float
    memory_terms: dict[str, float]
    wgt: tuple[float, ...] = ()
    """Weight-gradient part of each chunk's backward (``pipeline_parallel.chunk_times``)."""
    p2p_chunks: tuple[float, ...] = ()
    """Seconds of one send of each chunk, on the link it takes (``pipeline_parallel.chunk_send_times``)."""
    p2p_back_chunks: tuple[float, ...] = ()
    """Seconds of the gradient's hop back over each chunk's forward hop (sent by the next stage)."""
    moe: dict[str, float] | None = None
    """A MoE model's terms over the step (``_moe_summary``); None for a dense model."""


def block_times(ctx: RankContext, lc: LayerCompute, comm: tuple[float, float] | None = None) -> BlockTimes:
    """Compose one block's per-dimension terms (recompute and the CPU sync waits applied). ``comm``:
    the block's TP and Ulysses collectives (``_block_comm``) when known."""
    cf = ctx.cf
    tp, hp = comm if comm is not None else _block_comm(ctx)
    cp_raw_f, cp_raw_b, cp_f, cp_b = CP.ring_comm(ctx, lc)
    b = BlockTimes(comp_f=cf * lc.fwd, comp_b=cf * lc.bwd, tp_f=tp, tp_b=tp, hp_f=hp, hp_b=hp, cp_f=cp_f,
                   cp_b=cp_b, cp_raw_f=cp_raw_f, cp_raw_b=cp_raw_b, z3_f=0.0, z3_b=0.0)
    recompute = ctx.step.recompute
    if recompute == "full":
        b.comp_b += b.comp_f
        b.tp_b += b.tp_f
        b.hp_b += b.hp_f
        b.cp_b += b.cp_f
        b.cp_raw_b += b.cp_raw_f
    elif recompute == "selective" and not OS.applies(ctx.step):  # torchtitan's keeps the attention's output
        b.comp_b += cf * lc.attn_fwd
    # ZeRO-3: the gathers hide behind the neighbouring block's compute, recomputation included
    b.z3_f, b.z3_b = DP.zero3_block_exposed(ctx, b.comp_f, b.comp_b)
    if ctx.rates.cpu is not None:
        _charge_sync(ctx, b)
    return b


def _block_comm(ctx: RankContext) -> tuple[float, float]:
    """Seconds of one block's TP collectives and of its Ulysses all-to-alls (no compute in them)."""
    return TP.block_comm(ctx), U.block_comm(ctx)


def _charge_sync(ctx: RankContext, b: BlockTimes) -> None:
    """CPU: each blocking collective inside a block also waits for the rank that drifted behind;
    charged to the dimension that synchronises (tp, else hp, else the ring, else ZeRO-3's gathers)."""
    sync_f, sync_b = _cpu.sync_waits(ctx, b.comp_f, b.comp_b, DP.zero3_gathers(ctx))
    if sync_f == 0.0 and sync_b == 0.0:
        return
    s = ctx.step
    if s.tp > 1:
        b.tp_f, b.tp_b = b.tp_f + sync_f, b.tp_b + sync_b
    elif s.hp > 1:
        b.hp_f, b.hp_b = b.hp_f + sync_f, b.hp_b + sync_b
    elif s.cp > 1:
        b.cp_f, b.cp_b = b.cp_f + sync_f, b.cp_b + sync_b
        b.cp_raw_f, b.cp_raw_b = b.cp_raw_f + sync_f, b.cp_raw_b + sync_b
    else:
        b.z3_f, b.z3_b = b.z3_f + sync_f, b.z3_b + sync_b


@dataclass(frozen=True)
class _Fixed:
    """What ``rank_cost`` prices of a dense rank that its attention work (``context.DOC_INPUTS``)
    does not move: its block's activations, the head and embedding, the sends, the step's DP
    volume, its memory and optimizer step. Kept per place (``_fixed_memo``): the DP replicas of a
    step with documents differ only in their attention."""

    acts: tuple[float, float, float]
    """The block's activations (kept per micro-batch, full, of which the scores)."""
    head: tuple[float, float]
    head_tp: tuple[float, float]
    embedding_tp: float
    embed: tuple[float, float] | None
    p2ps: tuple[float, ...]
    p2p_back: tuple[float, ...]
    """Seconds of the gradient's hop back over each chunk's forward hop (``RankCost.p2p_back_chunks``)."""
    pp_sends: float
    dp_raw: float
    memory: tuple[float, dict[str, float]]
    optimizer: float
    block_comm: tuple[float, float]
    """The block's TP and Ulysses collectives (``_block_comm``)."""
    transfers: list
    """What the ZeRO group moves in a step (``data_parallel.step_transfers``)."""


def _fixed(ctx: RankContext, acts: tuple[float, float, float]) -> _Fixed:
    """``_Fixed`` of ``ctx`` whose block's activations are ``acts``."""
    s = ctx.step
    hd = LY.piece(ctx, "head") or LY.shard_piece(ctx, "head")
    emb = LY.piece(ctx, "embed") or LY.shard_piece(ctx, "embed")
    head = (hd.fwd, hd.bwd) if hd is not None else head_compute(s.model, ctx.rates, tokens=ctx.tokens_local, tp=s.tp)
    head_tp = _cpu.head_tp_comm(ctx) if s.tp > 1 and ctx.rates.cpu is not None else (0.0, 0.0)
    p2ps, p2p_back, grad_sends = PP.chunk_send_times(ctx)
    kept, full = LY.measured_activations(ctx, *acts)
    transfers = DP.step_transfers(ctx)
    return _Fixed(acts=acts, head=head, head_tp=head_tp, embedding_tp=TP.embedding_comm(ctx),
                  embed=(emb.fwd, emb.bwd) if emb is not None else None, p2ps=p2ps, p2p_back=p2p_back,
                  pp_sends=PP.sends_per_microbatch(ctx, p2ps, grad_sends), dp_raw=DP.step_comm(ctx, transfers),
                  memory=M.rank_memory(ctx, kept, full), optimizer=_optimizer(ctx), block_comm=_block_comm(ctx),
                  transfers=transfers)


_FIXED: dict[int, _Fixed] = {}


def _fixed_memo(ctx: RankContext) -> _Fixed | None:
    """``_fixed`` of a dense rank, once per place (``RankContext.place_token``: every input but the
    attention work; tests/unit/test_rank_cost_key.py checks ``_fixed`` reads none of that); None for
    a MoE rank (its activations come with its blocks, ``_moe_blocks``)."""
    if ctx.step.experts is not None:
        return None
    hit = _FIXED.get(ctx.place_token)
    if hit is None:
        if len(_FIXED) >= _MEMO_LIMIT:
            _FIXED.clear()
        hit = _FIXED[ctx.place_token] = _fixed(ctx, dense_activations(ctx))
    return hit


def rank_cost(ctx: RankContext, fixed: _Fixed | None = None) -> RankCost:
    """Per-micro-batch chunk times, per-step terms and memory of one TP group's ranks. ``fixed``: the
    dense rank's ``_fixed`` when known (``rank_cost_memo``: once per place), else computed here."""
    if ctx.step.experts is not None:  # a MoE model: each chunk its mix of dense and MoE layers
        blocks, lc, acts, moe = _moe_blocks(ctx)
        return _composed(ctx, blocks, blocks[0], tuple(ctx.cf * g for g in lc), _fixed(ctx, acts), moe)
    f = fixed if fixed is not None else _fixed(ctx, dense_activations(ctx))
    b, layer_w = _dense_block(ctx, f.acts, f.block_comm)
    if ctx.window is None:
        return _composed(ctx, b, b, layer_w, f, None)
    # sliding-window layers (cost/windows.py): the same block at the windowed attention work, each
    # chunk the mean of its full and windowed layers
    bw, _ = _dense_block(WIN.windowed(ctx), f.acts, f.block_comm)
    blocks = tuple(_mean_block(((b, n - k), (bw, k))) for n, k in zip(ctx.layers, ctx.window.chunk_layers, strict=True))
    return _composed(ctx, blocks, blocks[0], (layer_w,) * len(blocks), f, None)


def _composed(ctx: RankContext, blocks: Any, b: BlockTimes, layer_w: Any, f: _Fixed, moe: dict | None) -> RankCost:
    """The rank's cost from its blocks (``b``: the first chunk's) and what its attention does not move."""
    s = ctx.step
    ch = PP.chunk_times(ctx, blocks, f.embedding_tp, f.head, f.head_tp, embed=f.embed, layer_w=layer_w)
    overl, fixed = DP.grad_sync(ctx, b.comp_f, b.comp_b, f.transfers)
    if ctx.rates.cpu is not None:
        overl, fixed = _cpu.exposed_grad_sync(overl, fixed)
        if s.zero >= 2 and s.shard_n > 1 and not DP.zero3_gathers(ctx):  # ZeRO-3's meet per block: block_times
            fixed += _cpu.zero_step_sync(ctx, b.comp_f, b.comp_b, sum(ctx.layers))
    dp_raw, (total, terms), optimizer = f.dp_raw, f.memory, f.optimizer
    if moe is not None:
        e_overl, e_fixed = EDP.grad_sync(ctx)
        overl, fixed, dp_raw = overl + e_overl, fixed + e_fixed, dp_raw + e_overl + e_fixed
        optimizer += EDP.optimizer_time(ctx)
        total, terms = MM.add_expert_memory(ctx, total, terms, moe.pop("buffers"))
        moe["expert_grad_sync_s"] = e_overl + e_fixed
    m_d = ctx.microbatches
    ep = m_d * ch.ep
    pp_sends = f.pp_sends
    return RankCost(
        spec=ctx.spec, fwd=ch.fwd, bwd=ch.bwd, p2p=f.p2ps[0], wgt=ch.wgt, p2p_chunks=f.p2ps, p2p_back_chunks=f.p2p_back,
        compute_s=m_d * ch.compute, tp_comm_s=m_d * ch.tp, hp_comm_s=m_d * ch.hp, cp_comm_s=m_d * ch.cp_raw,
        pp_comm_s=m_d * pp_sends, dp_comm_s=dp_raw,
        comm_s=m_d * (ch.tp + ch.hp + ch.cp_raw + pp_sends) + dp_raw + ep,
        exposed_in_ops=m_d * ch.exposed, busy=m_d * (sum(ch.fwd) + sum(ch.bwd)),
        dp_overlappable=overl, dp_exposed_fixed=fixed, dp_in_window=ctx.layers[0] * b.z3_b,
        optimizer=optimizer, memory_total=total, memory_terms=terms,
        moe=None if moe is None else {**{k: m_d * v if k in _PER_MICROBATCH else v for k, v in moe.items()},
                                      "ep_comm_s": ep})


_PER_MICROBATCH = ("router_s", "moe_host_s", "experts_s", "ep_exposed_s")
"""The MoE terms ``_moe_blocks`` gives per micro-batch (``rank_cost`` reports them per step)."""


def _dense_block(ctx: RankContext, acts: tuple[float, float, float], comm: tuple[float, float]
                 ) -> tuple[BlockTimes, float]:
    """A dense model's block whose activations are ``acts`` (kept per micro-batch, full, of which the
    scores) and collectives ``comm`` (``_block_comm``): its times, its weight-gradient GEMM seconds."""
    s = ctx.step
    _, full, scores = acts
    # elementwise traffic over the sbh tensors; the softmax over the scores is part of the attention
    # kernel's throughput (fused attention never writes the s^2 scores to memory)
    lc = layer_compute(s.model, ctx.rates, tokens=ctx.tokens_local, tp=s.tp, heads_local=ctx.heads,
                       keysum=ctx.keysum, block_seq=ctx.block_seq, blocks=ctx.ring, micro_batch=s.mbs,
                       act_bytes=full - scores)
    # measured layers first (cost/layers.py), then the kernel curves / datasheet of compute.py, on the
    # profile's scale where the device has one that cannot price this rank's block (a cp/hp shard)
    blk = LY.piece(ctx, "block") or LY.reconciled_block(ctx, lc)
    if blk is not None:
        lc = LY.measured_block(lc, blk)
    b = block_times(ctx, lc, comm)
    b.comp_b += module_seconds(ctx, s.model.ffn_hidden, moe_layer=False)
    return b, ctx.cf * lc.gemm_fwd


def dense_activations(ctx: RankContext) -> tuple[float, float, float]:
    """A dense block's activations (kept per micro-batch, full, of which the scores), less what its
    ``recompute_modules`` no longer keep."""
    kept, full, scores = M.block_activations(ctx)
    return attention_side_kept(ctx, kept, ctx.step.model.ffn_hidden, moe_layer=False), full, scores


def attention_side_kept(ctx: RankContext, kept: float, ffn_width: float, moe_layer: bool) -> float:
    """Bytes a layer's attention side (and its FFN of ``ffn_width``) keeps per micro-batch: ``kept``
    (the block count) less what its ``recompute_modules`` drop, or what torchtitan's per-op
    checkpointing keeps where it runs the plan (``op_sac.py``)."""
    s = ctx.step
    if OS.applies(s):
        return OS.kept_bytes(s.model, ffn_width, tokens=s.mbs * ctx.tokens / s.hp, cp_tokens=s.mbs * ctx.tokens,
                             heads_local=ctx.heads, tp=s.tp, bpe=s.bpe)
    return kept - module_saving(ctx, ffn_width, moe_layer)


def module_saving(ctx: RankContext, ffn_width: float, moe_layer: bool) -> float:
    """Bytes a layer's attention side no longer keeps per micro-batch under ``recompute_modules``."""
    s = ctx.step
    return RMOD.block_saving(s.model, s.recompute_modules, tokens=s.mbs * ctx.tokens / s.hp,
                             cp_tokens=s.mbs * ctx.tokens, tp=s.tp, sequence_parallel=s.sp, heads_local=ctx.heads,
                             ffn_width=ffn_width, moe_layer=moe_layer, act_bytes=s.bpe)


def module_seconds(ctx: RankContext, ffn_width: float, moe_layer: bool) -> float:
    """Backward seconds a layer's attention side spends rebuilding its ``recompute_modules``, or the
    GEMMs torchtitan's per-op checkpointing recomputes (``op_sac.py``)."""
    s = ctx.step
    if OS.applies(s):
        return ctx.cf * OS.rerun_seconds(s.model, ctx.rates, ffn_width, tokens=ctx.tokens_local, tp=s.tp)
    return ctx.cf * RMOD.block_seconds(s.model, ctx.rates, s.recompute_modules, tokens=ctx.tokens_local, tp=s.tp,
                                       sequence_parallel=s.sp, ffn_width=ffn_width, moe_layer=moe_layer, bpe=s.bpe)


def _moe_blocks(ctx: RankContext) -> tuple[tuple[BlockTimes, ...], tuple[float, ...], tuple[float, float, float],
                                           dict[str, float]]:
    """A MoE rank's blocks: per model chunk of the rank, the mean of its dense and MoE layers' block
    times (a chunk's layers times it is their sum); per chunk the weight-gradient GEMM seconds of one
    layer; the activations kept per layer and micro-batch (mean over the rank's layers); the MoE
    terms per micro-batch over the rank's layers (``moe_layers.py``)."""
    x = ctx.step.experts
    bd, lc_d, (kd, fd, sd) = _moe_dense_layer(ctx)
    bm, t, lc_m, (km, fm, sm) = moe_block(ctx)
    n_moe = x.chunk_moe_layers[ctx.pp_index]
    blocks, w = [], []
    for n, k in zip(ctx.layers, n_moe, strict=True):
        blocks.append(_mix(bd, bm, n - k, k))
        w.append(((n - k) * lc_d.gemm_fwd + k * (lc_m.gemm_fwd + t.experts_s / (3.0 * ctx.cf))) / n)
    if ctx.window is not None:  # sliding-window layers (cost/windows.py): each chunk's four kinds of layer
        blocks, bm = _windowed_moe_blocks(ctx, n_moe, bd, bm)
    nl, nm = sum(ctx.layers), sum(n_moe)
    mean = lambda a, b: ((nl - nm) * a + nm * b) / nl  # noqa: E731
    # each MoE layer on its own measurement where the profile has the moe piece's bytes (the dense
    # block's ratio scales the mean below, in ``_fixed``); full recomputation keeps the block input alone
    q = LY.moe_activation_ratio(ctx, fm + t.routed_full)
    kq = 1.0 if ctx.step.recompute == "full" else q
    acts = (mean(kd, kq * (km + t.routed_kept)), mean(fd, q * (fm + t.routed_full)), mean(sd, q * sm))
    terms = {"router_s": nm * t.router_s, "moe_host_s": nm * t.host_s, "experts_s": nm * t.experts_s,
             "ep_exposed_s": nm * (bm.ep_f + bm.ep_b), "imbalance": t.imbalance,
             "tokens_per_expert": t.tokens_per_expert, "moe_layers": float(nm), "buffers": t.buffers,
             "ep_inter_peers": float(ctx.expert_links.ep_inter_n)}
    return tuple(blocks), tuple(w), acts, terms


def _moe_dense_layer(ctx: RankContext) -> tuple[BlockTimes, LayerCompute, tuple[float, float, float]]:
    """A MoE model's dense layer on this rank: its block times, compute and activations (kept, full,
    of which the scores)."""
    m = ctx.step.model
    lc_d, kd, fd, sd = ML.base_block(ctx, m.dense_ffn_width)
    # measured layers first (cost/layers.py): the dense layers from the profile's ``block`` (an MoE
    # model's first dense layer), the MoE layers on the scale of its ``moe`` piece (``moe_block``)
    blk = LY.piece(ctx, "block")
    if blk is not None:
        lc_d = LY.measured_block(lc_d, blk)
    bd = block_times(ctx, lc_d)
    kd = attention_side_kept(ctx, kd, m.dense_ffn_width, moe_layer=False)
    bd.comp_b += module_seconds(ctx, m.dense_ffn_width, moe_layer=False)
    return bd, lc_d, (kd, fd, sd)


def _windowed_moe_blocks(ctx: RankContext, n_moe: tuple[int, ...], bd: BlockTimes, bm: BlockTimes
                         ) -> tuple[list[BlockTimes], BlockTimes]:
    """Each chunk's mean block over its full and windowed dense and MoE layers (the windowed ones
    priced on ``windows.windowed``'s context), and the mean MoE layer (its exposed exchange)."""
    cw = WIN.windowed(ctx)
    bd_w, bm_w = _moe_dense_layer(cw)[0], moe_block(cw)[0]
    win = ctx.window
    blocks = [_mean_block(((bd, n - k - (kw - kwm)), (bd_w, kw - kwm), (bm, k - kwm), (bm_w, kwm)))
              for n, k, kw, kwm in zip(ctx.layers, n_moe, win.chunk_layers, win.chunk_moe, strict=True)]
    nm, nwm = sum(n_moe), sum(win.chunk_moe)
    return blocks, _mean_block(((bm, nm - nwm), (bm_w, nwm)))


def reruns_moe_forward(step: Any) -> bool:
    """Whether the backward runs a MoE layer's forward again, its dispatch and combine included: full
    recomputation, or the ``moe`` module of per-module recomputation."""
    return step.recompute == "full" or "moe" in step.recompute_modules


def moe_block(ctx: RankContext) -> tuple[BlockTimes, Any, LayerCompute, tuple[float, float, float]]:
    """One MoE layer on this rank: its block times (attention and shared experts, router, routed
    experts, exposed exchange, recomputation), its MoE terms (``moe_layers.moe_terms``), the
    attention's compute and its activations (kept, full, scores) before the routed ones."""
    m = ctx.step.model
    lc_m, km, fm, sm = ML.base_block(ctx, m.moe.shared_width)
    shared_fwd = ML.shared_gemm_fwd(ctx)
    t = ML.moe_terms(ctx, shared_fwd)
    steps = MS.measured_steps(ctx)  # the profile's FFN steps at this ep and etp: the layer from them
    moe_hit = LY.moe_piece(ctx) if steps is None else None  # else its ``moe`` piece: the layer on its scale
    if steps is not None:
        lc_m, t = MS.priced(ctx, t, shared_fwd, steps)
    elif moe_hit is not None:
        lc_m, t = ML.measured_moe(ctx, lc_m, t, moe_hit.fwd, moe_hit.bwd, shared_fwd)
    bm = block_times(ctx, lc_m)
    charged = (bm.comp_f, bm.comp_b) if _cpu_block_synced(ctx) else (0.0, 0.0)
    if not m.moe.shared_width:  # tp's second gather/scatter pair is the FFN's: routed tokens leave in their
        bm.tp_f, bm.tp_b = 0.5 * bm.tp_f, 0.5 * bm.tp_b  # sequence-parallel slices (expert_dispatch.py)
    full_rc = reruns_moe_forward(ctx.step)
    km = attention_side_kept(ctx, km, m.moe.shared_width, moe_layer=True)
    bm.comp_b += module_seconds(ctx, m.moe.shared_width, moe_layer=True)
    bm.comp_f += t.comp_f
    bm.comp_b += t.comp_b + (t.comp_f if full_rc else 0.0)
    bm.ep_f, bm.ep_b = t.ep_f, t.ep_b + (t.ep_f if full_rc else 0.0)
    bm.ep_raw = t.exchange_raw * (1.5 if full_rc else 1.0)
    if ctx.step.experts.overlap == "a2a_1f1b":
        _overlap_microbatches(ctx, bm, t, shared_fwd)
    if ctx.rates.cpu is not None:
        _cpu_moe_waits(ctx, bm, charged)
    # ZeRO-3 (FSDP) gathers the layer's experts over edp with its dense weights, behind the same compute
    bm.z3_f, bm.z3_b = DP.zero3_block_exposed(ctx, bm.comp_f, bm.comp_b, EDP.zero3_gather(ctx))
    return bm, t, lc_m, (km, fm, sm)


def _overlap_microbatches(ctx: RankContext, bm: BlockTimes, t: Any, shared_fwd: float) -> None:
    """``bm``'s exposed exchange under the cross-micro-batch overlap (``Plan.moe_a2a_overlap``;
    ``expert_dispatch.paired_exposed``): the paired forwards and backwards share what their pair
    leaves exposed, the warm-up's and cool-down's keep theirs (``expert_dispatch.paired_fraction``).
    The experts between dispatch and combine are the routed ones and the shared experts; the rest
    of the block (attention, router, permutation, host time) runs before the dispatch."""
    s = ctx.step
    mlp_f = t.experts_s / 3.0 + ctx.cf * shared_fwd
    mlp_b = 2.0 * mlp_f
    attn_f = max(0.0, bm.layer_f - bm.ep_f - mlp_f)
    attn_b = max(0.0, bm.layer_b - bm.ep_b - mlp_b)
    pair = XD.paired_exposed(t.exchange_raw / 4.0, attn_f, mlp_f, attn_b, mlp_b)
    phi = XD.paired_fraction(s.pp, s.v, ctx.pp_index, ctx.microbatches)
    bm.ep_f = phi * 0.5 * pair + (1.0 - phi) * bm.ep_f
    bm.ep_b = phi * 0.5 * pair + (1.0 - phi) * bm.ep_b


def _cpu_block_synced(ctx: RankContext) -> bool:
    """Whether ``block_times`` charged a CPU block's waits at its own blocking collectives (then a
    MoE layer's add their calls, and the skew only on the compute those did not cover)."""
    return ctx.rates.cpu is not None and _cpu.block_sync_calls(ctx, DP.zero3_gathers(ctx))[0] > 0


def _cpu_moe_waits(ctx: RankContext, bm: BlockTimes, charged: tuple[float, float]) -> None:
    """A CPU rank's MoE layer: the runtime's small collectives around the exchange and the waits at
    its blocking calls (``cpu.moe_comm``, ``cpu.moe_sync_waits``), on ``bm``'s exposed exchange;
    ``charged``: the compute whose skew the block's own waits already took."""
    comm_f, comm_b = _cpu.moe_comm(ctx)
    wait_f, wait_b = _cpu.moe_sync_waits(ctx, bm.comp_f - charged[0], bm.comp_b - charged[1])
    bm.ep_f, bm.ep_b = bm.ep_f + comm_f + wait_f, bm.ep_b + comm_b + wait_b
    bm.ep_raw += comm_f + comm_b + wait_f + wait_b


def _mix(bd: BlockTimes, bm: BlockTimes, n_dense: int, n_moe: int) -> BlockTimes:
    """The mean block of ``n_dense`` blocks ``bd`` and ``n_moe`` blocks ``bm``."""
    n = n_dense + n_moe
    return BlockTimes(**{f: (n_dense * getattr(bd, f) + n_moe * getattr(bm, f)) / n
                         for f in BlockTimes.__dataclass_fields__})


def _mean_block(parts: tuple[tuple[BlockTimes, int], ...]) -> BlockTimes:
    """The mean block of ``count`` blocks of each ``(block, count)``; a chunk without layers takes the
    first block (it multiplies by its zero layers)."""
    n = sum(k for _, k in parts)
    if n == 0:
        return parts[0][0]
    return BlockTimes(**{f: sum(k * getattr(b, f) for b, k in parts) / n for f in BlockTimes.__dataclass_fields__})


def _optimizer(ctx: RankContext) -> float:
    """The step-end update: measured where the device's layer profile has it (``layers.update_time``:
    the runtime's AdamW and, per micro-batch, its gradient accumulation), else the bandwidth price."""
    got = LY.update_time(ctx)
    return got[0] if got is not None else DP.optimizer_time(ctx)


_MEMO: dict[tuple, RankCost] = {}
_MEMO_LIMIT = 100_000


def rank_cost_memo(ctx: RankContext) -> RankCost:
    """``rank_cost`` memoised by ``ctx.cost_key()`` across estimates, as the context's place token
    (``RankContext.place_token``: the key less the attention work) and its attention work
    (``DOC_INPUTS``). A search prices thousands of plans whose tp groups mostly repeat ones it
    priced before (measured at 128 devices of 4 types: 51,216 of 57,728 groups, a third of the
    search's time): a neighbour in the hill climb changes one share or knob, and groups on different
    devices of one type with the same links and shares do the same work. With documents every DP
    replica of a drawn step is a context of its own (``context.tp_groups``): copies of one template
    per place, which carry its token, so each costs a lookup of four values, and a replica not seen
    before prices only what its attention moves (``_fixed_memo``: the rest once per place). A
    RankCost is frozen, so sharing one is safe. The ring blocks are in the key only where the block's
    price reads them (``Rates.reads_ring_blocks``): zigzag CP shards of an even split have the same
    causal work and the same blocks in another order, so on a FlashAttention-class GPU the cp ranks of
    a place are one rank cost, not cp of them (measured at 1,024 devices: 60k rank costs priced in a
    search, most of them cp-fold repeats)."""
    key = (ctx.place_token, ctx.keysum, ctx.ring if ctx.rates.reads_ring_blocks else None, ctx.attn_seq)
    hit = _MEMO.get(key)
    if hit is not None:
        return hit
    if len(_MEMO) >= _MEMO_LIMIT:
        _MEMO.clear()
    cost = _MEMO[key] = rank_cost(ctx, _fixed_memo(ctx))
    return cost
