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
from autotune.specs import windows as WIN
from autotune.specs.moe import MLASpec, MoESpec, mla_from_dict, moe_from_dict

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
    explicit_head_dim: int = 0
    """Each head's width where it is not hidden / heads (Qwen3, GPT-OSS: the model file's
    ``head_dim``); 0: hidden / heads."""
    moe: MoESpec | None = None
    """Experts (``autotune/specs/moe.py``); None: a dense model."""
    mla: MLASpec | None = None
    """Multi-head Latent Attention; None: standard multi-head / grouped-query attention."""
    window: int = 0
    """Sliding-window attention: the keys a windowed layer's query attends, itself included (HF's
    ``sliding_window``; Megatron ``--window-size window-1,0``); 0: every layer full causal
    (``autotune/specs/windows.py``)."""
    window_skip_freq: int | tuple[int, ...] | None = None
    """Which layers are windowed, as Megatron's ``--window-attn-skip-freq``: None every layer, an
    integer N every layer but each Nth (layer numbers from 1), or 1/0 per layer."""
    sinks: bool = False
    """Learned attention sinks: one logit per head and layer in the softmax's denominator (GPT-OSS;
    Megatron ``--softmax-type learnable``)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab"):
            v = getattr(self, name)
            # ffn_hidden 0: a block without FFN, what the cost model prices of a MoE layer without
            # shared experts beside its routed experts (cost/moe_layers.ffn_model); files need >= 1
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "ffn_hidden" else 1):
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
        if self.explicit_head_dim < 0:
            raise InputError(f"must be a positive integer, got {self.explicit_head_dim}", field="head_dim")
        if self.moe is not None:
            bad = [i for i in self.moe.dense_layers if not 0 <= i < self.layers]
            if bad:
                raise InputError(f"layer {bad[0]} is out of range (the model has {self.layers} layers, 0..{self.layers - 1})",
                                 field="moe.dense_layers")
            if len(self.moe.dense_layers) == self.layers:
                raise InputError("every layer is dense: drop the moe block or a dense layer", field="moe.dense_layers")
        WIN.check_window(self.window, self.window_skip_freq, self.layers)
        if not isinstance(self.sinks, bool):
            raise InputError(f"expected true or false, got {self.sinks!r}", field="sinks")

    # ---- shapes -------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """Each head's width: the file's ``head_dim``, MLA's value head, else hidden / heads."""
        if self.explicit_head_dim:
            return self.explicit_head_dim
        return self.mla.v_head_dim if self.mla is not None else self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): heads * head_dim."""
        return self.heads * self.head_dim

    @property
    def qk_head_dim(self) -> int:
        """Each head's query/key width (MLA: non-rope plus rope part)."""
        return self.mla.qk_head_dim if self.mla is not None else self.head_dim

    @property
    def v_head_dim(self) -> int:
        return self.mla.v_head_dim if self.mla is not None else self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): kv_heads * head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.activation == "swiglu" else 2

    # ---- parameters ---------------------------------------------------------------------------
    def attention_gemms(self) -> tuple[tuple[int, int, bool], ...]:
        """(in, out, split over tp) of each attention weight matrix, in the order the block runs them.

        Standard attention: the fused QKV projection and the output projection. MLA (DeepSeek-V2,
        section 2.1.2): the query down- and up-projection (or one projection without q
        compression), the joint KV down-projection (which also yields the shared rope key), the KV
        up-projection, the output projection; the down-projections are replicated over tp
        (Megatron-Core's MLA), every other matrix split."""
        h = self.hidden
        if self.mla is None:
            return ((h, self.q_dim + 2 * self.kv_dim, True), (self.q_dim, h, True))
        m, a = self.mla, self.heads
        q = ((h, m.q_lora_rank, False), (m.q_lora_rank, a * m.qk_head_dim, True)) if m.q_lora_rank else \
            ((h, a * m.qk_head_dim, True),)
        return q + ((h, m.kv_lora_rank + m.qk_rope_head_dim, False),
                    (m.kv_lora_rank, a * (m.qk_nope_head_dim + m.v_head_dim), True), (a * m.v_head_dim, h, True))

    def attention_params(self) -> int:
        sinks = self.heads if self.sinks else 0  # one learned logit per head
        if self.mla is not None:  # the matrices plus the two latent RMSNorms
            return sum(i * o for i, o, _ in self.attention_gemms()) + self.mla.q_lora_rank + self.mla.kv_lora_rank + sinks
        h, kv, q = self.hidden, self.kv_dim, self.q_dim
        n = h * q + 2 * h * kv + q * h + sinks  # Wq, Wk, Wv, Wo
        if self.bias:
            n += q + 2 * kv + h
        return n

    # ---- sliding windows ----------------------------------------------------------------------
    def is_window_layer(self, i: int) -> bool:
        """Whether layer ``i`` (from 0) attends a sliding window (``specs/windows.py``)."""
        return WIN.is_window_layer(self.window, self.window_skip_freq, i)

    @property
    def window_layer_count(self) -> int:
        return sum(self.is_window_layer(i) for i in range(self.layers)) if self.window else 0

    def window_keys(self, seq_len: int) -> float:
        """Mean keys a query of a windowed layer attends over a causal sequence of ``seq_len``
        (``windows.query_keys``: (s+1)/2 when the window covers the sequence)."""
        return WIN.query_keys(0, seq_len, 0, self.window) / seq_len

    def attention_flops_fwd(self, seq_len: int, keys: float | None = None) -> float:
        """Forward FLOPs per token of every layer's QK^T and AV: the full layers at ``keys`` (default
        causal), the windowed ones at ``window_keys`` (documents and windows together are refused
        where they are priced, ``cost/windows.py``)."""
        full = self.layer_attention_flops_fwd(seq_len, keys=keys)
        n_win = self.window_layer_count
        if not n_win:
            return self.layers * full
        return (self.layers - n_win) * full + n_win * self.layer_attention_flops_fwd(seq_len, keys=self.window_keys(seq_len))

    def mlp_params(self, width: int | None = None) -> int:
        """One FFN of ``width`` (default ``ffn_hidden``)."""
        h, f = self.hidden, self.ffn_hidden if width is None else width
        if f == 0:
            return 0
        n = self.mlp_matrices * h * f
        if self.bias:
            n += (self.mlp_matrices - 1) * f + h
        return n

    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    # ---- experts ------------------------------------------------------------------------------
    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i not in self.moe.dense_layers

    @property
    def moe_layer_count(self) -> int:
        return 0 if self.moe is None else self.layers - len(self.moe.dense_layers)

    @property
    def dense_ffn_width(self) -> int:
        """FFN width of the dense layers (all layers of a dense model)."""
        if self.moe is None or self.moe.dense_ffn_hidden is None:
            return self.ffn_hidden
        return self.moe.dense_ffn_hidden

    def ffn_width(self, i: int) -> int:
        """Width of the FFN every token of layer ``i`` runs through on the attention's ranks: the dense
        FFN, or in a MoE layer the shared experts (0 without them); routed experts are apart."""
        return self.moe.shared_width if self.is_moe_layer(i) else self.dense_ffn_width

    def router_params(self) -> int:
        """The router's weight, and its bias with ``bias`` (GPT-OSS's router is a Linear with bias)."""
        return 0 if self.moe is None else self.moe.experts * (self.hidden + (1 if self.bias else 0))

    def expert_params(self) -> int:
        """One routed expert."""
        return 0 if self.moe is None else self.mlp_params(self.moe.expert_ffn_hidden)

    def expert_params_per_layer(self) -> int:
        """All routed experts of one MoE layer (what expert parallelism shards)."""
        return 0 if self.moe is None else self.moe.experts * self.expert_params()

    def layer_params(self, i: int | None = None) -> int:
        """One transformer block's parameters outside its routed experts: attention, its two norms,
        and the FFN (a MoE layer: its shared experts and router). ``i`` picks the layer of a MoE
        model (default: a MoE layer, or any layer of a dense model)."""
        if self.moe is None:
            return self.attention_params() + self.mlp_params() + 2 * self.norm_params()
        moe = self.is_moe_layer(i) if i is not None else True
        ffn = self.mlp_params(self.moe.shared_width) + self.router_params() if moe else self.mlp_params(self.dense_ffn_width)
        return self.attention_params() + ffn + 2 * self.norm_params()

    def dense_params(self) -> int:
        """Every parameter outside the routed experts (what data parallelism replicates)."""
        if self.moe is None:
            return self.param_count()
        blocks = sum(self.layer_params(i) for i in range(self.layers))
        return blocks + self.embedding_params() + self.head_params()

    def embedding_params(self) -> int:
        n = self.vocab * self.hidden
        if self.position == "learned":
            n += self.max_positions * self.hidden
        return n

    def head_params(self) -> int:
        """Final norm plus the LM head (zero extra matrix when tied)."""
        return self.norm_params() + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def param_count(self) -> int:
        if self.moe is None:
            return self.layers * self.layer_params() + self.embedding_params() + self.head_params()
        return self.dense_params() + self.moe_layer_count * self.expert_params_per_layer()

    def total_params(self) -> int:
        return self.param_count()

    def active_params(self) -> int:
        """Parameters one token's forward uses: every dense parameter (embedding table included, as
        Mistral's Mixtral counts and as the model cards of tests/unit/test_moe_spec.py compare) and
        ``top_k`` routed experts in each MoE layer."""
        if self.moe is None:
            return self.param_count()
        return self.dense_params() + self.moe_layer_count * self.moe.top_k * self.expert_params()

    # ---- FLOPs --------------------------------------------------------------------------------
    def layer_matmul_flops_fwd(self, i: int | None = None) -> float:
        """Forward FLOPs per token of one block's weight matmuls: 2 * (weights a token multiplies);
        a MoE layer: attention, router, shared and ``top_k`` routed experts (``i``: as ``layer_params``)."""
        if self.moe is None and self.mla is None and not self.explicit_head_dim:
            h, kv, f = self.hidden, self.kv_dim, self.ffn_hidden
            return 2.0 * (2 * h * h + 2 * h * kv + self.mlp_matrices * h * f)
        attn = sum(a * b for a, b, _ in self.attention_gemms())
        if self.moe is None or (i is not None and not self.is_moe_layer(i)):
            return 2.0 * (attn + self.mlp_matrices * self.hidden * self.dense_ffn_width)
        m = self.moe
        ffn = self.mlp_matrices * self.hidden * (m.shared_width + m.top_k * m.expert_ffn_hidden) + self.moe.experts * self.hidden
        return 2.0 * (attn + ffn)

    def matmul_flops_fwd(self) -> float:
        """Forward FLOPs per token of every block's weight matmuls."""
        if self.moe is None:
            return self.layers * self.layer_matmul_flops_fwd()
        n_moe = self.moe_layer_count
        return n_moe * self.layer_matmul_flops_fwd() + (self.layers - n_moe) * self.layer_matmul_flops_fwd(
            self.moe.dense_layers[0] if self.moe.dense_layers else None)

    def layer_attention_flops_fwd(self, seq_len: int, causal: bool = True, keys: float | None = None) -> float:
        """Forward FLOPs per token of QK^T and AV: 2 * heads * (qk width + v width) * keys attended
        (standard attention: 2 matmuls * 2 * heads * head_dim). ``keys``: the mean keys a query
        attends when a mask keeps fewer than the causal window's (documents: a window's
        same-document causal pairs over its tokens, ``cost/documents.py``)."""
        if keys is None:
            keys = (seq_len + 1) / 2 if causal else seq_len
        if self.mla is None:
            return 2.0 * 2.0 * self.q_dim * keys
        return 2.0 * self.heads * (self.qk_head_dim + self.v_head_dim) * keys

    def head_flops_fwd(self) -> float:
        """LM head per token (the embedding lookup is free)."""
        return 2.0 * self.hidden * self.vocab

    def forward_flops_per_token(self, seq_len: int, keys: float | None = None) -> float:
        if self.moe is None and not self.window:
            attention = self.layer_attention_flops_fwd(seq_len, keys=keys)
            return self.layers * (self.layer_matmul_flops_fwd() + attention) + self.head_flops_fwd()
        return self.matmul_flops_fwd() + self.attention_flops_fwd(seq_len, keys) + self.head_flops_fwd()

    def model_flops_per_token(self, seq_len: int, keys: float | None = None) -> float:
        """Training FLOPs per token without recomputation (forward + 2x backward): what MFU counts
        (a MoE model: the active parameters' matmuls, docs/moe.md). ``keys``: the mean keys a query
        attends under a document mask (``layer_attention_flops_fwd``)."""
        return 3.0 * self.forward_flops_per_token(seq_len, keys)

    def hardware_flops_per_token(self, seq_len: int, recompute: str = "none", keys: float | None = None) -> float:
        """Training FLOPs per token the devices really execute, recomputation included.

        full: every block's forward again (Megatron ``--recompute-granularity full``);
        selective: only the attention core (QK^T, softmax, AV) again (Korthikanti et al. 2022).
        """
        if recompute not in RECOMPUTE:
            raise InputError(f"must be one of {', '.join(RECOMPUTE)}, got {recompute!r}", field="recompute")
        base = self.model_flops_per_token(seq_len, keys)
        if recompute == "full":
            if self.moe is None and not self.window:
                attention = self.layer_attention_flops_fwd(seq_len, keys=keys)
                return base + self.layers * (self.layer_matmul_flops_fwd() + attention)
            return base + self.matmul_flops_fwd() + self.attention_flops_fwd(seq_len, keys)
        if recompute == "selective":
            if not self.window:
                return base + self.layers * self.layer_attention_flops_fwd(seq_len, keys=keys)
            return base + self.attention_flops_fwd(seq_len, keys)
        return base

    def to_dict(self) -> dict[str, Any]:
        """The model file's keys; the optional blocks only where set, so a dense model's dict (and the
        studies that store it) reads as before."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("explicit_head_dim", "moe", "mla", "window", "window_skip_freq", "sinks")}
        if self.window:
            d["window"] = self.window
            if self.window_skip_freq is not None:
                wsf = self.window_skip_freq
                d["window_skip_freq"] = wsf if isinstance(wsf, int) else list(wsf)
        if self.sinks:
            d["sinks"] = True
        if self.explicit_head_dim:
            d["head_dim"] = self.explicit_head_dim
        if self.moe is not None:
            d["moe"] = self.moe.to_dict()
        if self.mla is not None:
            d["mla"] = self.mla.to_dict()
        return d

    def summary(self) -> dict[str, Any]:
        d = self.to_dict()
        d["params"] = self.param_count()
        if self.moe is not None:
            d["active_params"] = self.active_params()
        if self.window:
            d["window_layers"] = f"{self.window_layer_count} of {self.layers}"
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

_MODEL_KEYS = ({f.name for f in dataclasses.fields(ModelSpec)} - {"explicit_head_dim"}) | {"head_dim"}


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
            explicit_head_dim=F.get_int(d, "head_dim", "head_dim", default=0, minimum=0),
            moe=moe_from_dict(d["moe"]) if d.get("moe") is not None else None,
            mla=mla_from_dict(d["mla"]) if d.get("mla") is not None else None,
            window=F.get_int(d, "window", "window", default=0, minimum=0),
            window_skip_freq=WIN.skip_freq_from(d.get("window_skip_freq")),
            sinks=F.get_bool(d, "sinks", "sinks", default=False),
        )
        return ModelSpec(**kw)
    except InputError as e:
        raise e.within(source=source) from None


_DATA = Path(__file__).with_name("data")


def _file_presets() -> dict[str, ModelSpec]:
    """The presets written as model files (``specs/data/*.yaml``: the MoE models, each with its
    model card's source), read as a user's model file is."""
    out = {}
    for p in sorted(_DATA.glob("*.yaml")):
        m = model_from_dict(F.read_mapping(p, "model"), source=p.name)
        out[m.name] = m
    return out


PRESETS.update(_file_presets())


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A preset name (``llama3-8b``) or a YAML/JSON model file."""
    s = str(name_or_path)
    if s in PRESETS:
        return PRESETS[s]
    p = Path(s)
    if p.suffix.lower() in (".yaml", ".yml", ".json") or p.exists():
        return model_from_dict(F.read_mapping(p, "model"), source=s)
    raise InputError(f"unknown model preset {s!r}" + suggest(s, PRESETS), field="model")
