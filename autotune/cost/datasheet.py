"""A datasheet model that sees size: GEMM, attention and elementwise time on a GPU nobody profiled.

The flat datasheet rate (``peak x achievable_fraction`` whatever the shape) makes a micro-batch of 1
as efficient as one of 8 and a tp shard of 1/8 as efficient as the whole layer; measured per-layer
profiles say otherwise (issue 18: an A100 block at 8.7 ms per sample at micro-batch 1, 7.8 at 4).
This model prices each kernel from its shape and the device's datasheet figures:

* **GEMM** ``(m x k) @ (k x n)``: the output is cut into ``TILE x TILE`` tiles, one per SM at a time
  (NVIDIA, "Matrix Multiplication Background User's Guide", sections "Tile Quantization" and "Wave
  Quantization": a partial tile costs a whole one, and a last partial wave of tiles leaves SMs idle).
  Time = max(FLOPs / (peak x ceiling x tile efficiency x wave efficiency), bytes moved / HBM
  bandwidth) + one launch. The ceiling is the entry's ``achievable_fraction`` on tensor cores (the
  catalogue's sourced large-GEMM figure), ``CUDA_CORE_EFF`` for fp32 on CUDA cores.
* **Attention**, fused (flash / memory-efficient, ``DeviceSpec.fused_attention()``): the causal
  FLOPs at ``ATTN_EFF_MAX(head_dim) x seq / (seq + ATTN_SEQ_HALF)`` of peak, backward at
  ``ATTN_BWD_EFF`` of the forward's rate. Materialised (a runtime without fused kernels): QK^T and
  AV as batched GEMMs over the whole s x s square (the mask does not skip work) and the softmax,
  mask and dropout streaming the scores through HBM (``SCORE_PASSES`` passes each way).
* **Elementwise** (norms, activations, residuals, dropout): bytes / (HBM bandwidth x ``MEM_EFF``),
  plus ``LAUNCH_S`` per kernel (``KERNELS_BLOCK_FWD`` forward, twice that backward).

Constants and where they come from:

- ``TILE = 128``: cuBLAS/CUTLASS's common tensor-core thread-block tile (the guide's examples use
  128 x 128 and 256 x 128); a dimension below it gets the power-of-two tile that covers it, down to
  ``MIN_TILE = 16``.
- ``CUDA_CORE_EFF = 0.85``: cuBLAS SGEMM reaches ~14 of V100's 15.7 TFLOPS (NVIDIA V100 whitepaper
  figure of SGEMM throughput).
- ``MEM_EFF = 0.8``: streaming kernels reach ~80-90% of HBM peak (STREAM-like copy on A100 ~1.3 of
  1.555 TB/s, NVIDIA A100 whitepaper memory section); 0.8 for short kernels.
- ``ATTN_EFF_MAX`` {64: 0.55, 128: 0.65}, ``ATTN_SEQ_HALF = 512``, ``ATTN_BWD_EFF = 0.75``:
  FlashAttention-2 (Dao 2023), A100 causal forward ~170-190 TFLOPS of 312 at 16k tokens for head
  dims 64/128, about half that at 512; backward ~25% slower than forward.
- ``LAUNCH_S``: seconds per kernel (launch, host dispatch, the gap on the stream); ``KERNELS_BLOCK_FWD``: the
  kernels of a Megatron GPT block's forward (2 layer norms, QKV GEMM, 2 attention kernels (or the
  fused one) with softmax and dropout, output GEMM, 2 bias-dropout-adds, 2 MLP GEMMs, bias-GeLU,
  transposes). ``LAUNCH_S`` is the one fitted constant: on Sailor's measured OPT-350 layers
  (A100-40GB and V100-16GB, fp32 = TF32 on the A100, materialised attention), and checked on its
  GPT-Neo-2.7B layers, which it never saw (``benchmarks/bench_layers.py``: block fwd+bwd median
  error 3.9% there, against 35.5% for the flat datasheet rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

TILE = 128
MIN_TILE = 16
"""The narrowest tile edge (CUTLASS's smallest tensor-core tiles; a GEMV runs memory-bound)."""
CUDA_CORE_EFF = 0.85
MEM_EFF = 0.8
ATTN_EFF_MAX = {64: 0.55, 128: 0.65}
ATTN_SEQ_HALF = 512.0
ATTN_BWD_EFF = 0.75
SCORE_PASSES = 3
"""Passes of the s x s scores through HBM forward (mask + softmax, dropout, the AV GEMM's read)."""
LAUNCH_S = 28e-6
"""Fixed seconds per kernel: fitted (grid 2-64 us) on Sailor's OPT-350 layers, where 28 us gave the
lowest median error (7.8%; 4 us, a bare launch, gave 14.9%): an eager framework's per-op host cost
(dispatch, autograd, the Python of Megatron-DeepSpeed) as much as the launch itself."""
KERNELS_BLOCK_FWD = 18
KERNELS_HEAD_FWD = 4


@dataclass(frozen=True)
class SizeModel:
    """One GPU at one dtype as the shape-aware datasheet model sees it."""

    peak: float
    """Dense FLOP/s at the dtype (catalogue)."""
    ceiling: float
    """Fraction of peak a large, well-tiled GEMM reaches."""
    sms: int
    mem_bw: float
    bpe: int
    fused: bool
    """Fused attention (flash / memory-efficient) on the target runtime."""
    launch_s: float = LAUNCH_S

    def gemm_time(self, m: float, n: float, k: float, batch: float = 1.0) -> float:
        """Seconds of ``batch`` independent (m x k) @ (k x n) products."""
        return _gemm_time(self, m, n, k, batch)

    def _gemm_time(self, m: float, n: float, k: float, batch: float) -> float:
        if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
            return 0.0
        # a thin operand gets a thin tile (the libraries carry 16..128-wide kernels), else TILE
        sm_, sn = _tile(m), _tile(n)
        tm, tn = math.ceil(m / sm_), math.ceil(n / sn)
        tiles = tm * tn * batch
        tile_eff = (m * n) / (tm * tn * sm_ * sn)
        waves = math.ceil(tiles / self.sms)
        wave_eff = tiles / (waves * self.sms)
        compute = 2.0 * m * n * k * batch / (self.peak * self.ceiling * tile_eff * wave_eff)
        memory = self.bpe * (m * k + k * n + m * n) * batch / self.mem_bw
        return max(compute, memory) + self.launch_s

    def stream_time(self, nbytes: float, kernels: float = 0.0) -> float:
        """Seconds of memory-bound kernels moving ``nbytes`` in ``kernels`` launches."""
        return nbytes / (self.mem_bw * MEM_EFF) + kernels * self.launch_s

    def attention(self, batch_heads: float, seq: float, head_dim: int, causal_pairs: float) -> tuple[float, float]:
        """(fwd, bwd) seconds of attention for ``batch_heads`` (micro-batch x local heads) over
        ``seq`` queries, ``causal_pairs`` (query, key) pairs per head that the mask keeps."""
        if batch_heads <= 0 or seq <= 0:
            return 0.0, 0.0
        if self.fused:
            hds = sorted(ATTN_EFF_MAX)
            emax = ATTN_EFF_MAX[min(hds, key=lambda d: abs(d - head_dim))]
            eff = emax * seq / (seq + ATTN_SEQ_HALF)
            flops = 4.0 * head_dim * batch_heads * causal_pairs
            fwd = flops / (self.peak * eff) + self.launch_s
            return fwd, 2.0 * flops / (self.peak * eff * ATTN_BWD_EFF) + self.launch_s
        # materialised: two batched GEMMs over the full square, the scores streamed through HBM
        bmm = self.gemm_time(seq, seq, head_dim, batch_heads) + self.gemm_time(seq, head_dim, seq, batch_heads)
        scores = batch_heads * seq * seq * self.bpe
        fwd = bmm + self.stream_time(2.0 * SCORE_PASSES * scores, kernels=SCORE_PASSES)
        return fwd, 2.0 * bmm + self.stream_time(2.0 * SCORE_PASSES * scores, kernels=SCORE_PASSES)


@lru_cache(maxsize=4096)
def _gemm_time(sm: SizeModel, m: float, n: float, k: float, batch: float) -> float:
    """``SizeModel.gemm_time`` memoised: a pure function of the frozen (hashable) SizeModel and the
    shape, and the search prices the same shapes on the same GPUs over and over."""
    return sm._gemm_time(m, n, k, batch)


def _tile(dim: float) -> int:
    """The tile edge for a dimension: TILE, or the power of two >= it down to MIN_TILE."""
    return int(min(TILE, max(MIN_TILE, 2 ** math.ceil(math.log2(max(dim, 1.0))))))


def size_model(spec, dtype: str, bpe: int) -> SizeModel | None:
    """The shape-aware model of a datasheet GPU (None for CPUs, profiled devices and entries without
    an SM count, which keep the flat rate)."""
    if spec.kind not in ("cuda", "rocm") or not spec.sm_count or spec.provenance == "measured" or spec.profile:
        return None
    peak = spec.flops(dtype)
    strict = dtype == "fp32-strict" or (dtype == "fp32" and spec.peak_flops.get("fp32-strict") == peak)
    return SizeModel(peak=peak, ceiling=CUDA_CORE_EFF if strict else spec.achievable_fraction, sms=spec.sm_count,
                     mem_bw=spec.memory_bandwidth, bpe=bpe, fused=spec.fused_attention(), launch_s=LAUNCH_S)
