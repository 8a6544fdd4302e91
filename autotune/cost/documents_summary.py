"""A length distribution summarised once per window shape and CP layout (``estimate`` prices a plan
with documents from it): two priced steps per plan, not every drawn step replica by replica.

A step waits for its slowest DP replica, and a replica's time is close to linear in its attention
work (pairs per window): the GEMMs, the communication and the memory do not move with the
documents, the attention's FLOPs are its pairs. So the expected step over the ``DRAWS`` drawn steps
(seed ``SEED``) is summarised by:

* two **works** (``Works``: per CP rank the masked pairs with the ring's synchronisation, the
  pair-weighted attention length, on a CPU the kernel calls): ``typical``, the mean over every drawn
  window, and ``heavy``, the mean over the steps of each step's heaviest window (where a step's
  slowest replica comes from; heavy windows hold long documents, so its attention runs at their
  length). Each is given to every replica (``DocWork.uniform``: replicas of a place share one
  context and one rank cost, as without documents). They do not depend on how windows are dealt,
  so both balances of a plan share them;
* ``replica_pairs``: every dealt step's (as the runtime deals them, ``documents.replica_rows``)
  pairs per window of each replica, one ``[DRAWS, replicas]`` array per sample counts and balance.

``estimate`` prices the two works, reads each replica's end of step in both
(``estimate._replica_ends``) and ``expected_step`` draws a line through them per replica: the mean
over the dealt steps of the slowest replica on its line at its own pairs per window (numpy, no
pricing). Exact where a replica's time is linear in its pairs (one device type, no overlap changing
sides); a work that does not vary (every window alike) prices one step.

Kept for the process: the works per (distribution, window, batch, CP token shares, layout, CPU or
not), the replicas' pairs per sample counts and balance; a search prices hundreds of plans on a
few dozen such shapes.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Any

import numpy as np

from autotune import documents as W
from autotune.cost import documents as DOC
from autotune.cost.ring import segments


@dataclasses.dataclass(frozen=True)
class Works:
    """The two uniform works of one CP layout (module docstring): what ``estimate`` prices. They do
    not depend on how windows are dealt, so both balances of a plan share them."""

    typical: DOC.DocWork
    heavy: DOC.DocWork
    x_typical: float
    """Causal pairs per window of ``typical``: the mean over every window of the ``DRAWS`` steps."""
    x_heavy: float
    """Causal pairs per window of ``heavy``: the mean over the steps of each step's heaviest window."""
    pairs: np.ndarray
    """``[DRAWS, global_batch]``: every drawn window's causal pairs."""

    @property
    def varies(self) -> bool:
        """False when every window has the typical work (then one step is priced)."""
        return self.x_heavy > self.x_typical * (1 + 1e-12)


def works(plan: Any, dist: W.LengthDistribution, seq_len: int, global_batch: int, on_cpu: bool) -> Works:
    """``Works`` of ``dist`` for ``plan``'s CP layout (resolved: shares filled in), kept per what it
    reads of the plan (the CP token shares and layout)."""
    zig = plan.cp_layout == "zigzag" and plan.degrees.cp > 1
    key = (dist.digest(), seq_len, global_batch, plan.shares.tokens, zig, on_cpu)
    got = _WORKS.get(key)
    if got is None:
        if len(_WORKS) >= _LIMIT:  # a long-lived process pricing many workloads: start again
            _WORKS.clear()
        got = _WORKS[key] = _works(dist, seq_len, global_batch, plan.shares.tokens, zig, on_cpu)
    return got


_WORKS: dict[tuple, Works] = {}
_LIMIT = 1024


def _works(dist: W.LengthDistribution, seq_len: int, global_batch: int, tokens: tuple[int, ...], zig: bool,
           on_cpu: bool) -> Works:
    """The mean work of every window and of each step's heaviest window, per CP rank: its masked
    pairs with the ring's synchronisation over the windows it averages (``mean_w max_c / max_c
    mean_w``, as ``documents._step_work`` weighs a replica's windows), the pair-weighted attention
    length, on a CPU the kernel calls."""
    pairs, num, den, whole = _layout(dist, seq_len, global_batch, tokens, zig)
    total = pairs.sum(axis=0).reshape(-1, global_batch)
    heavy = total.argmax(axis=1) + np.arange(total.shape[0]) * global_batch
    every = np.arange(total.size)

    def work(rows: np.ndarray) -> DOC.DocWork:
        mean = pairs[:, rows].mean(axis=1)
        sync = float(pairs[:, rows].max(axis=0).mean() / mean.max()) if len(tokens) > 1 and mean.max() > 0 else 1.0
        ks = tuple(float(v) * sync for v in mean)
        seqs = tuple(_seq(num[c, rows].sum(), den[c, rows].sum(), whole[c], tokens[c]) for c in range(len(tokens)))
        ring = _ring(dist, seq_len, global_batch, rows, sync, tokens, zig) if on_cpu else (None,) * len(tokens)
        return DOC.DocWork((ks,), (ring,), (seqs,), uniform=True)

    total.flags.writeable = False
    return Works(work(every), work(heavy), float(total.mean()), float(total.ravel()[heavy].mean()), total)


def replica_pairs(plan: Any, dist: W.LengthDistribution, seq_len: int, global_batch: int, wk: Works) -> np.ndarray:
    """``[DRAWS, replicas]``: each replica's causal pairs per window in each drawn step, dealt as
    ``plan.balance`` deals (``documents.replica_rows``; a replica without rows: 0); kept per
    distribution, window, batch, sample counts and balance (a window's pairs do not depend on the
    CP layout)."""
    samples = plan.shares.samples
    key = (dist.digest(), seq_len, global_batch, samples, plan.balance)
    got = _PAIRS.get(key)
    if got is None:
        if len(_PAIRS) >= _LIMIT:
            _PAIRS.clear()
        lab = _labels(dist, seq_len, global_batch, samples, plan.balance)
        draws, reps = lab.shape[0], len(samples)
        idx = (np.arange(draws)[:, None] * reps + lab).ravel()
        sums = np.bincount(idx, weights=wk.pairs.ravel(), minlength=draws * reps).reshape(draws, reps)
        counts = np.asarray(samples, dtype=float)
        got = _PAIRS[key] = np.divide(sums, counts[None, :], out=np.zeros_like(sums), where=counts[None, :] > 0)
        got.flags.writeable = False
    return got


_PAIRS: dict[tuple, np.ndarray] = {}


def _seq(num: float, den: float, whole: tuple[float, float], shard: int) -> float:
    """``documents._attn_seq`` on summed weights: the shard times the pair-weighted mean piece over
    that of one window-long document, at most the shard."""
    one = whole[0] / whole[1] if whole[1] else 0.0
    mine = num / den if den else 0.0
    return min(float(shard), shard * mine / one) if one else float(shard)


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """Every document piece of the ``DRAWS`` drawn steps' windows (flattened in step order) at global
    positions (window ``i`` at ``i * seq_len``: ascending), with the prefix sums of each whole
    piece's pairs and pairs * length (``_rank_sums``)."""

    gs: np.ndarray
    ge: np.ndarray
    cum_pp: np.ndarray
    cum_num: np.ndarray
    rows: int


@lru_cache(maxsize=4)
def _pieces(dist: W.LengthDistribution, seq_len: int, global_batch: int) -> _Tiles:
    p = DOC.drawn_pieces(dist, seq_len, global_batch)
    n = (p.end - p.start).astype(float)
    full = n * (n + 1) / 2  # a whole piece: its pairs, and its pair weights
    return _Tiles(p.start + p.row * seq_len, p.end + p.row * seq_len, np.concatenate(([0.0], np.cumsum(full))),
                  np.concatenate(([0.0], np.cumsum(full * n))), p.rows)


@lru_cache(maxsize=64)
def _layout(dist: W.LengthDistribution, seq_len: int, global_batch: int, tokens: tuple[int, ...], zig: bool
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[tuple[float, float], ...]]:
    """Per CP rank, per window of the ``DRAWS`` drawn steps: its masked pairs and attention-length
    weights (``documents._Pieces.of_ranks``, ``[cp, windows]`` in float64), once per CP layout;
    and the weights of one window-long document per CP rank."""
    pieces, whole = _pieces(dist, seq_len, global_batch), DOC._Pieces.of(((seq_len,),))
    segs = segments(tokens, zig, seq_len)
    ranks = _rank_sums(pieces, segs, seq_len)
    ones = [whole.of_ranks(sg) for sg in segs]
    return (np.stack([r[0] for r in ranks]), np.stack([r[1] for r in ranks]), np.stack([r[2] for r in ranks]),
            tuple((float(o[1][0]), float(o[2][0])) for o in ones))


def _rank_sums(t: _Tiles, segs: list[list[tuple[int, int]]], seq_len: int
               ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per CP rank (``segs``: its segments), ``documents._Pieces.of_ranks`` (per window: the causal
    same-document pairs of the queries in its segments, and the sums of pairs * piece and of pairs
    over the pieces inside each segment) in float64, in time of the windows and segments rather than
    of the pieces: a window's pieces tile it in order, so those a segment cuts are a run of them, and
    only the run's two ends are cut (the pieces between lie whole inside: prefix sums of their whole
    figures). Every rank's segments' terms at once (``[segments, windows]``), then each rank's added
    up segment by segment in the order of a loop over them (the same floats)."""
    rows, gs, ge, cum_pp, cum_num = t.rows, t.gs, t.ge, t.cum_pp, t.cum_num
    flat = [(c, a, w) for c, sg in enumerate(segs) for a, w in sg if w > 0]
    out = [(np.zeros(rows), np.zeros(rows), np.zeros(rows)) for _ in segs]
    if not flat:
        return out
    qlo = np.arange(rows, dtype=np.int64)[None, :] * seq_len + np.asarray([a for _, a, _ in flat], dtype=np.int64)[:, None]
    qhi = qlo + np.asarray([w for *_, w in flat], dtype=np.int64)[:, None]
    first = np.searchsorted(ge, qlo, side="right")  # the first piece ending after the segment starts
    last = np.searchsorted(gs, qhi, side="left") - 1  # the last piece starting before it ends
    inner = np.maximum(last - first - 1, 0)  # whole pieces strictly between the two ends
    lo_i, hi_i = first + 1, first + 1 + inner
    whole_pp, whole_num = cum_pp[hi_i] - cum_pp[lo_i], cum_num[hi_i] - cum_num[lo_i]
    ends = []
    for end_piece, keep in ((first, np.ones(first.shape, dtype=bool)), (last, last > first)):
        s0 = gs[end_piece].astype(float)
        lo = np.maximum(qlo, gs[end_piece]).astype(float)
        hi = np.minimum(qhi, ge[end_piece]).astype(float)
        cut = np.where(keep & (hi > lo), hi - lo, 0.0)
        pp = cut * (cut + 1) / 2
        ends.append((cut * (2 * lo + cut - 2 * s0 + 1) / 2, pp, pp * cut))  # pairs: sum of (p - s0 + 1) over the cut
    for q, (c, _, _) in enumerate(flat):
        pairs, num, den = out[c]
        pairs += whole_pp[q]
        den += whole_pp[q]
        num += whole_num[q]
        for cut_pairs, pp, ppn in ends:
            pairs += cut_pairs[q]
            den += pp[q]
            num += ppn[q]
    return out


@lru_cache(maxsize=256)
def _labels(dist: W.LengthDistribution, seq_len: int, global_batch: int, samples: tuple[int, ...], balance: str
            ) -> np.ndarray:
    """``[DRAWS, global_batch]``: the replica each window of each drawn step is dealt to, as
    ``documents.replica_rows`` deals (in order; by cost: ``assign_windows``, run for every step at
    once on the windows' pairs, counted once per distribution)."""
    costs = np.asarray(DOC._draw_pairs(dist, seq_len, global_batch, DOC.SEED), dtype=float)
    draws = costs.shape[0]
    if balance != "cost":
        out = np.broadcast_to(np.repeat(np.arange(len(samples)), samples), (draws, global_batch)).copy()
    else:
        out = _deal_by_cost(costs, np.asarray(samples, dtype=float))
    out.flags.writeable = False
    return out


def _deal_by_cost(costs: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """``documents.assign_windows`` of every row of ``costs`` ([steps, windows]) at once: windows in
    decreasing cost (ties by position), each to the replica whose load per sample would be lowest
    among those with room (ties to the lowest index), in the same float arithmetic."""
    draws, n = costs.shape
    order = np.argsort(-costs, axis=1, kind="stable")
    load = np.zeros((draws, len(samples)))
    count = np.zeros((draws, len(samples)))
    out = np.empty((draws, n), dtype=np.int64)
    steps = np.arange(draws)
    for k in range(n):
        i = order[:, k]
        c = costs[steps, i]
        with np.errstate(divide="ignore", invalid="ignore"):  # a replica of no samples: never has room
            score = (load + c[:, None]) / samples[None, :]
        score[count >= samples[None, :]] = np.inf
        r = score.argmin(axis=1)  # the first of equal scores: the lowest replica
        out[steps, i] = r
        load[steps, r] += c
        count[steps, r] += 1
    return out


def _ring(dist: W.LengthDistribution, seq_len: int, global_batch: int, rows: np.ndarray, sync: float,
          tokens: tuple[int, ...], zig: bool) -> tuple[Any, ...]:
    """Per CP rank, the CPU kernel calls (``documents.masked_blocks``) of the windows ``rows`` (flat
    indices of the drawn steps' windows), per window and times the synchronisation (as
    ``documents._step_work`` weighs a drawn replica's)."""
    steps = DOC.drawn_steps(dist, seq_len, global_batch, DOC.DRAWS, DOC.SEED)
    segs = segments(tokens, zig, seq_len)
    calls: list[dict[tuple[int, int, bool], float]] = [{} for _ in tokens]
    w = sync / len(rows)
    for i in rows:
        d, b = divmod(int(i), global_batch)
        for c in range(len(tokens)):
            for blk in DOC.masked_blocks(steps[d][b], segs, c):
                calls[c][blk] = calls[c].get(blk, 0.0) + w
    return tuple(tuple(sorted((q, k, causal, n) for (q, k, causal), n in cs.items())) for cs in calls)


def expected_step(wk: Works, x: np.ndarray, ends: list[np.ndarray], steps: list[float]) -> float:
    """The mean over the dealt steps of the step time: each replica on the line through its end of
    step in the two priced works (``ends``: per replica, ``typical`` then ``heavy``) at its own pairs
    per window (``x``, ``replica_pairs``); what the step adds after the last replica (``steps`` less
    the latest end: the exposure every replica waits for) on the same line at the step's largest
    ``x``. A slope below zero (more pairs, no more time: the attention hidden) counts as zero."""
    if not wk.varies or len(steps) < 2:
        return steps[0]
    span = wk.x_heavy - wk.x_typical
    a, b = ends
    slope = np.maximum((b - a) / span, 0.0)
    lead = (a[None, :] + slope[None, :] * (x - wk.x_typical)).max(axis=1)
    extra = (steps[0] - a.max(), steps[1] - b.max())
    tail = extra[0] + (extra[1] - extra[0]) / span * (x.max(axis=1) - wk.x_typical)
    return float(np.mean(lead + np.maximum(tail, 0.0)))


def step_floor(wk: Works, x: np.ndarray, typical_ends: np.ndarray) -> float:
    """A floor under ``expected_step`` from the typical work's step alone, whatever the heavy one
    gives: the latest typical end among the replicas whose pairs per window, averaged over the dealt
    steps, reach the typical work's (-inf where none does). Why: the expected step is the mean over
    the steps of the slowest replica on its line plus a tail clamped at 0, so at least the mean of any
    one replica's line, ``a + slope * (mean x - x_typical)``, and the slope is clamped at 0. Proved
    in the reals; ``FLOOR_MARGIN`` covers the rounding of the float sums (~1e-15 of a step), so
    a plan whose floor reaches a faster plan's step times ``1 + FLOOR_MARGIN`` has an expected step
    no shorter (``documents_estimator.cp_balanced``: not priced at the heavy work)."""
    above = x.mean(axis=0) >= wk.x_typical * (1 + FLOOR_MARGIN)
    return float(typical_ends[above].max()) / (1 + FLOOR_MARGIN) if above.any() else float("-inf")


FLOOR_MARGIN = 1e-9
"""``step_floor``'s relative margin against rounding: the float sums it stands for are exact to ~1e-15."""
