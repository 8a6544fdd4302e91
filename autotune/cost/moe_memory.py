"""A MoE rank's memory beyond the dense model's: the routed experts' weights, gradients and optimizer
states, the activations the experts keep for backward, and the dispatch buffers.

* Expert states: the rank's expert parameters (``expert_data_parallel.expert_params_on_rank``: its
  MoE layers, its EP rank's experts, its etp slice) at the dense states' bytes per parameter
  (``memory.model_states``), the optimizer states (and from ZeRO-2 the gradients) sharded over edp,
  as Megatron-Core's distributed optimizer shards them; expert weights stay whole on their rank.
* Routed activations, per MoE layer and micro-batch, kept for backward: the permuted input of every
  token copy the busiest rank's experts process (hidden), their up/gate projection and activation
  outputs (as the dense MLP's ``matrices * width`` count, at the expert width over etp), and the
  router's fp32 probabilities over the rank's tokens. Full recomputation keeps none of them (the
  block input is all it keeps); selective keeps them.
* Dispatch buffers: one send and one receive buffer of the busiest rank's token copies, alive while
  a layer runs (once per rank, not per layer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autotune.cost import expert_data_parallel as EDP
from autotune.cost import memory as M
from autotune.cost.data_parallel import grads_accumulate_unsharded

if TYPE_CHECKING:
    from autotune.cost.context import RankContext


def routed_activation_bytes(model: Any, *, received: float, tokens: float, etp: int, bpe: int,
                            recompute: str) -> float:
    """Bytes one MoE layer keeps for backward per micro-batch beyond its attention and shared
    experts: ``received`` token copies on the busiest rank, ``tokens`` the rank's tokens."""
    if recompute == "full":
        return 0.0
    e = model.moe
    copies = received * (model.hidden + model.mlp_matrices * e.expert_ffn_hidden / etp) * bpe
    return copies + tokens * e.experts * 4.0


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
    st = M.model_states(p, s.dtype, min(s.zero, 2), x.edp, p / n_moe,
                        grads_unsharded=grads_accumulate_unsharded(s.zero, s.pp, ctx.microbatches),
                        framework=M.framework_of(s))
    out = dict(terms)
    for k in ("weights", "gradients", "optimizer"):
        out[k] = terms[k] + st[k]
        out[f"expert_{k}"] = st[k]
    out["activations"] = terms["activations"] + buffers
    out["dispatch_buffers"] = buffers
    alloc = sum(out[k] for k in ("weights", "gradients", "optimizer", "activations", "logits"))
    out["reserve"] = M.reserve(ctx.spec, alloc)
    return alloc + out["reserve"], out
