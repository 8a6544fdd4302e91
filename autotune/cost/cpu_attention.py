"""CPU attention priced by the tiles torch's flash kernel computes (``profile["attention_cpu"]``).

A CPU trial's attention is ``scaled_dot_product_attention``, which on CPU runs torch's flash kernel
(``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``): queries in blocks of 32 rows (under 192
tokens), 64 (under 768) or 256, keys in blocks of 512; a causal query block computes every key
block up to the one holding its last query's key, whole. So the work a call does is not the causal
pairs ``s (s + 1) / 2`` but the cells of the tiles it touches (``kernel_cells``): the full square up
to 512 tokens (2x the pairs), 1.5x the pairs at 1,024, 1.125x at 4,096. Measured on this project's
machine (fp32, head_dim 32, one thread, fwd + bwd per head): 7.6, 7.1, 7.1, 6.9, 7.0, 7.2 ns per
cell at 128, 512, 1,024, 2,048, 4,096, 8,192 tokens, where per *pair* it runs 15.2 ns to 7.7 ns.
Pricing per pair at one length and extrapolating (the old ``attention_head_time``) priced a 4,096
window 2.8x what it took, and short documents at half their cost (their calls run the full square).

The price of one call over ``heads`` (batch x head) rows, per direction::

    seconds = call_s + heads * (head_s + tok_s * q + cell_s * kernel_cells(q, k, causal))

``call_s`` is per SDPA call (dispatch, autograd node: what a document piece costs whatever its
length), ``head_s`` per head row, ``tok_s`` per query of a head (bf16's backward: ~0.5 us a query at
short lengths, where its time grows faster than its tiles: 224, 366, 554 us a head at 64, 160, 256
tokens, against 16, 102, 262 us of cells), ``cell_s`` per computed cell. The profile measures a few calls per
dtype and head dim (``profilers/compute.py``: short and long, one head and several) and ``fit_line``
solves the three by least squares in relative error. A masked window runs one call per document piece
(``runtime/documents.py``), so its price is this sum over its pieces (``cost/cpu.py:block_extras``).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from autotune.errors import InputError

Q_SPLITS = ((768, 256), (192, 64), (0, 32))
"""(from this many query tokens, query block rows): torch's CPU flash kernel's ``q_split_size``."""
KV_SPLIT = 512
"""Its key block (``kv_split_size``)."""
PARTS = ("call_s", "head_s", "tok_s", "cell_s")


@lru_cache(maxsize=65536)
def kernel_cells(q: int, k: int, causal: bool) -> float:
    """(query, key) cells the CPU flash kernel computes for ``q`` queries over ``k`` keys: all of them
    without a mask; causal (top-left, as ``is_causal``), every key block up to the one holding the
    query block's last visible key, whole."""
    q, k = int(q), int(k)
    if q <= 0 or k <= 0:
        return 0.0
    if not causal:
        return float(q) * k
    qb = min(next(rows for start, rows in Q_SPLITS if q >= start), q)
    kb = min(KV_SPLIT, k)
    total = 0
    for m in range(0, q, qb):
        rows = min(qb, q - m)
        keys = min(m + rows, k)
        total += rows * min(-(-keys // kb) * kb, k)
    return float(total)


@dataclass(frozen=True)
class Line:
    """One direction's price: ``call_s + heads * (head_s + tok_s * queries + cell_s * cells)``."""

    call_s: float
    head_s: float
    tok_s: float
    cell_s: float

    def at(self, queries: float, cells: float, heads: float) -> float:
        return self.call_s + heads * (self.head_s + self.tok_s * queries + self.cell_s * cells)


def fit_line(points: list[tuple[float, float, float, float]]) -> Line:
    """``Line`` through (queries, cells, heads, seconds) points: least squares in relative error, each
    part >= 0 (a negative one is noise: the best fit with it at 0, over the subsets that keep
    ``cell_s``)."""
    pts = [tuple(float(x) for x in p) for p in points if p[1] > 0 and p[2] > 0 and p[3] > 0]
    if not pts:
        raise ValueError("no attention points to fit")
    y = np.array([1.0 for _ in pts])
    cols = np.array([[1.0 / t, h / t, h * q / t, h * c / t] for q, c, h, t in pts])
    best, best_res = None, math.inf
    for keep in (s for n in (4, 3, 2, 1) for s in itertools.combinations(range(4), n) if 3 in s):
        coef, *_ = np.linalg.lstsq(cols[:, keep], y, rcond=None)
        if np.any(coef < 0):
            continue
        full = np.zeros(4)
        full[list(keep)] = coef
        res = float(np.sum((cols @ full - y) ** 2))
        if res < best_res - 1e-12:
            best, best_res = full, res
    if best is None:  # cells alone with a negative slope cannot happen with positive times
        raise ValueError("attention points give no non-negative fit")
    return Line(*(float(x) for x in best))


@dataclass(frozen=True)
class Curve:
    """One dtype and head dim: forward and backward ``Line``."""

    fwd: Line
    bwd: Line


class CpuAttention:
    """The profile's curves of one dtype, by head dim; ``call`` prices one SDPA call. Between profiled
    head dims each part is linear in head_dim; below the smallest, that one's curve (a cell's softmax
    and bookkeeping, not its dot products, set the time there: measured fp32 at 128 tokens, 122 us per
    head at head_dim 8 against 125 at 32); above the largest, its fixed parts and ``cell_s`` scaled
    with head_dim (the dot products dominate: 2.2x the cell cost from 32 to 64 at 4,096 tokens)."""

    def __init__(self, curves: dict[int, Curve], source: str = ""):
        if not curves:
            raise ValueError("no attention curves")
        self.curves, self.source = dict(sorted(curves.items())), source
        self.dims = list(self.curves)

    def _lines(self, head_dim: float) -> tuple[Line, Line]:
        dims = self.dims
        if head_dim <= dims[0]:
            return self.curves[dims[0]].fwd, self.curves[dims[0]].bwd
        if head_dim >= dims[-1]:
            c, r = self.curves[dims[-1]], head_dim / dims[-1]
            return tuple(Line(ln.call_s, ln.head_s, ln.tok_s, ln.cell_s * r)  # type: ignore[return-value]
                         for ln in (c.fwd, c.bwd))
        i = bisect.bisect_right(dims, head_dim)
        lo, hi = self.curves[dims[i - 1]], self.curves[dims[i]]
        w = (head_dim - dims[i - 1]) / (dims[i] - dims[i - 1])
        mix = [Line(*(getattr(a, p) + w * (getattr(b, p) - getattr(a, p)) for p in PARTS))
               for a, b in ((lo.fwd, hi.fwd), (lo.bwd, hi.bwd))]
        return mix[0], mix[1]

    def call(self, q: float, k: float, causal: bool, head_dim: float, heads: float) -> tuple[float, float]:
        """(forward, backward) seconds of one call over ``heads`` (batch x head) rows of ``q`` queries
        and ``k`` keys."""
        cells = kernel_cells(int(round(q)), int(round(k)), bool(causal))
        f, b = self._lines(head_dim)
        return f.at(q, cells, heads), b.at(q, cells, heads)


def _number(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise InputError(f"must be a finite number >= 0, got {v!r}", field=where)
    return float(v)


def read_curves(section: Any, dtype: str, where: str = "profile") -> CpuAttention | None:
    """The ``CpuAttention`` of ``dtype`` from a profile's ``attention_cpu`` section (None where the
    section or the dtype is absent: an older profile); a malformed entry is refused in one line."""
    if section is None or section == {}:
        return None
    if not isinstance(section, dict):
        raise InputError(f"must be a mapping of dtype to head dims, got {type(section).__name__}",
                         field=f"{where}.attention_cpu")
    by_hd = section.get(dtype)
    if by_hd is None:
        return None
    base = f"{where}.attention_cpu.{dtype}"
    if not isinstance(by_hd, dict) or not by_hd:
        raise InputError(f"must be a non-empty mapping of head dim to curves, got {by_hd!r}", field=base)
    curves = {}
    for hd, entry in by_hd.items():
        try:
            d = int(hd)
        except (TypeError, ValueError):
            raise InputError(f"head dim must be an integer, got {hd!r}", field=base) from None
        if d <= 0 or not isinstance(entry, dict):
            raise InputError(f"needs a positive head dim and a mapping, got {hd!r}: {entry!r}", field=base)
        lines = []
        for direction in ("fwd", "bwd"):
            part = entry.get(direction)
            if not isinstance(part, dict):
                raise InputError(f"missing (need {', '.join(PARTS)})", field=f"{base}.{hd}.{direction}")
            lines.append(Line(*(_number(part.get(p), f"{base}.{hd}.{direction}.{p}") for p in PARTS)))
        curves[d] = Curve(*lines)
    return CpuAttention(curves, f"{where} attention_cpu ({dtype}, head dims {', '.join(map(str, sorted(curves)))})")
