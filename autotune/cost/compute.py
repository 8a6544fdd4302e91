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
* Host time: the profile measures the GPU's work, so the runtime's kernels (``kernels.KernelCosts``:
  per block forward and backward, the head) are added at its host time per kernel, as the datasheet
  path adds them: the profile's own eager figure (``overheads.kernel_host_s``) for autotune's
  runtime where measured, else the runtime's ``host_s``. A small model on a fast GPU is host-bound.

Without a profile a GPU with an SM count is priced kernel by kernel from its shape (``datasheet.py``:
the catalogue's measured GEMM ceiling at the sustained clock, tile, wave and depth losses, the
runtime's kernels from ``kernels.py``); any other device runs every GEMM and attention call at the
flat ``peak_flops[dtype] * achievable_fraction`` (an end-to-end figure, documented per entry). Elementwise work (norms, activation, softmax, loss) is memory-bound: bytes moved divided by
``memory_bandwidth``.

On a CPU (``DeviceSpec.kind == "cpu"``) the per-call costs, measured attention call times and ring
blocks of eager PyTorch on a few cores are added by ``cpu.py`` (``Rates.cpu``); nothing here reads
a CPU constant, so no accelerator's figure depends on one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from autotune.cost import cpu as _cpu
from autotune.cost import datasheet as _datasheet
from autotune.cost.cpu import (  # noqa: F401  (their old home: kept importable from here)
    CPU_GEMM_CALL_S,
    CPU_OP_S,
    CPU_OPS_BLOCK_FWD,
    CPU_OPS_HEAD_FWD,
    CPU_OPS_RING_BLOCK_FWD,
    CPU_SYNC_CALL_S,
    CPU_SYNC_SKEW,
    SHORT_CALL_EXPONENT,
)
from autotune.cost.interp import loglinear
from autotune.cost.kernels import FUSED_LOSS_BYTES, RUNTIME, eager_bytes, eager_loss_bytes
from autotune.cost.ring import ring_blocks  # noqa: F401  (cost.compute.ring_blocks: kept importable)
from autotune.plan_parts import FP8_RECIPES, compute_dtype, gemm_peak
from autotune.specs.model import ATTENTION_BWD_FLOPS  # noqa: F401  (cost.compute.ATTENTION_BWD_FLOPS: its old home)

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp32-strict": 4, **{d: 2 for d in FP8_RECIPES}}
"""Bytes per element of what a rank stores and moves: activations, gathered weights, tp and cp
traffic. An FP8 dtype keeps and communicates them in bf16 (Transformer Engine's FP8 copies live only
inside a linear layer; priced there: ``datasheet.Fp8Linear``)."""



@dataclass
class Rates:
    """Throughput of one device type at one dtype: what a GEMM or an attention call takes."""

    name: str
    flat: float
    """FLOP/s without a profile: peak * achievable_fraction."""
    memory_bandwidth: float
    gemm_flat: float | None = None
    """Under an FP8 dtype, the flat rate of the linear layers' GEMMs (the FP8 peak * achievable_fraction);
    None: ``flat``."""
    gemm_fit: tuple[float, float] | None = None
    """(overhead_s, peak_flops_per_s) from the profile's affine fit."""
    gemm_points: tuple[list[float], list[float]] | None = None
    attn_points: tuple[list[float], list[float], list[float]] | None = None
    """(seq, fwd FLOP/s, bwd FLOP/s) at the profiled head dim."""
    attn_bwd_flops: float = ATTENTION_BWD_FLOPS
    """Backward FLOPs per forward FLOP in the profile's attention rates (its ``bwd_flops_factor``)."""
    source: str = "datasheet"
    cpu: _cpu.CpuRates | None = None
    """The CPU trial terms (``cpu.py``) of a ``kind == "cpu"`` device; None on accelerators."""
    size: Any = None
    """The shape-aware datasheet model (``datasheet.SizeModel``) of an unprofiled GPU, else None."""
    host: Any = None
    """The runtime's kernels (``kernels.KernelCosts``) of a GPU priced from a measured profile: the
    profile measures the GPU's work, not the host time the runtime spends issuing each kernel, which
    is the same on any GPU price (the datasheet path adds it in ``SizeModel.block``); None elsewhere."""

    @property
    def reads_ring_blocks(self) -> bool:
        """Whether a block's price (``layer_compute``) reads a CP rank's ring blocks (``blocks``): on a
        CPU (one kernel call each, ``cpu.block_extras``) and on an unprofiled GPU whose attention
        prices them (``SizeModel.prices_ring_blocks``); a measured GPU's attention reads the causal
        pairs alone. The rank-cost memo keys by the blocks only where they are read
        (``rank.rank_cost_memo``)."""
        return self.cpu is not None or (self.size is not None and self.size.prices_ring_blocks)

    @property
    def gemm_call_s(self) -> float:
        """Fixed seconds per GEMM call (CPU; 0 on accelerators)."""
        return self.cpu.gemm_call_s if self.cpu is not None else 0.0

    @property
    def op_s(self) -> float:
        """Fixed seconds per elementwise operator (CPU; 0 on accelerators)."""
        return self.cpu.op_s if self.cpu is not None else 0.0

    def gemm_time(self, flops: float) -> float:
        if flops <= 0:
            return 0.0
        if self.cpu is not None:
            return self.cpu.gemm_time(flops, self.gemm_fit[1] if self.gemm_fit is not None else self.flat)
        if self.gemm_fit is not None:
            return self.gemm_fit[0] + flops / self.gemm_fit[1]
        if self.gemm_points is not None:
            return flops / loglinear(*self.gemm_points, flops)
        return flops / (self.gemm_flat or self.flat)

    def hp_gemm_time(self, flops: float) -> float:
        """``gemm_time`` of a GEMM that stays in 16 bits under an FP8 dtype (the LM head)."""
        return self.gemm_time(flops) if self.gemm_flat is None else (flops / self.flat if flops > 0 else 0.0)

    def attention_time(self, flops_fwd: float, block_seq: float) -> tuple[float, float]:
        """(forward, backward) seconds of causal attention with ``flops_fwd`` forward FLOPs whose
        blocks are ``block_seq`` tokens long. Measured: the backward's FLOPs are ``attn_bwd_flops``
        times the forward's (the convention its profile counted them with), so its measured time
        comes back; datasheet: twice the forward's, as the model's FLOP accounting has it."""
        if flops_fwd <= 0:
            return 0.0, 0.0
        if self.attn_points is not None:
            seqs, fwd, bwd = self.attn_points
            return (flops_fwd / loglinear(seqs, fwd, block_seq),
                    self.attn_bwd_flops * flops_fwd / loglinear(seqs, bwd, block_seq))
        t = flops_fwd / self.flat
        return t, 2.0 * t

    def memory_time(self, nbytes: float) -> float:
        return nbytes / self.memory_bandwidth

    def attention_head_time(self, seq: float, head_dim: int) -> tuple[float, float] | None:
        """CPU: seconds of one measured (batch x head) call (``cpu.CpuRates.attention_head_time``);
        None on accelerators and without measured call times."""
        return self.cpu.attention_head_time(seq, head_dim) if self.cpu is not None else None


def _gemm_rates(r: Rates, gemm: Any) -> None:
    """The profile's GEMM fit (or its points) for one dtype into ``r``."""
    if not isinstance(gemm, dict):
        return
    rate, over = gemm.get("peak_flops_per_s"), gemm.get("overhead_s") or 0.0
    pts = sorted((float(a), float(b)) for a, b in gemm.get("points") or [] if a > 0 and b > 0)
    if isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0:
        r.gemm_fit = (float(over), float(rate))
        r.source = "measured"
    elif pts:
        r.gemm_points = ([p[0] for p in pts], [p[1] for p in pts])
        r.source = "measured"


def _attention_rates(r: Rates, att: Any, head_dim: int) -> None:
    """The profile's attention rates at the profiled head dim nearest ``head_dim`` into ``r``."""
    by_hd = att.get("by_head_dim") if isinstance(att, dict) else None
    if not (isinstance(by_hd, dict) and by_hd):
        return
    hd = min(by_hd, key=lambda k: abs(int(k) - head_dim))
    batch_heads = float(att.get("batch", 1)) * float(att.get("heads", 1))
    factor = float(att.get("bwd_flops_factor", ATTENTION_BWD_FLOPS))  # profiles before the key: 2.5 too
    seqs, fw, bw = [], [], []
    for row in sorted(by_hd[hd].get("points") or []):
        seq, f_s, b_s = float(row[0]), float(row[1]), float(row[2])
        if f_s <= 0 or b_s <= 0:
            continue
        flops = 2.0 * batch_heads * seq * seq * int(hd)  # the profiler's causal forward count
        seqs.append(seq)
        fw.append(flops / f_s)
        bw.append(factor * flops / b_s)  # the backward's FLOPs as the profiler counted them
    if seqs:
        r.attn_points = (seqs, fw, bw)
        r.attn_bwd_flops = factor


def rates_for(spec: Any, dtype: str, head_dim: int, kernels: Any = None) -> Rates:
    """Build the throughput model of a DeviceSpec (profile fits where present, else the datasheet;
    a CPU's trial terms from ``cpu.py``). ``kernels``: the runtime's per-kernel costs
    (``kernels.KernelCosts``; None: autotune's own runtime), read by the size-aware GPU model."""
    flat = spec.flops(compute_dtype(dtype)) * spec.achievable_fraction
    r = Rates(name=spec.name, flat=flat, memory_bandwidth=spec.memory_bandwidth,
              source=spec.provenance if spec.provenance != "measured" else "measured (no fits)",
              gemm_flat=spec.flops(gemm_peak(dtype)) * spec.achievable_fraction if dtype in FP8_RECIPES else None)
    prof = spec.profile or {}
    if spec.kind == "cpu":
        r.cpu = _cpu.cpu_rates(spec, dtype)
    _gemm_rates(r, (prof.get("gemm") or {}).get(dtype))
    _attention_rates(r, prof.get("attention") or {}, head_dim)
    if r.cpu is not None:  # priced with the kernel terms above, so after them
        r.cpu.context = _cpu.context_of(prof, dtype, lambda m, seq, b: reference_price(r, dtype, m, seq, b))
    if r.cpu is None and r.gemm_fit is None and r.gemm_points is None and r.attn_points is None:
        r.size = _datasheet.size_model(spec, dtype, DTYPE_BYTES.get(dtype, 2), kernels)
        if r.size is not None:
            r.source = "datasheet (size-aware)"
    if r.cpu is None and r.size is None and r.source == "measured":
        r.host = kernels or RUNTIME
        measured = (prof.get("overheads") or {}).get("kernel_host_s")
        if (kernels is None or kernels is RUNTIME) and isinstance(measured, (int, float)) and measured > 0:
            # the profile timed eager PyTorch's host time per kernel on this machine (profilers/overheads.py
            # launch_fns): autotune's runtime is eager PyTorch, so it issues its kernels at that rate (asked
            # as None by library calls and as RUNTIME by the CLI: ``targets.kernel_costs("runtime")``)
            r.host = dataclasses.replace(RUNTIME, host_s=float(measured),
                                         source=RUNTIME.source + f"; host time measured by profile: {measured * 1e6:.1f} us")
    return r


_RATES: dict[tuple[int, str, int, Any], tuple[Any, Rates]] = {}


def cached_rates(spec: Any, dtype: str, head_dim: int, kernels: Any = None) -> Rates:
    """``rates_for`` memoised per (spec object, dtype, head_dim, runtime kernel costs)."""
    key = (id(spec), dtype, head_dim, kernels)
    hit = _RATES.get(key)
    if hit is None or hit[0] is not spec:
        if len(_RATES) > 256:
            _RATES.clear()
        hit = _RATES[key] = (spec, rates_for(spec, dtype, head_dim, kernels))
    return hit[1]


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



@dataclass
class LayerCompute:
    """Seconds one rank spends computing one block for one micro-batch (no communication)."""

    gemm_fwd: float
    attn_fwd: float
    attn_bwd: float
    elem_fwd: float
    elem_bwd: float | None = None
    """Elementwise (and host) seconds of the backward where the runtime's backward kernels were
    counted on their own (``kernels.KernelCosts.block_bwd``); None: twice ``elem_fwd``."""

    @property
    def fwd(self) -> float:
        return self.gemm_fwd + self.attn_fwd + self.elem_fwd

    @property
    def bwd(self) -> float:
        # GEMM backward = dgrad + wgrad, each the forward's size; elementwise backward twice forward
        elem_b = 2.0 * self.elem_fwd if self.elem_bwd is None else self.elem_bwd
        return 2.0 * self.gemm_fwd + self.attn_bwd + elem_b


def layer_compute(model: Any, rates: Rates, *, tokens: float, tp: int, heads_local: int, keysum: float,
                  block_seq: float, micro_batch: int, act_bytes: float,
                  blocks: tuple[tuple[int, int, bool], ...] | None = None) -> LayerCompute:
    """One block on one rank.

    tokens: tokens in the sequence-sharded parts (micro_batch * cp shard / hp); heads_local: query
    heads this rank attends after tp and hp; keysum: sum of keys attended per query position over the
    rank's queries (``causal_keys``, whole cp shard: Ulysses gives each hp rank all of its shard's
    tokens for its heads); act_bytes: the block's stored activation bytes (elementwise traffic);
    blocks: with cp > 1 the ring's blocks (``ring.ring_blocks``), priced one kernel call each on CPU and
    one materialised square each on an unprofiled GPU."""
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    if rates.size is not None:  # an unprofiled GPU: every kernel priced from its shape (datasheet.py)
        return _sized_block(model, rates.size, tokens=tokens, tp=tp, heads_local=heads_local, keysum=keysum,
                            block_seq=block_seq, micro_batch=micro_batch, act_bytes=act_bytes, blocks=blocks)
    if _standard_attention(model):
        attn_gemm = (rates.gemm_time(2.0 * tokens * h * (h + 2 * kv) / tp)  # fused QKV projection
                     + rates.gemm_time(2.0 * tokens * h * h / tp))          # output projection
    else:  # queries wider than hidden (Qwen3, GPT-OSS) or MLA's projections (specs/model.attention_gemms)
        attn_gemm = sum(rates.gemm_time(2.0 * tokens * i * o / (tp if split else 1))
                        for i, o, split in model.attention_gemms())
    gemm = (attn_gemm
            + rates.gemm_time(2.0 * tokens * h * f * (model.mlp_matrices - 1) / tp)  # up (and gate)
            + rates.gemm_time(2.0 * tokens * f * h / tp))                   # down projection
    # QK^T over the query/key width, AV over the value width (4 * head_dim for standard attention)
    attn_flops = 2.0 * (model.qk_head_dim + model.v_head_dim) * heads_local * micro_batch * keysum
    elem = rates.memory_time(2.0 * act_bytes)  # written once, read once
    attn = None
    if rates.cpu is not None:
        elem, attn = _cpu.block_extras(rates, model, elem=elem, heads_local=heads_local, micro_batch=micro_batch,
                                       block_seq=block_seq, blocks=blocks)
    a_fwd, a_bwd = attn if attn is not None else rates.attention_time(attn_flops, block_seq)
    if rates.host is not None:  # a profiled GPU: the runtime's host time per kernel, as the datasheet adds it
        k = rates.host
        return LayerCompute(gemm_fwd=gemm, attn_fwd=a_fwd, attn_bwd=a_bwd, elem_fwd=elem + k.block_fwd * k.host_s,
                            elem_bwd=2.0 * elem + _bwd_kernels(k) * k.host_s)
    lc = LayerCompute(gemm_fwd=gemm, attn_fwd=a_fwd, attn_bwd=a_bwd, elem_fwd=elem)
    if rates.cpu is not None and rates.cpu.context is not None:  # CPU: as the block runs in context
        return rescaled_block(lc, *rates.cpu.context.block(lc.fwd, lc.bwd))
    return lc


def _standard_attention(model: Any) -> bool:
    """Queries as wide as the model and no latent attention: the fused QKV and output projections
    priced as they always were (so every dense preset's figures stay bit for bit)."""
    return getattr(model, "mla", None) is None and not getattr(model, "explicit_head_dim", 0)


def _bwd_kernels(k: Any) -> int:
    """Kernels of one block's backward: counted (``block_bwd``), else twice the forward's."""
    return k.block_bwd if k.block_bwd is not None else 2 * k.block_fwd


def rescaled_block(lc: LayerCompute, fwd: float, bwd: float) -> LayerCompute:
    """``lc`` with its totals replaced by ``fwd`` / ``bwd`` (a measured block, or the kernel price in
    context): each forward term scaled so they sum to ``fwd`` (selective recomputation still finds the
    attention core's share), the attention backward keeping its share of ``bwd``."""
    scale = fwd / lc.fwd if lc.fwd > 0 else 0.0

    class RescaledLayerCompute(LayerCompute):
        @property
        def fwd(self) -> float:
            return fwd

        @property
        def bwd(self) -> float:
            return bwd

    return RescaledLayerCompute(gemm_fwd=lc.gemm_fwd * scale, attn_fwd=lc.attn_fwd * scale,
                                attn_bwd=bwd * (lc.attn_bwd / lc.bwd if lc.bwd > 0 else 0.0),
                                elem_fwd=lc.elem_fwd * scale)


def reference_price(rates: Rates, dtype: str, model: Any, seq: int, mbs: int) -> tuple[float, float, float, float]:
    """The kernel price (block fwd, bwd, head fwd, bwd) of a whole-sequence, unsharded micro-batch of
    ``mbs`` x ``seq`` tokens: what ``cpu.context_of`` sets against the profile's reference points."""
    from autotune.cost.activations import layer_activation_bytes

    _, full, scores = layer_activation_bytes(
        model, micro_batch=mbs, tokens_local=float(seq), cp_tokens=float(seq), seq_len=seq, heads_local=model.heads,
        tp=1, sequence_parallel=False, recompute="none", act_bytes=DTYPE_BYTES.get(dtype, 2), fused_attention=False)
    lc = layer_compute(model, rates, tokens=float(mbs * seq), tp=1, heads_local=model.heads,
                       keysum=seq * (seq + 1) / 2.0, block_seq=float(seq), micro_batch=mbs, act_bytes=full - scores)
    hf, hb = head_compute(model, rates, tokens=float(mbs * seq), tp=1)
    return lc.fwd, lc.bwd, hf, hb


_SIZED: dict[tuple, tuple[Any, tuple[float, float, float, float]]] = {}


def _sized_block(model: Any, sm: Any, *, tokens: float, tp: int, heads_local: int, keysum: float,
                 block_seq: float, micro_batch: int, act_bytes: float,
                 blocks: tuple[tuple[int, int, bool], ...] | None = None) -> LayerCompute:
    """``_sized_block_times`` memoised: a pure function of the model (a frozen spec, held by identity
    like ``cached_rates``), the frozen ``SizeModel`` and the shape, which the search meets again
    and again (every plan of the same tp, shares and device type); a fresh LayerCompute each call."""
    key = (id(model), sm, tokens, tp, heads_local, keysum, block_seq, micro_batch, act_bytes, blocks)
    hit = _SIZED.get(key)
    if hit is None or hit[0] is not model:
        if len(_SIZED) > 4096:
            _SIZED.clear()
        hit = _SIZED[key] = (model, _sized_block_times(model, sm, tokens, tp, heads_local, keysum, block_seq,
                                                       micro_batch, act_bytes, blocks))
    return LayerCompute(*hit[1])


def _sized_block_times(model: Any, sm: Any, tokens: float, tp: int, heads_local: int, keysum: float,
                       block_seq: float, micro_batch: int, act_bytes: float,
                       blocks: tuple[tuple[int, int, bool], ...] | None = None
                       ) -> tuple[float, float, float, float, float | None]:
    """(gemm_fwd, attn_fwd, attn_bwd, elem_fwd, elem_bwd) of one block, every kernel priced from its shape.

    The runtime's kernels (``kernels.KernelCosts``: how many a block issues, the host time of each)
    cost the larger of the GPU's work plus a gap per kernel and the host's time to issue them
    (``KernelCosts.block_time``); what that adds beyond the GEMMs' and attention's GPU time is
    booked as elementwise time (backward: twice, as ``LayerCompute.bwd`` counts it)."""
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    if _standard_attention(model):
        attn_gemm = sm.gemm_time(tokens, (h + 2 * kv) / tp, h) + sm.gemm_time(tokens, h, h / tp)
    else:
        attn_gemm = sum(sm.gemm_time(tokens, o / (tp if split else 1), i) for i, o, split in model.attention_gemms())
    gemm = (attn_gemm
            + sm.gemm_time(tokens, f * (model.mlp_matrices - 1) / tp, h) + sm.gemm_time(tokens, h, f / tp))
    a_fwd, a_bwd = sm.attention(micro_batch * heads_local, block_seq, (model.qk_head_dim + model.v_head_dim) // 2,
                                keysum, blocks)
    if sm.kernels.eager_elementwise:  # every eager op reads and writes its own tensors
        stream = sm.stream_time(tokens * eager_bytes(model, tp))
    else:  # fused: each stored activation written once, read once
        stream = sm.stream_time(2.0 * act_bytes)
    elem = sm.block(gemm + a_fwd + stream, sm.kernels.block_fwd) - gemm - a_fwd
    # counted backward kernels: the backward's own host time (None: twice the forward's, as before)
    elem_b = None if sm.kernels.block_bwd is None else 2.0 * stream + sm.kernels.block_bwd * sm.kernels.host_s
    return gemm, a_fwd, a_bwd, elem, elem_b


def head_compute(model: Any, rates: Rates, *, tokens: float, tp: int) -> tuple[float, float]:
    """(fwd, bwd) seconds of the LM head (vocab-parallel over tp) and the cross-entropy on the last
    stage: GEMM 2*h*V/tp per token, and the loss's HBM traffic per logit: counted per eager op where
    the runtime runs the loss eager (``kernels.eager_loss_bytes``), else a fused loss's
    (``kernels.FUSED_LOSS_BYTES``; the flat rate's default)."""
    if rates.size is not None:
        sm = rates.size.hp  # the LM head stays in 16 bits under an FP8 dtype
        logits = tokens * model.vocab / tp
        bf, bb = eager_loss_bytes(tp) if sm.kernels.eager_elementwise else FUSED_LOSS_BYTES
        g = sm.gemm_time(tokens, model.vocab / tp, model.hidden)
        e_f = sm.block(g + sm.stream_time(bf * logits), sm.kernels.head_fwd) - g
        e_b = sm.block(g + sm.stream_time(bb * logits), sm.kernels.head_fwd) - g
        return g + e_f, 2.0 * g + e_b + _head_bwd_extra(sm.kernels)
    g = rates.hp_gemm_time(2.0 * tokens * model.hidden * model.vocab / tp)
    e = rates.memory_time(3.0 * 4.0 * tokens * model.vocab / tp)
    if rates.cpu is not None:
        e = e + _cpu.head_ops(rates)
        if rates.cpu.context is not None:  # as the head runs in context
            return rates.cpu.context.head(g + e, 2.0 * g + e)
    if rates.host is not None:  # a profiled GPU: the runtime's host time per kernel
        e = e + rates.host.head_fwd * rates.host.host_s
        return g + e, 2.0 * g + e + _head_bwd_extra(rates.host)
    return g + e, 2.0 * g + e


def _head_bwd_extra(k: Any) -> float:
    """Host seconds the head's counted backward kernels take beyond its forward's (0: not counted)."""
    return 0.0 if k.head_bwd is None else (k.head_bwd - k.head_fwd) * k.host_s
