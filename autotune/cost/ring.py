"""The blocks a context-parallel rank's ring attention computes, the runtime's rule
(``autotune/runtime/ring_attention.py:_pairs``): priced one kernel call each on CPU (``cpu.py``)
and one materialised square each on an unprofiled GPU (``datasheet.SizeModel.attention``), so it
sits apart from both device models."""

from __future__ import annotations


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


def ring_blocks(tokens: tuple[int, ...], index: int, zigzag: bool, seq_len: int) -> tuple[tuple[int, int, bool], ...]:
    """The attention blocks CP rank ``index`` computes over one ring turn: ``(query length, key
    length, causal)`` for every (own query segment, key segment of any rank) pair with a visible key,
    the rule of ``autotune/runtime/ring_attention.py:_pairs`` over the segments of
    ``autotune/runtime/attention.py:shard_segments`` (zigzag: a front and a mirrored back segment)."""
    segs = segments(tokens, zigzag, seq_len)
    out = []
    for qs, ql in segs[index]:
        for ksegs in segs:
            for ks, kl in ksegs:
                if ql and kl and ks < qs + ql:
                    out.append((ql, kl, not (ks + kl <= qs + 1)))
    return tuple(out)
