"""How a runtime issues a transformer block's kernels: the host time per kernel and the kernels per
block, which the size-aware datasheet model (``datasheet.py``) turns into time.

A block costs its kernels' GPU time plus ``host_s`` per kernel: the time a runtime spends issuing
each kernel (dispatch, autograd bookkeeping, the launch), which the stream waits for. Counted in
full, not hidden behind long kernels: the regime model ``max(GPU time, kernels x host time)`` was
tried first and priced Sailor's measured layers worse at every host time (their OPT-350 block
median error stayed at 25% for every host time from 2 to 64 us, against 7.6% added in full:
benchmarks/bench_layers.py), and on the large
blocks of big models the added time is a few percent of the GEMMs' anyway. ``host_s`` and the
kernel counts belong to the runtime that will run the plan: an eager PyTorch model dispatches every
norm, rotary and residual op from Python; Megatron fuses bias-GeLU, bias-dropout-add, the softmax
and (Transformer Engine) layer norm + GEMM; torch.compile fuses the elementwise chains into a few
Triton kernels. Each target's figures live beside its rules (``autotune/export/<target>.py``
``KERNELS``; ``autotune/targets.py`` ``kernel_costs`` asks it); autotune's own runtime's are
``RUNTIME`` here, the default of every estimate.

Sources:

- a tiny kernel replayed from a CUDA graph (no host in the loop) took 1.03 us per kernel on an H200
  (benchmarks/gpu_gemm.py, 2026-12-04, ``launch.graph_add_s``): the floor of ``host_s``.
- eager host time: 10.7 us (an add), 18.4 us (a layer norm), 20.3 us (a small matmul) per op on
  the same machine (``launch.eager_*``); 18 us, their median, for eager PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EAGER_HOST_S = 18e-6
COMPILED_HOST_S = 8e-6
"""Host seconds per kernel of code compiled by torch.compile (Inductor's wrapper launches its Triton and
library kernels without per-op dispatch or autograd bookkeeping): not measured here; between a CUDA
graph's replay (1.0 us) and eager dispatch (EAGER_HOST_S), assumed 8 us."""


@dataclass(frozen=True)
class KernelCosts:
    """One runtime's per-kernel host time and kernels per block (forward; backward issues twice as many)."""

    name: str
    host_s: float
    """Host seconds to issue one kernel (dispatch, autograd bookkeeping, the launch call)."""
    block_fwd: int
    """Kernels of one transformer block's forward (GEMMs, attention, norms, activations, residuals)."""
    head_fwd: int
    """Kernels of the final norm, LM head and loss, forward."""
    source: str = ""
    eager_elementwise: bool = False
    """Each norm, rotary and activation op reads and writes its tensors on its own (``eager_bytes``);
    False: the memory-bound work is fused, each stored activation written once and read once."""
    block_bwd: int | None = None
    """Kernels of one block's backward where counted (None: twice ``block_fwd``)."""
    head_bwd: int | None = None
    """Kernels of the final norm, LM head and loss, backward, where counted (None: ``head_fwd``)."""
    attention_eff_max: float = 0.0
    """Fraction of dense peak the runtime's fused attention forward reaches at long sequences, where
    its kernels are not the ones ``datasheet.ATTN_EFF_MAX`` describes (FlashAttention-2 on Ampere,
    FlashAttention-3 / cuDNN on Hopper); 0: ``ATTN_EFF_MAX``. Length and backward scale it as they
    scale ``ATTN_EFF_MAX``."""
    framework: str = "runtime"
    """Who allocates the model states of a plan run this way (``memory.state_bytes``: each framework's
    own copies); the kernels alone do not say it (DeepSpeed and Accelerate both run eager PyTorch)."""
    compute_eff: float = 1.0
    """Fraction of the device's tensor-core rate (peak x sustained clock) this runtime's GEMMs and
    attention keep over a whole training step, beyond the shape losses ``datasheet.py`` prices: 1
    for every runtime autotune targets; below 1 only for the historical stacks of
    ``benchmarks/bench_published.py``, fitted there on named rows (each figure says which)."""

    moe_overlap: str = "none"
    """What the runtime runs beside a MoE layer's token all-to-all (``expert_layout.MOE_OVERLAPS``):
    ``none`` (torchtitan, DeepSpeed, autotune's runtime wait for each exchange) or ``shared_experts``
    (Megatron-Core ``--moe-shared-expert-overlap``: the shared experts' MLP runs during it)."""

    moe_fwd: int = 0
    """Kernels one MoE layer's forward issues beyond its dense block and its experts' GEMMs: the router
    and its auxiliary loss, the permutation, the dispatcher's split bookkeeping and device-to-host
    copies, the all-to-alls, the experts' activation, the unpermutation (``moe_layer_host``); 0: not
    counted for this runtime."""
    moe_bwd: int = 0
    """The same, backward."""
    expert_fwd: int = 0
    """Kernels per local expert, forward, where the grouped GEMM is issued as one GEMM per expert
    (Transformer Engine's ``GroupedLinear``): the up and down projections; 0 where one grouped kernel
    runs every expert."""
    expert_bwd: int = 0
    """The same, backward (dgrad and wgrad of each projection)."""
    expert_fp8: int = 0
    """GEMM inputs quantised per local expert, forward (and as many backward), under an FP8 dtype: each
    expert's GEMM inputs cast on their own."""
    fp8_quantize: tuple[tuple[str, int], ...] = ()
    """Kernels one quantisation of an expert's GEMM input takes, per FP8 recipe (``plan_parts.FP8_RECIPES``
    values; a recipe not named: 1); 0 for a recipe that quantises every expert's input of a GEMM in one
    fused kernel (``fp8_quantize_kernels``)."""
    moe_syncs: int = 0
    """Device-to-host synchronisations per dropless MoE layer forward (the dropless dispatcher waits for
    the token counts before it can size the all-to-all), each priced ``MOE_SYNC_S``; none under a
    capacity factor (``moe_layer_host``)."""
    graph_scopes: tuple[tuple[str, int, int], ...] = ()
    """(scope, forward kernels, backward kernels) of each part of a layer the runtime can capture in a
    CUDA graph (``Plan.cuda_graph_scope``); empty: it captures none."""

    def block_time(self, gpu_s: float, kernels: float) -> float:
        """Seconds of ``kernels`` kernels whose GPU work takes ``gpu_s``: the work plus each kernel's
        host time (module docstring)."""
        return gpu_s + kernels * self.host_s


GRAPH_REPLAY_S = 1.03e-6
"""Seconds per kernel replayed from a CUDA graph: a tiny kernel replayed from a graph with no host in
the loop took 1.03 us per kernel on an H200 (benchmarks/gpu_gemm.py, 2026-12-04, ``launch.graph_add_s``;
module docstring). Measured, not fitted."""

MOE_SYNC_S = 2.45e-3
"""Exposed seconds of one device-to-host synchronisation inside a MoE layer (the host blocks until the
GPU has drained its queue, then the GPU idles while the host issues again): FITTED by
``benchmarks/bench_published_moe.py --fit`` on the rows its ``FITTED`` names, every other row held out."""


def fp8_quantize_kernels(k: KernelCosts, local_experts: int, recipe: str | None) -> int:
    """Kernels one MoE layer pass (forward, and as many backward) issues to quantise its experts' GEMM
    inputs under FP8 ``recipe`` (None: not FP8): ``expert_fp8`` inputs per expert, each at the recipe's
    kernels per quantisation (``fp8_quantize``), or once per GEMM where the recipe fuses every expert's."""
    if not recipe:
        return 0
    per = dict(k.fp8_quantize).get(recipe, 1)
    return k.expert_fp8 * (per * local_experts if per else 1)


def moe_layer_host(k: KernelCosts, local_experts: int, fp8: str | None, graphed: tuple[str, ...] = (),
                   dropless: bool = True) -> tuple[float, float]:
    """(forward, backward) host seconds one MoE layer adds on the busiest rank: its kernels beyond the
    dense block at the runtime's ``host_s`` each (counted in full, as ``block_time`` counts a block's)
    and its synchronisations at ``MOE_SYNC_S``; less what its CUDA-graphed scopes (``graphed``) save:
    their kernels replay at ``GRAPH_REPLAY_S`` each instead of ``host_s``, for one graph launch
    (``host_s``) per scope and pass (``graph_saving``). ``fp8``: the FP8 recipe (``plan_parts.FP8_RECIPES``
    value; None: not FP8), whose quantisation kernels ``fp8_quantize_kernels`` counts.

    ``dropless`` False (a capacity factor, buffers padded to it): no synchronisation. Megatron-Core's
    alltoall dispatcher sizes a drop-and-pad exchange from the capacity, known on the host, and returns
    from ``MoEAlltoAllTokenDispatcher.preprocess`` before it sets any sync point (megatron-core
    core_v0.15.0 ``transformer/moe/token_dispatcher.py``: ``if self.drop_and_pad: ... return``, the
    sync point staying ``no_sync``); only the dropless path waits for the token counts."""
    quantise = fp8_quantize_kernels(k, local_experts, fp8)
    syncs = k.moe_syncs if dropless else 0
    fwd = (k.moe_fwd + local_experts * k.expert_fwd + quantise) * k.host_s + syncs * MOE_SYNC_S
    bwd = (k.moe_bwd + local_experts * k.expert_bwd + quantise) * k.host_s
    save_f, save_b = graph_saving(k, graphed)
    return fwd - save_f, bwd - save_b


def graph_saving(k: KernelCosts, graphed: tuple[str, ...]) -> tuple[float, float]:
    """(forward, backward) host seconds a layer saves with ``graphed`` scopes captured in CUDA graphs
    (the attention's kernels are its dense block's, the router's and the preprocessing's its MoE part's:
    all credited here, on the MoE layer): each captured kernel costs ``GRAPH_REPLAY_S`` instead of
    ``host_s``, and each scope's graph is launched once per pass. A scope the runtime cannot capture
    (not in ``graph_scopes``) saves nothing."""
    counts = {name: (f, b) for name, f, b in k.graph_scopes}
    per = k.host_s - GRAPH_REPLAY_S
    f = sum(counts[g][0] * per - k.host_s for g in graphed if g in counts and counts[g][0])
    b = sum(counts[g][1] * per - k.host_s for g in graphed if g in counts and counts[g][1])
    return max(0.0, f), max(0.0, b)


def eager_bytes(model: Any, tp: int) -> float:
    """HBM bytes per token that one block's memory-bound ops move forward when each runs as its own
    eager PyTorch op (bf16 activations; counted from the ops, not fitted):

    - RMSNorm as autotune's runtime and torchtitan write it (upcast, square, mean, rsqrt, scale,
      weight, downcast): 40 bytes per element, twice; LayerNorm is one fused kernel
      (``F.layer_norm``): 4 bytes per element, twice;
    - residual adds: read 2 x 2, write 2 bytes per element, twice (12 per element of h);
    - rotary on q and k (rotate-half: two products, a negation, a concatenation, a sum): 20 bytes per
      element of the tp rank's q and k;
    - SwiGLU (SiLU, then the gate product): 10 bytes per element of the rank's ffn width; GeLU: 4."""
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    norms = 2 * (40 if model.norm == "rmsnorm" else 4) * h
    rotary = 20 * (h + kv) / tp if model.position == "rope" else 0.0
    mlp = (10 if model.mlp_matrices == 3 else 4) * f / tp
    return norms + 12 * h + rotary + mlp


FUSED_LOSS_BYTES = (12.0, 12.0)
"""HBM bytes per logit of a fused softmax cross-entropy (fwd, bwd): the fp32 logits read and written
about three times (Megatron's and Transformer Engine's fused vocab-parallel loss)."""


def eager_loss_bytes(tp: int) -> tuple[float, float]:
    """HBM bytes per local logit (fwd, bwd) of the cross-entropy as autotune's runtime runs it eager
    (``runtime/tensor.py``), counted from its ops (bf16 logits, fp32 arithmetic), not fitted:

    - tp = 1, ``F.cross_entropy(logits.float())``: forward the upcast (read 2, write 4) and
      log-softmax over a row too long for shared memory (max pass, sum-of-exp pass, then read and
      write: 16); backward the zero-filled nll gradient (4), the log-softmax backward (row sum of
      the gradient, then read gradient and output, write: 16) and the downcast (read 4, write 2):
      22 forward, 26 backward;
    - tp > 1, ``_VocabParallelCE``: forward upcast 6, max 4, subtract 8, exp 8, sum 4, divide 8 (38);
      backward clone 8, zeros 4, masked fill 8, subtract 12, scale 8, downcast 6 (46).
    Hugging Face models' losses (``logits.float()`` then ``CrossEntropyLoss``) are the tp = 1 count."""
    return (22.0, 26.0) if tp == 1 else (38.0, 46.0)


RUNTIME = KernelCosts(
    name="runtime", host_s=EAGER_HOST_S, block_fwd=42, head_fwd=14, block_bwd=71, head_bwd=24,
    source="autotune's runtime is eager PyTorch; its kernels counted from the ops its Llama block dispatches "
           "(TorchDispatchMode, views left out; tests/unit/test_runtime_kernels.py keeps the counts in step): "
           "per block 42 forward (2 fp32 RMSNorms of 8 ops each, 7 GEMMs, rotary 5 ops each on q and k, the "
           "GQA repeat, SDPA, SiLU, gate product, 2 residual adds) and 71 backward; final norm, head and loss "
           "14 forward, 24 backward; host time per kernel: EAGER_HOST_S (H200, benchmarks/gpu_gemm.py); "
           "elementwise traffic: eager_bytes", eager_elementwise=True)
"""autotune's own runtime (``autotune/runtime/model.py``): what an estimate without a target prices."""

EAGER = KernelCosts(
    name="eager PyTorch", host_s=EAGER_HOST_S, block_fwd=24, head_fwd=5,
    source="an eager PyTorch decoder (Hugging Face models under Accelerate or DeepSpeed, Composer, torchtitan "
           "without compile): about as many kernels per block as autotune's runtime; host time EAGER_HOST_S; "
           "elementwise traffic: eager_bytes", eager_elementwise=True)
"""Eager PyTorch frameworks other than autotune's runtime (their exporters name it)."""

FA2_ON_HOPPER_EFF = 0.35
"""FlashAttention-2's utilisation of an H100 (Shah et al. 2024, 'FlashAttention-3', abstract and
section 1: "FlashAttention-2 achieving only 35% utilization on the H100 GPU"): Ampere-era kernels
(mma.sync, no wgmma / TMA) run on Hopper. The Triton flash attention of 2023 stacks is no faster
(Dao 2023, 'FlashAttention-2', section 4.1: FlashAttention-2 is 1.3-2.5x faster than the Triton
implementation on A100), so this is an upper bound for them."""

EAGER_PRE_HOPPER_ATTENTION = KernelCosts(
    name="eager PyTorch, pre-Hopper attention kernels", host_s=EAGER_HOST_S, block_fwd=24, head_fwd=5,
    source="EAGER's kernels with a 2023 flash attention (Triton flash or FlashAttention-1/2, Ampere "
           "instructions) run on Hopper: forward at FA2_ON_HOPPER_EFF of dense peak (Shah et al. 2024)",
    eager_elementwise=True, attention_eff_max=FA2_ON_HOPPER_EFF)
"""Eager PyTorch on H100 before Hopper attention kernels existed (FlashAttention-3, July 2024; cuDNN
SDPA in torch 2.5): MosaicML's 2023 MPT runs (llm-foundry yamls, ``attn_impl: triton``)."""

MEGATRON_DEEPSPEED_EAGER = KernelCosts(
    name="megatron-deepspeed (fp32, unfused)", host_s=32e-6, block_fwd=23, head_fwd=4,
    source="Megatron-DeepSpeed as Sailor ran it (fp32, materialised attention): 2 layer norms, QKV GEMM, scores "
           "GEMM, softmax, dropout, AV GEMM, output GEMM, 2 bias-dropout-adds, 2 MLP GEMMs, bias-GeLU, "
           "transposes; host_s fitted on Sailor's OPT-350 layers (benchmarks/bench_layers.py)")
"""The runtime of Sailor's published per-layer timings (``benchmarks/bench_layers.py`` fits its host time)."""

# ---- historical stacks of benchmarks/bench_published.py (no autotune target runs like them) -------------
H100_2023_EFF = 0.81
"""``compute_eff`` of MosaicML's 2023 H100 stack, fitted (grid 0.70-1.00, median |error|) by
``benchmarks/bench_published.py --fit`` on its two single-node rows (MPT-3B at s 8,192 and MPT-7B at
s 2,048 on 8 H100: NVLink only, so no inter-node network in the figure); its four multi-node rows
are held out. What it stands for (docs/validation.md "Prices against published runs"): torch 2.0.1
with CUDA 11.8 (llm-foundry ``scripts/train/benchmarking/sweep.sh``: ``mosaicml/pytorch:2.0.1_cu118``),
whose cuBLAS 11.11 ran a 2048 x 8192 x 8192 bf16 GEMM at 720 TFLOPS on H100 against 743 with
cuBLAS 12.0 (pytorch/pytorch#100850), Triton pre-MLIR flash attention, FSDP1's gathers and
reduce-scatters sharing the SMs with the GEMMs they overlap; the same table's A100 rows need none
of it (H100 ran 2.1-2.3x A100 per GPU there, against 3.2x in peak)."""

EAGER_H100_2023 = KernelCosts(
    name="eager PyTorch on H100, 2023 stack", host_s=EAGER_HOST_S, block_fwd=24, head_fwd=5,
    source="EAGER_PRE_HOPPER_ATTENTION's kernels (torch 2.0.1+cu118, Triton flash attention) keeping "
           "H100_2023_EFF of the tensor-core rate (fitted on two published rows, bench_published.py)",
    eager_elementwise=True, attention_eff_max=FA2_ON_HOPPER_EFF, compute_eff=H100_2023_EFF)
"""MosaicML's 2023 MPT runs on H100 (llm-foundry benchmarking README, table 'H100 80GB BF16')."""

MEGATRON_DEEPSPEED_2021_EFF = 0.75
"""``compute_eff`` of the 2021-22 Megatron-DeepSpeed that trained MT-NLG 530B and BLOOM 176B,
fitted (grid 0.70-1.00) by ``benchmarks/bench_published.py --fit`` on one row, MT-NLG on 280 DGX
A100 (its most micro-batches per replica, so the least bubble in the figure); MT-NLG's other two
rows and BLOOM (another cluster, network and model) are held out. Candidates it stands for
(docs/validation.md): DeepSpeed's synchronous pipeline sends, ``CUDA_LAUNCH_BLOCKING=1`` in
BLOOM's launch script (bigscience ``train/tr11-176B-ml/tr11-176B-ml.slurm``: every launch waits for
its kernel), the tensor-parallel all-reduces' achieved NVLink bandwidth."""

MEGATRON_DEEPSPEED_2021 = KernelCosts(
    name="megatron-deepspeed 2021-22 (bf16, pipelined)", host_s=MEGATRON_DEEPSPEED_EAGER.host_s,
    block_fwd=MEGATRON_DEEPSPEED_EAGER.block_fwd, head_fwd=MEGATRON_DEEPSPEED_EAGER.head_fwd,
    source="MEGATRON_DEEPSPEED_EAGER's kernels and host time (Sailor's layers) keeping "
           "MEGATRON_DEEPSPEED_2021_EFF of the tensor-core rate (fitted on one published row, bench_published.py)",
    compute_eff=MEGATRON_DEEPSPEED_2021_EFF)
"""MT-NLG 530B (Smith et al. 2022) and BLOOM 176B (BigScience tr11) as they were trained."""
