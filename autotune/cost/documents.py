"""Pricing packed windows with document masks (``Plan.doc_mask``, ``autotune/documents.py``).

With documents, a window's attention costs the sum over its document pieces of their causal
(query, key) pairs instead of the window's S(S+1)/2; everything else (GEMMs, norms, the loss,
communication volumes, memory) is per token and a window always holds S tokens, so it is priced as
before. Windows differ, so:

* **Expected step, not mean work.** A step waits for its slowest DP replica and, inside a replica,
  for its slowest CP rank. ``DRAWS`` steps are drawn from the distribution with a fixed seed
  (``documents.sample_window``: data-order packing) and each step's windows dealt to the replicas as
  the runtime deals them (``documents.replica_rows``: in order, or by cost). Window costs are
  heavy-tailed (a window is one document in ~9% of draws of a log-normal corpus, a fifth of its
  pairs in the median one), so a few priced steps are a noisy estimate (+-25% on 8 windows); pricing
  every drawn step replica by replica is the reference, but costs a hundred estimates. The
  distribution is summarised instead (``documents_summary``): two works (the mean window's and each
  drawn step's heaviest window's, per CP rank) are each given to every replica and priced by the
  whole cost model (so mixed devices, uneven shares and pipeline bubbles act as usual), each
  replica's end of step is a line through the two, and the expected step is the mean over all
  ``DRAWS`` dealt steps of the slowest replica on its line at its own pairs per window (exact where a
  replica's time is linear in its pairs; within 0.3% of the reference on the benchmark plans that
  fit, ``tests/unit/test_cost_documents.py``).
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
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np

from autotune import documents as W
from autotune.cost.ring import segments
from autotune.specs.windows import query_keys

DRAWS = 128
"""Steps drawn and dealt for the expected step (``documents_summary``); the draws are fixed (SEED), so
a plan's price is deterministic."""
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


def masked_pairs(docs: tuple[int, ...], segs: list[tuple[int, int]], window: int | None = None) -> float:
    """Causal same-document (query, key) pairs of the queries in ``segs``: a query at p in the
    document starting at s attends p - s + 1 keys, at most ``window`` (a windowed layer,
    ``specs/windows.query_keys``)."""
    total = 0.0
    for s, e in W_starts(docs):
        for a, n in segs:
            lo, hi = max(a, s), min(a + n, e)
            if lo < hi:  # sum over p in [lo, hi) of (p - s + 1), at most ``window`` each
                total += query_keys(lo, hi, s, window)
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
    uniform: bool = False
    """Every replica has the same work (``documents_summary``'s works): the tuples hold one
    replica's, and replicas of a place share one context, as without documents (``context.tp_groups``)."""


def step_work(step: tuple[tuple[int, ...], ...], plan: Any, seq_len: int, on_cpu: bool) -> DocWork:
    """The attention work of one drawn step under ``plan`` (resolved: shares filled in)."""
    zig = plan.cp_layout == "zigzag" and plan.degrees.cp > 1
    return _step_work(step, plan.shares.samples, plan.balance, plan.shares.tokens, zig, seq_len, on_cpu)


def _step_work(step: tuple[tuple[int, ...], ...], samples: tuple[int, ...], balance: str, tokens: tuple[int, ...],
               zig: bool, seq_len: int, on_cpu: bool) -> DocWork:
    """``step_work`` on what it reads of a plan: the replicas' sample counts and balance, the CP
    ranks' token shares and layout (so plans that differ elsewhere share one ``DocWork``)."""
    cp = len(tokens)
    segs = segments(tokens, zig, seq_len)
    per_rank, wholes = _rank_pieces(step, tokens, zig, seq_len)
    keysums, rings, seqs = [], [], []
    for rows in W.replica_rows(step, samples, balance):
        seqs.append(tuple(_attn_seq(per_rank[c], rows, wholes[c], tokens[c]) for c in range(cp)))
        pairs = np.array([[float(per_rank[c][0][r]) for c in range(cp)] for r in rows])
        mean = pairs.mean(axis=0)  # per window (the cost model multiplies by the micro-batch size)
        sync = float(pairs.max(axis=1).mean() / pairs.mean(axis=0).max()) if cp > 1 else 1.0
        keysums.append(tuple(float(x) * sync for x in mean))
        if not on_cpu:
            rings.append((None,) * cp)
            continue
        ring = []
        for c in range(cp):
            calls: dict[tuple[int, int, bool], float] = {}
            for r in rows:
                for blk in masked_blocks(step[r], segs, c):
                    calls[blk] = calls.get(blk, 0.0) + 1.0
            w = sync / len(rows)  # per window (the kernels run per row; micro_batch multiplies outside)
            ring.append(tuple(sorted((q, k, causal, n * w) for (q, k, causal), n in calls.items())))
        rings.append(tuple(ring))
    return DocWork(tuple(keysums), tuple(rings), tuple(seqs))


@lru_cache(maxsize=1024)
def _rank_pieces(step: tuple[tuple[int, ...], ...], tokens: tuple[int, ...], zig: bool, seq_len: int
                 ) -> tuple[tuple[tuple[np.ndarray, ...], ...], tuple[tuple[np.ndarray, ...], ...]]:
    """Per CP rank, ``_Pieces.of_ranks`` of the step's windows and of one window-long document: what
    ``_step_work`` reads of the CP layout, once per step and layout (not per replicas' counts and
    balance, nor per replica). Read-only arrays: the cache hands the same ones to every caller."""
    segs = segments(tokens, zig, seq_len)
    pieces, whole = _Pieces.of(step), _Pieces.of(((seq_len,),))
    out = (tuple(pieces.of_ranks(sg) for sg in segs), tuple(whole.of_ranks(sg) for sg in segs))
    for arrays in (*out[0], *out[1]):
        for a in arrays:
            a.flags.writeable = False
    return out


@dataclasses.dataclass(frozen=True)
class _Pieces:
    """Every document piece of a step's windows as arrays (start, end, row), so a CP rank's masked
    pairs and pair-weighted piece lengths are a few numpy operations per segment, not a loop over
    documents. Integer arithmetic throughout (int64): a window's pairs and their sums stay exact,
    as the float loops they replace were wherever their partial sums stayed below 2**53."""

    start: np.ndarray
    end: np.ndarray
    row: np.ndarray
    rows: int

    @classmethod
    def of(cls, step: tuple[tuple[int, ...], ...]) -> _Pieces:
        lens = [np.asarray(w, dtype=np.int64) for w in step]
        end = np.concatenate([np.cumsum(x) for x in lens])
        size = np.concatenate(lens)
        row = np.repeat(np.arange(len(step)), [len(x) for x in lens])
        return cls(end - size, end, row, len(step))

    def of_ranks(self, segs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per row, for the queries in ``segs``: the causal same-document pairs (``masked_pairs``), and
        over each document's piece inside each segment, the sums of pairs * piece and of pairs
        (``_attn_seq``'s weights)."""
        pairs = np.zeros(self.rows, dtype=np.int64)
        num = np.zeros(self.rows, dtype=np.int64)
        den = np.zeros(self.rows, dtype=np.int64)
        for a, n in segs:
            lo, hi = np.maximum(a, self.start), np.minimum(a + n, self.end)
            m = lo < hi
            s, lo, hi, row = self.start[m], lo[m], hi[m], self.row[m]
            # sum over p in [lo, hi) of (p - s + 1): (hi - lo) terms from lo - s + 1 to hi - s
            pairs += _isum(row, (hi - lo) * (lo + hi - 2 * s + 1) // 2, self.rows)
            piece = hi - lo
            pp = piece * (piece + 1) // 2
            num += _isum(row, pp * piece, self.rows)
            den += _isum(row, pp, self.rows)
        return pairs, num, den


def _isum(row: np.ndarray, values: np.ndarray, rows: int) -> np.ndarray:
    """Integer sums of ``values`` per ``row`` (ascending, as ``_Pieces`` holds them): differences of
    the running int64 sum at the rows' bounds (``np.bincount`` sums in float64, which rounds past
    2**53; ``np.add.at`` is exact too but slower)."""
    cum = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values, out=cum[1:])
    bounds = np.searchsorted(row, np.arange(rows + 1))
    return cum[bounds[1:]] - cum[bounds[:-1]]


def _attn_seq(work: tuple[np.ndarray, np.ndarray, np.ndarray], rows: list[int],
              whole: tuple[np.ndarray, np.ndarray, np.ndarray], shard: int) -> float:
    """The shard's attention length with documents: the shard (the cost model's length for a whole
    window) times the pair-weighted mean piece length over that of one window-long document (so a
    single document prices exactly as no documents). ``work``: ``_Pieces.of_ranks`` of the step,
    ``whole``: of one window-long document, both for this shard's segments."""
    def weighted(num: int, den: int) -> float:
        return float(num) / float(den) if den else 0.0

    one = weighted(int(whole[1][0]), int(whole[2][0]))
    mine = weighted(int(work[1][rows].sum()), int(work[2][rows].sum()))
    return min(float(shard), shard * mine / one) if one else float(shard)


def drawn_work(plan: Any, dist: Any, seq_len: int, global_batch: int, on_cpu: bool,
               steps: int = 4, seed: int = SEED) -> list[DocWork]:
    """The work of every step of ``GivenWindows`` (what ``estimate`` prices for them), or of the first
    ``steps`` drawn steps of a distribution, replica by replica (a reference: ``estimate`` prices a
    distribution's summary, ``documents_summary``). Drawn steps' work is kept per (distribution,
    window, batch, seed, step) and what ``_step_work`` reads of the plan."""
    if isinstance(dist, GivenWindows):
        return [step_work(st, plan, seq_len, on_cpu) for st in dist.steps]
    zig = plan.cp_layout == "zigzag" and plan.degrees.cp > 1
    shape = (plan.shares.samples, plan.balance, plan.shares.tokens, zig, on_cpu)
    drawn = drawn_steps(dist, seq_len, global_batch, DRAWS, seed)
    out = []
    for i in range(min(steps, len(drawn))):
        key = (dist.digest(), seq_len, global_batch, seed, i, shape)
        work = _WORK.get(key)
        if work is None:
            if len(_WORK) >= _WORK_LIMIT:  # a long-lived process pricing many workloads: start again
                _WORK.clear()
            work = _WORK[key] = _step_work(drawn[i], plan.shares.samples, plan.balance, plan.shares.tokens, zig,
                                           seq_len, on_cpu)
        out.append(work)
    return out


_WORK: dict[tuple[Any, ...], DocWork] = {}
_WORK_LIMIT = 8192


@lru_cache(maxsize=64)
def _draw_pairs(dist: W.LengthDistribution, seq_len: int, global_batch: int, seed: int) -> list[list[int]]:
    """The causal pairs of every window of the ``DRAWS`` drawn steps (what both balances weigh):
    ``attention_pairs`` of each, summed per window over its pieces in int64 (exact: a window's pairs
    are below S**2), not a Python loop over the documents (8k windows of 32-token snippets: ~500,000)."""
    if seed != SEED:
        return [[_pairs(w) for w in st] for st in drawn_steps(dist, seq_len, global_batch, DRAWS, seed)]
    p = drawn_pieces(dist, seq_len, global_batch)
    n = p.end - p.start
    return _isum(p.row, n * (n + 1) // 2, p.rows).reshape(DRAWS, global_batch).tolist()


@lru_cache(maxsize=4)
def drawn_pieces(dist: W.LengthDistribution, seq_len: int, global_batch: int) -> _Pieces:
    """``_Pieces`` of every window of the ``DRAWS`` drawn steps (seed ``SEED``), flattened in step order."""
    steps = drawn_steps(dist, seq_len, global_batch, DRAWS, SEED)
    return _Pieces.of(tuple(w for st in steps for w in st))


@lru_cache(maxsize=65536)
def _pairs(docs: tuple[int, ...]) -> int:
    return W.attention_pairs(docs)


def combine(times: list[float], report: Callable[[int], tuple[dict[str, Any], dict[str, Any]]], dist: Any,
            plan: Any, model: Any, seq_len: int, global_batch: int, mean: float
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(predicted, breakdown) of the priced steps, whose step times are ``times``, for the expected
    step ``mean`` (a distribution: ``documents_summary.expected_step`` over its summary's two priced
    works; given windows: their plain mean, and ``step_times_s`` each). One figure per plan: the
    breakdown is the priced step nearest that mean (``report(i)``: the (predicted, breakdown) of step
    i, asked of that step only), its seconds scaled to the mean (``_scaled``), so its terms add up to
    the headline as they add up to a priced step; memory is that step's. The model FLOPs are the
    masked workload's (``masked_keys``): MFU counts the attention the mask keeps, not the whole
    causal window's. A ``documents`` entry says how it was priced."""
    times = [float(t) for t in times]
    if isinstance(dist, GivenWindows):
        how = f"mean over {len(times)} given steps ({dist.source})"
    elif len(times) > 1:
        how = (f"2 summarised works priced (the mean window's and each step's heaviest window's, over {DRAWS} steps "
               f"drawn with seed {SEED}), the expected step the mean over those steps, as dealt, of the slowest "
               f"replica on its line between them")
    else:
        how = (f"the mean window's work priced (over {DRAWS} steps drawn with seed {SEED}): every window alike, "
               f"or the plan over memory whatever the windows")
    pred, bd = report(min(range(len(times)), key=lambda i: abs(times[i] - mean)))  # the first nearest
    drawn = float(pred["step_time_s"])
    scale = mean / drawn if drawn > 0 else 1.0
    pred = dict(pred)
    pred["step_time_s"] = mean
    pred["tokens_per_s"] = global_batch * seq_len / mean if mean > 0 else 0.0
    bd = _scaled(bd, scale)
    keys = masked_keys(dist, seq_len, global_batch)
    flops = dict(bd["flops"])
    tokens = float(global_batch) * seq_len
    flops["unmasked_model_per_step"] = flops["model_per_step"]
    flops["model_per_step"] = model.model_flops_per_token(seq_len, keys) * tokens
    flops["hardware_per_step"] = model.hardware_flops_per_token(seq_len, plan.recompute, keys) * tokens
    bd["flops"] = flops
    if isinstance(pred.get("mfu"), (int, float)):
        peak = flops["cluster_peak_per_s"]
        pred["mfu"] = flops["model_per_step"] / (mean * peak) if mean > 0 and peak > 0 else 0.0
    info = {"source": dist.source} if isinstance(dist, GivenWindows) else _info(dist)
    bd["documents"] = {**info, "packing": "order", "balance": plan.balance, "priced_steps_s": times,
                       "step_time_s": mean, "breakdown_scaled_from_s": drawn, "masked_keys_per_query": keys,
                       "unmasked_keys_per_query": (seq_len + 1) / 2,
                       "how": how + f"; the breakdown is the priced step of {drawn:.4g} s scaled to it"}
    return pred, bd


def _info(dist: W.LengthDistribution) -> dict[str, Any]:
    """What a breakdown says of a distribution, once per distribution (its digest and source)."""
    key = (dist.digest(), dist.source)
    got = _INFO.get(key)
    if got is None:
        got = _INFO[key] = {"source": dist.source, "digest": dist.digest(),
                                      "mean_length": round(dist.mean(), 2), "documents": dist.documents,
                                      "p50": dist.quantile(0.5), "p90": dist.quantile(0.9)}
    return got


_INFO: dict[tuple[str, str], dict[str, Any]] = {}
_SCALED = ("stages", "ranks")


def _scaled(bd: dict[str, Any], k: float) -> dict[str, Any]:
    """``bd`` with every time figure (keys ending ``_s``, the timeline's ``start`` and ``end``) times ``k``:
    the drawn step's breakdown as the expected step's, so its parts add up to the headline."""
    def times(d: dict[str, Any], keys: tuple[str, ...] = ()) -> dict[str, Any]:
        out = dict(d)
        for key in _timed(tuple(d), keys):
            v = d[key]
            if type(v) is float:  # nearly every figure (a breakdown of 64 ranks holds ~900): one test
                out[key] = v * k
            else:
                out[key] = [x * k for x in v] if isinstance(v, list) else v * k if isinstance(v, (int, float)) else v
        return out

    out = times(bd)
    for key in _SCALED:
        if isinstance(bd.get(key), list):
            out[key] = [times(x) for x in bd[key]]
    if isinstance(bd.get("timeline"), list):
        out["timeline"] = [times(e, ("start", "end")) for e in bd["timeline"]]
    return out


@lru_cache(maxsize=256)
def _timed(names: tuple[str, ...], keys: tuple[str, ...]) -> tuple[str, ...]:
    """The keys of a row ``_scaled`` scales (ending ``_s``, or among ``keys``), once per key set: a
    breakdown's rows share a few (a row per rank, per stage, per timeline event)."""
    return tuple(n for n in names if n.endswith("_s") or n in keys)


def masked_keys(dist: Any, seq_len: int, global_batch: int) -> float:
    """The mean keys a query attends under the document mask: the windows' causal same-document
    pairs over their tokens (a whole causal window: (S + 1) / 2), over the ``DRAWS`` drawn steps
    or every given window."""
    if isinstance(dist, GivenWindows):
        windows = [w for st in dist.steps for w in st]
        return sum(_pairs(w) for w in windows) / (len(windows) * seq_len)
    key = (dist.digest(), seq_len, global_batch)
    got = _KEYS.get(key)
    if got is None:
        got = _KEYS[key] = _drawn_keys(dist, seq_len, global_batch)
    return got


_KEYS: dict[tuple, float] = {}


@lru_cache(maxsize=64)
def _drawn_keys(dist: W.LengthDistribution, seq_len: int, global_batch: int) -> float:
    """``masked_keys`` of the ``DRAWS`` drawn steps, once per distribution, window and batch."""
    pairs = _draw_pairs(dist, seq_len, global_batch, SEED)
    return sum(sum(st) for st in pairs) / (sum(len(st) for st in pairs) * seq_len)
