"""Cost-balanced CP token shares for packed documents (``documents_estimator.cp_balanced`` prices them).

Without documents the zigzag layout balances causal attention exactly and the contiguous one does
not; with documents neither count split balances the ring: the window's first piece is cut at the
window start (its queries see only the keys inside the window), so the expected same-document keys
of the query at position p, ``E[k(p)]``, grow from 1 at p = 0 towards the corpus's stationary value
(the age of the document a position falls in: length-biased, so long for heavy-tailed corpora).
A CP rank's expected attention work is the sum of ``E[k(p)]`` over its positions; a rank's share
*by cost* is the split where those sums stand in the ratio of the count shares it started from
(even shares: equal sums; the uneven shares of a mixed cluster keep their device-speed ratio).

The attention is not all of a rank's time (GEMMs and norms are per token), so the split balancing
attention alone over-corrects: ``documents_estimator.cp_balanced`` prices points on the line from
the count split to this one and keeps the fastest. ``key_profile`` is the cost model's own draws
(``cost/documents.drawn_steps``), so the rule and the price see the same windows.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from autotune import documents as W
from autotune.cost.documents import DRAWS, SEED, drawn_steps


@lru_cache(maxsize=32)
def key_profile(dist: W.LengthDistribution, seq_len: int, draws: int = DRAWS, seed: int = SEED) -> tuple[float, ...]:
    """``E[k(p)]`` for p = 0 .. seq_len - 1: the mean over ``draws`` drawn windows of the keys the
    query at p attends (p - the start of its document piece + 1). Summed over the windows as
    ``draws * (p + 1)`` less the sum of the piece starts covering p, a running sum of +start at each
    piece's start and -start at its end: integers (exact), then one division."""
    starts, ends = [], []
    for (docs,) in drawn_steps(dist, seq_len, 1, draws, seed):
        end = np.cumsum(np.asarray(docs, dtype=np.int64))
        starts.append(end - docs)
        ends.append(end)
    a, e = np.concatenate(starts), np.concatenate(ends)
    jumps = np.zeros(seq_len + 1, dtype=np.int64)
    np.add.at(jumps, a, a)
    np.add.at(jumps, e, -a)
    acc = draws * (np.arange(seq_len, dtype=np.int64) + 1) - np.cumsum(jumps[:seq_len])
    return tuple((acc / draws).tolist())


def _snap(x: float, unit: int) -> int:
    return max(unit, int(round(x / unit)) * unit)


def cost_tokens(profile: tuple[float, ...], start: tuple[int, ...], zigzag: bool, granule: int) -> tuple[int, ...]:
    """Token shares whose expected attention work (sums of ``profile`` over each rank's positions,
    contiguous or zigzag segments as ``cost.documents.segments`` lays them) stand in the ratio of
    ``start`` (the count shares), each a multiple of ``granule``, summing to the window."""
    s, cp = len(profile), len(start)
    if cp == 1:
        return start
    cum = np.concatenate([[0.0], np.cumsum(profile)])
    total = float(cum[-1])
    want = [total * t / s for t in start]
    out, a = [], 0
    if not zigzag:
        for r in range(cp - 1):
            end = int(np.searchsorted(cum, cum[a] + want[r]))  # first cut with the rank's work reached
            t = _snap(end - a, granule)
            t = min(t, s - a - granule * (cp - 1 - r))
            out.append(t)
            a += t
        return (*out, s - a)
    half = granule // 2  # zigzag: rank r holds [a, a + f) and its mirror [s - a - f, s - a), 2f tokens
    for r in range(cp - 1):
        fs = np.arange(half, s // 2 - a - half * (cp - 1 - r) + 1, half)
        work = cum[a + fs] - cum[a] + cum[s - a] - cum[s - a - fs]
        f = int(fs[int(np.argmin(np.abs(work - want[r])))])
        out.append(2 * f)
        a += f
    return (*out, s - 2 * a)


def toward(start: tuple[int, ...], target: tuple[int, ...], frac: float, granule: int) -> tuple[int, ...]:
    """The shares ``frac`` of the way from ``start`` to ``target``, snapped to ``granule``, summing as they do."""
    out = [_snap(a + frac * (b - a), granule) for a, b in zip(start[:-1], target[:-1], strict=True)]
    last = sum(start) - sum(out)
    if last < granule:  # snapping pushed the last rank below a granule: fall back to the start
        return start
    return (*out, last)
