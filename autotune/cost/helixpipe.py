"""HelixPipe's cost (Zhang et al. 2025, arXiv 2507.00394): the event simulation that times the
schedule's ``rank_order`` (``autotune/schedules/helixpipe.py`` holds the order, the placement and the
memory rules), each rank's operation times priced from the cost model's own block terms, its memory,
and the estimate's hooks for a schedule whose data flow is no chain of stages (``rank_cost``,
``simulate_replicas``: ``cost/estimate.py`` calls them when ``schedule.chain`` is False).

Pure Python (no torch): the search's inner loop prices with it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from autotune.cost import cpu as _cpu
from autotune.cost import layers as LY
from autotune.cost import memory as M
from autotune.cost import tensor_parallel as TP
from autotune.cost.compute import head_compute, layer_compute
from autotune.cost.rank import RankCost
from autotune.schedules.helixpipe import FWD, all_orders, chain_rank, in_flight, is_block, peer, rank_order


# ---- simulation ---------------------------------------------------------------------------------
@dataclass
class HelixSimulation:
    """Start and end of every operation of one replica's helix, per micro-batch and chain position."""

    p: int
    layers: int
    m: int
    folds: int
    f_end: list[list[float]]
    b_end: list[list[float]]
    op_fwd: tuple[tuple[float, ...], ...]
    """Seconds of chain position k on rank r: ``op_fwd[k][r]``."""
    op_bwd: tuple[tuple[float, ...], ...]
    hops: tuple[tuple[tuple[float, ...], ...], ...]
    rank_finish: list[float]
    rank_busy: list[float]
    makespan: float = 0.0
    shares: tuple[int, ...] | None = None

    @property
    def fwd(self) -> tuple[float, ...]:
        """Seconds of one micro-batch's forward operations on each rank (the chain schedules'
        per-stage figure, for the breakdown)."""
        return tuple(sum(self.op_fwd[k][r] for k in range(2 * self.layers + 1)
                         if chain_rank(k, 0, self.p, self.folds, self.shares) == r) for r in range(self.p))

    @property
    def bwd(self) -> tuple[float, ...]:
        return tuple(sum(self.op_bwd[k][r] for k in range(2 * self.layers + 1)
                         if chain_rank(k, 0, self.p, self.folds, self.shares) == r) for r in range(self.p))

    def bubble_fraction(self, s: int) -> float:
        span = self.makespan
        return (span - self.rank_busy[s]) / span if span > 0 else 0.0

    def hop_time(self, k_from: int, kind: int, src: int, dst: int) -> float:
        """Seconds to move chain position ``k_from``'s output (FWD) or input gradient (BWD)."""
        edge = k_from if kind == FWD else k_from - 1  # the edge between chain positions e and e+1
        return self.hops[edge % 2][src][dst] if src != dst else 0.0

    def events(self, schedule: str | None = None, ranks: list[int] | None = None) -> list[dict]:
        """Gantt events per pipeline rank (the dashboard's shape; ``chunk`` = chain position,
        ``part`` = block | attention, comm events for every hop that leaves the rank)."""
        out: list[dict] = []
        p, L, m, F = self.p, self.layers, self.m, self.folds
        for s in range(p):
            rank = ranks[s] if ranks else s
            t = 0.0
            for op in rank_order(p, L, m, F, s, self.shares):
                k, i = op.k, op.microbatch
                if op.kind == FWD:
                    end, dur = self.f_end[i][k], self.op_fwd[k][s]
                else:
                    end, dur = self.b_end[i][k], self.op_bwd[k][s]
                start = end - dur
                if start > t + 1e-15:
                    out.append({"stage": s, "rank": rank, "kind": "bubble", "microbatch": None, "start": t,
                                "end": start})
                out.append({"stage": s, "rank": rank, "kind": "fwd" if op.kind == FWD else "bwd",
                            "microbatch": i, "chunk": k, "part": "block" if is_block(k) else "attention",
                            "start": start, "end": end})
                dst = peer(op, p, L, F, self.shares)
                if dst is not None and dst != s:
                    hop = self.hop_time(k, op.kind, s, dst)
                    if hop > 0:
                        out.append({"stage": s, "rank": rank, "kind": "comm", "comm": "pp", "microbatch": i,
                                    "chunk": k, "to_stage": dst, "start": end, "end": end + hop})
                t = end
            if self.makespan > t + 1e-15:
                out.append({"stage": s, "rank": rank, "kind": "bubble", "microbatch": None, "start": t,
                            "end": self.makespan})
        return out


def simulate(p: int, layers: int, m: int, folds: int, fwd: tuple[tuple[float, ...], ...],
             bwd: tuple[tuple[float, ...], ...], hops: tuple[tuple[tuple[float, ...], ...], ...],
             shares: tuple[int, ...] | None = None) -> HelixSimulation:
    """Time ``rank_order`` on every rank: an operation starts when its rank is free and its input
    has arrived (the producer's end plus the hop between the two ranks it really joins). Longer than
    a screen on purpose: the estimate's inner loop, one loop over local variables (as
    ``cost.pipeline.simulate_chain``).

    ``fwd[k][r]`` / ``bwd[k][r]``: seconds of chain position ``k`` (``2L + 1`` entries) when it runs
    on pipeline rank ``r`` (a mixed cluster prices each rank's device); ``hops[t][src][dst]``:
    seconds to move one micro-batch's hop from ``src`` to ``dst``, ``t = 0`` for block -> attention
    (and its gradient back), ``t = 1`` for attention -> block (and back)."""
    n = 2 * layers + 1
    f_end = [[-1.0] * n for _ in range(m)]
    b_end = [[-1.0] * n for _ in range(m)]
    orders = all_orders(p, layers, m, folds, shares)
    ranks_of = [[chain_rank(k, mb, p, folds, shares) for k in range(n)] for mb in range(min(m, p * folds))]
    group = p * folds
    ptr = [0] * p
    free = [0.0] * p
    busy = [0.0] * p
    remaining = sum(len(o) for o in orders)
    last = n - 1
    while remaining:
        advanced = 0
        for s in range(p):
            ops, kk, t = orders[s], ptr[s], free[s]
            nops = len(ops)
            while kk < nops:
                kind, k, mb = ops[kk]
                rk = ranks_of[mb % group]
                if kind == FWD:
                    if k:
                        dep = f_end[mb][k - 1]
                        if dep < 0:
                            break
                        src = rk[k - 1]
                        if src != s:
                            dep += hops[(k - 1) % 2][src][s]
                        if dep > t:
                            t = dep
                    d = fwd[k][s]
                    t += d
                    busy[s] += d
                    f_end[mb][k] = t
                else:
                    if k < last:
                        dep = b_end[mb][k + 1]
                        if dep < 0:
                            break
                        src = rk[k + 1]
                        if src != s:
                            dep += hops[k % 2][src][s]
                    else:
                        dep = f_end[mb][k]
                    if dep > t:
                        t = dep
                    d = bwd[k][s]
                    t += d
                    busy[s] += d
                    b_end[mb][k] = t
                kk += 1
            advanced += kk - ptr[s]
            ptr[s], free[s] = kk, t
        if not advanced:  # pragma: no cover - an order that deadlocks is a bug in rank_order
            raise RuntimeError(f"helixpipe order deadlocked (p={p}, L={layers}, m={m}, F={folds})")
        remaining -= advanced
    return HelixSimulation(p=p, layers=layers, m=m, folds=folds, f_end=f_end, b_end=b_end, op_fwd=fwd, op_bwd=bwd,
                           hops=hops, rank_finish=free, rank_busy=busy, makespan=max(free), shares=shares)


@lru_cache(maxsize=512)
def simulate_cached(p: int, layers: int, m: int, folds: int, fwd: tuple[tuple[float, ...], ...],
                    bwd: tuple[tuple[float, ...], ...],
                    hops: tuple[tuple[tuple[float, ...], ...], ...],
                    shares: tuple[int, ...] | None = None) -> HelixSimulation:
    return simulate(p, layers, m, folds, fwd, bwd, hops, shares)


# ---- pricing (the cost model's side: autotune/cost/estimate.py asks these for helixpipe plans) ----
PRE_ATTENTION_ELEMENTWISE = 0.2
"""Share of a block's elementwise work (outside attention) that is PreAttn's: LN1 and its residual
read, one of the block's five sbh-sized elementwise tensors (two norm inputs, the MLP input, two
residual adds); the rest is PostAttn's. Decides how the embedding and loss ends are priced."""
ATTENTION_TP_SHARE = 0.25
"""Of a block's four tensor-parallel collectives (entry and exit of attention and of the MLP), the
attention's entry (its all-gather under sequence parallelism) runs on the attention's rank."""


@dataclass(frozen=True)
class HelixRankTimes:
    """One rank's seconds per micro-batch of each kind of helix operation, and its hop sizes."""

    block_f: float
    block_b: float
    first_f: float
    """Block 0: embedding + PreAttn(0)."""
    first_b: float
    last_f: float
    """Block L: PostAttn(L-1) + final norm, LM head, loss."""
    last_b: float
    attn_f: float
    attn_b: float
    compute_f: float
    """Compute (no communication) of one block + one attention, forward; for the step's terms."""
    compute_b: float
    attn_compute_f: float
    """Of which the attention's."""
    attn_compute_b: float
    tp_f: float
    tp_b: float
    to_attention_bytes: float
    """Block -> attention: residual, LN1 output and the QKV weights (``--transfer-weight``)."""
    to_block_bytes: float
    """Attention -> block: residual and attention output."""


def _on_profile_scale(ctx, lc, qkv: float):
    """(block terms, QKV seconds) from the device's layer profile where it has one, as for every other
    schedule (cost/layers.py: one scale); else the compute model's unchanged."""
    blk = LY.piece(ctx, "block") or LY.reconciled_block(ctx, lc)
    if blk is None:
        return lc, qkv
    return LY.measured_block(lc, blk), qkv * (blk.fwd / lc.fwd if lc.fwd > 0 else 1.0)


def _ends(ctx) -> tuple[float, float, float]:
    """(embedding forward, head forward, head backward) seconds: measured pieces first, at the
    shard's length where the profile holds whole sequences, else the compute model's."""
    m_emb = LY.piece(ctx, "embed") or LY.shard_piece(ctx, "embed")
    emb = m_emb.fwd if m_emb is not None else ctx.rates.memory_time(ctx.hidden_bytes)
    m_head = LY.piece(ctx, "head") or LY.shard_piece(ctx, "head")
    if m_head is not None:
        return emb, m_head.fwd, m_head.bwd
    hf, hb = head_compute(ctx.step.model, ctx.rates, tokens=ctx.tokens_local, tp=ctx.step.tp)
    return emb, hf, hb


def rank_times(ctx) -> HelixRankTimes:
    """Price the helix operations of the tensor-parallel group ``ctx`` (a ``cost.context.RankContext``)
    from the cost model's own block terms: the QKV projection moves to the attention's rank
    (transfer-weight); recomputation (``recompute="full"``: checkpoint without attention) adds the
    parameter blocks' forward and the QKV projection to backward, never the attention forward."""
    s = ctx.step
    model, rates, cf = s.model, ctx.rates, ctx.cf
    h, kv, tp = model.hidden, model.kv_dim, s.tp
    _, full, scores = M.block_activations(ctx)
    lc = layer_compute(model, rates, tokens=ctx.tokens_local, tp=tp, heads_local=ctx.heads, keysum=ctx.keysum,
                       block_seq=ctx.block_seq, blocks=ctx.ring, micro_batch=s.mbs, act_bytes=full - scores)
    qkv = rates.gemm_time(2.0 * ctx.tokens_local * h * (h + 2 * kv) / tp)
    lc, qkv = _on_profile_scale(ctx, lc, qkv)
    attn_bytes = _attention_bytes(ctx)
    share = min(1.0, attn_bytes / max(full - scores, 1.0))
    elem_a, elem_p = lc.elem_fwd * share, lc.elem_fwd * (1.0 - share)
    keep = s.recompute == "full"
    # the backward's elementwise (and host) time per forward's: the runtime's counted backward kernels
    # where it has them (compute.LayerCompute.elem_bwd), else twice
    eb = lc.elem_bwd / lc.elem_fwd if lc.elem_bwd is not None and lc.elem_fwd > 0 else 2.0
    a_f = cf * (qkv + lc.attn_fwd + elem_a)
    a_b = cf * (2.0 * qkv + lc.attn_bwd + eb * elem_a + (qkv + elem_a if keep else 0.0))
    p_f = cf * (lc.gemm_fwd - qkv + elem_p)
    p_b = (2.0 * p_f if eb == 2.0 else cf * (2.0 * (lc.gemm_fwd - qkv) + eb * elem_p)) + (p_f if keep else 0.0)
    tp1 = TP.block_comm(ctx)
    sync_f, sync_b = _cpu.sync_waits(ctx, cf * lc.fwd, cf * lc.bwd) if rates.cpu is not None else (0.0, 0.0)
    tpa_f, tpa_b = ATTENTION_TP_SHARE * (tp1 + sync_f), ATTENTION_TP_SHARE * (tp1 + sync_b)
    tpp_f, tpp_b = (1 - ATTENTION_TP_SHARE) * (tp1 + sync_f), (1 - ATTENTION_TP_SHARE) * (tp1 + sync_b)
    if keep:
        tpa_b += tpa_f
        tpp_b += tpp_f
    pre_f, pre_b = PRE_ATTENTION_ELEMENTWISE * cf * elem_p, 2.0 * PRE_ATTENTION_ELEMENTWISE * cf * elem_p
    emb_f, hf, hb = _ends(ctx)
    emb = cf * emb_f + TP.embedding_comm(ctx)
    htp = _cpu.head_tp_comm(ctx) if tp > 1 and rates.cpu is not None else (0.0, 0.0)
    block_f, block_b = p_f + tpp_f, p_b + tpp_b
    last_f = block_f - pre_f + cf * hf + htp[0]
    last_b = block_b - pre_b + cf * hb + htp[1] + (cf * hf if keep else 0.0)
    x_bytes = ctx.hidden_bytes / (tp if s.sp else 1)
    return HelixRankTimes(
        block_f=block_f, block_b=block_b, first_f=pre_f + emb, first_b=pre_b + (pre_f if keep else 0.0),
        last_f=last_f, last_b=last_b, attn_f=a_f + tpa_f, attn_b=a_b + tpa_b,
        compute_f=a_f + p_f, compute_b=a_b + p_b, attn_compute_f=a_f, attn_compute_b=a_b, tp_f=tp1 + sync_f, tp_b=tp1 + sync_b + (tp1 + sync_f if keep else 0),
        to_attention_bytes=2.0 * x_bytes + s.bpe * (h + 2 * kv) * h / tp,
        to_block_bytes=x_bytes + s.bpe * s.mbs * ctx.tokens * h / tp)


def _attention_bytes(ctx) -> float:
    """Bytes of the attention's own activations for one micro-batch (Q, K, V, its output, the
    scores where the kernel keeps them): the part of a block that moves to the attention's rank."""
    s = ctx.step
    model = s.model
    hd, b, tok = model.head_dim, s.mbs, ctx.tokens
    scale = s.bpe / 2.0
    q_o = 4.0 * hd * ctx.heads * b * tok
    k_v = 4.0 * (model.kv_dim / s.tp) * b * tok
    return (q_o + k_v) * scale


def op_time(t: HelixRankTimes, k: int, layers: int, backward: bool) -> float:
    if k % 2:
        return t.attn_b if backward else t.attn_f
    if k == 0:
        return t.first_b if backward else t.first_f
    if k == 2 * layers:
        return t.last_b if backward else t.last_f
    return t.block_b if backward else t.block_f


def rank_memory(ctx, t: HelixRankTimes) -> tuple[float, dict[str, float]]:
    """(bytes, terms) of one rank: its blocks' model states (rank 0 adds the embedding and the head)
    and the activations of every micro-batch (first in, last out: all m are held when backward
    starts, the same on every rank): per block and attention what ``recompute`` keeps."""
    s = ctx.step
    model, p, L, tp, bpe = s.model, s.pp, model_layers(ctx), s.tp, s.bpe
    r = ctx.pp_index
    params = (L // p) * ctx.layer_params
    if r == 0:
        params += float(model.embedding_params()) + float(model.head_params())
    states = M.model_states(params / tp, s.dtype, s.zero, s.shard_n, ctx.layer_params / tp,
                            framework=M.framework_of(s), grad_reduce=s.grad_reduce)
    _, full0, scores = M.block_activations(ctx)
    # on the layer profile's scale where it measured activation bytes (layers.measured_activations)
    full = LY.measured_activations(ctx, full0, full0, scores)[1]
    scores *= full / full0 if full0 > 0 else 1.0
    attn = _attention_bytes(ctx) + scores
    x_bytes = ctx.hidden_bytes / (tp if s.sp else 1)
    w_bytes = bpe * (model.hidden + 2 * model.kv_dim) * model.hidden / tp
    o_bytes = bpe * s.mbs * ctx.tokens * model.hidden / tp
    lse = 4.0 * s.mbs * ctx.tokens * ctx.heads
    m = ctx.microbatches
    shares = s.plan.helix_attention
    held, logits_held = in_flight(p, L, m, s.plan.helix_folds, r, shares)
    if s.recompute == "full":  # checkpoint without attention: block inputs; attention inputs, output, LSE
        per_block, per_attn = x_bytes + o_bytes, x_bytes + w_bytes + o_bytes + lse
        working = full
        logits_each = 0.0
    else:
        per_block, per_attn = full - attn, attn + x_bytes + w_bytes
        working = 0.0
        logits_each = ctx.tokens_local * model.vocab / tp * M.logit_bytes(s)
    ops_mb = held // m if m else 0  # operations of one micro-batch on this rank
    n_attn = shares[r] if shares is not None else L // p
    n_blocks = ops_mb - n_attn
    acts = m * (n_blocks * per_block + n_attn * per_attn) + working
    logits = logits_each * logits_held
    alloc = states["weights"] + states["gradients"] + states["optimizer"] + acts + logits
    res = M.reserve(ctx.spec, alloc)
    return alloc + res, {**states, "activations": acts, "logits": logits, "reserve": res,
                         "activation_per_layer_microbatch": per_block + per_attn,
                         "layers_microbatches_in_flight": m * n_attn}


def model_layers(ctx) -> int:
    return int(ctx.step.model.layers)


# ---- the cost model's hooks ---------------------------------------------------------------------
def rank_cost(ctx, base):
    """``base`` (the chain schedules' ``cost.rank.RankCost`` of this tp group) with the helix's own
    per-micro-batch operation times, step terms and memory; the times ride along as ``helix``."""
    t = rank_times(ctx)
    s = ctx.step
    p, L, r, m = s.pp, s.model.layers, ctx.pp_index, ctx.microbatches
    ks = [k for k in range(2 * L + 1) if chain_rank(k, 0, p, s.plan.helix_folds, s.plan.helix_attention) == r]
    n_attn = sum(1 for k in ks if k % 2)
    fwd = sum(op_time(t, k, L, False) for k in ks)
    bwd = sum(op_time(t, k, L, True) for k in ks)
    n_blk = len(ks) - n_attn
    compute = n_blk * (t.compute_f + t.compute_b - t.attn_compute_f - t.attn_compute_b) + n_attn * (
        t.attn_compute_f + t.attn_compute_b)
    tp = n_blk * (1 - ATTENTION_TP_SHARE) * (t.tp_f + t.tp_b) + n_attn * ATTENTION_TP_SHARE * (t.tp_f + t.tp_b)
    total, terms = rank_memory(ctx, t)
    sends = 2.0 * (n_blk * ctx.mf * ctx.collectives.p2p(ctx.links.pp, t.to_attention_bytes)
                   + n_attn * ctx.mf * ctx.collectives.p2p(ctx.links.pp, t.to_block_bytes))
    return HelixRankCost(**{**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                            "fwd": (fwd,), "bwd": (bwd,), "compute_s": m * compute, "tp_comm_s": m * tp,
                            "pp_comm_s": m * sends,
                            "comm_s": m * (tp + sends) + base.dp_comm_s, "exposed_in_ops": m * tp,
                            "busy": m * (fwd + bwd), "memory_total": total, "memory_terms": terms},
                         helix=t, helix_ctx=ctx)


def simulate_replicas(s, per_rep_stage) -> list[HelixSimulation]:
    """One helix simulation per DP replica: each rank's operation times from its slowest tp group,
    every hop priced on the link between the devices of the two pipeline ranks it joins."""
    p, L, F = s.pp, s.model.layers, s.plan.helix_folds
    n = 2 * L + 1
    sims = []
    for d in range(s.dp):
        times, ctxs = [], []
        for st in range(p):
            costs = list(per_rep_stage[(d, st)].values())
            c = max(costs, key=lambda c_: c_.busy)
            times.append(c.helix)
            ctxs.append(c.helix_ctx)
        fwd = tuple(tuple(op_time(times[r], k, L, False) for r in range(p)) for k in range(n))
        bwd = tuple(tuple(op_time(times[r], k, L, True) for r in range(p)) for k in range(n))
        ranks = [s.plan.rank_of(pp=a, dp=d) for a in range(p)]
        hops = []
        for kind in ("to_attention_bytes", "to_block_bytes"):
            rows = []
            for a in range(p):
                row = []
                for b in range(p):
                    if a == b:
                        row.append(0.0)
                        continue
                    link = s.topo.link(s.devs[ranks[a]], s.devs[ranks[b]])
                    c = ctxs[a]
                    row.append(c.mf * c.collectives.p2p(link, getattr(times[a], kind)))
                rows.append(tuple(row))
            hops.append(tuple(rows))
        sims.append(simulate_cached(p, L, s.microbatches[d], F, fwd, bwd, tuple(hops), s.plan.helix_attention))
    return sims


@dataclasses.dataclass(frozen=True)
class HelixRankCost(RankCost):
    """``RankCost`` with the helix operation times of its tp group (``simulate_replicas`` reads them)."""

    helix: HelixRankTimes | None = None
    helix_ctx: object = None
