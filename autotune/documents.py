"""The workload as a distribution of document lengths, and how documents are packed into windows.

A corpus is documents of many lengths; training packs them into windows of ``seq_len`` tokens and
masks attention at document boundaries (``autotune/runtime/documents.py``). This module holds what
the planner and the runtime must agree on:

* ``LengthDistribution``: document lengths and their counts, read from ``--lengths FILE`` (a
  histogram, ``length,count`` per line), from a flat token file with an end-of-document id
  (``--data FILE --eod ID``: a document ends with, and includes, its EOD token) or from a Megatron
  ``.idx`` (its sequence lengths grouped by its document index). ``summary()`` is what a study
  records, so a resumed or validated study prices the same workload.
* Packing in **data order** (Megatron's and Llama 3's: documents follow one another, a window is the
  next ``seq_len`` tokens, a document longer than what is left of a window continues in the next
  one). No padding, no reordering, so every token of the data trains once and the loss is the
  token-weighted mean over documents (each token counts once, as without masks). First-fit-
  decreasing would need padding (a loss mask) to fill the windows it cannot fill; it is not offered.
* ``sample_window``: the documents of one window of a data-order stream of documents drawn from
  the distribution: the first piece is the residual of a length-biased draw (the document that
  straddles the window's start; renewal theory), then independent draws until the window is full,
  the last one cut. The runtime's synthetic data and the cost model's sampled windows both call it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from autotune.errors import InputError

PACKINGS = ("order",)
"""Packings the runtime runs: ``order`` (data order, see the module docstring)."""


@dataclass(frozen=True)
class LengthDistribution:
    """Document lengths (tokens, ascending, distinct) and how many documents have each."""

    lengths: tuple[int, ...]
    counts: tuple[int, ...]
    source: str = ""
    """Where it came from (``lengths:FILE``, ``eod:FILE:ID``, ``megatron:FILE``, ``lognormal:...``)."""

    def __post_init__(self) -> None:
        if not self.lengths or len(self.lengths) != len(self.counts):
            raise ValueError("a length distribution needs as many counts as lengths, and at least one")
        if min(self.lengths) < 1 or min(self.counts) < 1:
            raise ValueError("document lengths and counts must be positive")

    @classmethod
    def from_lengths(cls, values: Sequence[int] | np.ndarray, source: str = "") -> LengthDistribution:
        arr = np.asarray(values, dtype=np.int64)
        arr = arr[arr > 0]
        if arr.size == 0:
            raise ValueError("no document of positive length")
        u, c = np.unique(arr, return_counts=True)
        return cls(tuple(int(x) for x in u), tuple(int(x) for x in c), source)

    # The figures below are computed once per distribution (``cached_property`` writes the instance's
    # ``__dict__``, which a frozen dataclass allows): the cost model asks for them on every drawn window.
    @cached_property
    def documents(self) -> int:
        return sum(self.counts)

    @cached_property
    def tokens(self) -> int:
        return int(np.dot(self.lengths, self.counts))

    def mean(self) -> float:
        return self.tokens / self.documents

    def quantile(self, q: float) -> int:
        cum = self._cumulative
        return int(self.lengths[int(np.searchsorted(cum, q * cum[-1]))])

    @cached_property
    def _cumulative(self) -> np.ndarray:
        """Documents at or below each length (``quantile``: every priced plan's breakdown names p50 and p90)."""
        return np.cumsum(self.counts)

    def digest(self) -> str:
        """A short hash of the histogram: two studies price the same workload when digests match."""
        return self._digest

    @cached_property
    def _digest(self) -> str:
        text = json.dumps([self.lengths, self.counts]).encode()
        return hashlib.sha256(text).hexdigest()[:16]

    @cached_property
    def sampler(self) -> _Sampler:
        """The arrays ``sample_window`` draws from (built once, not per window)."""
        return _Sampler.of(self)

    def summary(self) -> dict[str, Any]:
        """What a study records (with the histogram itself, so a resume prices it without the file)."""
        return {"source": self.source, "documents": self.documents, "tokens": self.tokens,
                "mean": round(self.mean(), 3), "p50": self.quantile(0.5), "p90": self.quantile(0.9),
                "p99": self.quantile(0.99), "max": self.lengths[-1], "digest": self.digest(),
                "lengths": list(self.lengths), "counts": list(self.counts)}

    def brief(self) -> dict[str, Any]:
        """``summary`` without the histogram: what a search's JSON and a trial's result show."""
        return {k: v for k, v in self.summary().items() if k not in ("lengths", "counts")}

    @classmethod
    def from_summary(cls, d: dict[str, Any]) -> LengthDistribution:
        return cls(tuple(int(x) for x in d["lengths"]), tuple(int(x) for x in d["counts"]), str(d.get("source", "")))

    def to_payload(self) -> dict[str, Any]:
        return {"lengths": list(self.lengths), "counts": list(self.counts), "source": self.source}


def describe(brief: dict[str, Any]) -> str:
    """One line for the terminal on the documents a plan was priced or run with (``brief`` or a
    breakdown's ``documents`` entry: count, median, p90, source, digest)."""
    n, p50, p90 = brief.get("documents"), brief.get("p50"), brief.get("p90")
    shape = f"{n:,} documents, median {p50:,} tokens, p90 {p90:,}" if n and p50 and p90 else "documents"
    digest = f", digest {brief['digest'][:8]}" if brief.get("digest") else ""
    return f"{shape} ({brief.get('source') or 'given windows'}{digest})"


# ---- reading distributions ----------------------------------------------------------------------
def read_histogram(path: str | Path, field: str = "--lengths") -> LengthDistribution:
    """``length,count`` per line (comma, tab or spaces; ``#`` comments and a header line allowed)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise InputError(f"{p} does not exist or is not a file", field=field)
    pairs: dict[int, int] = {}
    first = True  # the first line that is not blank or a comment may be a header
    for n, raw in enumerate(p.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        header, first = first, False
        parts = line.replace(",", " ").replace("\t", " ").split()
        if len(parts) != 2:
            raise InputError(f"{p}:{n}: expected 'length,count', got {raw.strip()!r}", field=field)
        try:
            length, count = int(parts[0]), int(parts[1])
        except ValueError:
            if header:
                continue
            raise InputError(f"{p}:{n}: length and count must be whole numbers, got {raw.strip()!r}",
                             field=field) from None
        if length < 1 or count < 0:
            raise InputError(f"{p}:{n}: length must be >= 1 and count >= 0, got {length}, {count}", field=field)
        if count:
            pairs[length] = pairs.get(length, 0) + count
    if not pairs:
        raise InputError(f"{p} holds no document (no line with a positive count)", field=field)
    keys = sorted(pairs)
    return LengthDistribution(tuple(keys), tuple(pairs[k] for k in keys), f"lengths:{p.name}")


def eod_positions(tokens: np.ndarray, eod: int) -> np.ndarray:
    return np.flatnonzero(np.asarray(tokens) == eod)


def lengths_from_eod(tokens: np.ndarray, eod: int) -> np.ndarray:
    """Document lengths of a flat token array: a document ends with (and includes) its EOD token;
    the tail after the last EOD is a document too."""
    ends = eod_positions(tokens, eod) + 1
    n = len(tokens)
    if ends.size == 0 or ends[-1] != n:
        ends = np.append(ends, n)
    return np.diff(np.concatenate([[0], ends]))


def megatron_lengths(idx: str | Path) -> np.ndarray:
    """Document lengths of a Megatron ``PREFIX.idx`` (megatron/core/datasets/indexed_dataset.py, v1:
    magic, version, dtype code, sequence count, document count, int32 sequence lengths, int64
    sequence pointers, int64 document indices): a document is the sequences between two indices."""
    with open(idx, "rb") as f:
        head = f.read(9 + 8 + 1 + 8 + 8)
        if len(head) < 34 or not head.startswith(b"MMIDIDX\x00\x00"):
            raise InputError(f"{idx} is not a Megatron index file (no MMIDIDX header)", field="--data")
        n_seq, n_doc = struct.unpack("<QQ", head[18:34])
        seq = np.frombuffer(f.read(4 * n_seq), dtype=np.int32).astype(np.int64)
        f.read(8 * n_seq)
        docs = np.frombuffer(f.read(8 * n_doc), dtype=np.int64)
    if seq.size != n_seq or docs.size != n_doc:
        raise InputError(f"{idx} is shorter than its header says", field="--data")
    if n_doc < 2:  # no document index: every sequence is a document
        return seq
    cum = np.concatenate([[0], np.cumsum(seq)])
    return np.diff(cum[docs])


def lognormal(mu: float, sigma: float, *, n: int = 20000, seed: int = 0, max_len: int | None = None,
              source: str | None = None) -> LengthDistribution:
    """``n`` lengths drawn from a log-normal (ln length ~ N(mu, sigma)), rounded, clipped to
    ``[1, max_len]``: for benchmarks and tests (say which corpus gave mu and sigma)."""
    x = np.random.default_rng(seed).lognormal(mu, sigma, n)
    x = np.clip(np.rint(x), 1, max_len or np.inf).astype(np.int64)
    return LengthDistribution.from_lengths(x, source or f"lognormal:mu={mu},sigma={sigma},n={n},seed={seed}")


# ---- packing ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Sampler:
    """A distribution's lengths and the CDFs of its plain and length-biased draws, as numpy's
    ``Generator.choice(a, p=p)`` builds them (``cdf = p.cumsum(); cdf /= cdf[-1]``, then one uniform per
    draw located with ``searchsorted(side="right")``): drawing with them consumes the generator as
    ``choice`` does, so the windows are the ones ``choice`` drew, bit for bit."""

    lengths: np.ndarray
    cdf: np.ndarray
    cdf_biased: np.ndarray
    mean: int
    """``int(mean length)``, at least 1: how many draws a window's remainder asks for at once."""

    @classmethod
    def of(cls, dist: LengthDistribution) -> _Sampler:
        lengths = np.asarray(dist.lengths, dtype=np.int64)
        counts = np.asarray(dist.counts, dtype=np.float64)
        biased = lengths * counts

        def cdf(p: np.ndarray) -> np.ndarray:
            c = p.cumsum()
            c /= c[-1]
            return c

        return cls(lengths, cdf(counts / counts.sum()), cdf(biased / biased.sum()), max(1, int(dist.mean())))


def sample_window(dist: LengthDistribution, seq_len: int, rng: np.random.Generator) -> tuple[int, ...]:
    """Document pieces of one window of a data-order stream (module docstring), summing to ``seq_len``."""
    sm = dist.sampler
    first = int(sm.lengths[sm.cdf_biased.searchsorted(rng.random(), side="right")])
    residual = int(first - rng.integers(0, first))  # the straddling document's part in this window: 1..first
    if residual >= seq_len:
        return (seq_len,)
    out, total = [residual], residual
    while total < seq_len:  # draws in batches; the window takes them up to the first that fills it
        drawn = sm.lengths[sm.cdf.searchsorted(rng.random(2 * (seq_len - total) // sm.mean + 4), side="right")]
        ends = total + np.cumsum(drawn)
        k = int(ends.searchsorted(seq_len, side="left"))  # the first draw whose end reaches the window's
        take = drawn[:k + 1]
        out.extend(take.tolist())
        total = int(ends[min(k, len(ends) - 1)])
    out[-1] -= total - seq_len  # the last document continues in the next window
    return tuple(out)


def window_rng(seed: int, step: int, row: int) -> np.random.Generator:
    """The generator of window (step, row) of a synthetic stream: any rank draws the same documents."""
    return np.random.default_rng([seed, step, row, 0x5EED])


def docs_of_window(tokens: np.ndarray, eod: int) -> tuple[int, ...]:
    """Document pieces of a window's input tokens (``seq_len`` of them): a piece ends after each EOD."""
    ends = eod_positions(tokens[:-1], eod) + 1
    bounds = np.concatenate([[0], ends, [len(tokens)]])
    return tuple(int(x) for x in np.diff(bounds) if x > 0)


def docs_between(ends: np.ndarray, start: int, seq_len: int) -> tuple[int, ...]:
    """Document pieces of the window ``[start, start + seq_len)`` of a file whose documents end at
    the sorted cumulative offsets ``ends`` (a Megatron index)."""
    lo, hi = np.searchsorted(ends, [start, start + seq_len], side="right")
    inner = ends[lo:hi]
    inner = inner[(inner > start) & (inner < start + seq_len)]
    bounds = np.concatenate([[start], inner, [start + seq_len]])
    return tuple(int(x) for x in np.diff(bounds))


# ---- balancing windows over data-parallel replicas ----------------------------------------------
def attention_pairs(docs: Sequence[int]) -> int:
    """Causal (query, key) pairs of a window with these document pieces: sum of n(n+1)/2."""
    return sum(n * (n + 1) // 2 for n in docs)


def assign_windows(costs: Sequence[float], samples: Sequence[int]) -> list[list[int]]:
    """Rows of a step's global batch for each DP replica, by cost rather than by count.

    Every replica keeps its count (``shares.samples``: the uneven shares of a mixed cluster stay
    what the plan says); the windows are dealt longest-processing-time first (Graham 1969): in
    decreasing cost (ties by row), each to the replica whose load per sample (its count stands for its
    speed) would be lowest, among those with room. Deterministic: every rank computes the same deal."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    load = [0.0] * len(samples)
    rows: list[list[int]] = [[] for _ in samples]
    for i in order:
        best = min((r for r in range(len(samples)) if len(rows[r]) < samples[r]),
                   key=lambda r: ((load[r] + costs[i]) / samples[r], r))
        rows[best].append(i)
        load[best] += costs[i]
    return [sorted(r) for r in rows]


def replica_rows(docs: Sequence[Sequence[int]], samples: Sequence[int], balance: str) -> list[list[int]]:
    """Rows of each replica: in order (``count``, ``shares.samples`` each) or by cost (``cost``)."""
    if balance == "cost":
        return assign_windows([attention_pairs(d) for d in docs], samples)
    out, start = [], 0
    for n in samples:
        out.append(list(range(start, start + n)))
        start += n
    return out


# ---- where the documents come from: the CLI's options, a study's record, a trial's payload -------
@dataclass(frozen=True)
class DocumentSource:
    """A workload of documents: the length distribution and, when read from a token file, that
    file and how its documents end (so trials train on the very windows that were priced)."""

    dist: LengthDistribution
    data: str | None = None
    """The token file (``--data``), None for a histogram (trials then draw synthetic windows)."""
    eod: int | None = None
    """The end-of-document id of a flat file; None for a Megatron dataset (its index has the ends)."""
    idx: str | None = None
    """A Megatron dataset's ``.idx``."""

    def record(self) -> dict[str, Any]:
        """What a study records: the distribution's summary (histogram included) and the source."""
        return {**self.dist.summary(), "data": self.data, "eod": self.eod, "idx": self.idx}

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> DocumentSource:
        return cls(LengthDistribution.from_summary(d), d.get("data"), d.get("eod"), d.get("idx"))

    def payload(self) -> dict[str, Any]:
        """The trial payload's ``documents`` entry (``runtime/documents.DocumentFeed``)."""
        if self.eod is not None:
            return {"eod": int(self.eod)}
        if self.idx is not None:
            return {"megatron_idx": self.idx}
        return self.dist.to_payload()


def documents_from_options(*, data: str | None, eod: int | None, lengths: str | None, vocab: int,
                           data_dtype: str = "auto") -> DocumentSource | None:
    """The documents that ``--data FILE --eod ID`` or ``--lengths FILE`` give (None: neither); bad
    combinations and unreadable files are InputErrors naming the option."""
    if eod is not None and data is None:
        raise InputError("needs --data (the token file whose documents end with this id)", field="--eod")
    if lengths is not None and data is not None:
        raise InputError("give --lengths FILE (a histogram, synthetic tokens) or --data FILE --eod ID, not both",
                         field="--lengths")
    if lengths is not None:
        return DocumentSource(read_histogram(lengths))
    if data is None or eod is None:
        return None
    from autotune.token_files import open_token_file

    tf = open_token_file(data, vocab, dtype=data_dtype)
    if not 0 <= eod < vocab:
        raise InputError(f"{eod} is not a token id of a vocabulary of {vocab}", field="--eod")
    if tf.fmt == "megatron":
        idx = str(Path(tf.path).with_suffix(".idx"))
        return DocumentSource(LengthDistribution.from_lengths(megatron_lengths(idx), f"megatron:{Path(idx).name}"),
                              data=tf.path, idx=idx)
    mm = np.memmap(tf.path, dtype=np.dtype(tf.dtype), mode="r", offset=tf.offset, shape=(tf.tokens,))
    found = lengths_from_eod(mm, eod)
    if len(found) < 2:
        raise InputError(f"{tf.path} holds no token {eod}: no document ends there; is --eod the right id?",
                         field="--eod")
    return DocumentSource(LengthDistribution.from_lengths(found, f"eod:{Path(tf.path).name}:{eod}"),
                          data=tf.path, eod=eod)


def plan_masks(plan: Any, docs: DocumentSource | None, doc_mask: bool | None) -> Any:
    """``plan`` with ``doc_mask`` as the options say: on by default when documents are given, off
    when asked; a plan that masks documents without any to mask is an InputError."""
    if docs is None:
        if doc_mask or (plan.doc_mask and doc_mask is None):
            raise InputError("the plan masks documents (doc_mask); give them with --data FILE --eod ID or "
                             "--lengths FILE, or pass --no-doc-mask", field="--doc-mask")
        return plan.replace(doc_mask=False) if plan.doc_mask else plan
    return plan.replace(doc_mask=doc_mask is not False)
