"""Per-module selective recomputation (``Plan.recompute_modules``, Megatron-Core's ``--recompute-granularity
selective --recompute-modules``): what each named part of a layer stops keeping for the backward, and
the forward work it runs again there.

Megatron-Core (megatron/core/transformer/transformer_config.py ``recompute_modules``,
transformer_layer.py, moe/experts.py, multi_latent_attention.py):

* ``core_attn``: the attention scores and softmax (the default; a fused attention keeps none, so this
  only matters unfused): the existing ``recompute=selective`` term (``activations.py``, ``rank.block_times``).
* ``layernorm``: the input and pre-MLP norms' outputs are discarded after use and rebuilt from the
  norm inputs (kept anyway as residuals): 2 x hidden per token, the QKV and MLP inputs of
  Korthikanti's count; two norm forwards again, memory-bound.
* ``mla_up_proj`` (MLA models): the query and key/value up-projections' outputs (and the rope
  applied to them) are discarded; the compressed latents they were made from are kept. The two
  up-projection GEMMs run again.
* ``moe_act``: the routed experts' activation output (the second grouped GEMM's input) is discarded
  and rebuilt from the first GEMM's output (kept): ``width / etp`` per routed token copy; the
  activation's elementwise pass again.
* ``mlp``: a dense layer's whole MLP (``not is_moe_layer``) is checkpointed: it keeps its input only;
  its forward GEMMs again.
* ``shared_experts``: the shared experts likewise.
* ``moe``: the whole MoE layer (router, dispatch, routed and shared experts, combine) is checkpointed:
  its forward again, the token exchange included.

Sizes are in the units of ``activations.layer_activation_bytes`` (bytes of 16-bit activations,
times ``act_bytes / 2``), so what a module saves is the same term the block's count holds.
"""

from __future__ import annotations

from typing import Any

from autotune.cost import grouped_gemm as GG


def recomputes_core_attn(recompute: str, modules: tuple[str, ...]) -> bool:
    """Whether the attention core is rebuilt in the backward: ``recompute=selective`` with no modules
    named (Megatron's default ``["core_attn"]``) or with ``core_attn`` among them."""
    return recompute == "selective" and (not modules or "core_attn" in modules)


def block_recompute(recompute: str, modules: tuple[str, ...]) -> str:
    """The ``recompute`` the block count (``activations.layer_activation_bytes``) takes: the named
    modules without ``core_attn`` keep the scores as no recomputation does."""
    if recompute == "selective" and not recomputes_core_attn(recompute, modules):
        return "none"
    return recompute


def block_saving(model: Any, modules: tuple[str, ...], *, tokens: float, cp_tokens: float, tp: int,
                 sequence_parallel: bool, heads_local: int, ffn_width: float, moe_layer: bool,
                 act_bytes: int) -> float:
    """Bytes one layer's attention and FFN on the attention's ranks (a dense layer's MLP or a MoE
    layer's shared experts, ``ffn_width`` wide) no longer keep per micro-batch under ``modules``.
    ``tokens``: the micro-batch's tokens outside attention on this rank (micro-batch times the cp/hp
    shard), ``cp_tokens``: the attention's tokens."""
    if not modules:
        return 0.0
    scale = act_bytes / 2.0
    h, saved = model.hidden, 0.0
    if "layernorm" in modules:
        saved += 4.0 * h * tokens / (tp if sequence_parallel else 1)
    if "mla_up_proj" in modules and getattr(model, "mla", None) is not None:
        m, frac = model.mla, heads_local / model.heads
        # the q half of the count's Q/O term and its K/V term, less the latents kept instead
        saved += (2.0 * model.head_dim * heads_local + 4.0 * model.kv_dim * frac) * cp_tokens
        saved -= 2.0 * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim) * tokens
    whole_ffn = ("mlp" in modules and not moe_layer) or (moe_layer and ({"shared_experts", "moe"} & set(modules)))
    if whole_ffn:
        saved += 2.0 * ffn_width * model.mlp_matrices * tokens / tp
    return max(saved, 0.0) * scale


def routed_saving(model: Any, modules: tuple[str, ...], *, received: float, etp: int, act_bytes: float) -> float:
    """Bytes of one MoE layer's routed experts no longer kept per micro-batch: ``moe_act`` the
    activation output of each of the ``received`` token copies (``act_bytes`` each element: its
    stored form, FP8 where the second GEMM takes FP8 input, ``moe_memory.routed_activation_bytes``);
    ``moe`` is handled by the caller (nothing routed is kept)."""
    if "moe_act" in modules and "moe" not in modules:
        return received * model.moe.expert_ffn_hidden / etp * act_bytes
    return 0.0


def block_seconds(model: Any, rates: Any, modules: tuple[str, ...], *, tokens: float, tp: int,
                  sequence_parallel: bool, ffn_width: float, moe_layer: bool, bpe: int) -> float:
    """Forward seconds one layer's attention-side modules run again in the backward (before the
    compute factor): the norms, MLA's up-projections, the dense MLP or the shared experts."""
    if not modules:
        return 0.0
    h, s = model.hidden, 0.0
    if "layernorm" in modules:  # two norms: read the input, write the output
        s += rates.memory_time(2 * 2.0 * h * bpe * tokens / (tp if sequence_parallel else 1))
    if "mla_up_proj" in modules and getattr(model, "mla", None) is not None:
        m, a = model.mla, model.heads
        ups = (m.q_lora_rank * a * m.qk_head_dim if m.q_lora_rank else 0) + \
            m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim)
        s += rates.gemm_time(2.0 * tokens * ups / tp)
    if ("mlp" in modules and not moe_layer) or (moe_layer and ({"shared_experts", "moe"} & set(modules))):
        s += GG.mlp_gemm_time(rates, model, tokens, ffn_width / tp)
        s += GG.activation_time(rates, model, tokens, ffn_width / tp, bpe)
    return s


def routed_seconds(model: Any, rates: Any, modules: tuple[str, ...], *, received: float, etp: int,
                   bpe: int) -> float:
    """Forward seconds of the routed experts' activation run again under ``moe_act`` (``moe`` reruns
    the whole layer: the caller adds its forward)."""
    if "moe_act" in modules and "moe" not in modules:
        return GG.activation_time(rates, model, received, model.moe.expert_ffn_hidden / etp, bpe)
    return 0.0
