"""Compute time of one rank: device throughput for a shape (profile or datasheet) and the FLOPs of a
transformer block's pieces on that rank's share.

FLOPs (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", eq. 3, generalised to GQA and SwiGLU as in ``autotune.specs.model``): a matmul with an
(m x n) weight costs 2*m*n FLOPs per token forward and twice that backward (dgrad + wgrad); causal
attention's QK^T and AV cost 2 * 2 * head_dim per (query, key) pair that the mask keeps, per head.

Throughput. With a measured profile (``DeviceSpec.profile``, written by ``profilers/compute.py``):

* GEMM: ``gemm[dtype]`` holds the affine fit ``time = overhead_s + flops / peak_flops_per_s``
  (so small GEMMs are inefficient and large ones saturate: efficiency by size); without the fit,
  the ``points`` ``[[flops_per_call, flops_per_s], ...]`` are interpolated log-linearly.
* Attention: ``attention.by_head_dim[d].points`` ``[[seq, fwd_s, bwd_s], ...]`` measured with
  ``batch * heads`` independent heads and causal FLOPs ``2*batch*heads*seq^2*d`` (forward); the
  throughput at the rank's block length is interpolated log-linearly in the sequence length, at the
  nearest measured head dim.

Without a profile a GEMM or attention call runs at ``peak_flops[dtype] * achievable_fraction`` (the
catalogue documents each device's fraction; ~0.6 for large Megatron GEMMs on A100/H100, Narayanan et
al. 2021). Elementwise work (norms, activation, softmax, loss) is memory-bound: bytes moved divided by
``memory_bandwidth``.

CPU (``DeviceSpec.kind == "cpu"``: eager PyTorch on a few cores, the shapes of a local trial) adds
what dominates small shapes there and is negligible on a GPU kernel stream:

* a fixed cost per GEMM call (``gemm_call_s``): oneDNN packs its operands on every call, so a bf16
  128x64x64 product takes ~25 us whatever its FLOPs (measured: 25 us at 1 MFLOP, 66 us at 34 MFLOP,
  then ~1 TFLOP/s on one core of this project's Xeon with AMX);
* a fixed cost per elementwise operator (``op_s``: dispatch, allocation and the autograd node;
  the profile measures it as the intercept of a bf16 multiply's time against its elements, ~2 us
  here, its bytes being priced by ``memory_time``) times the operators a block issues
  (``CPU_OPS_BLOCK_FWD``, counted on ``autotune/runtime/model.py``), backward twice that;
* attention from the profile's measured *times* per (batch x head) call, interpolated in log(seq)
  and linearly in head_dim between profiled head dims (linear in seq below the shortest), not from a
  FLOP rate: torch's CPU flash kernel works in fixed blocks, so at short sequences its time hardly
  falls with the FLOPs (profile: fwd+bwd 6.8 ms at seq 256 vs 19.7 ms at 512 for 4 heads of 64).

Both constants are read from ``profile["overheads"]`` (``gemm_call_s``: seconds or {dtype: seconds};
``op_s``) when the profiler measures them (``profilers/overheads.py``), else the defaults below (measured with torch 2.13 on this project's 2-core machine;
validate's calibration scales them with the rest of the compute).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp32-strict": 4}

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


def _loglinear(xs: list[float], ys: list[float], x: float) -> float:
    """y at x, interpolated linearly in log(x) between measured points, clamped at the ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    k = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + w * (y1 - y0)


@dataclass
class Rates:
    """Throughput of one device type at one dtype: what a GEMM or an attention call takes."""

    name: str
    flat: float
    """FLOP/s without a profile: peak * achievable_fraction."""
    memory_bandwidth: float
    gemm_fit: tuple[float, float] | None = None
    """(overhead_s, peak_flops_per_s) from the profile's affine fit."""
    gemm_points: tuple[list[float], list[float]] | None = None
    attn_points: tuple[list[float], list[float], list[float]] | None = None
    """(seq, fwd FLOP/s, bwd FLOP/s) at the profiled head dim."""
    source: str = "datasheet"
    gemm_call_s: float = 0.0
    """Fixed seconds per GEMM call (CPU; 0 on accelerators)."""
    op_s: float = 0.0
    """Fixed seconds per elementwise operator (CPU; 0 on accelerators)."""
    sync_call_s: float = 0.0
    """CPU: seconds per blocking collective inside a block beyond its measured time (0 elsewhere)."""
    sync_skew: float = 0.0
    """CPU: wait at a sync inside a block per second of compute since the last sync (0 elsewhere)."""
    cpu: bool = False
    """The CPU terms apply (``DeviceSpec.kind == "cpu"``)."""
    cpu_gemm_points: tuple[list[float], list[float]] | None = None
    """CPU: the profile's GEMM rates by size (median per size), interpolated rather than fitted: the
    affine fit over the profiled sizes is pulled down by the largest calls (which leave the cache),
    ~460 GFLOP/s on this machine where the block's GEMMs run at 800-1000."""
    attn_head_times: dict[int, tuple[list[float], list[float], list[float]]] | None = None
    """CPU: {head_dim: (seq, fwd s, bwd s) of one (batch x head) causal call} from the profile."""

    def gemm_time(self, flops: float) -> float:
        if flops <= 0:
            return 0.0
        if self.cpu:  # CPU: the per-call cost, then the measured rate at this size
            if self.cpu_gemm_points is not None:
                rate = _loglinear(*self.cpu_gemm_points, flops)
            else:
                rate = self.gemm_fit[1] if self.gemm_fit is not None else self.flat
            return self.gemm_call_s + flops / rate
        if self.gemm_fit is not None:
            return self.gemm_fit[0] + flops / self.gemm_fit[1]
        if self.gemm_points is not None:
            return flops / _loglinear(*self.gemm_points, flops)
        return flops / self.flat

    def attention_time(self, flops_fwd: float, block_seq: float) -> tuple[float, float]:
        """(forward, backward) seconds of causal attention with ``flops_fwd`` forward FLOPs whose
        blocks are ``block_seq`` tokens long; backward does twice the forward FLOPs."""
        if flops_fwd <= 0:
            return 0.0, 0.0
        if self.attn_points is not None:
            seqs, fwd, bwd = self.attn_points
            return flops_fwd / _loglinear(seqs, fwd, block_seq), 2.0 * flops_fwd / _loglinear(seqs, bwd, block_seq)
        t = flops_fwd / self.flat
        return t, 2.0 * t

    def memory_time(self, nbytes: float) -> float:
        return nbytes / self.memory_bandwidth

    def attention_head_time(self, seq: float, head_dim: int) -> tuple[float, float] | None:
        """CPU: (forward, backward) seconds of one causal (batch x head) call over ``seq`` tokens,
        from the profile's measured times (None without them): log-log in seq between points and
        beyond the longest (that segment's slope), linear in head_dim between profiled head dims and
        as sqrt(head_dim) above the largest; below the smallest head dim that one's time, below the
        shortest sequence as seq ** SHORT_CALL_EXPONENT. torch's CPU flash kernel works in fixed blocks, so a short
        call costs far more than its FLOPs (trials here: 0.35 ms per head backward at seq 128 /
        head_dim 8, 0.5 ms at 256 / 32, where FLOP scaling from 256 / 64 gives 0.05 and 0.2)."""
        if not self.attn_head_times:
            return None
        per_hd = {hd: (_loglog(seqs, fw, seq), _loglog(seqs, bw, seq)) for hd, (seqs, fw, bw) in
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


def _loglog(xs: list[float], ys: list[float], x: float) -> float:
    """y at x, linear in (log x, log y) between points and beyond the last (its segment's slope,
    at least 0); below the first point as x ** ``SHORT_CALL_EXPONENT``."""
    if x <= xs[0]:
        return ys[0] * (x / xs[0]) ** SHORT_CALL_EXPONENT if x > 0 else 0.0
    if len(xs) == 1:
        return ys[0]
    k = len(xs) - 1 if x >= xs[-1] else bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
    slope = max(0.0, (math.log(y1) - math.log(y0)) / (math.log(x1) - math.log(x0)))
    return math.exp(math.log(y0) + slope * (math.log(x) - math.log(x0)))


SHORT_CALL_EXPONENT = 1.0
"""CPU attention below the shortest profiled sequence: time ~ seq^1, far slower to fall than the
FLOPs (seq^2). Trials here put the true exponent between 0.3 (a whole 128-token call, 0.35 ms per
head fwd+bwd, against ~0.45 at 256) and 0.75 (a 32-token ring block, 0.12 ms); 1 is what
``benchmarks/bench_validate.py`` chose: it leaves tiny and small with the same bias, so one
calibration factor serves both (0.5 over-prices the short ring blocks of tiny's CP by 2x)."""


def rates_for(spec: Any, dtype: str, head_dim: int) -> Rates:
    """Build the throughput model of a DeviceSpec (profile fits where present, else the datasheet)."""
    flat = spec.flops(dtype) * spec.achievable_fraction
    r = Rates(name=spec.name, flat=flat, memory_bandwidth=spec.memory_bandwidth,
              source=spec.provenance if spec.provenance != "measured" else "measured (no fits)")
    prof = spec.profile or {}
    cpu = r.cpu = spec.kind == "cpu"
    if cpu:
        over = prof.get("overheads") if isinstance(prof.get("overheads"), dict) else {}

        def pick(key: str, default: float) -> float:
            # a number, or {dtype: number} (the profiler measures GEMM calls per dtype): the plan's
            v = over.get(key)
            if isinstance(v, dict):
                v = v.get(dtype)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            return float(v) if ok else default

        r.gemm_call_s = pick("gemm_call_s", CPU_GEMM_CALL_S.get(dtype, CPU_GEMM_CALL_S["fp32"]))
        r.op_s = pick("op_s", CPU_OP_S)
        r.sync_call_s = pick("sync_call_s", CPU_SYNC_CALL_S)
        r.sync_skew = pick("sync_skew", CPU_SYNC_SKEW)
    gemm = (prof.get("gemm") or {}).get(dtype)
    if isinstance(gemm, dict):
        rate, over = gemm.get("peak_flops_per_s"), gemm.get("overhead_s") or 0.0
        pts = sorted((float(a), float(b)) for a, b in gemm.get("points") or [] if a > 0 and b > 0)
        if spec.kind == "cpu" and pts:
            by_size: dict[float, list[float]] = {}
            for a, b in pts:
                by_size.setdefault(a, []).append(b)
            xs = sorted(by_size)
            r.cpu_gemm_points = (xs, [sorted(by_size[x])[len(by_size[x]) // 2] for x in xs])
        if isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0:
            r.gemm_fit = (float(over), float(rate))
            r.source = "measured"
        elif pts:
            r.gemm_points = ([p[0] for p in pts], [p[1] for p in pts])
            r.source = "measured"
    att = prof.get("attention") or {}
    by_hd = att.get("by_head_dim") if isinstance(att, dict) else None
    if isinstance(by_hd, dict) and by_hd:
        hd = min(by_hd, key=lambda k: abs(int(k) - head_dim))
        batch_heads = float(att.get("batch", 1)) * float(att.get("heads", 1))
        seqs, fw, bw = [], [], []
        for row in sorted(by_hd[hd].get("points") or []):
            seq, f_s, b_s = float(row[0]), float(row[1]), float(row[2])
            if f_s <= 0 or b_s <= 0:
                continue
            flops = 2.0 * batch_heads * seq * seq * int(hd)  # the profiler's causal forward count
            seqs.append(seq)
            fw.append(flops / f_s)
            bw.append(2.5 * flops / b_s)  # the profiler counts backward as 2.5x forward
        if seqs:
            r.attn_points = (seqs, fw, bw)
        if cpu:
            times = {}
            for k, v in by_hd.items():
                rows = sorted((float(a), float(b), float(c)) for a, b, c in (v.get("points") or [])
                              if float(b) > 0 and float(c) > 0)
                if rows:
                    times[int(k)] = ([x[0] for x in rows], [x[1] / batch_heads for x in rows],
                                     [x[2] / batch_heads for x in rows])
            r.attn_head_times = times or None
    return r


def causal_keys(tokens: tuple[int, ...], index: int, zigzag: bool, seq_len: int) -> float:
    """Sum over the query positions of CP shard ``index`` of the keys each attends (causal: q + 1).

    Contiguous shards: shard i covers [a, a + n) with a the tokens of the shards before it, so later
    shards cost more (sum = n*a + n(n+1)/2). Zigzag (load-balanced, as Megatron-CP and ring-flash-
    attention do): shard i holds a front chunk [A, A + n/2) and its mirror [S - A - n/2, S - A), so
    every shard of an even split costs the same."""
    n = tokens[index]
    if not zigzag or len(tokens) == 1:
        a = sum(tokens[:index])
        return n * a + n * (n + 1) / 2.0
    half = n // 2
    a = sum(tokens[:index]) // 2
    b = seq_len - a - half
    return (half * a + half * (half + 1) / 2.0) + (half * b + half * (half + 1) / 2.0)


def ring_blocks(tokens: tuple[int, ...], index: int, zigzag: bool, seq_len: int) -> tuple[tuple[int, int, bool], ...]:
    """The attention blocks CP rank ``index`` computes over one ring turn: ``(query length, key
    length, causal)`` for every (own query segment, key segment of any rank) pair with a visible key,
    the rule of ``autotune/runtime/ring_attention.py:_pairs`` over the segments of
    ``autotune/runtime/attention.py:shard_segments`` (zigzag: a front and a mirrored back segment)."""
    segs = []
    a = 0
    for t in tokens:
        if zigzag and len(tokens) > 1:
            f = t // 2
            segs.append([(a, f), (seq_len - a - f, f)])
            a += f
        else:
            segs.append([(a, t)])
            a += t
    out = []
    for qs, ql in segs[index]:
        for ksegs in segs:
            for ks, kl in ksegs:
                if ql and kl and ks < qs + ql:
                    out.append((ql, kl, not (ks + kl <= qs + 1)))
    return tuple(out)


CPU_OPS_RING_BLOCK_FWD = 10
"""Operators per ring block forward beyond the kernel: split, GQA index_select of k and v, the
online-softmax merge in fp32 (casts, two exp, sub, mul x2, add, log)."""


@dataclass
class LayerCompute:
    """Seconds one rank spends computing one block for one micro-batch (no communication)."""

    gemm_fwd: float
    attn_fwd: float
    attn_bwd: float
    elem_fwd: float

    @property
    def fwd(self) -> float:
        return self.gemm_fwd + self.attn_fwd + self.elem_fwd

    @property
    def bwd(self) -> float:
        # GEMM backward = dgrad + wgrad, each the forward's size; elementwise backward twice forward
        return 2.0 * self.gemm_fwd + self.attn_bwd + 2.0 * self.elem_fwd


def layer_compute(model: Any, rates: Rates, *, tokens: float, tp: int, heads_local: int, keysum: float,
                  block_seq: float, micro_batch: int, act_bytes: float,
                  blocks: tuple[tuple[int, int, bool], ...] | None = None) -> LayerCompute:
    """One block on one rank.

    tokens: tokens in the sequence-sharded parts (micro_batch * cp shard / hp); heads_local: query
    heads this rank attends after tp and hp; keysum: sum of keys attended per query position over the
    rank's queries (``causal_keys``, whole cp shard: Ulysses gives each hp rank all of its shard's
    tokens for its heads); act_bytes: the block's stored activation bytes (elementwise traffic);
    blocks: with cp > 1 the ring's blocks (``ring_blocks``), priced one kernel call each on CPU."""
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    gemm = (rates.gemm_time(2.0 * tokens * h * (h + 2 * kv) / tp)          # fused QKV projection
            + rates.gemm_time(2.0 * tokens * h * h / tp)                    # output projection
            + rates.gemm_time(2.0 * tokens * h * f * (model.mlp_matrices - 1) / tp)  # up (and gate)
            + rates.gemm_time(2.0 * tokens * f * h / tp))                   # down projection
    attn_flops = 4.0 * model.head_dim * heads_local * micro_batch * keysum
    elem = rates.memory_time(2.0 * act_bytes) + CPU_OPS_BLOCK_FWD * rates.op_s  # written once, read once
    if rates.attn_head_times and blocks:
        # CPU ring: one kernel call per block (a causal one at its length, a full one as the causal
        # call with the same work, length sqrt(2 q k)); each block's fp32 merge streams o and lse
        a_fwd = a_bwd = 0.0
        for ql, kl, causal in blocks:
            f, b = rates.attention_head_time(ql if causal else math.sqrt(2.0 * ql * kl), model.head_dim)
            a_fwd += f
            a_bwd += b
        n = heads_local * micro_batch
        a_fwd, a_bwd = a_fwd * n, a_bwd * n
        merge = sum(ql for ql, _, _ in blocks) * n * model.head_dim * 4.0 * 4.0  # o read+written, fp32, x2
        elem += len(blocks) * CPU_OPS_RING_BLOCK_FWD * rates.op_s + rates.memory_time(merge)
    elif rates.attn_head_times:
        # CPU: measured call times per (batch x head) at the shard's length
        f, b = rates.attention_head_time(block_seq, model.head_dim)
        n = heads_local * micro_batch
        a_fwd, a_bwd = f * n, b * n
    else:
        a_fwd, a_bwd = rates.attention_time(attn_flops, block_seq)
    return LayerCompute(gemm_fwd=gemm, attn_fwd=a_fwd, attn_bwd=a_bwd, elem_fwd=elem)


def head_compute(model: Any, rates: Rates, *, tokens: float, tp: int) -> tuple[float, float]:
    """(fwd, bwd) seconds of the LM head (vocab-parallel over tp) and the cross-entropy on the last
    stage: GEMM 2*h*V/tp per token, and the fp32 logits read/written ~3 times by the softmax-loss."""
    g = rates.gemm_time(2.0 * tokens * model.hidden * model.vocab / tp)
    e = rates.memory_time(3.0 * 4.0 * tokens * model.vocab / tp) + CPU_OPS_HEAD_FWD * rates.op_s
    return g + e, 2.0 * g + e
