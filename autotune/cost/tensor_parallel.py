"""Tensor parallelism (Megatron, Shoeybi et al. 2019): the collectives of one rank's tp group.

Per block and micro-batch Megatron's f/g operators all-reduce the block's activation twice forward
(after attention and after the MLP) and twice backward; with sequence parallelism each all-reduce
becomes an all-gather plus a reduce-scatter of the same bytes (Korthikanti et al. 2022, section
4.2.2). They are not overlapped with compute, as in Megatron. The vocab-parallel embedding reduces
its output once (an all-reduce, a reduce-scatter with sequence parallelism). A tp group sits inside
one node (Plan validation), so its link is the node's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autotune.cost.context import RankContext



def block_comm(ctx: RankContext) -> float:
    """Seconds of one block's tp collectives for one micro-batch, forward (backward the same)."""
    tp = ctx.step.tp
    if tp <= 1:
        return 0.0
    K, link, act = ctx.collectives, ctx.links.tp, ctx.hidden_bytes
    one = K.all_gather(link, tp, act) + K.reduce_scatter(link, tp, act) if ctx.step.sp else K.all_reduce(
        link, tp, act)
    return 2.0 * one * ctx.mf


def embedding_comm(ctx: RankContext) -> float:
    """Seconds of the vocab-parallel embedding's reduction (first model chunk, forward)."""
    tp = ctx.step.tp
    if tp <= 1:
        return 0.0
    K, link, act = ctx.collectives, ctx.links.tp, ctx.hidden_bytes
    return K.reduce_scatter(link, tp, act) * ctx.mf if ctx.step.sp else K.all_reduce(link, tp, act) * ctx.mf
