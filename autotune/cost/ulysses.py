"""Ulysses head parallelism (Jacobs et al. 2023, DeepSpeed-Ulysses): all-to-alls around attention.

Outside attention each of the hp ranks of a CP shard holds ``tokens / hp`` of its tokens for all of
its tp rank's heads; before attention an all-to-all sends Q, K and V so that each rank holds all of
the shard's tokens for its own heads (``shares.heads``, possibly uneven), and after attention one
all-to-all brings the context back. An uneven head split paces the exchange: the busiest rank sends
its tokens of the others' heads or receives the others' tokens of its own heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autotune.cost.context import RankContext



def busiest_heads(hp: int, heads: Sequence[int], heads_tp: int) -> int:
    """Heads' worth of tokens the busiest rank of an hp group sends or receives (0 without hp)."""
    return max((hp - 1) * max(heads), heads_tp - min(heads)) if hp > 1 else 0


def block_comm(ctx: RankContext) -> float:
    """Seconds of one block's all-to-alls for one micro-batch, forward (backward the same): Q, K, V
    (K and V at the kv width) to head shards before attention, the context back after it."""
    s = ctx.step
    if s.hp <= 1:
        return 0.0
    K, link = ctx.collectives, ctx.links.hp
    unit = s.bpe * ctx.tokens_local * s.model.head_dim * s.a2a_heads
    return ctx.mf * (K.all_to_all(link, s.hp, unit * (1.0 + 2.0 * s.kv_ratio)) + K.all_to_all(link, s.hp, unit))
