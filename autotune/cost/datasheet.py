"""A datasheet model that sees size: GEMM, attention and elementwise time on a GPU nobody profiled.

The flat datasheet rate (``peak x achievable_fraction`` whatever the shape) makes a micro-batch of 1
as efficient as one of 8 and a tp shard of 1/8 as efficient as the whole layer; measured per-layer
profiles say otherwise (issue 18: an A100 block at 8.7 ms per sample at micro-batch 1, 7.8 at 4).
This model prices each kernel from its shape and the device's datasheet figures:

* **GEMM** ``(m x k) @ (k x n)``: the output is cut into ``TILE x TILE`` tiles, one per SM at a time
  (NVIDIA, "Matrix Multiplication Background User's Guide", sections "Tile Quantization" and "Wave
  Quantization": a partial tile costs a whole one, and a last partial wave of tiles leaves SMs idle).
  Time = max(FLOPs / (peak x sustained clock x ceiling x tile eff. x wave eff. x depth eff.), bytes
  moved / HBM bandwidth). The ceiling is the catalogue's ``gemm_ceiling`` (the fraction of dense
  peak a large GEMM reaches through cuBLAS, measured, with its source), kept apart from end-to-end
  efficiency (``achievable_fraction``, which no longer enters here: the old model used it as every
  GEMM's ceiling and then added the rest of a step's losses again); the sustained clock is the
  catalogue's (a benchmark runs at boost, a training run at its power limit); the depth efficiency
  ``k / (k + K_FILL)`` is the fixed fill and drain of every output tile.
* **Attention**, fused (flash / memory-efficient, ``DeviceSpec.fused_attention()``): the causal
  FLOPs at ``ATTN_EFF_MAX(head_dim) x seq / (seq + ATTN_SEQ_HALF)`` of peak, backward 2.5x the
  forward's FLOPs (it recomputes QK^T) at ``ATTN_BWD_EFF`` of the forward's rate. Materialised (a
  runtime without fused kernels): QK^T and AV as batched GEMMs over the whole s x s square (the
  mask does not skip work) and the softmax, mask and dropout streaming the scores through HBM
  (``SCORE_PASSES`` passes each way); under context parallelism one such square per block of the
  rank's ring (``ring.ring_blocks``: its queries against every key block they see), not one square
  of its own shard.
* **FP8** (``autotune.plan_parts.FP8_RECIPES``): the linear layers' GEMMs (``gemm_time``) run at the
  device's FP8 peak (``Fp8Linear``: MXFP8's own key on Blackwell) with their inputs read at 1 byte and
  their output written in bf16, plus the recipe's quantisation passes over each GEMM's activation
  input (``QUANT_BYTES``); attention and the LM head stay in bf16 (``hp``), as Transformer Engine and
  torchao keep them.
* **Elementwise** (norms, activations, residuals, dropout): bytes / (HBM bandwidth x ``MEM_EFF``);
  the bytes and the kernels a block issues are the runtime's (``kernels.py``: fused, or each eager
  op on its own), and so is the host time per kernel.

Constants and where they come from:

- ``TILE = 128``: cuBLAS/CUTLASS's common tensor-core thread-block tile (the guide's examples use
  128 x 128 and 256 x 128); a dimension below it gets the power-of-two tile that covers it, down to
  ``MIN_TILE = 16``.
- ``CUDA_CORE_EFF``: IEEE fp32 on CUDA cores, the catalogue's SGEMM figure (~14 of V100's 15.7 TFLOPS).
- ``MEM_EFF = 0.8``: streaming kernels reach ~80-90% of HBM peak (STREAM-like copy on A100 ~1.3 of
  1.555 TB/s, NVIDIA A100 whitepaper memory section); 0.8 for short kernels.
- ``ATTN_EFF_MAX`` {64: 0.55, 128: 0.65}, ``ATTN_SEQ_HALF = 512``, ``ATTN_BWD_EFF = 0.75``:
  FlashAttention-2 (Dao 2023), A100 causal forward ~170-190 TFLOPS of 312 at 16k tokens for head
  dims 64/128, about half that at 512; the H200 sweep of benchmarks/gpu_gemm.py finds the backward's
  rate (counting 2.5x the forward's FLOPs) at 0.76 of the forward's.
- ``K_FILL``: fitted on the H200 GEMM sweep (below).
- The runtime's host time per kernel and kernel counts: ``kernels.py`` (Sailor's Megatron-DeepSpeed
  runtime's host time is fitted on its OPT-350 layers and checked on GPT-Neo-2.7B, which it never
  saw: ``benchmarks/bench_layers.py``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from autotune.cost.kernels import MEGATRON_DEEPSPEED_EAGER, RUNTIME, KernelCosts
from autotune.plan_parts import FP8_RECIPES, compute_dtype, gemm_peak
from autotune.specs.catalogue import SGEMM_CEILING_DEFAULT
from autotune.specs.model import ATTENTION_BWD_FLOPS  # noqa: E402  (a fused backward's FLOPs per forward FLOP)

TILE = 128
MIN_TILE = 16
"""The narrowest tile edge (CUTLASS's smallest tensor-core tiles; a GEMV runs memory-bound)."""
CUDA_CORE_EFF = SGEMM_CEILING_DEFAULT
"""IEEE fp32 on CUDA cores where a device has no measured figure (the catalogue's, with its source)."""
MEM_EFF = 0.8
ATTN_EFF_MAX = {64: 0.55, 128: 0.65}
ATTN_SEQ_HALF = 512.0
ATTN_BWD_EFF = 0.75
K_FILL = 512.0
"""A GEMM's depth k costs a fixed fill and drain per output tile on top of its k / tile_k main-loop
steps: efficiency k / (k + K_FILL), relative to the catalogue ceiling's own shape (K_REF deep).
Fitted (grid 0-1024) on the H200 GEMM sweep of benchmarks/gpu_gemm.py (12 transformer shapes of
bf16, m, n, k >= 1536, benchmarks/data/h200/h200_gemm.json): mean error 3.2% (4096 x 1536 x 12288 at
0.53 of peak, 8192 x 14336 x 4096 at 0.69), against 7.4% with the ceiling alone; fitted on GEMMs
only, never on a training run."""
K_MIN = 1536.0
"""The shallowest depth the fit saw; a shallower GEMM (attention's QK^T, k = head dim) keeps this depth's efficiency."""
K_REF = 8192.0
"""Depth of the shapes the catalogue's ceilings were measured at (MAMF's best shapes, k 2816-13312;
the H200 sweep's 8192^3)."""
SCORE_PASSES = 3
"""Passes of the s x s scores through HBM forward (mask + softmax, dropout, the AV GEMM's read)."""
LAUNCH_S = MEGATRON_DEEPSPEED_EAGER.host_s
"""Host seconds per kernel of the runtime Sailor measured (kept for ``benchmarks/bench_layers.py``,
which re-fits it); each runtime's own figure is its ``kernels.KernelCosts.host_s``."""
KERNELS_BLOCK_FWD = MEGATRON_DEEPSPEED_EAGER.block_fwd
KERNELS_HEAD_FWD = MEGATRON_DEEPSPEED_EAGER.head_fwd


QUANT_BYTES = {"delayed": 4.0, "current": 6.0, "blockwise": 4.0, "mxfp8": 4.0}
"""HBM bytes per element of an FP8 GEMM's activation input that its recipe's quantisation moves:
reading the bf16 input (2) and writing the FP8 copy and its transpose for the weight gradient (1 + 1,
Transformer Engine's fused cast-transpose); ``current`` scaling first reads the input once more for
this step's amax (+2); ``delayed`` takes its scale from the amax history (fused into the cast);
blockwise and MXFP8 compute each block's scale inside the cast kernel (their scales, 1 byte per 128
or 32 elements, are left out). Priced once per GEMM call and twice in the backward with the rest of
the GEMM (the gradient's cast is the same size for the square-ish shapes of a block)."""


@dataclass(frozen=True)
class Fp8Linear:
    """How a SizeModel's linear GEMMs run under an FP8 recipe."""

    peak: float
    """FP8 dense FLOP/s at the sustained clock (``fp8``, or ``mxfp8`` for MXFP8)."""
    ceiling: float
    """Fraction of that peak a large FP8 GEMM reaches (the catalogue's ``gemm_fraction``)."""
    quant_bytes: float
    """``QUANT_BYTES`` of the recipe."""


@dataclass(frozen=True)
class SizeModel:
    """One GPU at one dtype, run by one runtime, as the shape-aware datasheet model sees it."""

    peak: float
    """Dense FLOP/s at the dtype (catalogue)."""
    ceiling: float
    """Fraction of peak a large, well-tiled GEMM reaches (the catalogue's ``gemm_ceiling``)."""
    sms: int
    mem_bw: float
    bpe: int
    fused: bool
    """Fused attention (flash / memory-efficient) on the target runtime."""
    flash: bool = True
    """The fused attention is FlashAttention-2-class (``DeviceSpec.flash_attention``); False: the
    memory-efficient kernel of a device older than Ampere (``attention``)."""
    kernels: KernelCosts = RUNTIME
    """The runtime's host time per kernel and kernels per block (``kernels.py``)."""
    tensor_cores: bool = True
    """Tensor-core GEMMs (the depth efficiency of ``K_FILL`` applies); False: IEEE fp32 on CUDA cores."""
    fp8: Fp8Linear | None = None
    """Under an FP8 dtype, how ``gemm_time`` (the linear layers) runs; None: at ``peak`` in ``bpe``."""

    @property
    def hp(self) -> SizeModel:
        """This model without FP8: what attention's and the LM head's GEMMs run at."""
        return self if self.fp8 is None else _high_precision(self)

    def gemm_time(self, m: float, n: float, k: float, batch: float = 1.0) -> float:
        """GPU seconds of ``batch`` independent (m x k) @ (k x n) products of a linear layer (the
        launch is the runtime's: ``block``); FP8 under an FP8 dtype."""
        return _gemm_time(self, m, n, k, batch)

    def _gemm_time(self, m: float, n: float, k: float, batch: float) -> float:
        if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
            return 0.0
        if self.fp8 is not None:  # 1-byte inputs, a 16-bit output, then the recipe's quantisation passes
            f8 = self.fp8
            memory = ((m * k + k * n) + self.bpe * m * n) * batch / self.mem_bw
            return (max(self._compute_time(m, n, k, batch, f8.peak * f8.ceiling), memory)
                    + self.stream_time(f8.quant_bytes * m * k * batch))
        memory = self.bpe * (m * k + k * n + m * n) * batch / self.mem_bw
        return max(self._compute_time(m, n, k, batch, self.peak * self.ceiling), memory)

    def _compute_time(self, m: float, n: float, k: float, batch: float, rate: float) -> float:
        """Tensor-core seconds of the product at ``rate`` (peak x ceiling) with its tile, wave and depth losses."""
        # a thin operand gets a thin tile (the libraries carry 16..128-wide kernels), else TILE
        sm_, sn = _tile(m), _tile(n)
        tm, tn = math.ceil(m / sm_), math.ceil(n / sn)
        tiles = tm * tn * batch
        tile_eff = (m * n) / (tm * tn * sm_ * sn)
        waves = math.ceil(tiles / self.sms)
        wave_eff = tiles / (waves * self.sms)
        kd = max(k, K_MIN)  # the sweep's shallowest GEMM: no figure below it (attention's k = head_dim)
        depth_eff = (kd / (kd + K_FILL)) * (1.0 + K_FILL / K_REF) if self.tensor_cores else 1.0
        return 2.0 * m * n * k * batch / (rate * tile_eff * wave_eff * depth_eff)

    def stream_time(self, nbytes: float) -> float:
        """GPU seconds of memory-bound kernels moving ``nbytes``."""
        return nbytes / (self.mem_bw * MEM_EFF)

    def block(self, gpu_s: float, kernels: float) -> float:
        """Seconds of ``kernels`` kernels doing ``gpu_s`` of GPU work, as the runtime issues them."""
        return self.kernels.block_time(gpu_s, kernels)

    @property
    def prices_ring_blocks(self) -> bool:
        """Whether ``attention`` reads a CP rank's ring blocks: the materialised and memory-efficient
        kernels price their squares; a FlashAttention-class kernel prices the causal pairs alone."""
        return not (self.fused and self.flash)

    def attention(self, batch_heads: float, seq: float, head_dim: int, causal_pairs: float,
                  blocks: tuple[tuple[int, int, bool], ...] | None = None) -> tuple[float, float]:
        """GPU (fwd, bwd) seconds of attention for ``batch_heads`` (micro-batch x local heads) over
        ``seq`` queries, ``causal_pairs`` (query, key) pairs per head that the mask keeps; ``blocks``:
        a CP rank's ring blocks (``cpu.ring_blocks``: query length, key length, causal), which a
        materialised attention computes as one full (query x key) square each."""
        if batch_heads <= 0 or seq <= 0:
            return 0.0, 0.0
        if self.fused and not self.flash:
            return self._memory_efficient_attention(batch_heads, seq, head_dim, causal_pairs, blocks)
        if not self.prices_ring_blocks:  # FlashAttention-class: the causal pairs alone
            hds = sorted(ATTN_EFF_MAX)
            emax = self.kernels.attention_eff_max or ATTN_EFF_MAX[min(hds, key=lambda d: abs(d - head_dim))]
            eff = emax * seq / (seq + ATTN_SEQ_HALF)
            flops = 4.0 * head_dim * batch_heads * causal_pairs
            fwd = flops / (self.peak * eff)
            # the fused backward recomputes QK^T: 2.5x the forward's FLOPs (ATTENTION_BWD_FLOPS)
            return fwd, ATTENTION_BWD_FLOPS * flops / (self.peak * eff * ATTN_BWD_EFF)
        # materialised: two batched GEMMs over the full square, the scores streamed through HBM; under
        # cp one square per ring block, the rank's queries against every key block they see
        squares = blocks or ((seq, seq, True),)
        hp = self.hp  # attention's batched GEMMs stay in 16 bits under an FP8 dtype
        bmm = sum(hp.gemm_time(q, k, head_dim, batch_heads) + hp.gemm_time(q, head_dim, k, batch_heads)
                  for q, k, _ in squares)
        scores = batch_heads * sum(q * k for q, k, _ in squares) * self.bpe
        fwd = bmm + self.stream_time(2.0 * SCORE_PASSES * scores)
        return fwd, 2.0 * bmm + self.stream_time(2.0 * SCORE_PASSES * scores)

    def _memory_efficient_attention(self, batch_heads: float, seq: float, head_dim: int, causal_pairs: float,
                                    blocks: tuple[tuple[int, int, bool], ...] | None) -> tuple[float, float]:
        """GPU (fwd, bwd) seconds of the memory-efficient fused kernel of a device without
        FlashAttention-2 (Volta: PyTorch SDPA's xformers / CUTLASS kernel): the materialised
        attention's time (xformers PR #362, V100 fp16: the CUTLASS kernel's forward 5% slower than
        PyTorch's unfused attention at the median of its shapes, the backward 15% slower; a
        FlashAttention-2-rate price would make a V100 2.4x slower than an A100 at attention, less
        than at GEMMs, the reverse of HeterMoE's measurement, arXiv 2504.03871: an A40 3.7x a V100 at
        attention, 1.25x at expert GEMMs) for the (query, key) pairs the mask keeps: the kernel skips
        the key blocks above the diagonal (xformers PR #389), the unfused path computes the square."""
        squares = blocks or ((seq, seq, True),)
        kept = min(1.0, causal_pairs / max(sum(q * k for q, k, _ in squares), 1.0))
        fwd, bwd = dataclasses.replace(self, fused=False).attention(batch_heads, seq, head_dim, causal_pairs, blocks)
        return fwd * kept, bwd * kept


@lru_cache(maxsize=4096)
def _gemm_time(sm: SizeModel, m: float, n: float, k: float, batch: float) -> float:
    """``SizeModel.gemm_time`` memoised: a pure function of the frozen (hashable) SizeModel and the
    shape, and the search prices the same shapes on the same GPUs over and over."""
    return sm._gemm_time(m, n, k, batch)


@lru_cache(maxsize=256)
def _high_precision(sm: SizeModel) -> SizeModel:
    return dataclasses.replace(sm, fp8=None)


def _tile(dim: float) -> int:
    """The tile edge for a dimension: TILE, or the power of two >= it down to MIN_TILE."""
    return int(min(TILE, max(MIN_TILE, 2 ** math.ceil(math.log2(max(dim, 1.0))))))


def size_model(spec, dtype: str, bpe: int, kernels: KernelCosts | None = None) -> SizeModel | None:
    """The shape-aware model of a datasheet GPU run by ``kernels``' runtime (None: autotune's own;
    None back for CPUs, profiled devices and entries without an SM count, which keep the flat rate).
    An FP8 ``dtype`` gives the bf16 model with its linear GEMMs at the FP8 peak (``Fp8Linear``)."""
    if spec.kind not in ("cuda", "rocm") or not spec.sm_count or spec.provenance == "measured" or spec.profile:
        return None
    if dtype in FP8_RECIPES:
        base = size_model(spec, compute_dtype(dtype), bpe, kernels)
        key = gemm_peak(dtype)
        peak = spec.flops(key) * spec.sustained()[0] * (kernels.compute_eff if kernels is not None else 1.0)
        return base and dataclasses.replace(base, fp8=Fp8Linear(
            peak=peak, ceiling=spec.gemm_fraction(key)[0], quant_bytes=QUANT_BYTES[FP8_RECIPES[dtype]]))
    datasheet_peak = spec.flops(dtype)
    strict = dtype == "fp32-strict" or (dtype == "fp32" and spec.peak_flops.get("fp32-strict") == datasheet_peak)
    if strict:  # IEEE fp32 on CUDA cores: cuBLAS SGEMM's sustained figure, the device's own where measured
        peak, ceiling = datasheet_peak, spec.gemm_fraction("fp32-strict")[0]
    else:  # tensor cores: the burst ceiling (a short benchmark) at the clock a training run sustains
        peak, ceiling = datasheet_peak * spec.sustained()[0], spec.gemm_fraction(dtype)[0]
        if kernels is not None:  # a historical stack's fitted share of that rate (kernels.KernelCosts.compute_eff)
            peak *= kernels.compute_eff
    return SizeModel(peak=peak, ceiling=ceiling, sms=spec.sm_count, mem_bw=spec.memory_bandwidth, bpe=bpe,
                     fused=spec.fused_attention(), flash=spec.flash_attention, kernels=kernels or RUNTIME,
                     tensor_cores=not strict)
