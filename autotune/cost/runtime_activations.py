"""What autotune's own runtime block keeps for backward, term by term (issue 25, item 6).

``memory.layer_activation_bytes`` is Korthikanti et al.'s count for Megatron's layer (LayerNorm,
dropout after attention and MLP and on the attention probabilities, 16-bit scores). The runtime's
block (``autotune/runtime/model.py``: RMSNorm, rotary, ``scaled_dot_product_attention``, SwiGLU or
GeLU MLP, no dropout) keeps other tensors. Each term below names the op whose saved tensor it is, as
``torch.autograd.graph.saved_tensors_hooks`` lists them (``profilers/layers.py`` measures the sum
that way; ``tests/unit/test_runtime_activations.py`` checks every shape here against it), per token
of the rank (``b * s``), ``e`` the activation bytes (2 for bf16/fp16, 4 for fp32):

* two RMSNorms, each: its input cast to fp32 (``x.float()``: 4 bytes a value, the block input
  itself in fp32), the normalised product ``x * rsqrt(...)`` (fp32, saved by the weight multiply),
  and its output in ``e`` (saved by the next projections): ``2 * h * (4 + 4 + e)`` (the per-token
  rsqrt, 4 bytes, is left out: 1/h of the rest);
* attention inputs as SDPA saves them: q (after rotary), k and v for every query head (the runtime
  repeats GQA's kv heads before SDPA: ``repeat_interleave``) else the kv width; rotary saves none
  (its cos/sin are buffers);
* fused SDPA (flash on CUDA, and on CPU in torch >= 2.2 for causal masks): its output (the output
  projection's input, the same storage) and the fp32 log-sum-exp per query and head;
* materialised SDPA (the math kernel): q, k and v as it computes them (fp32 on CPU whatever the
  precision: the CPU math kernel upcasts reduced precision; ``e`` on accelerators), the softmax
  output (the same bytes, one per query and key: causal masking does not shrink it), and the
  output projection's input in ``e``;
* the MLP: SwiGLU keeps w1's and w3's outputs, SiLU's output and the product (4 x f), GeLU w1's
  output and GeLU's output (2 x f).

Tensor and sequence parallelism split these as the runtime's layers do: every projection and the
attention by tp; the norms, with sequence parallelism, by tp as well. Context parallelism and
Ulysses are ``memory.layer_activation_bytes``'s business (ring blocks keep their own tensors); this
count is the per-block check for the shapes ``profile --layers`` measures (cp = hp = 1).
"""

from __future__ import annotations

from typing import Any

FP32 = 4


def runtime_block_terms(model: Any, *, micro_batch: int, seq: int, tp: int = 1, act_bytes: int,
                        fused_attention: bool, on_cpu: bool, sequence_parallel: bool = False) -> dict[str, float]:
    """Bytes one runtime block keeps for backward per micro-batch, by term (see the module text)."""
    h, f, d = model.hidden, model.ffn_hidden, model.head_dim
    tokens = float(micro_batch * seq)
    e = act_bytes
    heads = model.heads // tp
    kv_heads = model.kv_heads // tp
    kv_width = heads * d if kv_heads < heads else kv_heads * d  # GQA: repeated to every query head
    norm_tokens = tokens / (tp if sequence_parallel and tp > 1 else 1)
    terms = {"norms": 2.0 * norm_tokens * h * (FP32 + FP32 + e)}
    if fused_attention:
        terms["attention_inputs"] = tokens * (heads * d + 2 * kv_width) * e
        terms["attention_output"] = tokens * heads * d * e
        terms["scores"] = tokens * heads * FP32  # log-sum-exp
    else:
        m = FP32 if on_cpu else e
        terms["attention_inputs"] = tokens * (heads * d + 2 * kv_width) * m
        terms["attention_output"] = tokens * heads * d * e
        terms["scores"] = tokens * heads * seq * m
    terms["mlp"] = tokens * (f // tp) * (4 if model.activation == "swiglu" else 2) * e
    return terms


def runtime_block_bytes(model: Any, **kw: Any) -> float:
    """The sum of ``runtime_block_terms``."""
    return sum(runtime_block_terms(model, **kw).values())
