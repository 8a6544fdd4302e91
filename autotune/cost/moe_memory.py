"""A MoE rank's memory beyond the dense model's: the routed experts' weights, gradients and optimizer
states, the activations the experts keep for backward, and the dispatch buffers.

* Expert states: the rank's expert parameters (``expert_data_parallel.expert_params_on_rank``: its
  MoE layers, its EP rank's experts, its etp slice) at the dense states' bytes per parameter
  (``memory.model_states``), the optimizer states (and from ZeRO-2 the gradients) sharded over edp,
  as Megatron-Core's distributed optimizer shards them; expert weights stay whole on their rank
  except under ZeRO-3 (torchtitan's FSDP shards them over the edp ranks, ``dp_shard_mod_ep``, and
  gathers them per layer as it does the dense blocks; ``expert_data_parallel.zero3_gather``).
* Routed activations, per MoE layer and micro-batch, kept for backward: the permuted input of every
  token copy the busiest rank's experts process (hidden), their up/gate projection and activation
  outputs (as the dense MLP's ``matrices * width`` count, at the expert width over etp), and the
  router's fp32 probabilities over the rank's tokens; under FP8 the GEMM inputs in FP8. Full
  recomputation keeps none of them (the block input is all it keeps); selective keeps them, less
  what its named modules drop (``moe_act``, ``moe``: ``recompute_modules.py``).
* torchtitan's ``selective`` (per-op checkpointing) keeps no grouped-GEMM output: the routed experts'
  forward runs again in the backward, and of the router only its top-k (``recomputes_routed_gemms``,
  ``op_sac_routed_bytes``; the attention side: ``op_sac.py``).
* Dispatch buffers: one send and one receive buffer of the busiest rank's token copies, alive while
  a layer runs (once per rank, not per layer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autotune.cost import expert_data_parallel as EDP
from autotune.cost import memory as M
from autotune.cost import recompute_modules as RMOD
from autotune.cost.data_parallel import grads_accumulate_unsharded, zero3_weights_gathered
from autotune.plan_parts import FP8_RECIPES

if TYPE_CHECKING:
    from autotune.cost.context import RankContext


def routed_activation_bytes(model: Any, *, received: float, tokens: float, etp: int, bpe: int,
                            recompute: str, dtype: str = "bf16", modules: tuple[str, ...] = ()) -> float:
    """Bytes one MoE layer keeps for backward per micro-batch beyond its attention and shared
    experts: ``received`` token copies on the busiest rank, ``tokens`` the rank's tokens.

    Per copy: the first grouped GEMM's input (hidden), its output ((matrices - 1) x width / etp, the
    activation's input) and the activation's output (width / etp, the second GEMM's input). Under an
    FP8 dtype the two GEMM inputs are kept as the FP8 tensors the GEMMs read (Transformer Engine's
    GroupedLinear saves its quantised input for the weight gradient: one byte an element, the MXFP8
    and blockwise scales' 1/32 and 1/128 left out); the activation's input stays in ``bpe``.
    ``modules`` (``recompute_modules.routed_saving``): ``moe_act`` drops the activation's output,
    ``moe`` keeps nothing of the layer (its input is the block's)."""
    if recompute == "full" or "moe" in modules:
        return 0.0
    e, w = model.moe, model.moe.expert_ffn_hidden / etp
    gemm_in = 1.0 if dtype in FP8_RECIPES else float(bpe)
    copies = received * (model.hidden * gemm_in + (model.mlp_matrices - 1) * w * bpe + w * gemm_in)
    copies -= RMOD.routed_saving(model, modules, received=received, etp=etp, act_bytes=gemm_in)
    return copies + tokens * e.experts * 4.0


def recomputes_routed_gemms(framework: str, recompute: str) -> bool:
    """Whether the runtime's ``selective`` recomputation keeps no routed GEMM output and runs the routed
    experts' forward again in the backward: torchtitan's per-op selective checkpointing (the exporter's
    ``selective_ac_option = "op"``) saves the outputs of the ops on its save list alone
    (torchtitan/distributed/activation_checkpoint.py ``_get_default_save_ops``: linear, the attention
    kernels, topk, max, all_to_all_single, reduce_scatter, and PyTorch's compute-intensive ops
    ``mm``/``bmm``/``addmm``/``_scaled_mm``), which ``_grouped_mm``, the experts' GEMMs, is not on; the
    token gather, the activation and the combine are recomputed as every op off the list."""
    return framework == "torchtitan" and recompute == "selective"


TOPK_BYTES = 4.0 + 8.0
"""One routed copy's top-k entry as torchtitan's router keeps it: the fp32 score (its softmax or
sigmoid runs in fp32) and the int64 expert index, both outputs of ``topk``."""


def op_sac_routed_bytes(model: Any, *, received: float, tokens: float, ep: int, bpe: int) -> float:
    """Bytes one MoE layer keeps for backward per micro-batch under torchtitan's per-op selective
    checkpointing (``recomputes_routed_gemms``, ``op_sac.py``): the dispatched tokens where they came
    through an ``all_to_all_single`` (ep > 1: its output is saved, ``received`` copies of ``hidden``),
    and the router's ``topk`` output over the rank's tokens (``TOPK_BYTES`` per copy); the gate's
    scores are not kept (``force_recompute_mm_shapes_by_fqns = ["moe.router.gate"]``: the gate's
    GEMM runs again), nor anything of the grouped GEMMs."""
    dispatched = received * model.hidden * bpe if ep > 1 else 0.0
    return dispatched + tokens * model.moe.top_k * TOPK_BYTES


def dispatch_buffer_bytes(model: Any, received: float, bpe: int) -> float:
    """Send and receive buffers of one layer's dispatch on the busiest rank."""
    return 2.0 * received * model.hidden * bpe


def add_expert_memory(ctx: RankContext, total: float, terms: dict[str, float], buffers: float
                      ) -> tuple[float, dict[str, float]]:
    """``memory.rank_memory``'s (total, terms) with the expert states added to weights, gradients and
    optimizer and the dispatch buffers to the activations, the reserve taken again on the new total;
    each MoE part also under its own key (``expert_*``, ``dispatch_buffers``)."""
    s, x = ctx.step, ctx.step.experts
    p = EDP.expert_params_on_rank(ctx)
    n_moe = max(1, sum(x.chunk_moe_layers[ctx.pp_index]))
    # ZeRO-3 shards the experts' weights over edp too (FSDP over torchtitan's dp_shard_mod_ep mesh),
    # holding two MoE layers' gathered at once as the dense blocks' (memory.model_states)
    st = M.model_states(p, s.dtype, s.zero, x.edp, p / n_moe,
                        grads_unsharded=grads_accumulate_unsharded(s.zero, s.pp, ctx.microbatches),
                        weights_gathered=zero3_weights_gathered(s),
                        framework=M.framework_of(s), grad_reduce=s.grad_reduce, moments=s.moments)
    out = dict(terms)
    for k in ("weights", "gradients", "optimizer"):
        out[k] = terms[k] + st[k]
        out[f"expert_{k}"] = st[k]
    out["activations"] = terms["activations"] + buffers
    out["dispatch_buffers"] = buffers
    alloc = sum(out[k] for k in ("weights", "gradients", "optimizer", "activations", "logits"))
    out["reserve"] = M.reserve(ctx.spec, alloc)
    return alloc + out["reserve"], out
