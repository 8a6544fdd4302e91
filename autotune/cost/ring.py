"""The blocks a context-parallel rank's ring attention computes, the runtime's rule
(``autotune/runtime/ring_attention.py:_pairs``): priced one kernel call each on CPU (``cpu.py``)
and one materialised square each on an unprofiled GPU (``datasheet.SizeModel.attention``), so it
sits apart from both device models."""

from __future__ import annotations

from functools import lru_cache
from typing import Any


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


@lru_cache(maxsize=8192)
def ring_blocks(tokens: tuple[int, ...], index: int, zigzag: bool, seq_len: int) -> tuple[tuple[int, int, bool], ...]:
    """The attention blocks CP rank ``index`` computes over one ring turn: ``(query length, key
    length, causal)`` for every (own query segment, key segment of any rank) pair with a visible key,
    the rule of ``autotune/runtime/ring_attention.py:_pairs`` over the segments of
    ``autotune/runtime/attention.py:shard_segments`` (zigzag: a front and a mirrored back segment).
    Memoised (an immutable answer of hashable arguments): every estimate of a CP layout asks it
    for each shard, O(cp) key segments each, and the segments once per layout (``_layout``):
    measured 6% of a 128-device search and a third of a 1,024-device one's estimates, where cp
    reaches 1,024. Equal blocks are one tuple object (``_BLOCKS``: a layout has few distinct
    lengths), so a cached shard costs a pointer per block: a search at 1,024 devices revisits a
    few dozen layouts up to cp = 1,024 (2.1 million blocks with zigzag), 8,192 shards."""
    own, keys = _layout(tokens, zigzag, seq_len)
    out: list[tuple[int, int, bool]] = []
    intern = _BLOCKS.setdefault
    arrays = _key_arrays(keys) if len(keys) > _NUMPY_KEYS else None
    for qs, ql in own[index]:
        if ql:  # a key is visible when it starts before the query segment ends; causal unless all before it
            end, first = qs + ql, qs + 1
            if arrays is None:
                blocks = [(ql, kl, ks + kl > first) for ks, kl in keys if ks < end]
                out += map(intern, blocks, blocks)
            else:
                out += _visible(arrays, ql, end, first)
    if len(_BLOCKS) > 100_000:
        _BLOCKS.clear()
    return tuple(out)


def _visible(arrays: tuple[Any, Any], ql: int, end: int, first: int) -> list[tuple[int, int, bool]]:
    """``ring_blocks``' blocks of one query segment (length ``ql``, ending at ``end``, its first key
    ``first``) over many key segments, in the same order and of the same values and types: the
    visibility and causality compared over arrays, and each distinct (key length, causal) one
    interned tuple (``_BLOCKS``), given to every block that has it."""
    import numpy as np

    ks_a, kl_a = arrays
    seen = ks_a < end
    kl_v = kl_a[seen]
    code = kl_v * 2 + (ks_a[seen] + kl_v > first)  # (key length, causal) as one int: kl > 0
    distinct, which = np.unique(code, return_inverse=True)
    intern = _BLOCKS.setdefault
    objs = [intern(b, b) for b in ((ql, x // 2, x % 2 == 1) for x in distinct.tolist())]
    return list(map(objs.__getitem__, which.tolist()))


_NUMPY_KEYS = 64
"""Key segments above which ``ring_blocks`` compares them with numpy (below, the calls cost more)."""


@lru_cache(maxsize=64)
def _key_arrays(keys: tuple[tuple[int, int], ...]) -> tuple[Any, Any]:
    """(start, length) of every key segment as two int64 arrays (``ring_blocks``' numpy path)."""
    import numpy as np

    a = np.asarray(keys, dtype=np.int64).reshape(-1, 2)
    return a[:, 0], a[:, 1]


_BLOCKS: dict[tuple[int, int, bool], tuple[int, int, bool]] = {}
"""One object per distinct block (``ring_blocks``)."""


@lru_cache(maxsize=256)
def _layout(tokens: tuple[int, ...], zigzag: bool, seq_len: int
            ) -> tuple[tuple[tuple[tuple[int, int], ...], ...], tuple[tuple[int, int], ...]]:
    """(each CP rank's segments, every non-empty key segment in rank order): ``segments`` once per layout."""
    segs = segments(tokens, zigzag, seq_len)
    return tuple(tuple(x) for x in segs), tuple((ks, kl) for ksegs in segs for ks, kl in ksegs if kl)
