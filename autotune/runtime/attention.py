"""Sharded causal attention for the runtime: Ulysses (hp) inside a CP shard, the ring (cp) across shards.

Entry points: ``AttentionContext`` (built by the runtime from the Plan and its groups),
``local_token_positions(ctx)`` (which global positions this rank holds) and
``sharded_attention(q, k, v, ctx)``.

Token layout (fixes what ``autotune/plan.py`` calls ``shares.tokens`` / ``cp_layout``). The
sequence has ``S = sum(cp_tokens)`` positions and ``C = len(cp_tokens)`` CP ranks.

* ``contiguous``: CP rank i holds one *segment*, positions ``[o_i, o_i + t_i)`` with
  ``o_i = t_0 + ... + t_{i-1}``.
* ``zigzag`` (load-balanced causal, as Megatron-CP / ring-flash-attn's zigzag, generalised to uneven
  shares): rank i holds two segments of ``f_i = t_i / 2`` tokens each. The *front* segments fill
  ``[0, S/2)`` in rank order (rank 0 first) and the *back* segments fill ``[S/2, S)`` in reverse rank
  order counted from the end (rank 0 holds the last ``f_0`` positions)::

      front_i = [F_i, F_i + f_i)            F_i = f_0 + ... + f_{i-1}
      back_i  = [S - F_i - f_i, S - F_i)

  so with even shares rank i holds chunks i and 2C-1-i of 2C equal chunks. ``t_i`` must be even.
  With ``C == 1`` the layout is irrelevant: the one shard is the whole sequence.
* Ulysses inside a shard: each of the shard's segments is split evenly over the hp ranks, hp rank h
  takes sub-segment h of every segment (so each hp rank's tokens stay position-ordered and, with
  zigzag, keep the balanced front/back pairing). Each segment length must divide by hp.

A rank's local tokens are its sub-segments in segment order (front then back): increasing
positions. After the Ulysses all-to-all (``ulysses.py``) a rank holds the whole shard (segments in
order) for its ``hp_heads[h]`` query heads; the ring (``ring_attention.py``) then runs over the CP
group of ranks that share this hp index, hence hold the same heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

CP_LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True, kw_only=True)
class AttentionContext:
    """This rank's view of the CP x HP attention sharding (groups are None when the degree is 1)."""

    cp_group: Any = None
    """Process group of the CP ring (ranks with the same hp index and other coordinates)."""
    cp_ranks: tuple[int, ...] = (0,)
    """Global ranks of the CP group in cp index order (peers for point-to-point)."""
    cp_index: int = 0
    """This rank's index in the CP group."""
    cp_tokens: tuple[int, ...] = ()
    """Tokens per CP rank (``shares.tokens``), summing to the sequence length."""
    cp_layout: str = "zigzag"
    """``zigzag`` or ``contiguous`` (see the module docstring for the positions)."""
    hp_group: Any = None
    """Process group of the Ulysses all-to-all (ranks of one CP shard)."""
    hp_ranks: tuple[int, ...] = (0,)
    """Global ranks of the HP group in hp index order."""
    hp_index: int = 0
    """This rank's index in the HP group."""
    hp_heads: tuple[int, ...] = ()
    """Query heads per HP rank (``shares.heads``), summing to the heads of one tp rank."""
    heads: int | None = None
    """Query heads of one tp rank (default: ``sum(hp_heads)``)."""
    kv_heads: int | None = None
    """KV heads of one tp rank (default: taken from ``k`` at call time)."""
    seq_len: int | None = None
    """Whole sequence length (default: ``sum(cp_tokens)``)."""

    def __post_init__(self) -> None:
        # the runtime may pass lists; keep the frozen dataclass hashable-ish and immutable
        for name in ("cp_ranks", "cp_tokens", "hp_ranks", "hp_heads"):
            object.__setattr__(self, name, tuple(int(x) for x in getattr(self, name)))
        cp, hp = len(self.cp_ranks), len(self.hp_ranks)
        if len(self.cp_tokens) != cp:
            raise ValueError(f"cp_tokens has {len(self.cp_tokens)} entries, cp_ranks {cp}")
        if len(self.hp_heads) != hp:
            raise ValueError(f"hp_heads has {len(self.hp_heads)} entries, hp_ranks {hp}")
        if not 0 <= self.cp_index < cp or not 0 <= self.hp_index < hp:
            raise ValueError(f"cp_index {self.cp_index} / hp_index {self.hp_index} outside cp={cp}, hp={hp}")
        if self.cp_layout not in CP_LAYOUTS:
            raise ValueError(f"cp_layout must be zigzag or contiguous, got {self.cp_layout!r}")
        if min(self.hp_heads) < 1:
            raise ValueError(f"every hp rank needs at least one head, got hp_heads={list(self.hp_heads)}")
        if min(self.cp_tokens) < 1:
            raise ValueError(f"every cp rank needs at least one token, got cp_tokens={list(self.cp_tokens)}")
        if self.heads is None:
            object.__setattr__(self, "heads", sum(self.hp_heads))
        elif sum(self.hp_heads) != self.heads:
            raise ValueError(f"hp_heads {list(self.hp_heads)} sum to {sum(self.hp_heads)}, not heads={self.heads}")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.seq_len is None:
            object.__setattr__(self, "seq_len", sum(self.cp_tokens))
        elif sum(self.cp_tokens) != self.seq_len:
            raise ValueError(f"cp_tokens {list(self.cp_tokens)} sum to {sum(self.cp_tokens)}, not seq_len={self.seq_len}")
        for i, segs in enumerate(shard_segments(self.cp_tokens, self.cp_layout)):
            for _, length in segs:
                if length % hp:
                    raise ValueError(f"cp rank {i}: a segment of {length} tokens does not split over hp={hp} ranks"
                                     f" (cp_tokens={list(self.cp_tokens)}, layout {self.layout})")

    @property
    def cp(self) -> int:
        return len(self.cp_ranks)

    @property
    def hp(self) -> int:
        return len(self.hp_ranks)

    @property
    def layout(self) -> str:
        """The effective layout: one shard has a single contiguous segment whatever cp_layout says."""
        return self.cp_layout if self.cp > 1 else "contiguous"


def shard_segments(cp_tokens: tuple[int, ...] | list[int], layout: str) -> list[list[tuple[int, int]]]:
    """Per CP rank, its ``(start, length)`` position segments in held order (module docstring)."""
    tokens = [int(t) for t in cp_tokens]
    if len(tokens) == 1 or layout == "contiguous":
        out, start = [], 0
        for t in tokens:
            out.append([(start, t)])
            start += t
        return out
    if layout != "zigzag":
        raise ValueError(f"cp_layout must be zigzag or contiguous, got {layout!r}")
    odd = [t for t in tokens if t % 2]
    if odd:
        raise ValueError(f"zigzag needs an even token share on every cp rank, got cp_tokens={tokens}")
    total = sum(tokens)
    out, front = [], 0
    for t in tokens:
        f = t // 2
        out.append([(front, f), (total - front - f, f)])
        front += f
    return out


def local_segments(ctx: AttentionContext) -> list[tuple[int, int]]:
    """This rank's sub-segments: hp rank h takes the h-th even part of every segment of its shard."""
    hp, h = ctx.hp, ctx.hp_index
    segs = shard_segments(ctx.cp_tokens, ctx.layout)[ctx.cp_index]
    return [(start + h * (length // hp), length // hp) for start, length in segs]


def local_token_positions(ctx: AttentionContext, seq_len: int | None = None) -> torch.LongTensor:
    """Global positions of this rank's local tokens, sorted as held (increasing)."""
    if seq_len is not None and seq_len != ctx.seq_len:
        raise ValueError(f"seq_len {seq_len} != the context's {ctx.seq_len} (sum of cp_tokens)")
    parts = [torch.arange(s, s + n, dtype=torch.long) for s, n in local_segments(ctx)]
    return torch.cat(parts)


def gqa_index(heads: int, kv_heads: int, first: int, count: int, kv_first: int, device: torch.device) -> torch.Tensor:
    """Local kv head for each of query heads ``first .. first+count-1`` (query head g uses kv head
    ``g // (heads / kv_heads)``, the grouping of ``repeat_interleave`` in the model), where the local
    kv heads start at global kv head ``kv_first``."""
    rep = heads // kv_heads
    return torch.arange(first, first + count, device=device) // rep - kv_first


def window_mask(seq: int, window: int, device: torch.device) -> torch.Tensor:
    """SDPA's boolean mask (True: attend) of a causal sliding window: key j for query i where
    0 <= i - j < window (Megatron's ``get_sliding_window_causal_mask`` with ``(window - 1, 0)``,
    negated: its True masks out)."""
    i = torch.arange(seq, device=device)
    gap = i[:, None] - i[None, :]
    return (gap >= 0) & (gap < window)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
    """Causal SDPA over a whole sequence, through a sliding-window mask where ``window`` is set and
    shorter than the sequence (a window that covers it is the causal mask)."""
    s = q.shape[2]
    if window and window < s:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(s, window, q.device))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sharded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext,
                      docs=None, window: int = 0) -> torch.Tensor:
    """Causal attention over global positions on this rank's tokens (``docs``: each row's document
    lengths over the whole window, ``documents.Docs``, when attention stops at document boundaries;
    every rank has them, so the ring and the all-to-all carry nothing extra; ``window``: a sliding-window
    layer's, run where the shard is the whole sequence, cp 1: the ring refuses it).

    q ``[B, heads, S_local, D]``, k/v ``[B, kv_heads, S_local, D]``; returns ``[B, heads, S_local, D]``.
    Ulysses (all-to-all over hp) turns the shard's token slices into head slices, the ring over cp
    attends across shards, Ulysses turns the result back.
    """
    from autotune.runtime.ring_attention import ring_attention
    from autotune.runtime.ulysses import heads_to_tokens, kv_head_range, tokens_to_heads

    _, heads, s_local, _ = q.shape
    kv_heads = k.shape[1]
    expect = sum(n for _, n in local_segments(ctx))
    if heads != ctx.heads or s_local != expect or k.shape != v.shape or k.shape[2] != s_local:
        raise ValueError(f"sharded_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not"
                         f" fit the context (heads={ctx.heads}, local tokens={expect})")
    if heads % kv_heads or (ctx.kv_heads is not None and kv_heads != ctx.kv_heads):
        raise ValueError(f"sharded_attention: {kv_heads} kv heads do not fit {heads} query heads"
                         f" (context kv_heads={ctx.kv_heads})")
    h = ctx.hp_index
    first = sum(ctx.hp_heads[:h])
    kv_ranges = [kv_head_range(ctx.hp_heads, heads, kv_heads, r) for r in range(ctx.hp)]
    nseg = len(local_segments(ctx))
    if ctx.hp > 1:  # Ulysses: token slices of all heads -> the whole shard of this rank's heads
        q_ranges = [(sum(ctx.hp_heads[:r]), sum(ctx.hp_heads[:r + 1])) for r in range(ctx.hp)]
        q, k, v = tokens_to_heads([q, k, v], ctx, [q_ranges, kv_ranges, kv_ranges], nseg)
    # GQA: the local kv head of each local query head (kv heads start at kv_ranges[h][0] after Ulysses)
    index = gqa_index(heads, kv_heads, first, ctx.hp_heads[h], kv_ranges[h][0] if ctx.hp > 1 else 0, q.device)
    if window and (ctx.cp > 1 or docs is not None):  # trial.check_runtime_support refuses these first
        raise ValueError("sharded_attention: a sliding window runs with cp 1 and no documents")
    if ctx.cp > 1:
        segs = shard_segments(ctx.cp_tokens, ctx.layout)
        o = ring_attention(q, k, v, index, segs, ctx.cp_index, ctx.cp_group, ctx.cp_ranks, docs)
    elif docs is not None:  # the whole sequence, one causal kernel per document
        from autotune.runtime.documents import doc_attention

        o = doc_attention(q, k.index_select(1, index), v.index_select(1, index), docs)
    else:  # the whole sequence is in this shard: plain causal SDPA on this rank's heads
        o = causal_sdpa(q, k.index_select(1, index), v.index_select(1, index), window)
    if ctx.hp > 1:
        o = heads_to_tokens(o, ctx, nseg)
    return o
