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

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

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


def attention_rank(i: int, offset: int, p: int) -> int:
    """Pipeline rank of layer ``i``'s attention (0-based) for a micro-batch at ``offset``."""
    return (i + 1 + offset) % p


def offset_of(mb: int, p: int, folds: int) -> int:
    """Offset ``d`` of micro-batch ``mb`` in its group (micro-batches are numbered group-major,
    then offset, then fold: ``mb = (g * p + d) * F + f``)."""
    return (mb // folds) % p


def chain_rank(k: int, mb: int, p: int, folds: int) -> int:
    """Pipeline rank of chain position ``k`` of micro-batch ``mb``."""
    if k % 2 == 0:
        return block_rank(k // 2, p)
    return attention_rank(k // 2, offset_of(mb, p, folds), p)


def is_block(k: int) -> bool:
    return k % 2 == 0


def blocks_of_rank(rank: int, p: int, layers: int) -> tuple[int, ...]:
    """Parameter blocks ``j`` held by pipeline rank ``rank`` (rank 0: 0, p, ..., L)."""
    return tuple(j for j in range(layers + 1) if block_rank(j, p) == rank)


def problems(p: int, layers: int, m: int, folds: int) -> list[str]:
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
    return out


# ---- order --------------------------------------------------------------------------------------
@lru_cache(maxsize=1024)
def rank_order(p: int, layers: int, m: int, folds: int, rank: int) -> tuple[HelixOp, ...]:
    """Operations of pipeline rank ``rank`` in the order it runs them (see the module docstring)."""
    bad = problems(p, layers, m, folds)
    if bad:
        raise ValueError("; ".join(bad))
    group = p * folds
    keyed = []
    for mb in range(m):
        g, d, f = mb // group, offset_of(mb, p, folds), mb % folds
        for k in range(2 * layers + 1):
            if chain_rank(k, mb, p, folds) == rank:
                keyed.append(((g, d + k, f), k, mb))
    keyed.sort()
    fwd = [HelixOp(FWD, k, mb) for _, k, mb in keyed]
    return tuple(fwd) + tuple(HelixOp(BWD, op.k, op.microbatch) for op in reversed(fwd))


def all_orders(p: int, layers: int, m: int, folds: int) -> tuple[tuple[HelixOp, ...], ...]:
    return tuple(rank_order(p, layers, m, folds, r) for r in range(p))


def peer(op: HelixOp, p: int, layers: int, folds: int) -> int | None:
    """Pipeline rank the output of ``op`` goes to (None at the ends of the chain)."""
    nxt = op.k + 1 if op.kind == FWD else op.k - 1
    if nxt < 0 or nxt > 2 * layers:
        return None
    return chain_rank(nxt, op.microbatch, p, folds)


def source(op: HelixOp, p: int, layers: int, folds: int) -> int | None:
    """Pipeline rank the input of ``op`` comes from (None: the data, or the loss)."""
    prev = op.k - 1 if op.kind == FWD else op.k + 1
    if prev < 0 or prev > 2 * layers:
        return None
    return chain_rank(prev, op.microbatch, p, folds)


def in_flight(p: int, layers: int, m: int, folds: int, rank: int) -> tuple[int, int]:
    """(most (block or attention) x micro-batch activations ``rank`` holds at once, most
    micro-batches whose logits it holds): from the order, forwards done minus backwards done."""
    held = peak = logits = peak_logits = 0
    last = 2 * layers
    for op in rank_order(p, layers, m, folds, rank):
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
    fwd: tuple[tuple[float, ...], ...]
    bwd: tuple[tuple[float, ...], ...]
    hops: tuple[tuple[tuple[float, ...], ...], ...]
    rank_finish: list[float]
    rank_busy: list[float]
    makespan: float = 0.0

    def bubble_fraction(self, s: int) -> float:
        span = self.makespan
        return (span - self.rank_busy[s]) / span if span > 0 else 0.0

    def hop_time(self, k_from: int, kind: int, src: int, dst: int) -> float:
        """Seconds to move chain position ``k_from``'s output (FWD) or input gradient (BWD)."""
        edge = k_from if kind == FWD else k_from - 1  # the edge between chain positions e and e+1
        return self.hops[edge % 2][src][dst] if src != dst else 0.0

    def events(self, ranks: list[int] | None = None) -> list[dict]:
        """Gantt events per pipeline rank (the dashboard's shape; ``chunk`` = chain position,
        ``part`` = block | attention, comm events for every hop that leaves the rank)."""
        out: list[dict] = []
        p, L, m, F = self.p, self.layers, self.m, self.folds
        for s in range(p):
            rank = ranks[s] if ranks else s
            t = 0.0
            for op in rank_order(p, L, m, F, s):
                k, i = op.k, op.microbatch
                if op.kind == FWD:
                    end, dur = self.f_end[i][k], self.fwd[k][s]
                else:
                    end, dur = self.b_end[i][k], self.bwd[k][s]
                start = end - dur
                if start > t + 1e-15:
                    out.append({"stage": s, "rank": rank, "kind": "bubble", "microbatch": None, "start": t,
                                "end": start})
                out.append({"stage": s, "rank": rank, "kind": "fwd" if op.kind == FWD else "bwd",
                            "microbatch": i, "chunk": k, "part": "block" if is_block(k) else "attention",
                            "start": start, "end": end})
                dst = peer(op, p, L, F)
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
             bwd: tuple[tuple[float, ...], ...], hops: tuple[tuple[tuple[float, ...], ...], ...]) -> HelixSimulation:
    """Time ``rank_order`` on every rank: an operation starts when its rank is free and its input
    has arrived (the producer's end plus the hop between the two ranks it really joins).

    ``fwd[k][r]`` / ``bwd[k][r]``: seconds of chain position ``k`` (``2L + 1`` entries) when it runs
    on pipeline rank ``r`` (a mixed cluster prices each rank's device); ``hops[t][src][dst]``:
    seconds to move one micro-batch's hop from ``src`` to ``dst``, ``t = 0`` for block -> attention
    (and its gradient back), ``t = 1`` for attention -> block (and back)."""
    n = 2 * layers + 1
    f_end = [[-1.0] * n for _ in range(m)]
    b_end = [[-1.0] * n for _ in range(m)]
    orders = all_orders(p, layers, m, folds)
    ranks_of = [[chain_rank(k, mb, p, folds) for k in range(n)] for mb in range(min(m, p * folds))]
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
    return HelixSimulation(p=p, layers=layers, m=m, folds=folds, f_end=f_end, b_end=b_end, fwd=fwd, bwd=bwd,
                           hops=hops, rank_finish=free, rank_busy=busy, makespan=max(free))


@lru_cache(maxsize=512)
def simulate_cached(p: int, layers: int, m: int, folds: int, fwd: tuple[tuple[float, ...], ...],
                    bwd: tuple[tuple[float, ...], ...],
                    hops: tuple[tuple[tuple[float, ...], ...], ...]) -> HelixSimulation:
    return simulate(p, layers, m, folds, fwd, bwd, hops)
