"""torchtitan's per-op selective activation checkpointing, priced as its policy keeps and reruns a block.

torchtitan runs ``recompute=selective`` as its per-op checkpointing (the exporter writes
``[activation_checkpoint] mode = "selective"``, ``selective_ac_option = "op"``). Its policy
(pytorch/torchtitan torchtitan/distributed/activation_checkpoint.py ``SelectiveAC._wrap_block`` and
``_get_default_save_ops``, commit 363709fd, July 2026; the same rule since PR #1380, 2025-07) wraps
every transformer block in a checkpoint and decides op by op, in forward order:

* it saves the output of every op on its save list: PyTorch's compute-intensive ops (``mm``,
  ``addmm``, ``bmm``, ``_scaled_mm``, the flash and memory-efficient SDPA kernels:
  ``torch._functorch.partitioners.get_default_op_list``), the cuDNN SDPA and flex-attention kernels,
  ``topk``, ``max``, the reduce-scatter and all-to-all collectives;
* except every second ``mm`` of the block (the 2nd, 4th, ...), recomputed in the backward. A linear
  with a bias runs as ``addmm`` (aten's ``linear``), which is saved and not counted;
* the router's gate (``force_recompute_mm_shapes_by_fqns = ["moe.router.gate"]``) is recomputed and
  not counted;
* every other op (norms, rotary, activations, the token gather and scatter, ``_grouped_mm``: the
  routed experts' GEMMs, ``moe_memory.recomputes_routed_gemms``) is recomputed.

So a block keeps per token: its input (the checkpoint reruns the block from it), the saved GEMM
outputs, the attention kernel's output and its fp32 log-sum-exp per head; a MoE layer also the
router's top-k (``moe_memory.op_sac_routed_bytes``). The backward runs again the recomputed GEMMs
(and the router gate, ``moe_layers``); the recomputed elementwise ops are left out of the price
(torchtitan compiles its blocks, and Inductor fuses them into the kernels around them).

The block's GEMMs in forward order are the model's (``ModelSpec.attention_gemms``: torchtitan's
attention with its fused ``wqkv`` then ``wo``, or MLA's down- and up-projections then ``wo``), then
the FFN as torchtitan's FeedForward runs it, ``w2(silu(w1(x)) * w3(x))``: w1, w3, w2 (w1, w2 without
a gate). A MoE layer's FFN is its shared experts (none: nothing more is counted).
Tensor parallelism: a column-parallel output is split over tp; a row-parallel one (the attention's
output projection, w2) is the whole partial sum before the reduce-scatter, whose output (hidden / tp)
is saved as well.
"""

from __future__ import annotations

from typing import Any

from autotune.cost.memory import framework_of

LSE_BYTES = 4.0
"""The attention kernel's log-sum-exp per query and head, fp32 (FlashAttention, cuDNN and flex)."""


def applies(step: Any) -> bool:
    """Whether ``step`` runs torchtitan's per-op checkpointing (its ``selective`` recomputation)."""
    return step.recompute == "selective" and framework_of(step) == "torchtitan"


def block_gemms(model: Any, ffn_width: float) -> list[tuple[float, float, bool, bool]]:
    """(in, out, split over tp, row-parallel) of each GEMM of one block in forward order: the
    attention's, then an FFN of ``ffn_width`` (none when 0)."""
    att = list(model.attention_gemms())
    out = [(i, o, split, k == len(att) - 1) for k, (i, o, split) in enumerate(att)]
    h = model.hidden
    if ffn_width:
        ups = [(h, ffn_width, True, False)] * (model.mlp_matrices - 1)  # w1 (and w3)
        out += ups + [(ffn_width, h, True, True)]  # w2
    return out


def _saved(model: Any, gemms: list[tuple[float, float, bool, bool]]) -> list[bool]:
    """Per GEMM whether the policy saves its output: every ``addmm`` (a biased linear), and of the
    ``mm``s the odd ones counted in forward order."""
    if model.bias:
        return [True] * len(gemms)
    return [k % 2 == 0 for k in range(len(gemms))]  # k = 0 is the first mm: count 1, saved


def kept_bytes(model: Any, ffn_width: float, *, tokens: float, cp_tokens: float, heads_local: int, tp: int,
               bpe: float) -> float:
    """Bytes one block keeps for its backward per micro-batch under the policy: ``tokens`` the
    micro-batch's tokens on this rank outside attention, ``cp_tokens`` inside it, ``heads_local``
    the rank's query heads (torchtitan shards the sequence with tp: the input over tp)."""
    gemms = block_gemms(model, ffn_width)
    per_token = model.hidden / tp  # the block's input, sequence-parallel under tp
    for (_, o, split, row), keep in zip(gemms, _saved(model, gemms), strict=True):
        if keep:
            per_token += o if row else o / (tp if split else 1)
        if row and tp > 1:
            per_token += model.hidden / tp  # the reduce-scatter's output
    attention = cp_tokens * heads_local * (model.v_head_dim * bpe + LSE_BYTES)
    return per_token * bpe * tokens + attention


def rerun_seconds(model: Any, rates: Any, ffn_width: float, *, tokens: float, tp: int) -> float:
    """Forward seconds of the GEMMs one block runs again in its backward (the unsaved ``mm``s) over
    ``tokens``, at the rates' GEMM sizes where it has them (the datasheet's), else at its flat rate."""
    gemms = block_gemms(model, ffn_width)
    s = 0.0
    for (i, o, split, row), keep in zip(gemms, _saved(model, gemms), strict=True):
        if keep:
            continue
        n, k = (o, i / (tp if split else 1)) if row else (o / (tp if split else 1), i)
        s += rates.size.gemm_time(tokens, n, k) if rates.size is not None else rates.gemm_time(2.0 * tokens * n * k)
    return s
