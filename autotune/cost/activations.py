"""Activation bytes of one transformer block: the formula (Korthikanti et al.'s count, fused or
materialised attention) that ``memory.py`` prices a rank with and that ``layers.py`` compares a layer
profile's measured bytes against. Apart from ``memory.py`` so that the layer-profile scale
(``layers.activation_scale``), which ``memory.py`` asks, can read the formula without a circle."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # typing only: context.py builds on the dimension modules
    from autotune.cost.context import RankContext


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


def block_activations(ctx: RankContext) -> tuple[float, float, float]:
    """``layer_activation_bytes`` of one block on the rank of ``ctx`` (a ``context.RankContext``):
    (kept per micro-batch, full, of which the scores)."""
    s = ctx.step
    return layer_activation_bytes(
        s.model, micro_batch=s.mbs, tokens_local=ctx.tokens / s.hp, cp_tokens=ctx.tokens, seq_len=s.seq_len,
        heads_local=ctx.heads, tp=s.tp, sequence_parallel=s.sp, recompute=s.recompute, act_bytes=s.bpe,
        fused_attention=ctx.spec.fused_attention())
