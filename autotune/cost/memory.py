"""Memory of one rank: model states, activations, logits and an allocator reserve.

Model states (Rajbhandari et al. 2020, "ZeRO", section 3.1): mixed-precision Adam keeps per
parameter 2 bytes of 16-bit weights and 12 of fp32 optimizer state (master weights, momentum,
variance), and its gradients in the precision they are accumulated and reduced in
(``data_parallel.grad_reduce_dtype``: fp32, 4 bytes, as Megatron does under ``--bf16``: its
distributed-optimizer table counts 18 bytes a parameter, 2 + 4 + 12; ZeRO's 16 assumed 16-bit
gradients). In fp32 training there is no master copy: 4 + 4 + 8. ZeRO
shards over the N ranks that hold the same parameters (dp x cp x hp here): stage 1 the optimizer
states, stage 2 also the gradients, stage 3 also the weights (plus two gathered blocks of weights
as the working set while a layer runs and the next is prefetched, as FSDP does). The runtime's
ZeRO-3 (FSDP2 with a mixed-precision policy) keeps one sharded copy of a weight, in fp32: under
16-bit compute that is the master copy the 12 bytes of optimizer state already count, so its weights
term is the gathered blocks alone (DeepSpeed's ZeRO-3 also keeps a 16-bit shard: 2/N bytes more a
parameter).

Gradients under ZeRO-2/3 are sharded only where the runtime holds them so: it reduce-scatters once a
step, in the last backward, and accumulates the micro-batches before it unsharded
(``data_parallel.grads_accumulate_unsharded``; autotune/runtime/sharding.py says why), so a rank
running more than one micro-batch, or any pipeline stage, holds whole gradients (4 bytes a
parameter under 16-bit compute): ZeRO-2 then needs the memory of ZeRO-1 at its peak, and ZeRO-3
saves the weights alone. One micro-batch without pipelining holds gradient shards, as the ZeRO
paper counts; where the weights are whole (ZeRO-2, ZeRO-3 gathered per step) they never add to
them: that backward frees each unit's gathered weights as it reduce-scatters the unit's gradients
(ZeRO-2) or starts with the weights freed (ZeRO-3), so only the excess of the shards over the
weights counts (none under 16-bit compute from 2 ranks on). ZeRO-3 holds its weights whole like
ZeRO-2 when the runtime gathers them once a step (replicas with different micro-batch counts,
``data_parallel.zero3_weights_gathered``).

Activations per block and micro-batch (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", section 4 / Table 2), in bytes for 16-bit activations:
``s*b*h*(34 + 5*a*s/h)`` without parallelism. Its terms, generalised to GQA (kv width) and SwiGLU
(f the MLP width, one 2f tensor per MLP matrix):

* not split by tensor parallelism: layer-norm inputs 4sbh, attention and MLP inputs 2sbh each,
  two dropout masks sbh each: 10sbh (split by tp with sequence parallelism);
* split by tp: Q 2sbh, K and V 2sb*kv each, the output projection's input 2sbh, the MLP's
  2sbf per matrix (GeLU with f = 4h: 16sbh): 24sbh for GPT-3 shapes;
* attention scores, softmax and its dropout: 5*a*s^2*b, split by tp (heads) and, with context
  parallelism, each rank keeps its s_c queries against all s keys (5*a*s_c*s*b).

On GPUs (``fused_attention``) the scores term is replaced by the fused kernel's log-sum-exp: the
runtime's ``scaled_dot_product_attention`` dispatches to flash / memory-efficient kernels there, as
Megatron does through Transformer Engine; on CPU the math kernel materialises the scores.

Ulysses (hp) ranks hold s_c / hp tokens outside attention and ``heads[i]`` heads over all s_c
tokens inside it. Recomputation (Korthikanti et al. section 5): ``selective`` drops the scores term;
``full`` keeps only each block's input (2sbh, /tp with sequence parallelism) and rebuilds one block
at a time (one block's full activations as working set). fp32 activations double every term.

In flight: the schedule decides how many micro-batches' activations a rank holds
(``pipeline.peak_in_flight``: min(p - s, m) under 1F1B, m under GPipe). The last stage also keeps
the logits (compute dtype plus an fp32 copy for the loss; torchtitan's compiled loss the compute dtype
alone: ``logit_bytes``) of its micro-batches in flight. With the MoE
all-to-all overlap one layer-micro-batch more (``paired_layer``: Megatron-Core's combined step stores
the next micro-batch's forward layers while it frees the backward's one pair later).

Reserve: the runtime's buffers (CUDA/ROCm context, NCCL and cuBLAS workspaces), the device's
named ``framework_reserve`` (``DeviceSpec.framework_reserve()``: autotune/specs/catalogue.py
``FRAMEWORK_RESERVE`` with its sources, overridable per node group in the cluster file), plus the
caching allocator's fragmentation, ``RESERVE_FRACTION`` of everything else (PyTorch's caching
allocator typically keeps 5-10% more than is allocated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autotune.cost.activations import layer_activation_bytes
from autotune.cost.compute import DTYPE_BYTES
from autotune.cost.data_parallel import grad_reduce_dtype, grads_accumulate_unsharded, zero3_weights_gathered
from autotune.cost.pipeline import peak_in_flight
from autotune.plan_parts import FP8_RECIPES, GRAD_REDUCE_DTYPE, MOMENTS_DTYPE

if TYPE_CHECKING:  # typing only: context.py builds on the dimension modules
    from autotune.cost.context import RankContext

TERM_NAMES = ("weights", "gradients", "optimizer", "activations", "logits", "reserve")
"""The terms a rank's memory adds up (an infeasible plan's reason names the largest)."""

RESERVE_FRACTION = 0.05


def state_bytes_per_param(dtype: str, grad_reduce: str = GRAD_REDUCE_DTYPE,
                          moments: str = MOMENTS_DTYPE) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) bytes per parameter with Adam: the one rule every
    figure of model states asks (``model_states``; the stage program's ZeRO-1 share, ``optimizer_share``;
    the pool's smallest subset, ``sharded_bytes_per_param``). Under 16-bit compute: weights in the
    compute dtype, gradients in ``grad_reduce_dtype`` (fp32), optimizer states the fp32 master and
    Adam's two moments (12; ``moments`` bf16: ``precision_aware_optimizer_bytes``); in fp32 the
    weights are the master (optimizer: the two moments, 8).
    Under an FP8 dtype the weights are kept twice (Transformer Engine's default "dual precision"
    weights: the bf16 weight plus its FP8 copy and that copy's transpose for the backward, cached
    over a step's micro-batches, as Megatron runs TE with ``is_first_microbatch``): 2 + 1 + 1 bytes."""
    if master_is_weight(dtype):
        return 4.0, 4.0, 8.0
    weights = 4.0 if dtype in FP8_RECIPES else 2.0
    opt = 12.0 if moments == MOMENTS_DTYPE else precision_aware_optimizer_bytes(dtype)
    return weights, float(DTYPE_BYTES[grad_reduce_dtype(dtype, grad_reduce)]), opt


def precision_aware_optimizer_bytes(dtype: str) -> float:
    """Optimizer-state bytes per parameter under Megatron's precision-aware optimizer with both of
    Adam's moments in bf16 (``Plan.moments`` bf16: ``--use-precision-aware-optimizer --exp-avg-dtype
    bf16 --exp-avg-sq-dtype bf16``): the moments 2 + 2 (megatron/core/optimizer/distrib_optimizer.py
    allocates ``exp_avg`` and ``exp_avg_sq`` in ``exp_avg_dtype`` / ``exp_avg_sq_dtype``) and the master
    copy: where Transformer Engine's FusedAdam keeps it (``use_precision_aware_optimizer_no_fp8_or_ds_fp8``
    in megatron/core/optimizer/optimizer_config.py: no FP8 recipe, or the delayed one) only the 16 bits
    of each fp32 master the bf16 weight does not already hold (``store_param_remainders``, on by default:
    an int16 shard, 2 bytes); under the other FP8 recipes Megatron-Core keeps the fp32 master itself (4)."""
    master = 2.0 if dtype not in FP8_RECIPES or FP8_RECIPES[dtype] == "delayed" else 4.0
    return master + 2.0 + 2.0


def master_is_weight(dtype: str) -> bool:
    """In fp32 the weights are the fp32 master copy the optimizer updates (no separate master)."""
    return dtype.startswith("fp32")


def optimizer_share(dtype: str) -> float:
    """The optimizer states' part of a parameter's model states (what ZeRO-1 shards): 12/18 under
    16-bit compute, 8/16 in fp32, 12/20 under FP8."""
    w, g, o = state_bytes_per_param(dtype)
    return o / (w + g + o)


def sharded_bytes_per_param(dtype: str) -> float:
    """Model-state bytes a parameter when ZeRO-3 shards every state (``model_states`` with sharded
    weights, less the gathered working set): gradients and optimizer states, plus the weights where
    they are the master (under 16-bit compute FSDP2's one sharded copy is the master the optimizer
    states count). 16 bytes in every dtype."""
    w, g, o = state_bytes_per_param(dtype)
    return (w if master_is_weight(dtype) else 0.0) + g + o


FRAMEWORKS = ("runtime", "megatron", "torchtitan", "deepspeed", "accelerate")
"""Who allocates a plan's model states (``cost/kernels.KernelCosts.framework``): autotune's runtime or
an export target; each keeps its own copies (``state_bytes``)."""


def state_bytes(dtype: str, framework: str = "runtime", zero_stage: int = 0,
                grad_reduce: str = GRAD_REDUCE_DTYPE, moments: str = MOMENTS_DTYPE
                ) -> tuple[float, float, float, float]:
    """(weights, gradients, optimizer states, the sharded weight copy ZeRO-3 keeps beyond them) bytes
    per parameter with Adam, as ``framework`` allocates them: the one table of model-state bytes.

    - runtime, torchtitan (FSDP2 with fp32 reduction, autotune/runtime/sharding.py): the runtime's
      rule, ``state_bytes_per_param`` (2 + 4 + 12 under 16-bit compute, 4 + 4 + 8 in fp32); ZeRO-3's
      sharded copy is the fp32 master (counted in the optimizer states) or, in fp32, the weights.
    - megatron: Megatron-Core's distributed-optimizer table (docs/source/api-guide/dist_optimizer.md):
      bf16 parameters with fp32 gradients 18 (= 6 + 12/d under the distributed optimizer: the
      runtime's figures); fp16 parameters with fp16 gradients 20 (4 + 16/d: the optimizer keeps fp32
      main parameters and main gradients, Float16OptimizerWithFloat16Params), since Megatron
      accumulates in fp32 only under --bf16 (arguments.py); with ``--grad-reduce-in-bf16``
      (``grad_reduce`` bf16) its gradient buffer is bf16: 2 + 2 + 12 (the distributed optimizer's fp32
      copy of a shard's gradient lives only inside the step, as its main parameters' ``.grad``).
      Under an FP8 dtype with the distributed optimizer (``zero_stage`` >= 1) the weights are
      ``MEGATRON_FP8_PARAM_BYTES`` (``megatron_fp8_params``): Megatron runs ``--fp8-param-gather``
      there (the exporter writes it, as Megatron-Bridge's FP8 recipes set it).
    - deepspeed: its ZeRO optimizer (runtime/zero/stage_1_and_2.py ``single_partition_of_fp32_groups``
      and their ``.grad``; stage3.py ``fp32_partitioned_groups_flat``) and, at ZeRO-0, FP16_Optimizer
      / BF16_Optimizer keep an fp32 copy of the parameters AND an fp32 copy of the gradients beside
      Adam's moments (16), with the 16-bit parameters and gradients (2 + 2): 20 bytes, where the ZeRO
      paper's count (2 + 2 + 12) leaves the fp32 gradients out; ZeRO-3 keeps a 16-bit shard of the
      weights (2). fp32: 4 + 4 + 8, and 16 for the optimizer under ZeRO >= 1 (the ZeRO optimizer
      clones the fp32 partition too). Not modelled: bf16 at ZeRO-0 without a pipeline, where the
      exported config (no ``grad_accum_dtype``) makes DeepSpeed step Adam on the bf16 weights
      themselves (engine.py ``DDP_BFLOAT16``: 2 + 2 + 4); priced as BF16_Optimizer's 20.
    - accelerate: ``mixed_precision`` is torch autocast: the weights, gradients and Adam stay fp32
      (4 + 4 + 8) whatever the compute dtype; FSDP2's shard is the fp32 weights themselves."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}")
    fp32 = master_is_weight(dtype)
    if framework == "accelerate":
        return 4.0, 4.0, 8.0, 4.0
    if framework == "deepspeed":
        w = 4.0 if fp32 else 2.0
        return w, w, 8.0 if fp32 and zero_stage == 0 else 16.0, w
    if framework == "megatron" and dtype == "fp16":
        return 2.0, 2.0, 16.0, 0.0
    if framework == "megatron" and megatron_fp8_params(dtype, zero_stage):
        _, g, o = state_bytes_per_param(dtype, grad_reduce, moments)
        return MEGATRON_FP8_PARAM_BYTES, g, o, 0.0
    w, g, o = state_bytes_per_param(dtype, grad_reduce, moments)
    return w, g, o, (w if fp32 else 0.0)


MEGATRON_FP8_PARAM_BYTES = 2.0
"""Bytes a parameter's weights take on the device under Megatron's ``--fp8-param-gather``: "keep the
compute param in fp8 (do not use any other intermediate dtype) and perform the param all-gather in fp8"
(megatron/core/distributed/distributed_data_parallel_config.py ``fp8_param_gather``). Each linear
weight is Transformer Engine's quantised tensor alone, with no bf16 copy: its row-wise FP8 data (1 byte,
what the forward GEMM reads) and its column-wise copy (1 byte: the Hopper transpose, or MXFP8's
column-scaled data, what the backward's data-gradient GEMM reads), the block scales' 1/32 (MXFP8) left
out; the parameters outside the linear layers (embeddings, norms, router) stay bf16, 2 bytes too. The
fp32 master copy is the distributed optimizer's (its 12 bytes), the gradient buffer as without FP8
(megatron/core/distributed/param_and_grad_buffer.py: FP8 weights are remapped into the param buffer, or
under ``--reuse-grad-buf-for-mxfp8-param-ag`` gathered through the gradient buffer)."""


def megatron_fp8_params(dtype: str, zero_stage: int) -> bool:
    """Whether Megatron keeps the weights of a plan in FP8 (``--fp8-param-gather``): under an FP8 dtype
    with the distributed optimizer, which the flag requires (megatron/training/arguments.py: "only
    supported with distributed optimizer"); Megatron-Bridge's FP8 recipes set it
    (src/megatron/bridge/training/mixed_precision.py: ``bf16_with_fp8_current_scaling_mixed``,
    ``bf16_with_mxfp8_mixed`` and the delayed recipes ``fp8_param_gather = True``)."""
    return dtype in FP8_RECIPES and zero_stage >= 1


def logit_bytes(step: Any) -> float:
    """Bytes the loss keeps per logit for the backward: the compute dtype's logits and the fp32 copy
    the loss's softmax reads (eager ``cross_entropy(logits.float())``, Megatron's fused one alike);
    under torchtitan, which compiles its loss (``[compile] components = ["model", "loss"]``, what
    the exporter writes), the bf16 logits alone: Inductor fuses the upcast into the softmax and
    recomputes it in the backward (tests/unit/test_op_sac.py measures both on CPU)."""
    return float(step.bpe) if framework_of(step) == "torchtitan" else step.bpe + 4.0


def framework_of(step: Any) -> str:
    """Who allocates the step's model states: its runtime's ``framework`` (autotune's when None)."""
    return getattr(step.kernels, "framework", None) or "runtime"


def model_states(params: float, dtype: str, zero_stage: int, shard: int, layer_params: float,
                 grads_unsharded: bool = False, weights_gathered: bool = False,
                 framework: str = "runtime", grad_reduce: str = GRAD_REDUCE_DTYPE,
                 moments: str = MOMENTS_DTYPE) -> dict[str, float]:
    """Weights, gradients and optimizer states of ``params`` parameters on one rank, as ``framework``
    allocates them (``state_bytes``).
    ``grads_unsharded``: under ZeRO-2/3 the rank accumulates whole gradients over its micro-batches
    (``data_parallel.grads_accumulate_unsharded``), so they are not divided by the shard count;
    ``weights_gathered``: under ZeRO-3 the rank holds all its weights gathered at some point of the
    step (``data_parallel.zero3_weights_gathered``), as ZeRO-2 does."""
    w, g, o, kept = state_bytes(dtype, framework, zero_stage, grad_reduce, moments)
    n = max(shard, 1)
    sharded_weights = zero_stage >= 3 and not weights_gathered and n > 1
    if sharded_weights:
        # ZeRO-3 keeps one sharded copy of each weight (``kept`` bytes: FSDP2's is the fp32 parameter,
        # under 16-bit compute the master the optimizer term counts) and only the gathered working
        # set (current and prefetched block) in the compute dtype
        weights = 2 * layer_params * w + params * kept / n
    else:
        weights = params * w
    grads = params * g / (n if zero_stage >= 2 and not grads_unsharded else 1)
    if zero_stage >= 2 and not grads_unsharded and n > 1 and not sharded_weights:
        # whole weights and one backward: it frees each unit's gathered weights as it reduce-scatters
        # the unit's gradients (ZeRO-2), or starts from freed weights (ZeRO-3 gathered per step):
        # the shards take the room the weights leave, only what exceeds it adds
        grads = max(0.0, grads - weights)
    return {"weights": weights, "gradients": grads, "optimizer": params * o / (n if zero_stage >= 1 else 1)}


def reserve(spec: Any, allocated: float) -> float:
    """The framework's fixed reserve on ``spec`` (a DeviceSpec) plus the allocator's fraction."""
    return spec.framework_reserve() + RESERVE_FRACTION * allocated


def block_activations(ctx: RankContext) -> tuple[float, float, float]:
    """``layer_activation_bytes`` of one block on the rank of ``ctx`` (a ``context.RankContext``):
    (kept per micro-batch, full, of which the scores)."""
    s = ctx.step
    return layer_activation_bytes(
        s.model, micro_batch=s.mbs, tokens_local=ctx.tokens / s.hp, cp_tokens=ctx.tokens, seq_len=s.seq_len,
        heads_local=ctx.heads, tp=s.tp, sequence_parallel=s.sp, recompute=s.recompute, act_bytes=s.bpe,
        fused_attention=ctx.spec.fused_attention())


def micro_batches_that_fit(terms: dict[str, float], capacity: float) -> int | None:
    """How many whole times a rank holds what one micro-batch adds (its activations and logits), from the
    ``terms`` ``rank_memory`` gave it at micro-batch 1, on ``capacity`` bytes: ``rank_memory`` read
    backwards. It is affine in the micro-batch: the model states stay, activations and logits scale
    with it, and the reserve is its fixed part plus ``RESERVE_FRACTION`` of the rest (``reserve``).
    None where micro-batches add nothing (no activations: any size fits)."""
    states = terms["weights"] + terms["gradients"] + terms["optimizer"]
    per = terms["activations"] + terms["logits"]
    if per <= 0:
        return None
    fixed = terms["reserve"] - RESERVE_FRACTION * (states + per)
    return int(((capacity - fixed) / (1 + RESERVE_FRACTION) - states) // per)


def paired_layer(ctx: RankContext, inflight: int) -> int:
    """The layer-micro-batch the all-to-all overlap (``Plan.moe_a2a_overlap``) keeps beyond the
    schedule's peak: Megatron-Core's combined step (``MultiTransformerLayerSchedulePlan.run``) runs
    micro-batch i+1's forward layer j beside micro-batch i's backward layer L-1-j and frees the
    backward's layer only after the pair (its first layer, ``is_last_layer_in_bwd``, after the whole
    step), so while a forward stores its layers the backward has one more of its own than the plain
    order (forward, then backward) ever holds beside them: 1 where the rank runs such steps (its peak
    is below all its layer-micro-batches), else 0 (one micro-batch, or every one in the warm-up)."""
    x = ctx.step.experts
    if x is None or x.overlap != "a2a_1f1b" or not sum(x.chunk_moe_layers[ctx.pp_index]):
        return 0
    return 1 if inflight < sum(ctx.layers) * ctx.microbatches else 0


def rank_memory(ctx: RankContext, kept: float, full: float) -> tuple[float, dict[str, float]]:
    """(bytes, terms) on the rank of ``ctx``: its model states (ZeRO-sharded), the activations of
    the layer-micro-batches its schedule holds at once (plus one block rebuilt under recompute),
    the last chunk's logits in flight, and the allocator's reserve."""
    s = ctx.step
    states = model_states(ctx.params / s.tp, s.dtype, s.zero, s.shard_n, ctx.layer_params / s.tp,
                          grads_unsharded=grads_accumulate_unsharded(s.zero, s.pp, ctx.microbatches),
                          weights_gathered=zero3_weights_gathered(s), framework=framework_of(s),
                          grad_reduce=s.grad_reduce, moments=s.moments)
    inflight, last_inflight = peak_in_flight(s.schedule, s.pp, s.v, ctx.microbatches, ctx.pp_index, ctx.layers)
    inflight += paired_layer(ctx, inflight)
    acts = kept * inflight + (full - kept if s.recompute != "none" else 0.0)
    logits = 0.0
    if s.n_chunks - 1 in s.chunks[ctx.pp_index]:
        logits = ctx.tokens_local * s.model.vocab / s.tp * logit_bytes(s) * last_inflight
    alloc = states["weights"] + states["gradients"] + states["optimizer"] + acts + logits
    res = reserve(ctx.spec, alloc)
    terms = {**states, "activations": acts, "logits": logits, "reserve": res,
             "activation_per_layer_microbatch": kept, "layers_microbatches_in_flight": inflight}
    return alloc + res, terms
