"""Uneven Ulysses (DeepSpeed-Ulysses, Jacobs et al. 2023): all-to-all between token and head shards.

Inside one CP shard the hp ranks hold even token slices of every segment of the shard and all heads
of their tp rank. ``tokens_to_heads`` sends each rank the heads it owns for every token slice, so a
rank ends with the whole shard (segments in position order) for its ``hp_heads[h]`` query heads;
``heads_to_tokens`` is the inverse. q, k and v go together in one all-to-all (a third of the
collectives' latency). Both are ``all_to_all_single`` with split sizes along the head
dimension (uneven heads per rank; gloo and NCCL take unequal splits) in a small autograd Function
whose backward is the reverse all-to-all (what the deprecated
``torch.distributed.nn.functional.all_to_all_single`` does). It calls ``dist.all_to_all_single``
through the module attribute, so the runtime's communication timing (which wraps ``dist``'s
functions) sees it.

GQA: query head g uses kv head ``g // rep`` (``rep = heads / kv_heads``). An hp rank gets every kv
head its query heads use; a kv head whose query group is cut between two ranks is sent to both
(replicated), and autograd sums its two gradients on the way back (the slices of one source tensor).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def kv_head_range(hp_heads: tuple[int, ...] | list[int], heads: int, kv_heads: int, r: int) -> tuple[int, int]:
    """``[lo, hi)`` of the kv heads used by hp rank r's query heads."""
    rep = heads // kv_heads
    first = sum(hp_heads[:r])
    last = first + hp_heads[r] - 1
    return first // rep, last // rep + 1


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0; backward sends the gradients back with the splits swapped."""

    @staticmethod
    def forward(ctx, send, in_splits, out_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = send.new_empty((sum(out_splits), *send.shape[1:]))
        dist.all_to_all_single(out, send.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _a2a(send: torch.Tensor, in_splits: list[int], out_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single along dim 0 with autograd."""
    return _AllToAll.apply(send, list(in_splits), list(out_splits), group)


def tokens_to_heads(xs: list[torch.Tensor], ctx, ranges: list[list[tuple[int, int]]], nseg: int
                    ) -> list[torch.Tensor]:
    """Each ``xs[i]`` ``[B, H_i, s, D]`` (this rank's token slices, all its heads) -> ``[B, h_i, T, D]``
    (the shard's T tokens in position order, heads ``ranges[i][me]``), all in ONE all-to-all (q, k
    and v travel together). ``ranges[i][r]`` are the heads of ``xs[i]`` that rank r receives; kv ranges
    may overlap (a replicated kv head)."""
    b, _, s, d = xs[0].shape
    hp, me = ctx.hp, ctx.hp_index
    xts = [x.permute(1, 0, 2, 3) for x in xs]  # heads first: all_to_all_single splits dim 0
    send = torch.cat([xt[lo:hi] for r in range(hp) for xt, rng in zip(xts, ranges, strict=True)
                      for lo, hi in [rng[r]]])
    in_splits = [sum(rng[r][1] - rng[r][0] for rng in ranges) for r in range(hp)]
    mine = [rng[me][1] - rng[me][0] for rng in ranges]
    y = _a2a(send, in_splits, [sum(mine)] * hp, ctx.hp_group)
    # received: per source rank r its sub-segment r of every segment -> segment-major, then rank
    sub = s // nseg
    y = y.view(hp, sum(mine), b, nseg, sub, d)
    return [part.permute(2, 1, 3, 0, 4, 5).reshape(b, n, nseg * hp * sub, d)
            for part, n in zip(torch.split(y, mine, dim=1), mine, strict=True)]


def heads_to_tokens(o: torch.Tensor, ctx, nseg: int) -> torch.Tensor:
    """Inverse of ``tokens_to_heads`` for the query heads: ``[B, hp_heads[me], T, D]`` -> ``[B, H, s, D]``."""
    b, mine, t, d = o.shape
    hp = ctx.hp
    sub = t // (nseg * hp)
    send = o.reshape(b, mine, nseg, hp, sub, d).permute(3, 1, 0, 2, 4, 5).reshape(hp * mine, b, nseg * sub, d)
    y = _a2a(send, [mine] * hp, list(ctx.hp_heads), ctx.hp_group)
    return y.permute(1, 0, 2, 3)
