"""CPU trial physics: what eager PyTorch on a few cores pays that a GPU kernel stream does not.

Local trials (``autotune trial`` / ``validate`` on ``local:N``) run the real runtime on CPU processes
over gloo. At their small shapes fixed per-call costs rival the work, so the cost model adds, for a
device of ``kind == "cpu"`` only:

* a fixed cost per GEMM call (``gemm_call_s``): oneDNN packs its operands on every call, so a bf16
  128x64x64 product takes ~25 us whatever its FLOPs (measured: 25 us at 1 MFLOP, 66 us at 34 MFLOP,
  then ~1 TFLOP/s on one core of this project's Xeon with AMX); the GEMM rate by size is the
  profile's measured points interpolated (not the affine fit, pulled down by calls that leave cache);
* a fixed cost per elementwise operator (``op_s``: dispatch, allocation and the autograd node; the
  profile measures it as the intercept of a bf16 multiply's time against its elements, ~2 us here)
  times the operators a block issues (``CPU_OPS_BLOCK_FWD``), backward twice that;
* attention per SDPA call by the tiles torch's CPU flash kernel computes (``cpu_attention.py``,
  the profile's ``attention_cpu``: a fixed cost per call and per head, and a cost per computed cell;
  an older profile's measured times per (batch x head) call, interpolated in log(seq) and linearly in
  head_dim), with context parallelism one kernel call per ring block (``ring_blocks``) plus its
  online-softmax merge, with documents one call per piece and row;
* collectives from the profile's measured gloo table (``GlooTable``) where it covers the op and the
  group size: gloo's loopback costs are far from alpha-beta with a datasheet figure (a 64 KiB
  reduce-scatter takes ~0.5 ms, an all-reduce of the same ~0.2 ms);
* waits at every blocking collective inside a block (``sync_waits``): two ranks sharing two cores
  drift apart between syncs, and the one that arrives first waits;
* the vocab-parallel loss's and LM head's small tp collectives (``head_tp_comm``), which a GPU
  finishes in microseconds beside milliseconds of blocks.

The device model (``compute.py``, ``comm.py``) asks this module only where the device is a CPU, so
no GPU figure can depend on a constant here (``tests/unit/test_cost_cpu.py`` changes them all and
checks GPU predictions unchanged). Per-call constants are read from ``profile["overheads"]``
(``profilers/overheads.py``) when measured, else the defaults below (torch 2.13 on this project's
2-core machine; validate's calibration scales them with the rest).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.cost import comm as C
from autotune.cost.cpu_attention import CpuAttention, read_curves
from autotune.cost.interp import loglinear, loglog
from autotune.cost.ring import ring_blocks  # noqa: F401  (its old home: kept importable from here)
from autotune.errors import InputError

if TYPE_CHECKING:  # typing only: context.py builds on the dimension modules
    from autotune.cost.context import RankContext

CPU_GEMM_CALL_S = {"bf16": 25e-6, "fp16": 25e-6, "fp32": 8e-6, "fp32-strict": 8e-6}
"""Seconds per GEMM call on CPU beyond its FLOPs (one thread; see the module docstring)."""
CPU_OP_S = 6e-6
"""Seconds per elementwise operator on CPU (dispatch, allocation, autograd bookkeeping; a bf16
multiply of 32k elements takes ~8 us on one core here). Only the fallback for profiles without
``overheads.op_s``: the profiler's intercept (~2 us here) gave a lower held-out error."""
CPU_OPS_BLOCK_FWD = 44
"""Elementwise operators one block issues forward in the runtime's model: 2 RMSNorms x 9 (float,
pow, mean, add, rsqrt, mul, weight cast, mul, cast back), rotary on q and k 2 x 6 (chunk, neg,
cat, 2 mul, add), GQA repeat of k and v 2, 5 views/transposes of q, k, v and the output, SwiGLU 2
(silu, mul), residual adds 2, the tp entry points 2, the attention kernel's own set-up ~3."""
CPU_SYNC_CALL_S = 0.3e-3
"""CPU: seconds a blocking collective inside a block costs beyond its measured time (waking the
rank that waited; the profile times its collectives back to back, both ranks already there)."""
CPU_SYNC_SKEW = 0.1
"""CPU: the wait at a synchronisation inside a block, as a fraction of the compute since the last
one (two ranks sharing two cores drift apart between syncs). 0.1 on a quiet machine
(``benchmarks/bench_validate.py`` at load < 2); other load raises it (~0.45 at load 3), which the
calibration's comm factor then absorbs."""
CPU_OPS_HEAD_FWD = 12
"""Final norm (9) and the loss (float cast, log-softmax, gather: 3)."""
CPU_OPS_RING_BLOCK_FWD = 10
"""Operators per ring block forward beyond the kernel: split, GQA index_select of k and v, the
online-softmax merge in fp32 (casts, two exp, sub, mul x2, add, log)."""
SHORT_CALL_EXPONENT = 1.0
"""CPU attention below the shortest profiled sequence: time ~ seq^1, far slower to fall than the
FLOPs (seq^2). Trials here put the true exponent between 0.3 (a whole 128-token call, 0.35 ms per
head fwd+bwd, against ~0.45 at 256) and 0.75 (a 32-token ring block, 0.12 ms); 1 is what
``benchmarks/bench_validate.py`` chose: it leaves tiny and small with the same bias, so one
calibration factor serves both (0.5 over-prices the short ring blocks of tiny's CP by 2x)."""


@dataclass
class CpuRates:
    """The CPU-only terms of one device type at one dtype (``Rates.cpu``)."""

    gemm_call_s: float
    """Fixed seconds per GEMM call."""
    op_s: float
    """Fixed seconds per elementwise operator."""
    sync_call_s: float
    """Seconds per blocking collective inside a block beyond its measured time."""
    sync_skew: float
    """Wait at a sync inside a block per second of compute since the last sync."""
    gemm_points: tuple[list[float], list[float]] | None = None
    """The profile's GEMM rates by size (median per size), interpolated rather than fitted: the
    affine fit over the profiled sizes is pulled down by the largest calls (which leave the cache),
    ~460 GFLOP/s on this machine where the block's GEMMs run at 800-1000."""
    attn_head_times: dict[int, tuple[list[float], list[float], list[float]]] | None = None
    """{head_dim: (seq, fwd s, bwd s) of one (batch x head) causal call} from the profile."""
    attention: CpuAttention | None = None
    """The SDPA price by kernel tiles (``cpu_attention.py``) from the profile's ``attention_cpu``; where
    present it prices every attention call instead of ``attn_head_times``."""
    context: Context | None = None
    """The kernel price mapped onto the runtime's block and head as measured in context (``Context``;
    None: the profile has no ``block_ref`` for this dtype, and the kernel price stands alone)."""

    def gemm_time(self, flops: float, fallback_rate: float) -> float:
        """The per-call cost, then the measured rate at this size (``fallback_rate`` without points)."""
        rate = loglinear(*self.gemm_points, flops) if self.gemm_points is not None else fallback_rate
        return self.gemm_call_s + flops / rate

    def attention_head_time(self, seq: float, head_dim: int) -> tuple[float, float] | None:
        """(forward, backward) seconds of one causal (batch x head) call over ``seq`` tokens, from
        the profile's measured times (None without them): log-log in seq between points and beyond
        the longest (that segment's slope), linear in head_dim between profiled head dims and as
        sqrt(head_dim) above the largest; below the smallest head dim that one's time, below the
        shortest sequence as seq ** SHORT_CALL_EXPONENT. A short call costs far more than its FLOPs
        (trials here: 0.35 ms per head backward at seq 128 / head_dim 8, 0.5 ms at 256 / 32, where
        FLOP scaling from 256 / 64 gives 0.05 and 0.2)."""
        if not self.attn_head_times:
            return None
        e = SHORT_CALL_EXPONENT
        per_hd = {hd: (loglog(seqs, fw, seq, e), loglog(seqs, bw, seq, e)) for hd, (seqs, fw, bw) in
                  self.attn_head_times.items()}
        hds = sorted(per_hd)
        if head_dim <= hds[0]:
            return per_hd[hds[0]]
        if head_dim >= hds[-1]:
            f, b = per_hd[hds[-1]]
            r = math.sqrt(head_dim / hds[-1])
            return f * r, b * r
        k = bisect.bisect_right(hds, head_dim)
        lo, hi = hds[k - 1], hds[k]
        w = (head_dim - lo) / (hi - lo)
        f = per_hd[lo][0] + w * (per_hd[hi][0] - per_hd[lo][0])
        b = per_hd[lo][1] + w * (per_hd[hi][1] - per_hd[lo][1])
        return f, b


@dataclass(frozen=True)
class Context:
    """What a CPU trial's block and head cost in context: per piece and direction, ``measured = fixed
    + factor x kernel price``, solved from the profile's ``block_ref`` points (the runtime's own block
    and head at ``profilers/block_ref.py``'s reference shape, two micro-batch sizes) against the
    kernel price of the same shapes. ``fixed`` is the per-micro-batch cost the kernels timed alone
    miss (operator dispatch and autograd nodes, ~230 per block fwd + bwd), ``factor`` what running
    inside a step adds to every kernel (operands evicted between GEMMs, bf16 elementwise conversions).
    Each is (fixed s, factor, floor s) for (block fwd, block bwd, head fwd, head bwd) (``_line``)."""

    block_fwd: tuple[float, float, float]
    block_bwd: tuple[float, float, float]
    head_fwd: tuple[float, float, float]
    head_bwd: tuple[float, float, float]
    source: str

    @staticmethod
    def _at(line: tuple[float, float, float], x: float) -> float:
        a, k, floor = line
        return max(a + k * x, floor)

    def block(self, fwd: float, bwd: float) -> tuple[float, float]:
        """(fwd, bwd) seconds of a block whose kernel price is (``fwd``, ``bwd``), in context."""
        return self._at(self.block_fwd, fwd), self._at(self.block_bwd, bwd)

    def head(self, fwd: float, bwd: float) -> tuple[float, float]:
        return self._at(self.head_fwd, fwd), self._at(self.head_bwd, bwd)


def _line(x: tuple[float, ...], y: tuple[float, ...]) -> tuple[float, float, float]:
    """(fixed, factor, floor) of y = fixed + factor * x: through the first point (the negligible shape,
    whose measured time is what the block costs whatever its size), the factor least squares in
    relative error over the others (the reference shape's micro-batches). ``fixed`` may be negative
    (the kernel price of the negligible shape already counts some per-call costs, and the factor
    scales them too); ``floor`` (the first point's time) bounds a price from below. A factor <= 0
    (noise) falls back to the ratio of the sums."""
    x0, y0 = x[0], y[0]
    num = sum((xi - x0) * (yi - y0) / yi**2 for xi, yi in zip(x[1:], y[1:], strict=True) if yi > 0)
    den = sum((xi - x0) ** 2 / yi**2 for xi, yi in zip(x[1:], y[1:], strict=True) if yi > 0)
    k = num / den if den > 0 else 0.0
    if k > 0 and math.isfinite(k):
        return y0 - k * x0, k, y0
    sx, sy = sum(x[1:]), sum(y[1:])
    return 0.0, sy / sx if sx > 0 and sy > 0 else 1.0, 0.0


def _ref_model(shape: dict[str, Any], name: str) -> tuple[Any, int]:
    from autotune.specs.model import ModelSpec

    return (ModelSpec(name=name, layers=1, hidden=int(shape["hidden"]), heads=int(shape["heads"]),
                      kv_heads=int(shape["kv_heads"]), ffn_hidden=int(shape["ffn_hidden"]), vocab=int(shape["vocab"]),
                      activation=str(shape.get("activation", "swiglu")), source="profile block_ref"),
            int(shape["seq"]))


def context_of(prof: dict[str, Any], dtype: str,
               price: Callable[[Any, int, int], tuple[float, float, float, float]]) -> Context | None:
    """The ``Context`` of a CPU profile at ``dtype`` (None without two micro-batches of each piece):
    the reference shapes priced by ``price(model, seq, micro_batch)`` (the kernel model's block fwd,
    bwd and head fwd, bwd: ``compute.reference_price``), against what the profile measured for them."""
    ref = (prof.get("block_ref") or {}).get(dtype)
    if ref is None:
        return None
    try:  # a measurement that cannot be read is refused, not priced as if it were absent
        pts = {(str(p[0]), int(p[1])): (float(p[2]), float(p[3])) for p in ref["points"]}
        model, seq = _ref_model(ref["shape"], "cpu-ref")
        fixed_model, fixed_seq = _ref_model(ref["shape"]["fixed"], "cpu-fixed")
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise InputError(f"malformed measurement ({type(exc).__name__}: {exc}); profile the device again",
                         source=f"profile {prof.get('id', '?')}", field=f"block_ref.{dtype}") from None
    mbs = sorted({b for piece, b in pts if piece == "block" and b > 0 and ("head", b) in pts})
    if len(mbs) < 2:
        return None
    if ("block", 0) not in pts or ("head", 0) not in pts:  # no fixed shape: the line through two micro-batches
        mbs, first = mbs[1:], mbs[0]
    else:
        first = 0
    priced = [price(fixed_model, fixed_seq, 1) if first == 0 else price(model, seq, first)]
    priced += [price(model, seq, b) for b in mbs]
    measured = [(*pts["block", b], *pts["head", b]) for b in (first, *mbs)]
    lines = [_line(tuple(k[i] for k in priced), tuple(m[i] for m in measured)) for i in range(4)]
    if first != 0:  # the first point is a real micro-batch, not the negligible shape: no floor from it
        lines = [(a, k, 0.0) for a, k, _ in lines]
    src = (f"profile block_ref ({dtype}: the runtime's block and head at hidden {fixed_model.hidden} / seq "
           f"{fixed_seq} and hidden {model.hidden} / seq {seq}, micro-batches {', '.join(map(str, mbs))})")
    return Context(*lines, source=src)


def _overhead(over: dict[str, Any], key: str, dtype: str, default: float, source: str) -> float:
    """A measured per-call constant: a number, or {dtype: number} (the profiler measures GEMM calls
    per dtype); ``default`` where absent; a one-line InputError where it is not a finite
    non-negative number (as ``cost/layers.py`` refuses its measurements)."""
    v = over.get(key)
    field = f"overheads.{key}"
    if isinstance(v, dict):
        v, field = v.get(dtype), f"{field}.{dtype}"
    if v is None:
        return default
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
        raise InputError(f"must be a non-negative number of seconds, got {v!r}", source=source, field=field)
    return float(v)


def _gemm_points(prof: dict[str, Any], dtype: str) -> tuple[list[float], list[float]] | None:
    gemm = (prof.get("gemm") or {}).get(dtype)
    if not isinstance(gemm, dict):
        return None
    pts = sorted((float(a), float(b)) for a, b in gemm.get("points") or [] if a > 0 and b > 0)
    if not pts:
        return None
    by_size: dict[float, list[float]] = {}
    for a, b in pts:
        by_size.setdefault(a, []).append(b)
    xs = sorted(by_size)
    return xs, [sorted(by_size[x])[len(by_size[x]) // 2] for x in xs]


def _attention_head_times(prof: dict[str, Any], dtype: str = "fp32"
                          ) -> dict[int, tuple[list[float], list[float], list[float]]] | None:
    """Per head dim (seq, fwd s, bwd s) of one (batch x head) call: the profile's ``attention_trial``
    where it was measured in ``dtype`` (the CPU flash kernel's bf16 backward is several times its
    fp32 one), else its ``attention`` rows."""
    trial = prof.get("attention_trial") or {}
    att = trial if isinstance(trial, dict) and trial.get("dtype") == dtype and trial.get("by_head_dim") else (
        prof.get("attention") or {})
    by_hd = att.get("by_head_dim") if isinstance(att, dict) else None
    if not (isinstance(by_hd, dict) and by_hd):
        return None
    batch_heads = float(att.get("batch", 1)) * float(att.get("heads", 1))
    times = {}
    for k, v in by_hd.items():
        rows = sorted((float(a), float(b), float(c)) for a, b, c in (v.get("points") or [])
                      if float(b) > 0 and float(c) > 0)
        if rows:
            times[int(k)] = ([x[0] for x in rows], [x[1] / batch_heads for x in rows],
                             [x[2] / batch_heads for x in rows])
    return times or None


def cpu_rates(spec: Any, dtype: str) -> CpuRates:
    """The CPU terms of a ``kind == "cpu"`` DeviceSpec: measured where its profile has them."""
    prof = spec.profile or {}
    src = f"profile {prof.get('id', '?')}"
    over = prof.get("overheads") or {}
    if not isinstance(over, dict):
        raise InputError(f"must be an object of per-call seconds, got {over!r}", source=src, field="overheads")
    return CpuRates(
        gemm_call_s=_overhead(over, "gemm_call_s", dtype, CPU_GEMM_CALL_S.get(dtype, CPU_GEMM_CALL_S["fp32"]), src),
        op_s=_overhead(over, "op_s", dtype, CPU_OP_S, src),
        sync_call_s=_overhead(over, "sync_call_s", dtype, CPU_SYNC_CALL_S, src),
        sync_skew=_overhead(over, "sync_skew", dtype, CPU_SYNC_SKEW, src),
        gemm_points=_gemm_points(prof, dtype),
        attn_head_times=_attention_head_times(prof, dtype),
        attention=read_curves(prof.get("attention_cpu"), dtype, f"profile {prof.get('id', '?')}"))


# ---- compute ---------------------------------------------------------------------------------------
def block_extras(rates: Any, model: Any, *, elem: float, heads_local: int, micro_batch: int, block_seq: float,
                 blocks: tuple[tuple[int, int, bool], ...] | None) -> tuple[float, tuple[float, float] | None]:
    """(elementwise seconds with the block's per-operator costs, (attention fwd, bwd) seconds from
    measured call times or None without them) of one block on a CPU rank; ``elem`` is the block's
    memory-bound time. With cp > 1 (``blocks``) one kernel call per ring block; each block's fp32
    merge streams o and lse. With documents (weighted blocks: calls per window) one call per document
    piece and row. Priced by ``cpu_attention`` where the profile has ``attention_cpu`` (every call by
    its kernel tiles), else by the per-head times (a full block as the causal call with the same
    work, length sqrt(2 q k))."""
    cpu = rates.cpu
    elem = elem + CPU_OPS_BLOCK_FWD * cpu.op_s
    if cpu.attention is None and not cpu.attn_head_times:
        return elem, None
    n = heads_local * micro_batch
    if blocks:
        a_fwd = a_bwd = calls = merge = 0.0
        for blk in blocks:  # (q, k, causal) or, with documents, (q, k, causal, calls per sequence)
            ql, kl, causal = blk[0], blk[1], blk[2]
            per_row = len(blk) > 3  # documents: one call per row and piece, of the rank's heads
            w = blk[3] if per_row else 1.0
            f, b = _call(cpu, ql, kl, causal, model.head_dim, heads_local if per_row else n)
            k = w * (micro_batch if per_row else 1.0)
            a_fwd += k * f
            a_bwd += k * b
            calls += w
            merge += w * ql
        merge = merge * n * model.head_dim * 4.0 * 4.0  # o read+written, fp32, x2
        elem += calls * CPU_OPS_RING_BLOCK_FWD * cpu.op_s + rates.memory_time(merge)
        return elem, (a_fwd, a_bwd)
    return elem, _call(cpu, block_seq, block_seq, True, model.head_dim, n)


def _call(cpu: CpuRates, q: float, k: float, causal: bool, head_dim: int, heads: float) -> tuple[float, float]:
    """(fwd, bwd) seconds of one attention call over ``heads`` (batch x head) rows."""
    if cpu.attention is not None:
        return cpu.attention.call(q, k, causal, head_dim, heads)
    f, b = cpu.attention_head_time(q if causal else math.sqrt(2.0 * q * k), head_dim)
    return f * heads, b * heads


def attention_calls(cpu: CpuRates, calls: list[tuple[int, int, bool]], head_dim: int, heads: int) -> float:
    """Forward + backward seconds of these calls (each over ``heads`` rows) as ``block_extras`` prices
    them: the reference a benchmark measures the runtime's attention against."""
    return sum(sum(_call(cpu, q, k, c, head_dim, heads)) for q, k, c in calls)


def head_ops(rates: Any) -> float:
    """Seconds of the final norm's and the loss's operators (beyond their bytes)."""
    return CPU_OPS_HEAD_FWD * rates.cpu.op_s


# ---- communication ---------------------------------------------------------------------------------
_TABLE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


class GlooTable:
    """Collective times from a CPU profile's measured ``collective_table`` (nccl-tests conventions,
    measured with gloo by ``profilers/links.py``): inside the host, over a group size the table
    covers, the measured time at that size interpolated log-log in bytes (below the smallest size
    its time: the latency floor; above the largest, that point's algorithm bandwidth); anything
    else the alpha-beta formulas of ``comm.py``. A point-to-point exchange between two ranks (a CP
    ring pass, a pipeline send and its matching receive) is the two-rank all-to-all that moves the
    same bytes each way. Same methods as ``comm.FORMULAS``."""

    def __init__(self, table: list[dict[str, Any]] | None = None, source: str = "collective_table"):
        self.curves: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
        acc: dict[tuple[str, int], dict[float, list[float]]] = {}
        for i, row in enumerate(table or []):
            try:
                op, n, b, t = row["op"], int(row["group_size"]), float(row["bytes"]), float(row["time_s"])
            except (KeyError, TypeError, ValueError) as exc:  # refused, not skipped (cost/layers.py does the same)
                raise InputError(f"malformed row {row!r} ({type(exc).__name__}: {exc}); expected op, group_size, "
                                 "bytes, time_s", source=source, field=f"links.collective_table[{i}]") from None
            if op in _TABLE_OPS and n >= 2 and b > 0 and t > 0 and math.isfinite(t):
                acc.setdefault((op, n), {}).setdefault(b, []).append(t)
        for key, by_bytes in acc.items():
            xs = sorted(by_bytes)
            self.curves[key] = (xs, [statistics.median(by_bytes[x]) for x in xs])

    def _measured(self, op: str, link: Any, n: int, nbytes: float) -> float | None:
        if link.kind not in ("intra", "self"):
            return None
        c = self.curves.get((op, n))
        if c is None:
            return None
        xs, ys = c
        if nbytes <= xs[0]:
            return ys[0]
        if nbytes >= xs[-1]:
            return ys[-1] * nbytes / xs[-1]
        k = bisect.bisect_right(xs, nbytes)
        w = (math.log(nbytes) - math.log(xs[k - 1])) / (math.log(xs[k]) - math.log(xs[k - 1]))
        return math.exp(math.log(ys[k - 1]) + w * (math.log(ys[k]) - math.log(ys[k - 1])))

    def _priced(self, op: str, formula: Any, link: Any, n: int, nbytes: float,
                table_bytes: float | None = None) -> float:
        """The measured time where the table covers it, else the formula's."""
        if n < 2 or nbytes <= 0:
            return 0.0
        t = self._measured(op, link, n, nbytes if table_bytes is None else table_bytes) if self.curves else None
        return formula(link, n, nbytes) if t is None else t

    def all_reduce(self, link: Any, n: int, nbytes: float) -> float:
        return self._priced("all_reduce", C.all_reduce, link, n, nbytes)

    def all_gather(self, link: Any, n: int, nbytes: float) -> float:
        return self._priced("all_gather", C.all_gather, link, n, nbytes)

    def reduce_scatter(self, link: Any, n: int, nbytes: float) -> float:
        return self._priced("reduce_scatter", C.reduce_scatter, link, n, nbytes)

    def all_to_all(self, link: Any, n: int, max_bytes: float) -> float:
        # the table's bytes are each rank's whole input, its own part included
        return self._priced("all_to_all", C.all_to_all, link, n, max_bytes,
                            max_bytes * n / (n - 1) if n >= 2 else None)

    def p2p(self, link: Any, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        t = self._measured("all_to_all", link, 2, 2.0 * nbytes) if self.curves and link.kind != "self" else None
        return C.p2p(link, nbytes) if t is None else t


_TABLES: dict[int, tuple[Any, Any]] = {}


def measured_collectives(spec: Any) -> Any:
    """The gloo table of a profiled CPU (cached per spec object), else ``comm.FORMULAS``."""
    hit = _TABLES.get(id(spec))
    if hit is None or hit[0] is not spec:
        table = ((spec.profile or {}).get("links") or {}).get("collective_table")
        if len(_TABLES) > 64:
            _TABLES.clear()
        src = f"profile {(spec.profile or {}).get('id', '?')}"
        hit = _TABLES[id(spec)] = (spec, GlooTable(table, src) if table else C.FORMULAS)
    return hit[1]


def sync_waits(ctx: RankContext, comp_f: float, comp_b: float, z3: int = 0) -> tuple[float, float]:
    """(forward, backward) seconds one block waits at its blocking collectives (0 without any):
    per call ``sync_call_s`` plus ``sync_skew`` of the compute between syncs. Calls per block and
    micro-batch as the runtime issues them: Megatron f/g 2 all-reduces (4 with sequence parallelism:
    an all-gather and a reduce-scatter each), Ulysses 2 all-to-alls, the ring's cp - 1 K/V passes
    forward; backward the same, plus the ring's cp dK/dV passes and the recomputed forward's calls;
    ``z3`` (``data_parallel.zero3_gathers``) more each way: ZeRO-3's block gathers."""
    calls_f, calls_b = block_sync_calls(ctx, z3)
    if not calls_f:
        return 0.0, 0.0
    cpu = ctx.rates.cpu
    return (ctx.mf * (calls_f * cpu.sync_call_s + cpu.sync_skew * comp_f),
            ctx.mf * (calls_b * cpu.sync_call_s + cpu.sync_skew * comp_b))


def block_sync_calls(ctx: RankContext, z3: int = 0) -> tuple[int, int]:
    """(forward, backward) blocking collectives of one block and micro-batch (``sync_waits``)."""
    s = ctx.step
    tp, hp, cp = s.tp, s.hp, s.cp
    calls_f = (4 if s.sp else 2) * (tp > 1) + 2 * (hp > 1) + (cp - 1)
    if not calls_f + z3:
        return 0, 0
    return calls_f + z3, calls_f + cp * (cp > 1) + (calls_f if s.recompute == "full" else 0) + z3


def moe_sync_calls(step: Any) -> tuple[int, int]:
    """(forward, backward) blocking collectives one MoE layer issues per micro-batch in the runtime
    (``runtime/moe.py``, ``runtime/expert_parallel.py``): with ep > 1 the per-expert counts'
    all-gather and the dispatch and combine all-to-alls forward, the two all-to-alls back; with
    etp > 1 two counts' all-gathers and the rows' gather and partial sums' return (all-to-alls) forward,
    their two back; where a sequence is split at the router (cp, hp, tp under sequence parallelism)
    the per-sequence counts' all-reduce forward; with tp ranks holding the same tokens (no sequence
    parallelism) the output's all-gather forward, and back the gathers of the input's and the routing
    weights' gradients (each rank kept its part of both). A layer whose
    forward runs again in the backward (full recomputation, the ``moe`` module) issues its forward's
    calls there too."""
    x = step.experts
    route = step.cp * step.hp * (step.tp if step.sp else 1)
    split = int(step.tp > 1 and not step.sp)
    calls_f = 3 * (x.ep > 1) + 4 * (x.etp > 1) + (route > 1) + split
    calls_b = 2 * (x.ep > 1) + 2 * (x.etp > 1) + 2 * split
    if step.recompute == "full" or "moe" in step.recompute_modules:
        calls_b += calls_f
    return calls_f, calls_b


def moe_sync_waits(ctx: RankContext, comp_f: float, comp_b: float) -> tuple[float, float]:
    """(forward, backward) seconds one MoE layer waits at its blocking collectives
    (``moe_sync_calls``): ``sync_call_s`` each, and ``sync_skew`` of ``comp_f`` / ``comp_b``, the
    layer's compute no earlier wait of the block covered (``sync_waits``' rule)."""
    calls_f, calls_b = moe_sync_calls(ctx.step)
    if not calls_f + calls_b:
        return 0.0, 0.0
    cpu = ctx.rates.cpu
    return (ctx.mf * (calls_f * cpu.sync_call_s + cpu.sync_skew * comp_f),
            ctx.mf * (calls_b * cpu.sync_call_s + cpu.sync_skew * comp_b))


def moe_comm(ctx: RankContext) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE layer's small collectives on a CPU rank, from the gloo
    table (the dispatch's and the experts' all-to-alls are ``expert_dispatch.py``'s): the counts'
    all-gathers (ep: ``experts`` int64 per rank; etp: one int64, then the EP rank's sources x local
    experts), the per-sequence counts' all-reduce over the router's split (``[mbs, seq, experts]``
    fp32), and with tp ranks holding the same tokens the output's all-gather forward, the input's
    and the routing weights' gradients' back (``runtime/expert_parallel.py``). A GPU finishes these
    in microseconds beside the exchange; on gloo each costs ~0.1-0.3 ms."""
    s, K, x, e = ctx.step, ctx.collectives, ctx.step.experts, ctx.step.model.moe
    xl = ctx.expert_links
    f = K.all_gather(xl.ep_intra, x.ep, 8.0 * e.experts) if x.ep > 1 else 0.0
    if x.etp > 1:
        f += K.all_gather(xl.etp, x.etp, 8.0) + K.all_gather(xl.etp, x.etp, 8.0 * e.experts)
    route = s.cp * s.hp * (s.tp if s.sp else 1)
    if route > 1:
        link = ctx.links.cp if s.cp > 1 else (ctx.links.hp if s.hp > 1 else ctx.links.tp)
        f += K.all_reduce(link, route, 4.0 * s.mbs * s.seq_len * e.experts)
    b = 0.0
    if s.tp > 1 and not s.sp:
        gather = K.all_gather(ctx.links.tp, s.tp, ctx.hidden_bytes)
        f, b = f + gather, gather + K.all_gather(ctx.links.tp, s.tp, 4.0 * ctx.tokens_local * e.top_k)
    if s.recompute == "full" or "moe" in s.recompute_modules:
        b += f
    return ctx.mf * f, ctx.mf * b


def zero_step_sync(ctx: RankContext, comp_f: float, comp_b: float, n_blocks: int) -> float:
    """CPU: seconds a ZeRO rank that gathers once a step (ZeRO-2; ZeRO-3 with uneven replicas,
    ``data_parallel.gathers_per_microbatch``) waits at those meetings: each block's all-gather in its
    first forward and its reduce-scatter in the last backward are collectives matched by order over
    the gradient group, so, as at ``sync_waits``' calls, ``sync_call_s`` each plus ``sync_skew`` of the
    block's compute (``comp_f``, ``comp_b``: one micro-batch's), once a step. Trial
    (``benchmarks/bench_zero_cpu.py``, small dp=2 bf16, load 1.1-1.9, two runs): the wall clock
    exceeded the slowest rank's CPU seconds by 46-51 ms a step under ZeRO-2 and 14-19 ms under
    ZeRO-0, at one and at two micro-batches."""
    cpu = ctx.rates.cpu
    return ctx.mf * n_blocks * (2 * cpu.sync_call_s + cpu.sync_skew * (comp_f + comp_b))


def exposed_grad_sync(overlappable: float, exposed: float) -> tuple[float, float]:
    """CPU: the step's gradient reduction hides behind nothing. A local trial runs one compute thread
    per core, so gloo's thread, which would overlap the reduction with the last backward on a GPU's
    own stream, takes its turn on a busy core. Measured (``autotune tune``, small, dp=2 ZeRO-2 bf16,
    load ~1): 0.10-0.13 s a step in collectives on the runtime's time split, with the backward
    running alongside them nothing shorter, against a raw gloo-table price of 0.059 s priced as
    hidden. Returns (overlappable 0, exposed with it)."""
    return 0.0, exposed + overlappable


def head_tp_comm(ctx: RankContext) -> tuple[float, float]:
    """(forward, backward) seconds of the last stage's small tp collectives: the vocab-parallel
    loss's two all-reduces (the max, then sum-exp and target logit) and the LM head's entry
    (all-gather forward with sequence parallelism, the input gradient's all-reduce / reduce-scatter
    backward). ~0.2 ms per call on CPU; microseconds on a GPU, so the device model leaves them out."""
    K, link, tp, tok, act = ctx.collectives, ctx.links.tp, ctx.step.tp, ctx.tokens_local, ctx.hidden_bytes
    sp = ctx.step.sp
    f = ctx.mf * (K.all_reduce(link, tp, 4.0 * tok) + K.all_reduce(link, tp, 8.0 * tok)
                  + (K.all_gather(link, tp, act) if sp else 0.0))
    b = ctx.mf * (K.reduce_scatter(link, tp, act) if sp else K.all_reduce(link, tp, act))
    return f, b
