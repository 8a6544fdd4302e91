"""The activation bytes of one transformer block (Korthikanti et al.'s count; fused or materialised
attention): the formula ``memory.py`` prices a rank with, ``layers.py`` compares a layer profile's
measured bytes against, and ``compute.reference_price`` sizes its reference block with. A module of
its own, importing nothing of the cost model, so each of them can ask it without a circle."""

from __future__ import annotations

from typing import Any


def layer_activation_bytes(model: Any, *, micro_batch: int, tokens_local: float, cp_tokens: float, seq_len: int,
                           heads_local: int, tp: int, sequence_parallel: bool, recompute: str,
                           act_bytes: int, fused_attention: bool = False) -> tuple[float, float, float]:
    """(bytes one block keeps per micro-batch for backward, bytes of one block's full activations,
    of which the attention scores term).

    tokens_local: tokens of the rank outside attention (cp shard / hp); cp_tokens: the cp shard
    (Ulysses attention runs over it for ``heads_local`` heads)."""
    h, kv, f, hd = model.hidden, model.kv_dim, model.ffn_hidden, model.head_dim
    scale = act_bytes / 2.0
    b = micro_batch
    undivided = 10.0 * h * b * tokens_local / (tp if sequence_parallel else 1)
    heads_per_tp = model.heads // tp
    frac = heads_local / heads_per_tp if heads_per_tp else 1.0  # this hp rank's part of the tp heads
    # attention tensors (Q, K, V, output-projection input) over the whole cp shard for local heads
    q_o = 4.0 * hd * heads_local * b * cp_tokens
    k_v = 4.0 * (kv / tp) * frac * b * cp_tokens
    mlp = 2.0 * f * model.mlp_matrices * b * tokens_local / tp
    if fused_attention:
        # Flash / memory-efficient SDPA (what the runtime and Megatron-TE run on GPUs) keeps only the
        # fp32 log-sum-exp per query and head for backward (Dao et al. 2022, FlashAttention, section 3.1),
        # never the s^2 scores; expressed in 16-bit units so ``scale`` applies like to the other terms.
        scores = 4.0 * heads_local * b * cp_tokens * (2.0 / act_bytes)
    else:
        scores = 5.0 * heads_local * b * cp_tokens * seq_len
    full = (undivided + q_o + k_v + mlp + scores) * scale
    if recompute == "full":
        kept = 2.0 * h * b * tokens_local / (tp if sequence_parallel else 1) * scale
    elif recompute == "selective":
        kept = full - scores * scale
    else:
        kept = full
    return kept, full, scores * scale
