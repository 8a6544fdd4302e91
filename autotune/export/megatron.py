"""Megatron-LM / Megatron Core (``pretrain_gpt.py``) arguments for a plan.

Mapping (argument names from megatron/training/arguments.py):

* ``tp`` -> ``--tensor-model-parallel-size``, ``pp`` -> ``--pipeline-model-parallel-size``;
* ``cp`` and ``hp`` are both sequence sharding to Megatron: ``--context-parallel-size cp*hp`` with
  ``--cp-comm-type p2p`` (ring, cp only), ``a2a`` (Ulysses, hp only) or ``a2a+p2p`` with
  ``--hierarchical-context-parallel-sizes hp cp`` (the first, inner level is all-to-all over
  adjacent ranks; our mesh puts hp inside cp, as Megatron's ``tp-cp-ep-dp-pp`` order does);
* layers: even stages need nothing; otherwise ``--decoder-first-pipeline-num-layers`` /
  ``--decoder-last-pipeline-num-layers`` when only the end stages differ, else
  ``--pipeline-model-parallel-layout`` (stages in layer order separated by ``|``, ``E`` embedding,
  ``t`` one decoder layer, ``L`` loss; stage j on pp rank ``j % pp``, virtual stage ``j // pp``,
  as megatron/core/transformer/pipeline_parallel_layer_layout.py reads it);
* virtual stages: ``--num-layers-per-virtual-pipeline-stage`` when every virtual stage is equal;
* batch: ``--micro-batch-size``, ``--global-batch-size`` (Megatron derives micro-batches per
  replica as global / (micro * dp));
* ``dtype``: ``--bf16`` / ``--fp16``; an FP8 dtype adds ``--fp8-format`` and ``--fp8-recipe`` (``FP8_ARGS``),
  and with the distributed optimizer ``--fp8-param-gather`` (``--reuse-grad-buf-for-mxfp8-param-ag``
  under MXFP8), the FP8 weights ``cost/memory.state_bytes`` prices;
* experts (``moe_arguments``): ``--num-experts``, ``--moe-router-topk``, ``--moe-ffn-hidden-size``,
  ``--expert-model-parallel-size ep``, ``--expert-tensor-parallel-size etp`` (Megatron-Core's parallel
  folding: the expert mesh tp-ep-dp-pp over the same ranks, as ``plan_parts.expert_groups`` orders it),
  ``--moe-grouped-gemm``, ``--moe-token-dispatcher-type alltoall`` (``moe_dispatcher flex``: ``flex
  --moe-flex-dispatcher-backend deepep``, and no ``--moe-shared-expert-overlap``), shared experts, the dense layers as
  a ``--moe-layer-freq`` pattern, the router, capacity and token dropping; MLA (``mla_arguments``);
* ``recompute`` -> ``--recompute-granularity selective|full`` (selective with ``--recompute-modules`` from
  ``recompute_modules``) (full with ``--recompute-method
  uniform --recompute-num-layers 1``); ``zero_stage`` 1 -> ``--use-distributed-optimizer``;
  ``sequence_parallel`` -> ``--sequence-parallel``; ``grad_reduce bf16`` -> ``--grad-reduce-in-bf16``;
  ``moments bf16`` -> ``--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``;
  ``moe_a2a_overlap`` -> ``--overlap-moe-expert-parallel-comm --delay-wgrad-compute`` (no
  ``--moe-shared-expert-overlap`` then: Megatron-Core refuses the two together); ``cuda_graph_scope`` ->
  ``--cuda-graph-impl transformer_engine --cuda-graph-scope ...`` (Megatron-LM's later versions name it
  ``--cuda-graph-modules`` and still read the old flag).

HelixPipe (``schedule helixpipe``) is the variant of Megatron-LM that names the fork it needs
(``HELIX_FORK``: upstream Megatron has no attention-parallel pipeline): ``--attention-pipeline
--num-fold F --num-layers-per-virtual-pipeline-stage 1 --transfer-weight``, and
``--checkpoint-without-attn`` for its recomputation (``recompute full``).

Megatron cannot express: uneven token, head or sample shares (CP cuts the sequence into 2*cp equal
chunks, heads split evenly over tp and the a2a group, every DP rank takes global/dp samples), a
contiguous CP layout (its causal CP always load-balances), GPipe (1F1B only), ZeRO-2/3 through
these flags, uneven expert shares, experts beside tensor parallelism without sequence parallelism.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from autotune.cost.expert_layout import moe_overlap
from autotune.cost.kernels import EAGER_HOST_S, KernelCosts
from autotune.cost.memory import megatron_fp8_params
from autotune.divisibility import even_heads_problem
from autotune.export.common import (
    Collected,
    Export,
    ExportContext,
    comment_lines,
    even_everything,
    even_experts,
    even_share_reasons,
    fold,
    placement_comment,
    placement_reasons,
    provenance,
    unexpressed,
    with_even,
)
from autotune.plan import FP8_RECIPES, Plan
from autotune.plan_record import PlanRecord
from autotune.schedules import schedule_of
from autotune.specs.windows import megatron_pattern

NAME = "megatron"

MOE_ROUTING = (20, 13)
"""(forward, backward) kernels of a MoE layer's gating GEMM, softmax top-k routing and auxiliary loss,
as megatron-core's ``moe_utils`` runs them unfused (counted by benchmarks/count_moe_kernels.py)."""
MOE_PERMUTATION = (11, 13)
"""(forward, backward) kernels of ``permute``, the two ``sort_chunks_by_idxs`` and ``unpermute`` with
the routing probabilities applied (counted by benchmarks/count_moe_kernels.py)."""
MOE_PREPROCESS = (7, 0)
"""(forward, backward) kernels of the alltoall dispatcher's ``preprocess`` (the token counts, splits and
the all-gather of the counts: 7 of MOE_DISPATCHER's forward), what ``--cuda-graph-scope moe_preprocess``
captures (its device-to-host copies move after it, ``cuda_dtoh_point = before_ep_alltoall``)."""
ATTENTION_KERNELS = (6, 12)
"""(forward, backward) kernels of a block's attention sub-block as KERNELS counts them (layer norm + QKV
GEMM 2, fused RoPE 1, flash attention 1, output GEMM 1, bias-dropout-add 1; backward twice), what
``--cuda-graph-scope attn`` captures."""
MOE_DISPATCHER = (16, 4)
"""(forward, backward) kernels of the alltoall dispatcher's own work, counted from its code
(``MoEAlltoAllTokenDispatcher.preprocess`` and ``_maybe_dtoh_and_synchronize``): forward the token
counts, splits and the all-gather of the counts (7), the device-to-host copies of the splits (5), the
all-to-alls of tokens and probabilities out and tokens back (3), the experts' fused activation (1);
backward the three all-to-alls and the activation's gradient."""

TE_FP8_QUANTIZE = (("current", 3), ("delayed", 0))
"""Kernels Transformer Engine issues to quantise one expert's GEMM input, per FP8 recipe, in
``GroupedLinear`` (``tex.split_quantize`` of the input forward and of the output gradient backward;
Transformer Engine v2.9, what Megatron-Bridge 0.2 pins: ``transformer-engine>=2.9.0a0,<2.10.0``):
``csrc/extensions/cast.cpp`` ``multi_tensor_quantize_impl`` runs one fused ``nvte_multi_cast_transpose``
for all experts only with delayed-scaling quantizers (``IsFloat8Quantizers``), else each expert's
``quantize`` on its own; current scaling's (``csrc/quantizer.cpp``
``Float8CurrentScalingQuantizer::quantize_impl``) is three kernels, ``nvte_compute_amax_with_config``,
``nvte_compute_scale_from_amax`` and ``nvte_quantize_v2``; MXFP8's and the blockwise recipe's one each."""

KERNELS = KernelCosts(
    name="megatron", framework="megatron", host_s=EAGER_HOST_S, block_fwd=11, head_fwd=3,
    source="Megatron-Core with Transformer Engine issues per block forward: layer norm + QKV GEMM and layer norm "
           "+ FC1 GEMM (TE LayerNormLinear, 2 kernels each), fused RoPE, one flash-attention kernel, the output "
           "and FC2 GEMMs, fused bias-GeLU / SwiGLU, 2 fused bias-dropout-adds: 11 kernels; each dispatched "
           "eagerly from Python (EAGER_HOST_S). A MoE layer adds (megatron.core.transformer.moe, alltoall dispatcher, "
           "grouped GEMM, unfused router and permutation as Megatron defaults them): MOE_KERNELS",
    moe_overlap="shared_experts", moe_fwd=MOE_ROUTING[0] + MOE_PERMUTATION[0] + MOE_DISPATCHER[0],
    moe_bwd=MOE_ROUTING[1] + MOE_PERMUTATION[1] + MOE_DISPATCHER[1], expert_fwd=2, expert_bwd=4, expert_fp8=2,
    fp8_quantize=TE_FP8_QUANTIZE, moe_syncs=1, graph_scopes=(("attn", *ATTENTION_KERNELS), ("moe_router", *MOE_ROUTING),
                               ("moe_preprocess", *MOE_PREPROCESS)))
"""How Megatron runs a plan: the cost model's kernel costs for ``estimate --target megatron`` (a MoE
layer's shared experts overlap its all-to-all: ``--moe-shared-expert-overlap``).

MOE_KERNELS: a MoE layer's kernels beyond its dense block (megatron-core, alltoall dispatcher,
``--moe-grouped-gemm``, router and permutation unfused as Megatron defaults them): MOE_ROUTING +
MOE_PERMUTATION + MOE_DISPATCHER (47 forward, 30 backward). The grouped GEMM is Transformer Engine's ``GroupedLinear``, one cuBLAS GEMM per local expert: 2 forward
(fc1, fc2), 4 backward (dgrad and wgrad of each), plus under FP8 each expert's GEMM input quantised on
its own (2 forward, 2 backward), at TE_FP8_QUANTIZE's kernels each (current scaling 3; delayed scaling one
fused kernel per GEMM for every expert). One device-to-host synchronisation per layer forward
(``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``: the all-to-all needs the split sizes
on the host)."""
FP8_ARGS = {"delayed": ("hybrid", "delayed"), "current": ("hybrid", "tensorwise"), "blockwise": ("e4m3", "blockwise"),
            "mxfp8": ("e4m3", "mxfp8")}
"""Each FP8 recipe (``plan_parts.FP8_RECIPES``) as Megatron's ``--fp8-format`` / ``--fp8-recipe``
(megatron/training/arguments.py; the recipe is megatron.core.enums.Fp8Recipe): the per-tensor recipes
in ``hybrid`` (E4M3 forward, E5M2 gradients, NeMo's FP8-CS), the block recipes in E4M3 throughout as
DeepSeek-V3 and Megatron's MXFP8 guide run them; ``--bf16`` for the rest of the model."""
HELIX_FORK = ("HelixPipe's Megatron-LM fork (the code of arXiv 2507.00394, branch dev): upstream Megatron-LM "
              "has no --attention-pipeline")
SUFFIX = ".sh"

EXPRESSES = ("dp", "pp", "cp", "hp", "tp", "ep", "etp", "moe_a2a_overlap", "moe_dispatcher", "grad_reduce", "moments", "cuda_graph_scope")
"""The dimensions and plan options it runs (``export.common.unexpressed`` refuses the rest)."""
WHY = {
    "experts": "Megatron-Core gives every expert-parallel rank num_experts/ep experts",
    "tokens": "Megatron context parallelism cuts the sequence into 2*cp equal chunks",
    "heads": "Megatron splits attention heads evenly over tp and the a2a (Ulysses) group",
    "samples": "Megatron gives every data-parallel rank global_batch/dp samples",
}


def _helix_fork(plan: Plan) -> bool:
    """Whether the plan runs HelixPipe, which only HelixPipe's own fork of Megatron-LM runs, with
    switches of its own (``HELIX_FORK``): the one place this exporter names a schedule, because
    those switches belong to that fork, not to a capability another schedule could share."""
    return plan.schedule == "helixpipe"


def reasons(plan: Plan, ctx: ExportContext) -> list[str]:
    r = Collected(even_share_reasons(plan, NAME, ("tokens", "heads", "samples"), WHY))
    r.items += unexpressed(plan, NAME, EXPRESSES)
    d = plan.degrees
    r.add(d.cp > 1 and plan.cp_layout == "contiguous",
          "cp_layout contiguous: Megatron's causal context parallelism always uses the load-balanced "
          "(zigzag) chunk order")
    why = schedule_of(plan).refusal(NAME)
    r.add(d.pp > 1 and why is not None, why or "")
    r.add(plan.zero_stage >= 2, f"zero_stage {plan.zero_stage}: Megatron's distributed optimizer "
          "(--use-distributed-optimizer) shards optimizer states only (ZeRO-1)")
    heads = even_heads_problem(ctx.model, d.tp, d.hp, "hp")  # autotune/divisibility.py
    r.add(heads is not None, heads or "")
    # Transformer Engine's a2a context parallelism splits query heads and KV groups over the a2a ranks
    r.add(d.hp > 1 and (ctx.model.kv_heads // d.tp) % d.hp != 0,
          f"kv heads per tp rank ({ctx.model.kv_heads // d.tp}) not divisible by hp({d.hp}): Megatron's a2a "
          "(Transformer Engine) splits KV groups over the all-to-all ranks")
    chunks = 2 * d.cp * d.hp * (d.tp if plan.sequence_parallel else 1)
    r.add(d.cp * d.hp > 1 and ctx.seq_len % chunks != 0,
          f"seq_len {ctx.seq_len} not divisible by 2*context-parallel-size({d.cp * d.hp})"
          + ("*tp" if plan.sequence_parallel and d.tp > 1 else "") + f" = {chunks}: Megatron cuts every "
          "sequence into 2*cp load-balanced chunks, whatever --cp-comm-type")
    r.items += expert_reasons(plan, ctx)
    r.items += placement_reasons(plan)
    return r.items


def expert_reasons(plan: Plan, ctx: ExportContext) -> list[str]:
    """What Megatron-Core's MoE layers cannot take: uneven expert shares (every EP rank builds
    num_experts / ep local experts), and tensor parallelism without sequence parallelism next to
    expert parallelism (Megatron-LM's argument checks refuse it)."""
    if ctx.model.moe is None:
        return []
    d = plan.degrees
    r = Collected(even_share_reasons(plan, NAME, ("experts",), WHY))
    r.add(plan.moe_a2a_overlap and d.pp > 1 and plan.virtual_stages == 1,
          f"moe_a2a_overlap with pp({d.pp}) and one model chunk per rank: Megatron-Core's overlapped schedule "
          "needs virtual pipeline stages when pp > 1 (TransformerConfig's own check)")
    r.add(d.tp > 1 and d.ep > 1 and not plan.sequence_parallel,
          f"sequence_parallel false with tp({d.tp}) and ep({d.ep}): Megatron-LM requires --sequence-parallel with "
          "expert and tensor parallelism together (megatron/training/arguments.py; its MoE README says the same)")
    return r.items


def candidates(plan: Plan, ctx: ExportContext) -> list[Plan]:
    base = with_even(plan, "tokens", "heads", "samples")
    if plan.degrees.pp > 1 and schedule_of(plan).refusal(NAME):  # the nearest schedule Megatron runs: 1F1B
        base = base.replace(schedule="1f1b")
        if plan.virtual_stages != 1:
            base = with_even(base, "layers").replace(virtual_stages=1)
    base = base.replace(cp_layout="zigzag", zero_stage=min(plan.zero_stage, 1))
    if ctx.model.moe is not None and plan.degrees.tp > 1 and plan.degrees.ep > 1:
        base = base.replace(sequence_parallel=True)
    out = [*even_experts(base, ctx), even_everything(base)]
    if plan.degrees.hp > 1:
        out += [fold(base, "hp", "cp"), fold(base, "hp", "dp")]
    return out


# ---- layer assignment ----------------------------------------------------------------------------
def layout_string(layers: tuple[int, ...]) -> str:
    """``Et*3|t*4|t*4|t*3L``: stages in layer order; embedding on the first, loss on the last."""
    stages = []
    for j, n in enumerate(layers):
        s = ("E" if j == 0 else "") + (f"t*{n}" if n > 1 else "t" * n) + ("L" if j == len(layers) - 1 else "")
        stages.append(s)
    return "|".join(stages)


def parse_layout(text: str) -> list[list[str]]:
    """The layout string back to per-stage layer letters (Megatron's own unrolling rules)."""
    s = text.replace(",", "")
    s = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    s = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    return [list(stage) for stage in s.split("|")]


def layer_args(plan: Plan) -> list[str]:
    layers = plan.shares.layers
    assert layers is not None
    pp, v = plan.degrees.pp, plan.virtual_stages
    if pp == 1:
        return []
    if len(set(layers)) == 1:
        return ["--num-layers-per-virtual-pipeline-stage", str(layers[0])] if v > 1 else []
    if v == 1 and (pp == 2 or len(set(layers[1:-1])) == 1):
        # only the end stages differ: the first/last-stage flags (older Megatron versions too);
        # Megatron spreads what is left evenly over the stages without a flag
        if pp == 2:
            return ["--decoder-first-pipeline-num-layers", str(layers[0])]
        args = []
        if layers[0] != layers[1]:
            args += ["--decoder-first-pipeline-num-layers", str(layers[0])]
        if layers[-1] != layers[1]:
            args += ["--decoder-last-pipeline-num-layers", str(layers[-1])]
        return args
    return ["--pipeline-model-parallel-layout", layout_string(layers)]


def layers_per_stage(args: list[str], num_layers: int, pp: int) -> list[int]:
    """Megatron's reading of the layer arguments: decoder layers of each (virtual) stage in layer
    order. Used by the tests to check every layer is assigned exactly once."""
    a = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    if "--pipeline-model-parallel-layout" in a:
        return [st.count("t") for st in parse_layout(a["--pipeline-model-parallel-layout"])]
    if "--num-layers-per-virtual-pipeline-stage" in a:
        n = int(a["--num-layers-per-virtual-pipeline-stage"])
        return [n] * (num_layers // n)
    first = a.get("--decoder-first-pipeline-num-layers")
    last = a.get("--decoder-last-pipeline-num-layers")
    if first is None and last is None:
        return [num_layers // pp] * pp
    rest = num_layers - int(first or 0) - int(last or 0)
    middle = pp - (first is not None) - (last is not None)
    per = rest // middle if middle else 0
    out = [per] * pp
    if first is not None:
        out[0] = int(first)
    if last is not None:
        out[-1] = int(last)
    return out


# ---- the arguments -------------------------------------------------------------------------------
def arguments(plan: Plan, ctx: ExportContext) -> list[str]:
    m, d = ctx.model, plan.degrees
    a: list[str] = [
        "--tensor-model-parallel-size", str(d.tp),
        "--pipeline-model-parallel-size", str(d.pp),
    ]
    seq_par = d.cp * d.hp
    if seq_par > 1:
        a += ["--context-parallel-size", str(seq_par)]
        if d.cp > 1 and d.hp > 1:
            a += ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", str(d.hp), str(d.cp)]
        else:
            a += ["--cp-comm-type", "a2a" if d.hp > 1 else "p2p"]
    if _helix_fork(plan):  # the fork's switches (HELIX_FORK)
        a += ["--attention-pipeline", "--num-fold", str(plan.helix_folds),
              "--num-layers-per-virtual-pipeline-stage", "1", "--transfer-weight"]
    else:
        a += layer_args(plan)
    a += ["--micro-batch-size", str(plan.micro_batch_size), "--global-batch-size", str(ctx.global_batch)]
    if _helix_fork(plan) and plan.recompute == "full":
        a.append("--checkpoint-without-attn")
    elif plan.recompute == "selective":
        a += ["--recompute-granularity", "selective"]
        if plan.recompute_modules:
            a += ["--recompute-modules", *plan.recompute_modules]
    elif plan.recompute == "full":
        a += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if plan.zero_stage == 1:
        a.append("--use-distributed-optimizer")
    if plan.grad_reduce == "bf16":  # megatron/training/arguments.py: accumulate_allreduce_grads_in_fp32 = False
        a.append("--grad-reduce-in-bf16")
    if plan.moments == "bf16":  # megatron/core/optimizer/optimizer_config.py: TE FusedAdam's state dtypes
        a += ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    if plan.cuda_graph_scope:  # Transformer Engine's graphs of these parts (Plan.cuda_graph_scope)
        a += ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", *plan.cuda_graph_scope]
    if plan.sequence_parallel and d.tp > 1:
        a.append("--sequence-parallel")
    if plan.dtype == "bf16" or plan.dtype in FP8_RECIPES:
        a.append("--bf16")
    elif plan.dtype == "fp16":
        a.append("--fp16")
    if plan.dtype in FP8_RECIPES:
        fmt, recipe = FP8_ARGS[FP8_RECIPES[plan.dtype]]
        a += ["--fp8-format", fmt, "--fp8-recipe", recipe]
        if megatron_fp8_params(plan.dtype, plan.zero_stage):  # FP8 weights, as memory.state_bytes prices them
            a.append("--fp8-param-gather")
            if recipe == "mxfp8":  # arguments.py: MXFP8 params gather through the gradient buffer
                a.append("--reuse-grad-buf-for-mxfp8-param-ag")
    # model shape (the dense layers' FFN width: Megatron's --ffn-hidden-size is theirs under MoE)
    a += ["--num-layers", str(m.layers), "--hidden-size", str(m.hidden), "--ffn-hidden-size", str(m.dense_ffn_width),
          "--num-attention-heads", str(m.heads), "--seq-length", str(ctx.seq_len),
          "--max-position-embeddings", str(max(ctx.seq_len, m.max_positions or 0)),
          "--vocab-size", str(m.vocab)]
    a += moe_arguments(plan, m) + mla_arguments(m) + attention_arguments(m)
    if m.kv_heads < m.heads:
        a += ["--group-query-attention", "--num-query-groups", str(m.kv_heads)]
    if m.activation == "swiglu":
        a.append("--swiglu")
    a += ["--normalization", "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm"]
    a += ["--position-embedding-type", "rope" if m.position == "rope" else "learned_absolute"]
    if not m.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    if not m.bias:
        a.append("--disable-bias-linear")
    return a


def attention_arguments(m: Any) -> list[str]:
    """The attention's shape beyond heads (megatron/training/arguments.py): ``--kv-channels`` where a
    head is not hidden / heads wide (Qwen3, GPT-OSS); sliding windows as ``--window-size`` (keys to
    the left of the query, to the right: ``window - 1,0``, since the query sees itself) and
    ``--window-attn-skip-freq`` (``specs/windows.py``: the same rule, Megatron Core's
    ``is_layer_window_attention``); learned sinks as ``--softmax-type learnable``."""
    a = []
    if m.mla is None and m.head_dim * m.heads != m.hidden:
        a += ["--kv-channels", str(m.head_dim)]
    if m.window:
        a += ["--window-size", f"{m.window - 1},0"]
        freq = megatron_pattern(m.window_skip_freq)
        if freq is not None:
            a += ["--window-attn-skip-freq", freq]
    if m.sinks:
        a += ["--softmax-type", "learnable"]
    return a


def moe_arguments(plan: Plan, m: Any) -> list[str]:
    """Megatron-Core's MoE arguments (megatron/training/arguments.py, _add_moe_args): experts, top-k,
    the experts' and shared experts' widths, the dense-layer pattern, the router, token dropping and
    the expert-parallel degrees; grouped GEMM and the all-to-all dispatcher, as the cost model prices
    the experts (one grouped GEMM per local expert set, tokens sent by all-to-all)."""
    moe = m.moe
    if moe is None:
        return []
    d, router = plan.degrees, moe.router
    a = ["--num-experts", str(moe.experts), "--moe-router-topk", str(moe.top_k),
         "--moe-ffn-hidden-size", str(moe.expert_ffn_hidden),
         "--expert-model-parallel-size", str(d.ep), "--expert-tensor-parallel-size", str(d.etp),
         "--moe-grouped-gemm", *dispatcher_arguments(plan),
         "--moe-router-score-function", router.score,
         "--moe-router-load-balancing-type", "aux_loss" if router.aux_loss_coeff > 0 else "none",
         "--moe-aux-loss-coeff", repr(router.aux_loss_coeff)]
    if moe.shared_experts:
        a += ["--moe-shared-expert-intermediate-size", str(moe.shared_width)]
        # as the cost model prices Megatron (KERNELS); the a2a overlap replaces it (Megatron-Core refuses both)
        if shared_expert_overlap(plan):
            a.append("--moe-shared-expert-overlap")
    if moe.dense_layers:
        a += ["--moe-layer-freq", layer_pattern([int(m.is_moe_layer(i)) for i in range(m.layers)])]
    if not router.dropless:
        a += ["--moe-expert-capacity-factor", repr(router.capacity_factor), "--moe-pad-expert-input-to-capacity",
              "--moe-token-drop-policy", "probs"]
    if router.force_balance:
        a.append("--moe-router-force-load-balancing")
    if plan.moe_a2a_overlap:  # one micro-batch's dispatch and combine beside another's compute (Plan.moe_a2a_overlap)
        a += ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    if plan.dtype in FP8_RECIPES:  # each expert's token count padded to the FP8 GEMM's alignment (16 or 32 rows)
        a.append("--moe-router-padding-for-quantization")
    return a


def dispatcher_arguments(plan: Plan) -> list[str]:
    """The token dispatcher (``Plan.moe_dispatcher``): ``alltoall``, or ``flex`` with the DeepEP backend
    (megatron-core's ``moe_flex_dispatcher_backend``; ``--moe-enable-deepep`` is its deprecated form)."""
    a = ["--moe-token-dispatcher-type", plan.moe_dispatcher]
    if plan.moe_dispatcher == "flex":
        a += ["--moe-flex-dispatcher-backend", "deepep"]
    return a


def shared_expert_overlap(plan: Plan) -> bool:
    """Whether Megatron runs the shared experts beside the all-to-all (``--moe-shared-expert-overlap``): as
    the cost model prices Megatron (``expert_layout.moe_overlap`` under KERNELS; not beside the a2a overlap
    nor with the flex dispatcher, which TransformerConfig refuses)."""
    return moe_overlap(plan, KERNELS) == "shared_experts"


def layer_pattern(flags: list[int]) -> str:
    """A per-layer 0/1 list in the run-length form Megatron's --moe-layer-freq evaluates:
    ``([0]*3+[1]*58)`` for DeepSeek-V3's three dense layers, then 58 MoE layers."""
    runs: list[list[int]] = []
    for f in flags:
        if runs and runs[-1][0] == f:
            runs[-1][1] += 1
        else:
            runs.append([f, 1])
    return "(" + "+".join(f"[{f}]*{n}" for f, n in runs) + ")"


def mla_arguments(m: Any) -> list[str]:
    """Multi-head Latent Attention (Megatron-Core's MLATransformerConfig): the compression ranks and
    the head widths (--qk-head-dim is the non-rope part, --qk-pos-emb-head-dim the rope part)."""
    mla = m.mla
    if mla is None:
        return []
    a = ["--multi-latent-attention", "--qk-layernorm"]  # the RMSNorms on the q and kv latents (DeepSeek-V2/V3)
    if mla.q_lora_rank:
        a += ["--q-lora-rank", str(mla.q_lora_rank)]
    return a + ["--kv-lora-rank", str(mla.kv_lora_rank), "--qk-head-dim", str(mla.qk_nope_head_dim),
                "--qk-pos-emb-head-dim", str(mla.qk_rope_head_dim), "--v-head-dim", str(mla.v_head_dim)]


def world_of(args: list[str], world: int) -> dict[str, int]:
    """Megatron's own arithmetic on the arguments: dp = world / (tp * pp * cp) and micro-batches
    per replica = global / (micro * dp)."""
    a = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    tp, pp = int(a["--tensor-model-parallel-size"]), int(a["--pipeline-model-parallel-size"])
    cp = int(a.get("--context-parallel-size", 1))
    dp = world // (tp * pp * cp)
    mbs, gb = int(a["--micro-batch-size"]), int(a["--global-batch-size"])
    return {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "num_microbatches": gb // (mbs * dp),
            "remainder": gb % (mbs * dp) + world % (tp * pp * cp)}


def render(record: PlanRecord, ctx: ExportContext) -> Export:
    plan = record.plan
    args = arguments(plan, ctx)
    prov = provenance(record, ctx)
    lines = ["#!/usr/bin/env bash", "# Megatron-LM / Megatron Core arguments for pretrain_gpt.py"]
    if _helix_fork(plan):
        lines.append(f"# REQUIRES {HELIX_FORK}")
    lines += comment_lines(prov)
    lines.append(f"# world size {plan.world} = {plan.degrees.product_text()}; ranks in Megatron's "
                 "tp-cp-ep-dp-pp order")
    lines += placement_comment(plan)
    lines.append("MEGATRON_PARALLEL_ARGS=(")
    i = 0
    while i < len(args):
        j = i + 1
        while j < len(args) and not args[j].startswith("--"):
            j += 1
        lines.append("  " + " ".join(shlex.quote(x) for x in args[i:j]))
        i = j
    lines.append(")")
    lines.append('# torchrun ... pretrain_gpt.py "${MEGATRON_PARALLEL_ARGS[@]}" <data, tokenizer and optimizer args>')
    data: dict[str, Any] = {"args": args, "provenance": prov}
    if _helix_fork(plan):
        data["requires"] = HELIX_FORK
    return Export(format=NAME, text="\n".join(lines) + "\n", data=data, suffix=SUFFIX)


def parse_script(text: str) -> list[str]:
    """The argument list back out of a rendered script (tests read the file the user gets)."""
    body = text.split("MEGATRON_PARALLEL_ARGS=(", 1)[1].split("\n)", 1)[0]
    return shlex.split(body)
