"""Context parallelism (ring attention, Liu et al. 2023; Megatron-CP): K/V passes around the ring.

Each of the cp ranks holds one shard of the sequence (``shares.tokens``; zigzag pairs a front chunk
with its mirror so causal work balances). Attention runs cp - 1 ring passes: each rank sends the K
and V it holds to the next while computing attention against the block it already received, so a
pass is exposed only beyond the attention it hides behind (the largest shard's K/V paces the ring).
Backward passes K, V and the partial dK, dV (twice the bytes). The attention work itself is priced
in ``compute.py`` from each shard's causal (query, key) pairs (``compute.causal_keys``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.cost.compute import LayerCompute

if TYPE_CHECKING:
    from autotune.cost.context import RankContext


def ring_comm(ctx: RankContext, lc: LayerCompute) -> tuple[float, float, float, float]:
    """(forward, backward) seconds of one block's ring passes for one micro-batch, then the parts of
    them not hidden behind the block's attention: ``(raw_f, raw_b, exposed_f, exposed_b)``."""
    s = ctx.step
    cp = s.cp
    if cp <= 1:
        return 0.0, 0.0, 0.0, 0.0
    K, link, mf, cf = ctx.collectives, ctx.links.cp, ctx.mf, ctx.cf
    kv_bytes = s.bpe * s.mbs * s.cp_max_tokens * 2.0 * s.model.head_dim * ctx.heads * s.kv_ratio
    pass_f, pass_b = mf * K.p2p(link, kv_bytes), mf * K.p2p(link, 2.0 * kv_bytes)
    return ((cp - 1) * pass_f, (cp - 1) * pass_b,
            (cp - 1) * max(0.0, pass_f - cf * lc.attn_fwd / cp), (cp - 1) * max(0.0, pass_b - cf * lc.attn_bwd / cp))
