"""The blocks a context-parallel rank's ring attention computes, the runtime's rule
(``autotune/runtime/ring_attention.py:_pairs``): priced one kernel call each on CPU (``cpu.py``)
and one materialised square each on an unprofiled GPU (``datasheet.SizeModel.attention``), so it
sits apart from both device models."""

from __future__ import annotations

from functools import lru_cache


def segments(tokens: tuple[int, ...], zigzag: bool, seq_len: int) -> list[list[tuple[int, int]]]:
    """Each CP rank's ``(start, length)`` segments (``runtime/attention.py:shard_segments``)."""
    out, a = [], 0
    for t in tokens:
        if zigzag and len(tokens) > 1:
            f = t // 2
            out.append([(a, f), (seq_len - a - f, f)])
            a += f
        else:
            out.append([(a, t)])
            a += t
    return out


@lru_cache(maxsize=4096)
def ring_blocks(tokens: tuple[int, ...], index: int, zigzag: bool, seq_len: int) -> tuple[tuple[int, int, bool], ...]:
    """The attention blocks CP rank ``index`` computes over one ring turn: ``(query length, key
    length, causal)`` for every (own query segment, key segment of any rank) pair with a visible key,
    the rule of ``autotune/runtime/ring_attention.py:_pairs`` over the segments of
    ``autotune/runtime/attention.py:shard_segments`` (zigzag: a front and a mirrored back segment).
    Memoised (an immutable answer of hashable arguments): every estimate of a CP layout asks it
    for each shard, O(cp^2) pairs each (measured: 6% of a 128-device search, where cp reaches 32)."""
    segs = segments(tokens, zigzag, seq_len)
    out = []
    for qs, ql in segs[index]:
        for ksegs in segs:
            for ks, kl in ksegs:
                if ql and kl and ks < qs + ql:
                    out.append((ql, kl, not (ks + kl <= qs + 1)))
    return tuple(out)
