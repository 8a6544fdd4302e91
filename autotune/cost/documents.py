"""Pricing packed windows with document masks (``Plan.doc_mask``, ``autotune/documents.py``).

With documents, a window's attention costs the sum over its document pieces of their causal
(query, key) pairs instead of the window's S(S+1)/2; everything else (GEMMs, norms, the loss,
communication volumes, memory) is per token and a window always holds S tokens, so it is priced as
before. Windows differ, so:

* **Expected step, not mean work.** A step waits for its slowest DP replica and, inside a replica,
  for its slowest CP rank. ``STEPS`` steps are drawn from the distribution with a fixed seed
  (``documents.sample_window``: data-order packing), each step's windows are dealt to the replicas
  as the runtime deals them (``documents.replica_rows``: in order, or by cost), and each drawn step
  is priced by the whole cost model with every replica's own attention work (so mixed devices,
  uneven shares and pipeline bubbles act as usual). Window costs are heavy-tailed (a window is one
  document in ~9% of draws of a log-normal corpus, a fifth of its pairs in the median one), so the
  mean over ``STEPS`` priced steps alone is a noisy estimate (+-25% on 8 windows). The prediction
  corrects it with a control variate (``expected``): ``DRAWS`` further steps are dealt (cheap: no
  pricing), and the priced steps' times are regressed on each step's slowest replica's pairs per
  window (``bottleneck``); the estimate is the priced mean moved along that line to the mean
  bottleneck of all ``DRAWS`` steps (exact where the step time is linear in it, as with one replica).
* **Given windows.** ``estimate(..., documents=GivenWindows(steps))`` prices exactly these steps
  (the windows a trial ran, ``trial_windows``): predicted against measured step by step, with no
  sampling error on either side.
* **Per CP rank.** A replica's CP rank c gets the mean over the replica's windows of its masked
  pairs (its segments of the zigzag or contiguous layout cut by the documents), scaled by
  ``mean_w max_c pairs_c(w) / max_c mean_w pairs_c(w)`` (>= 1): the ring synchronises every window,
  so a replica's time follows the sum over windows of the slowest rank, not the slowest rank's sum.
* **CPU kernels.** On a CPU every document piece of every ring block is one fused-kernel call
  (``runtime/documents.py`` loops over documents), so the CPU attention is priced per piece
  (``cpu.block_extras`` with weighted blocks): call overhead and short-sequence efficiency included.
* **Memory at the worst window.** The fused kernels keep no S x S scores, so a window's activation
  memory depends on its S tokens only: every window's memory is the full window's, as priced today.

Without a distribution, or with ``doc_mask`` off, nothing here runs: old plans price bit for bit.
"""

from __future__ import annotations

import dataclasses
import statistics
from functools import lru_cache
from typing import Any

import numpy as np

from autotune import documents as W
from autotune.cost.ring import segments

STEPS = 4
"""Steps priced per estimate (each by the whole model); the draws are fixed (SEED), so a plan's price
is deterministic."""
DRAWS = 128
"""Steps dealt (not priced) for the control variate's mean: the first ``STEPS`` of them are priced."""
SEED = 0


@dataclasses.dataclass(frozen=True)
class GivenWindows:
    """Steps of windows to price as they are (``estimate(documents=...)``) instead of drawing them:
    per step, per row of the global batch, its document pieces. ``source`` names where they came
    from (a trial's seed)."""

    steps: tuple[tuple[tuple[int, ...], ...], ...]
    source: str = "given windows"


def trial_windows(dist: W.LengthDistribution, seq_len: int, global_batch: int, seed: int, first: int,
                  count: int) -> GivenWindows:
    """The windows a trial with ``seed`` draws for steps ``first .. first + count - 1`` from ``dist``
    (``runtime/documents.DocumentFeed``: ``documents.window_rng(seed, step, row)``)."""
    return GivenWindows(tuple(tuple(W.sample_window(dist, seq_len, W.window_rng(seed, st, r)) for r in range(global_batch))
                              for st in range(first, first + count)), f"trial windows (seed {seed}, steps {first}.."
                                                                         f"{first + count - 1})")


def masked_pairs(docs: tuple[int, ...], segs: list[tuple[int, int]]) -> float:
    """Causal same-document (query, key) pairs of the queries in ``segs``: a query at p in the
    document starting at s attends p - s + 1 keys."""
    total = 0.0
    for s, e in W_starts(docs):
        for a, n in segs:
            lo, hi = max(a, s), min(a + n, e)
            if lo < hi:  # sum over p in [lo, hi) of (p - s + 1)
                total += (hi - lo) * ((lo - s + 1) + (hi - s)) / 2.0
    return total


def W_starts(docs: tuple[int, ...]) -> list[tuple[int, int]]:  # noqa: N802  (documents' (start, end))
    out, s = [], 0
    for n in docs:
        out.append((s, s + n))
        s += n
    return out


def masked_blocks(docs: tuple[int, ...], segs: list[list[tuple[int, int]]], index: int
                  ) -> list[tuple[int, int, bool]]:
    """The kernel calls of CP rank ``index`` over one ring turn with documents: ``(query length, key
    length, causal)`` per document piece of every visible block (``runtime/documents.block_pairs``)."""
    out = []
    bounds = W_starts(docs)
    for qs, ql in segs[index]:
        for ksegs in segs:
            for ks, kl in ksegs:
                if not (ql and kl and ks < qs + ql):
                    continue
                same = ks == qs and kl == ql
                for s, e in bounds:
                    q = min(e, qs + ql) - max(s, qs)
                    k = min(e, ks + kl) - max(s, ks)
                    if q > 0 and k > 0:
                        out.append((q, k, same))
    return out


@lru_cache(maxsize=64)
def drawn_steps(dist: W.LengthDistribution, seq_len: int, global_batch: int, steps: int, seed: int
                ) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``steps`` steps of ``global_batch`` windows each, drawn with a fixed seed (data order)."""
    rng = np.random.default_rng([seed, seq_len, global_batch])
    return tuple(tuple(W.sample_window(dist, seq_len, rng) for _ in range(global_batch)) for _ in range(steps))


@dataclasses.dataclass(frozen=True)
class DocWork:
    """One drawn step's attention work for the cost model's ``StepContext``: per DP replica, per CP
    shard, the masked pairs per micro-batch (``keysums``) and the CPU kernel calls (``ring``, weighted
    per micro-batch; None off CPU)."""

    keysums: tuple[tuple[float, ...], ...]
    ring: tuple[tuple[Any, ...], ...]
    attn_seq: tuple[tuple[float, ...], ...] = ()
    """Per replica and CP shard, the length its attention kernels run at: the mean document piece
    weighted by its pairs (where the work is), at most the shard (GPU kernel efficiency falls at
    short lengths; the CPU prices each call at its own length instead)."""


def step_work(step: tuple[tuple[int, ...], ...], plan: Any, seq_len: int, on_cpu: bool) -> DocWork:
    """The attention work of one drawn step under ``plan`` (resolved: shares filled in)."""
    d = plan.degrees
    zig = plan.cp_layout == "zigzag" and d.cp > 1
    segs = segments(plan.shares.tokens, zig, seq_len)
    keysums, rings, seqs = [], [], []
    for rows in W.replica_rows(step, plan.shares.samples, plan.balance):
        seqs.append(tuple(_attn_seq([step[r] for r in rows], segs[c], plan.shares.tokens[c], seq_len)
                          for c in range(d.cp)))
        pairs = np.array([[masked_pairs(step[r], segs[c]) for c in range(d.cp)] for r in rows])
        mean = pairs.mean(axis=0)  # per window (the cost model multiplies by the micro-batch size)
        sync = float(pairs.max(axis=1).mean() / pairs.mean(axis=0).max()) if d.cp > 1 else 1.0
        keysums.append(tuple(float(x) * sync for x in mean))
        if not on_cpu:
            rings.append((None,) * d.cp)
            continue
        ring = []
        for c in range(d.cp):
            calls: dict[tuple[int, int, bool], float] = {}
            for r in rows:
                for blk in masked_blocks(step[r], segs, c):
                    calls[blk] = calls.get(blk, 0.0) + 1.0
            w = sync / len(rows)  # per window (the kernels run per row; micro_batch multiplies outside)
            ring.append(tuple(sorted((q, k, causal, n * w) for (q, k, causal), n in calls.items())))
        rings.append(tuple(ring))
    return DocWork(tuple(keysums), tuple(rings), tuple(seqs))


def _attn_seq(windows: list[tuple[int, ...]], segs: list[tuple[int, int]], shard: int, seq_len: int) -> float:
    """The shard's attention length with documents: the shard (the cost model's length for a whole
    window) times the pair-weighted mean piece length over that of one window-long document (so a
    single document prices exactly as no documents)."""
    def weighted(ws: list[tuple[int, ...]]) -> float:
        num = den = 0.0
        for docs in ws:
            for s, e in W_starts(docs):
                for a, n in segs:
                    piece = min(e, a + n) - max(s, a)
                    if piece > 0:
                        pairs = piece * (piece + 1) / 2.0
                        num += pairs * piece
                        den += pairs
        return num / den if den else 0.0

    whole = weighted([(seq_len,)])
    return min(float(shard), shard * weighted(windows) / whole) if whole else float(shard)


def drawn_work(plan: Any, dist: Any, seq_len: int, global_batch: int, on_cpu: bool,
               steps: int = STEPS, seed: int = SEED) -> list[DocWork]:
    """The work of the steps to price: the first ``steps`` draws, or every step of ``GivenWindows``."""
    chosen = dist.steps if isinstance(dist, GivenWindows) else drawn_steps(dist, seq_len, global_batch, DRAWS, seed)[:steps]
    return [step_work(st, plan, seq_len, on_cpu) for st in chosen]


def bottleneck(step: tuple[tuple[int, ...], ...], plan: Any) -> float:
    """The control variate of one step: the largest attention pairs per window over its replicas (as
    ``documents.assign_windows`` weighs a replica: its load over its sample count)."""
    rows = W.replica_rows(step, plan.shares.samples, plan.balance)
    return max(sum(_pairs(step[r]) for r in rs) / len(rs) for rs in rows if rs)


@lru_cache(maxsize=65536)
def _pairs(docs: tuple[int, ...]) -> int:
    return W.attention_pairs(docs)


def expected(times: list[float], xs: list[float], mean_x: float) -> float:
    """Control-variate estimate of the mean step time: ``mean(times) + b (mean_x - mean(xs))`` with
    ``b`` the least-squares slope of the times on ``xs`` (0 where the xs do not spread or the slope is
    negative, i.e. the priced steps say nothing about it)."""
    mt, mx = statistics.fmean(times), statistics.fmean(xs)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (t - mt) for x, t in zip(xs, times, strict=True)) / var if var > 0 else 0.0
    return max(mt + max(b, 0.0) * (mean_x - mx), min(times))


def combine(priced: list[tuple[dict[str, Any], dict[str, Any]]], dist: Any, plan: Any,
            seq_len: int, global_batch: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(predicted, breakdown) of the priced steps: the step time is their control-variate mean
    (``expected``; given windows: their plain mean, and ``step_times_s`` each); the breakdown and
    memory are the priced step nearest that mean's, with a ``documents`` entry saying how it was priced."""
    times = [float(p["step_time_s"]) for p, _ in priced]
    if isinstance(dist, GivenWindows):
        mean = statistics.fmean(times)
        how = f"mean over {len(times)} given steps ({dist.source})"
    else:
        draws = drawn_steps(dist, seq_len, global_batch, DRAWS, SEED)
        xs = [bottleneck(st, plan) for st in draws]
        mean = expected(times, xs[:len(times)], statistics.fmean(xs))
        how = (f"{len(times)} drawn steps (seed {SEED}) priced, their mean moved by a control variate (the slowest "
               f"replica's pairs per window, mean over {DRAWS} dealt steps)")
    pred, bd = min(priced, key=lambda pb: abs(pb[0]["step_time_s"] - mean))
    pred = dict(pred)
    ratio = pred["step_time_s"] / mean if mean > 0 else 1.0
    pred["step_time_s"] = mean
    pred["tokens_per_s"] = global_batch * seq_len / mean if mean > 0 else 0.0
    if isinstance(pred.get("mfu"), (int, float)):
        pred["mfu"] = pred["mfu"] * ratio
    bd = dict(bd)
    info = ({"source": dist.source} if isinstance(dist, GivenWindows) else
            {"source": dist.source, "digest": dist.digest(), "mean_length": round(dist.mean(), 2)})
    bd["documents"] = {**info, "packing": "order", "balance": plan.balance, "drawn_steps_s": times,
                       "step_time_s": mean, "how": how}
    return pred, bd
