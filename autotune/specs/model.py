"""Decoder-only transformer specs: presets, file loading, parameter and FLOP counts.

Parameter counts reproduce the published figures (tests/unit/test_model_spec.py): Llama-3-8B 8.03B,
Llama-3-70B 70.6B, Llama-3-405B 405.9B, Llama-2-7B 6.74B, GPT-3 174.6B.
FLOPs follow Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", eq. 3) generalised to GQA and SwiGLU: a matmul with an (m x n) weight costs
2*m*n FLOPs per token forward, backward twice forward; causal attention's QK^T and AV cost
2 * 2 * hidden * (s+1)/2 per token and layer forward (each token attends to (s+1)/2 keys on average).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import InputError, suggest
from autotune.specs import fields as F

ATTENTION_BWD_FLOPS = 2.5
"""A measured attention backward's FLOPs per forward FLOP: five matmuls (S = QK^T recomputed, dV, dP,
dQ, dK) against the forward's two (Dao 2023, FlashAttention-2, section on FLOPs). The profiler
counts with it (``profilers/compute.py`` ``attention_flops``) and records it in the profile
(``attention.bwd_flops_factor``); pricing a profiled backward multiplies by the same factor, so a
backward measured at 2.5 ms is priced at 2.5 ms. Without a profile attention is priced by the
model's FLOP accounting (``ModelSpec.hardware_flops_per_token``: backward twice the forward, as
MFU counts it)."""


ACTIVATIONS = ("swiglu", "gelu")
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "learned")
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer. All sizes are counts, not bytes."""

    name: str
    """Preset or file name, for display and provenance."""
    layers: int
    """Number of transformer blocks."""
    hidden: int
    """Model width h; head_dim = hidden / heads."""
    heads: int
    """Query heads a."""
    kv_heads: int
    """Key/value heads (GQA when fewer than heads); heads must be a multiple of it."""
    ffn_hidden: int
    """MLP inner width f (per branch for SwiGLU)."""
    vocab: int
    """Vocabulary size V."""
    activation: str = "swiglu"
    """'swiglu' (three MLP matrices) or 'gelu' (two)."""
    norm: str = "rmsnorm"
    """'rmsnorm' (weight only) or 'layernorm' (weight and bias)."""
    tied_embeddings: bool = False
    """LM head shares the embedding matrix."""
    position: str = "rope"
    """'rope' (no parameters) or 'learned' (a max_positions x hidden table)."""
    max_positions: int = 0
    """Rows of the learned position table (0 for rope)."""
    bias: bool = False
    """Linear layers carry biases (GPT-3 style)."""
    source: str = ""
    """Where the figures come from (paper, model card) for presets."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"must be a positive integer, got {v!r}", field=name)
        if self.hidden % self.heads:
            raise InputError(f"hidden({self.hidden}) is not divisible by heads({self.heads})", field="hidden")
        if self.heads % self.kv_heads:
            raise InputError(f"heads({self.heads}) is not divisible by kv_heads({self.kv_heads})",
                             field="kv_heads")
        if self.activation not in ACTIVATIONS:
            raise InputError(f"must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}", field="activation")
        if self.norm not in NORMS:
            raise InputError(f"must be one of {', '.join(NORMS)}, got {self.norm!r}", field="norm")
        if self.position not in POSITIONS:
            raise InputError(f"must be one of {', '.join(POSITIONS)}, got {self.position!r}", field="position")
        if self.position == "learned" and self.max_positions < 1:
            raise InputError("learned positions need max_positions >= 1", field="max_positions")

    # ---- shapes -------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): kv_heads * head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.activation == "swiglu" else 2

    # ---- parameters ---------------------------------------------------------------------------
    def attention_params(self) -> int:
        h, kv = self.hidden, self.kv_dim
        n = h * h + 2 * h * kv + h * h  # Wq, Wk, Wv, Wo
        if self.bias:
            n += h + 2 * kv + h
        return n

    def mlp_params(self) -> int:
        h, f = self.hidden, self.ffn_hidden
        n = self.mlp_matrices * h * f
        if self.bias:
            n += (self.mlp_matrices - 1) * f + h
        return n

    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    def layer_params(self) -> int:
        """One transformer block: attention, MLP and its two norms."""
        return self.attention_params() + self.mlp_params() + 2 * self.norm_params()

    def embedding_params(self) -> int:
        n = self.vocab * self.hidden
        if self.position == "learned":
            n += self.max_positions * self.hidden
        return n

    def head_params(self) -> int:
        """Final norm plus the LM head (zero extra matrix when tied)."""
        return self.norm_params() + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def param_count(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params() + self.head_params()

    # ---- FLOPs --------------------------------------------------------------------------------
    def layer_matmul_flops_fwd(self) -> float:
        """Forward FLOPs per token of one block's weight matmuls: 2 * (weights)."""
        h, kv, f = self.hidden, self.kv_dim, self.ffn_hidden
        return 2.0 * (2 * h * h + 2 * h * kv + self.mlp_matrices * h * f)

    def layer_attention_flops_fwd(self, seq_len: int, causal: bool = True) -> float:
        """Forward FLOPs per token of QK^T and AV: 2 matmuls * 2 * hidden * keys attended."""
        keys = (seq_len + 1) / 2 if causal else seq_len
        return 2.0 * 2.0 * self.hidden * keys

    def head_flops_fwd(self) -> float:
        """LM head per token (the embedding lookup is free)."""
        return 2.0 * self.hidden * self.vocab

    def forward_flops_per_token(self, seq_len: int) -> float:
        layer = self.layer_matmul_flops_fwd() + self.layer_attention_flops_fwd(seq_len)
        return self.layers * layer + self.head_flops_fwd()

    def model_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token without recomputation (forward + 2x backward): what MFU counts."""
        return 3.0 * self.forward_flops_per_token(seq_len)

    def hardware_flops_per_token(self, seq_len: int, recompute: str = "none") -> float:
        """Training FLOPs per token the devices really execute, recomputation included.

        full: every block's forward again (Megatron ``--recompute-granularity full``);
        selective: only the attention core (QK^T, softmax, AV) again (Korthikanti et al. 2022).
        """
        if recompute not in RECOMPUTE:
            raise InputError(f"must be one of {', '.join(RECOMPUTE)}, got {recompute!r}", field="recompute")
        base = self.model_flops_per_token(seq_len)
        if recompute == "full":
            return base + self.layers * (self.layer_matmul_flops_fwd() + self.layer_attention_flops_fwd(seq_len))
        if recompute == "selective":
            return base + self.layers * self.layer_attention_flops_fwd(seq_len)
        return base

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> dict[str, Any]:
        d = self.to_dict()
        d["params"] = self.param_count()
        d["head_dim"] = self.head_dim
        return d


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, src: str) -> ModelSpec:
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn_hidden=ffn,
                     vocab=vocab, activation="swiglu", norm="rmsnorm", position="rope", source=src)


PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, "Touvron et al. 2023, Llama 2, Table 1; HF config"),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, "Touvron et al. 2023, Llama 2; HF config"),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, "Touvron et al. 2023, Llama 2; HF config"),
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, "Meta Llama 3 model card; HF config (8.03B)"),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, "Meta Llama 3 model card; HF config (70.6B)"),
        _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, "Llama 3 Herd of Models 2024, Table 3 (405B)"),
        ModelSpec(name="gpt3-175b", layers=96, hidden=12288, heads=96, kv_heads=96, ffn_hidden=4 * 12288,
                  vocab=50257, activation="gelu", norm="layernorm", position="learned", max_positions=2048,
                  bias=True, tied_embeddings=True,
                  source="Brown et al. 2020, GPT-3, Table 2.1 (174.6B with tied embeddings)"),
        # Small enough that every parallelism runs on CPU in seconds; sizes chosen so that
        # tp, hp and cp of 2 and 4 divide heads (8), kv heads (4) and layers (4).
        ModelSpec(name="tiny", layers=4, hidden=64, heads=8, kv_heads=4, ffn_hidden=176, vocab=256,
                  source="autotune test model"),
        ModelSpec(name="small", layers=8, hidden=256, heads=8, kv_heads=4, ffn_hidden=704, vocab=2048,
                  source="autotune CPU demo model (~7M params)"),
    )
}

_MODEL_KEYS = {f.name for f in dataclasses.fields(ModelSpec)}


def model_from_dict(d: dict[str, Any], source: str | None = None) -> ModelSpec:
    try:
        F.reject_unknown(d, _MODEL_KEYS, None)
        heads = F.get_int(d, "heads", "heads")
        kw: dict[str, Any] = dict(
            name=F.get_str(d, "name", "name", default=Path(source).stem if source else "model"),
            layers=F.get_int(d, "layers", "layers"),
            hidden=F.get_int(d, "hidden", "hidden"),
            heads=heads,
            kv_heads=F.get_int(d, "kv_heads", "kv_heads", default=heads),
            ffn_hidden=F.get_int(d, "ffn_hidden", "ffn_hidden"),
            vocab=F.get_int(d, "vocab", "vocab"),
            activation=F.get_str(d, "activation", "activation", default="swiglu", choices=ACTIVATIONS),
            norm=F.get_str(d, "norm", "norm", default="rmsnorm", choices=NORMS),
            tied_embeddings=F.get_bool(d, "tied_embeddings", "tied_embeddings", default=False),
            position=F.get_str(d, "position", "position", default="rope", choices=POSITIONS),
            max_positions=F.get_int(d, "max_positions", "max_positions", default=0, minimum=0),
            bias=F.get_bool(d, "bias", "bias", default=False),
            source=str(d.get("source") or source or ""),
        )
        return ModelSpec(**kw)
    except InputError as e:
        raise e.within(source=source) from None


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A preset name (``llama3-8b``) or a YAML/JSON model file."""
    s = str(name_or_path)
    if s in PRESETS:
        return PRESETS[s]
    p = Path(s)
    if p.suffix.lower() in (".yaml", ".yml", ".json") or p.exists():
        return model_from_dict(F.read_mapping(p, "model"), source=s)
    raise InputError(f"unknown model preset {s!r}" + suggest(s, PRESETS), field="model")
