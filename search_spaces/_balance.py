"""Balanced uneven shares: split a total over the indices of one mesh dimension by device speed.

The share at index i of a dimension is the same for every coordinate of the other dimensions
(autotune.plan), so index i runs at the pace of its slowest rank: its weight is the minimum speed
(and memory) over the ranks that hold that index. Equal time per index means share_i ~ speed_i
(HexiSeq, Metis and FlashFlex balance the same way); ``speed_exp`` in [0, 1.5] lets the search
move between an even split (0), the balanced one (1) and beyond, and ``mem_exp`` leans the split
toward memory capacity where memory, not speed, is the limit.
"""

from __future__ import annotations

import math

import numpy as np


def coords_array(mesh: tuple[int, ...]) -> np.ndarray:
    """(world, len(mesh)) coordinates of every rank, ranks linearised with the last dim innermost."""
    world = int(np.prod(mesh))
    out = np.empty((world, len(mesh)), dtype=np.int64)
    r = np.arange(world)
    for k in range(len(mesh) - 1, -1, -1):
        out[:, k] = r % mesh[k]
        r = r // mesh[k]
    return out


def index_minimum(values: np.ndarray, coords: np.ndarray, axis: int, n: int) -> np.ndarray:
    """Per index along ``axis``: the minimum of ``values`` over the ranks holding that index."""
    out = np.full(n, np.inf)
    np.minimum.at(out, coords[:, axis], values)
    return out


def weights(speed: np.ndarray, mem: np.ndarray, speed_exp: float, mem_exp: float) -> np.ndarray:
    s = np.maximum(speed / max(speed.max(), 1e-30), 1e-9)
    m = np.maximum(mem / max(mem.max(), 1e-30), 1e-9)
    return s ** speed_exp * m ** mem_exp


def proportional_split(total_units: int, w: np.ndarray, minimum: int = 1,
                       offset: np.ndarray | None = None) -> list[int] | None:
    """``total_units`` integers ~ ``w`` (largest remainder), each >= ``minimum``; None if impossible.

    ``offset`` (units, may be negative) is subtracted from the ideal share of each index after the
    proportional split, e.g. the LM head's work on the last pipeline stage in layer-equivalents.
    """
    n = len(w)
    if total_units < n * minimum:
        return None
    if n == 1:
        return [total_units]
    w = np.asarray(w, dtype=float)
    off = np.zeros(n) if offset is None else np.asarray(offset, dtype=float)
    ideal = (total_units + off.sum()) * w / w.sum() - off
    # Equal weights and no offset must give exactly the even split (larger ones first). The test is
    # np.allclose(w, w[0]) written out: numpy's costs ~20 us on a handful of weights, and the search
    # splits three dimensions of every point it builds.
    w0 = float(w[0])
    if offset is None and all(abs(x - w0) <= 1e-8 + 1e-5 * abs(w0) for x in w.tolist()):
        q, r = divmod(total_units, n)
        return [q + (1 if i < r else 0) for i in range(n)]
    ideal = np.maximum(ideal, minimum)
    ideal *= total_units / ideal.sum()
    base = np.maximum(np.floor(ideal).astype(int), minimum)
    rest = total_units - int(base.sum())
    order = np.argsort(-(ideal - np.floor(ideal)), kind="stable")
    i = 0
    while rest > 0:
        base[order[i % n]] += 1
        rest -= 1
        i += 1
    while rest < 0:  # minimum pushed us over: take from the largest shares that can give
        j = int(np.argmax(base - minimum))
        if base[j] <= minimum:
            return None
        base[j] -= 1
        rest += 1
    return [int(x) for x in base]


def tilt(shares: list[int], amount: int, minimum: int = 1) -> list[int]:
    """Move ``amount`` units from the last index to the first (negative: the other way), keeping
    each >= ``minimum``. In 1F1B the first stage holds the most micro-batches in flight
    (Narayanan et al. 2021), so memory, not speed, may want fewer layers there (negative tilt)."""
    out = list(shares)
    if len(out) < 2 or amount == 0:
        return out
    src, dst = (len(out) - 1, 0) if amount > 0 else (0, len(out) - 1)
    move = min(abs(amount), out[src] - minimum)
    out[src] -= move
    out[dst] += move
    return out


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
