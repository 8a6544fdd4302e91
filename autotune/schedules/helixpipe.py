"""HelixPipe (Zhang et al. 2025, arXiv 2507.00394): the attention-parallel pipeline, in one place.

Every layer is cut in three: *pre-attention* (LN1, and the QKV weights shipped to the attention),
the parameter-free *attention* (QKV projection with the shipped weights, rotary, causal attention)
and *post-attention* (output projection, residual, LN2, MLP, residual). Parameter block ``j``
(``0 .. L``) is PostAttn(layer j-1) + PreAttn(layer j) and lives on pipeline rank ``j % p``; block 0
also holds the embedding, block L the final norm, the LM head and the loss, so rank 0 holds both
ends (L must be a multiple of p). One micro-batch is then a chain of ``2L + 1`` operations,
chain position ``k``::

    k = 2j      parameter block j     on rank  j % p
    k = 2i + 1  attention of layer i  on rank (i + 1 + d) % p     (layers 0-based)

where ``d`` is the micro-batch's *offset* inside its group of ``p * F`` micro-batches (F folds).
Offset 0 is an ordinary one-layer-per-stage pipeline (attention on the rank of the block that
follows it); the offsets rotate the attention, so the p micro-batches of a group run their
attention on p different ranks and every rank runs ``L/p`` attentions per micro-batch.

The order (two-fold, first in last out): micro-batch ``(group g, offset d, fold f)`` is delayed by
``d`` operations, so in a schedule of unit operations chain position ``k`` runs at ``d + k``; the F
folds run each operation back to back (innermost loop), so one fold's transfer overlaps the other's
compute; groups follow one another; every forward of the step comes first, then every backward in
the exact reverse order (time-reversal of a valid schedule is valid for the reversed data flow).
With unit operations the ranks interleave a run of p attentions and a run of p blocks without a
gap, whatever the ratio of attention to block time; the only loss is rank 0's extra block per
micro-batch (it holds both ends). ``rank_order`` is the one source of this order: the runtime
(``autotune/runtime/helix.py``) executes it, the cost model's simulation (``simulate``) times it.

Pure Python (no torch): the cost model imports it in the search's inner loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

from autotune.schedules.base import B, F, Op, Schedule

FWD, BWD = 0, 1
"""Operation kinds (the same numbers as torch.distributed.pipelining's F and B)."""


class HelixOp(NamedTuple):
    """One operation of one rank: ``kind`` (FWD, BWD) of chain position ``k`` on ``microbatch``."""

    kind: int
    k: int
    microbatch: int


# ---- placement ----------------------------------------------------------------------------------
def block_rank(j: int, p: int) -> int:
    """Pipeline rank of parameter block ``j`` (0 .. L)."""
    return j % p


def attention_rank(i: int, offset: int, p: int, shares: tuple[int, ...] | None = None) -> int:
    """Pipeline rank of layer ``i``'s attention (0-based) for a micro-batch at ``offset``.

    ``shares`` (the plan's ``helix_attention``; None: L/p each, the published rotation): how many of
    a micro-batch's L attentions each rank runs. The ranks take turns along a cycle of L slots in
    which rank r appears ``shares[r]`` times, spread evenly (``attention_slots``); the micro-batch at
    offset d starts d slots further on, as the published rotation does."""
    if shares is None:
        return (i + 1 + offset) % p
    slots = attention_slots(shares)
    return slots[(i + 1 + offset) % len(slots)]


@lru_cache(maxsize=256)
def attention_slots(shares: tuple[int, ...]) -> tuple[int, ...]:
    """A cycle of ``sum(shares)`` slots where rank r appears ``shares[r]`` times, evenly interleaved
    (smooth weighted round robin: each turn goes to the rank furthest behind its share)."""
    total = sum(shares)
    credit = [0] * len(shares)
    out = []
    for _ in range(total):
        for r, w in enumerate(shares):
            credit[r] += w
        best = max(range(len(shares)), key=lambda r: (credit[r], -r))
        credit[best] -= total
        out.append(best)
    return tuple(out)


def offset_of(mb: int, p: int, folds: int) -> int:
    """Offset ``d`` of micro-batch ``mb`` in its group (micro-batches are numbered group-major,
    then offset, then fold: ``mb = (g * p + d) * F + f``)."""
    return (mb // folds) % p


def chain_rank(k: int, mb: int, p: int, folds: int, shares: tuple[int, ...] | None = None) -> int:
    """Pipeline rank of chain position ``k`` of micro-batch ``mb``."""
    if k % 2 == 0:
        return block_rank(k // 2, p)
    return attention_rank(k // 2, offset_of(mb, p, folds), p, shares)


def is_block(k: int) -> bool:
    return k % 2 == 0


def blocks_of_rank(rank: int, p: int, layers: int) -> tuple[int, ...]:
    """Parameter blocks ``j`` held by pipeline rank ``rank`` (rank 0: 0, p, ..., L)."""
    return tuple(j for j in range(layers + 1) if block_rank(j, p) == rank)


def problems(p: int, layers: int, m: int, folds: int, shares: tuple[int, ...] | None = None) -> list[str]:
    """Why HelixPipe cannot run ``p`` ranks, ``layers`` layers, ``m`` micro-batches per replica."""
    out = []
    if p < 2:
        out.append(f"degrees.pp: helixpipe needs pp >= 2, got pp({p})")
    if layers % p:
        out.append(f"degrees.pp: helixpipe needs layers({layers}) divisible by pp({p}) (L/p one-layer "
                   "chunks per rank)")
    if m % (p * folds) or m < 1:
        out.append(f"num_microbatches: helixpipe needs micro-batches per replica divisible by "
                   f"pp({p})*helix_folds({folds}) = {p * folds}, got {m}")
    if shares is not None and (len(shares) != p or sum(shares) != layers or min(shares) < 0):
        out.append(f"helix_attention: {list(shares)} must give each of pp({p}) ranks its attentions per "
                   f"micro-batch (>= 0), adding up to layers({layers})")
    return out


# ---- order --------------------------------------------------------------------------------------
@lru_cache(maxsize=1024)
def rank_order(p: int, layers: int, m: int, folds: int, rank: int,
               shares: tuple[int, ...] | None = None) -> tuple[HelixOp, ...]:
    """Operations of pipeline rank ``rank`` in the order it runs them (see the module docstring).
    Any placement (``shares``) keeps it deadlock-free: every rank runs its operations in one global
    order (ideal start, then fold) that every dependency respects."""
    bad = problems(p, layers, m, folds, shares)
    if bad:
        raise ValueError("; ".join(bad))
    if shares is not None and len(set(shares)) > 1:
        fwd = list(_listed_forward(p, layers, m, folds, shares)[rank])
    else:
        group = p * folds
        keyed = []
        for mb in range(m):
            g, d, f = mb // group, offset_of(mb, p, folds), mb % folds
            for k in range(2 * layers + 1):
                if chain_rank(k, mb, p, folds, shares) == rank:
                    keyed.append(((g, d + k, f), k, mb))
        keyed.sort()
        fwd = [HelixOp(FWD, k, mb) for _, k, mb in keyed]
    return tuple(fwd) + tuple(HelixOp(BWD, op.k, op.microbatch) for op in reversed(fwd))


@lru_cache(maxsize=64)
def _listed_forward(p: int, layers: int, m: int, folds: int,
                    shares: tuple[int, ...]) -> tuple[tuple[HelixOp, ...], ...]:
    """Forward orders of every rank under uneven attention shares, by list scheduling: an operation
    of rank r takes ``1 / speed_r`` with the speed its share implies (``shares[r] / (L/p)``, a rank
    without attention at the slowest given speed), and a free rank runs, among the operations whose
    input is ready, the one the published order puts first (group, ideal start, fold). Unlike the
    group-major order this lets a rank start the next group while the last one's chain still runs:
    with uneven speeds one group no longer paces the ranks in lockstep."""
    import heapq

    per = layers / p
    positive = [x for x in shares if x > 0]
    slow = min(positive) / per
    dur = [1.0 / (x / per if x > 0 else slow) for x in shares]
    n = 2 * layers + 1
    group = p * folds
    ready: list[list] = [[] for _ in range(p)]
    for mb in range(m):
        g, d, f = mb // group, offset_of(mb, p, folds), mb % folds
        heapq.heappush(ready[0], ((g, d, f), 0.0, 0, mb))  # block 0 of every micro-batch is ready at 0
    free = [0.0] * p
    out: list[list[HelixOp]] = [[] for _ in range(p)]
    pending = m * n
    while pending:
        # the rank that can start something earliest runs its first-priority ready operation
        best = None
        for r in range(p):
            if not ready[r]:
                continue
            at = max(free[r], min(item[1] for item in ready[r]))
            cand = [item for item in ready[r] if item[1] <= at]
            item = min(cand)
            if best is None or at < best[0] or (at == best[0] and r < best[1]):
                best = (at, r, item)
        assert best is not None, "helixpipe list schedule stalled"
        at, r, item = best
        ready[r].remove(item)
        heapq.heapify(ready[r])
        key, _, k, mb = item
        out[r].append(HelixOp(FWD, k, mb))
        free[r] = at + dur[r]
        pending -= 1
        if k + 1 < n:
            nr = chain_rank(k + 1, mb, p, folds, shares)
            g, d, f = key[0], offset_of(mb, p, folds), mb % folds
            heapq.heappush(ready[nr], ((g, d + k + 1, f), free[r], k + 1, mb))
    return tuple(tuple(o) for o in out)


def all_orders(p: int, layers: int, m: int, folds: int,
               shares: tuple[int, ...] | None = None) -> tuple[tuple[HelixOp, ...], ...]:
    return tuple(rank_order(p, layers, m, folds, r, shares) for r in range(p))


def peer(op: HelixOp, p: int, layers: int, folds: int, shares: tuple[int, ...] | None = None) -> int | None:
    """Pipeline rank the output of ``op`` goes to (None at the ends of the chain)."""
    nxt = op.k + 1 if op.kind == FWD else op.k - 1
    if nxt < 0 or nxt > 2 * layers:
        return None
    return chain_rank(nxt, op.microbatch, p, folds, shares)


def source(op: HelixOp, p: int, layers: int, folds: int, shares: tuple[int, ...] | None = None) -> int | None:
    """Pipeline rank the input of ``op`` comes from (None: the data, or the loss)."""
    prev = op.k - 1 if op.kind == FWD else op.k + 1
    if prev < 0 or prev > 2 * layers:
        return None
    return chain_rank(prev, op.microbatch, p, folds, shares)


def in_flight(p: int, layers: int, m: int, folds: int, rank: int,
              shares: tuple[int, ...] | None = None) -> tuple[int, int]:
    """(most (block or attention) x micro-batch activations ``rank`` holds at once, most
    micro-batches whose logits it holds): from the order, forwards done minus backwards done."""
    held = peak = logits = peak_logits = 0
    last = 2 * layers
    for op in rank_order(p, layers, m, folds, rank, shares):
        step = 1 if op.kind == FWD else -1
        held += step
        peak = max(peak, held)
        if op.k == last:
            logits += step
            peak_logits = max(peak_logits, logits)
    return peak, peak_logits


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


def rank_times(ctx) -> HelixRankTimes:
    """Price the helix operations of the tensor-parallel group ``ctx`` (a ``cost.context.RankContext``)
    from the cost model's own block terms: the QKV projection moves to the attention's rank
    (transfer-weight); recomputation (``recompute="full"``: checkpoint without attention) adds the
    parameter blocks' forward and the QKV projection to backward, never the attention forward."""
    from autotune.cost import cpu as _cpu
    from autotune.cost import memory as M
    from autotune.cost import tensor_parallel as TP
    from autotune.cost.compute import head_compute, layer_compute

    s = ctx.step
    model, rates, cf = s.model, ctx.rates, ctx.cf
    h, kv, tp = model.hidden, model.kv_dim, s.tp
    _, full, scores = M.block_activations(ctx)
    lc = layer_compute(model, rates, tokens=ctx.tokens_local, tp=tp, heads_local=ctx.heads, keysum=ctx.keysum,
                       block_seq=ctx.tokens, blocks=ctx.ring, micro_batch=s.mbs, act_bytes=full - scores)
    qkv = rates.gemm_time(2.0 * ctx.tokens_local * h * (h + 2 * kv) / tp)
    attn_bytes = _attention_bytes(ctx)
    share = min(1.0, attn_bytes / max(full - scores, 1.0))
    elem_a, elem_p = lc.elem_fwd * share, lc.elem_fwd * (1.0 - share)
    keep = s.recompute == "full"
    a_f = cf * (qkv + lc.attn_fwd + elem_a)
    a_b = cf * (2.0 * qkv + lc.attn_bwd + 2.0 * elem_a + (qkv + elem_a if keep else 0.0))
    p_f = cf * (lc.gemm_fwd - qkv + elem_p)
    p_b = 2.0 * p_f + (p_f if keep else 0.0)
    tp1 = TP.block_comm(ctx)
    sync_f, sync_b = _cpu.sync_waits(ctx, cf * lc.fwd, cf * lc.bwd) if rates.cpu is not None else (0.0, 0.0)
    tpa_f, tpa_b = ATTENTION_TP_SHARE * (tp1 + sync_f), ATTENTION_TP_SHARE * (tp1 + sync_b)
    tpp_f, tpp_b = (1 - ATTENTION_TP_SHARE) * (tp1 + sync_f), (1 - ATTENTION_TP_SHARE) * (tp1 + sync_b)
    if keep:
        tpa_b += tpa_f
        tpp_b += tpp_f
    pre_f, pre_b = PRE_ATTENTION_ELEMENTWISE * cf * elem_p, 2.0 * PRE_ATTENTION_ELEMENTWISE * cf * elem_p
    emb = cf * rates.memory_time(ctx.hidden_bytes) + TP.embedding_comm(ctx)
    hf, hb = head_compute(model, rates, tokens=ctx.tokens_local, tp=tp)
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
    from autotune.cost import memory as M

    s = ctx.step
    model, p, L, tp, bpe = s.model, s.pp, model_layers(ctx), s.tp, s.bpe
    r = ctx.pp_index
    params = (L // p) * ctx.layer_params
    if r == 0:
        params += float(model.embedding_params()) + float(model.head_params())
    states = M.model_states(params / tp, s.dtype, s.zero, s.shard_n, ctx.layer_params / tp)
    _, full, scores = M.block_activations(ctx)
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
        logits_each = ctx.tokens_local * model.vocab / tp * (bpe + 4.0)
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


def plan_problems(plan, model) -> list[str]:
    """Why a helixpipe ``plan`` (resolved shares) cannot run ``model``: the schedule's shape rules
    and what its runtime does not compose with."""
    d = plan.degrees
    out = []
    if plan.virtual_stages != 1:
        out.append(f"virtual_stages: helixpipe places one-layer blocks itself, got virtual_stages({plan.virtual_stages})")
    if d.cp > 1 or d.hp > 1:
        out.append(f"degrees: helixpipe runs each attention whole on one rank; cp({d.cp}) and hp({d.hp}) must be 1")
    if plan.recompute == "selective":
        out.append("recompute: helixpipe keeps the attention output ('full' checkpoints the parameter blocks "
                   "without attention); 'selective' would recompute the attention it exists to keep")
    if plan.zero_stage > 1:  # its trainer drives autotune's own TrainOptimizer, not FSDP2
        out.append(f"zero_stage: the helixpipe runtime shards optimizer states only (ZeRO 0 or 1), "
                   f"got {plan.zero_stage}")
    layers = plan.shares.layers
    if layers is not None and len(set(layers)) > 1:
        out.append(f"shares.layers: helixpipe holds L/p layers on every rank, got {list(layers)}")
    counts = sorted({s_ // plan.micro_batch_size for s_ in plan.shares.samples or ()})
    for c in counts or [plan.num_microbatches or 0]:
        out += [x for x in problems(d.pp, model.layers, c, plan.helix_folds, plan.helix_attention) if x not in out]
    return out


# ---- the cost model's hooks ---------------------------------------------------------------------
def rank_cost(ctx, base):
    """``base`` (the chain schedules' ``cost.rank.RankCost`` of this tp group) with the helix's own
    per-micro-batch operation times, step terms and memory; the times ride along as ``helix``."""
    import dataclasses

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


def _helix_cost_class():
    import dataclasses

    from autotune.cost.rank import RankCost

    @dataclasses.dataclass(frozen=True)
    class HelixRankCost(RankCost):
        helix: HelixRankTimes | None = None
        helix_ctx: object = None

    return HelixRankCost


class _Lazy:
    """``HelixRankCost`` is made on first use (the cost model imports this module, not the reverse)."""

    cls = None

    def __call__(self, **kw):
        if _Lazy.cls is None:
            _Lazy.cls = _helix_cost_class()
        return _Lazy.cls(**kw)


HelixRankCost = _Lazy()


# ---- the schedule module (autotune/schedules/base.py) --------------------------------------------
class HelixPipe(Schedule):
    """HelixPipe as the registry sees it; configured per plan with its folds (``for_plan``)."""

    name = "helixpipe"
    summary = ("HelixPipe: attention-parallel pipeline, two-fold first-in-last-out order, recomputation "
               "without attention (Zhang et al. 2025, arXiv 2507.00394)")
    chain = False
    targets = {"megatron": "--attention-pipeline (HelixPipe's Megatron-LM fork)"}
    refusals = {
        "torchtitan": "schedule helixpipe: torchtitan's pipeline schedules run whole layers per stage; none "
                      "splits attention off the parameter blocks (HelixPipe needs its own fork of Megatron-LM)",
        "deepspeed": "schedule helixpipe: DeepSpeed's pipeline engine runs its own 1F1B schedule (TrainSchedule) "
                     "over whole layers, one stage per rank",
        "accelerate": "schedule helixpipe: Accelerate has no training pipeline schedule",
    }

    def __init__(self, folds: int = 1, layers: int | None = None, shares: tuple[int, ...] | None = None):
        self.folds, self.layers, self.shares = folds, layers, shares

    def for_plan(self, plan: Any) -> HelixPipe:
        layers = sum(plan.shares.layers) if plan.shares.layers is not None else None
        return HelixPipe(plan.helix_folds, layers, getattr(plan, "helix_attention", None))

    def options(self) -> tuple[Any, ...]:
        return (self.folds, self.layers, self.shares)

    def min_microbatches(self, pp: int, virtual_stages: int) -> int:
        return pp * self.folds

    def microbatch_multiple(self, pp: int, virtual_stages: int) -> int:
        return pp * self.folds

    def check_shape(self, pp: int, virtual_stages: int) -> list[str]:
        return []  # check_plan says it all (plan_problems: it needs the model's layers)

    def check_microbatches(self, pp: int, virtual_stages: int, counts: Sequence[int]) -> list[str]:
        return []

    def check_plan(self, plan: Any, model: Any) -> list[str]:
        return plan_problems(plan, model)

    def op_order(self, pp: int, virtual_stages: int, m: int, rank: int) -> tuple[Op, ...]:
        """``rank_order`` as ``Op``: ``stage`` is the chain position k (2j block j, 2i+1 attention i)."""
        if self.layers is None:
            raise ValueError("helixpipe's order needs the layer count: configure it with for_plan(resolved plan)")
        return tuple(Op(F if o.kind == FWD else B, o.k, o.microbatch)
                     for o in rank_order(pp, self.layers, m, self.folds, rank, self.shares))

    def in_flight(self, pp: int, virtual_stages: int, m: int, rank: int,
                  layers: tuple[int, ...]) -> tuple[int, int]:
        """(layer-micro-batches held: every micro-batch's L/p layers, first in last out; logits held)."""
        L = self.layers if self.layers is not None else sum(layers) * pp
        held, logits = in_flight(pp, L, m, self.folds, rank, self.shares)
        n_attn = sum(1 for k in range(1, 2 * L + 1, 2) if chain_rank(k, 0, pp, self.folds, self.shares) == rank)
        return m * n_attn, logits

    def simulate(self, pp, virtual_stages, m, fwd, bwd, p2p, wgt=None):
        raise NotImplementedError("helixpipe prices itself from each rank's operation times and the link matrix "
                                  "(price_rank, simulate_replicas): its data flow is no chain of stages")

    # the cost model's and the runtime's hooks for a schedule whose data flow is not a chain
    def price_rank(self, ctx: Any, base: Any) -> Any:
        return rank_cost(ctx, base)

    def simulate_replicas(self, step: Any, per_rep_stage: Any) -> list[HelixSimulation]:
        return simulate_replicas(step, per_rep_stage)

    def build_trainer(self, plan: Any, spec: Any, mesh: Any, seq_len: int, global_batch: int, seed: int,
                      data: Any = None, documents: Any = None) -> Any:
        from autotune.runtime.helix import HelixTrainer

        return HelixTrainer(plan, spec, mesh, seq_len, global_batch, seed, data=data, documents=documents)
