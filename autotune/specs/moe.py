"""Mixture-of-Experts and Multi-head Latent Attention: the two optional blocks of a model spec.

A model file (or preset) with a ``moe:`` block replaces the FFN of its MoE layers by ``experts``
routed experts of width ``expert_ffn_hidden`` (each token goes to ``top_k`` of them) plus
``shared_experts`` always-on experts of width ``shared_ffn_hidden`` each; the layers listed in
``dense_layers`` (or the first ``first_dense``) keep a plain FFN of width ``dense_ffn_hidden``.
An ``mla:`` block replaces standard multi-head / grouped-query attention by DeepSeek-V2/V3's latent
attention (DeepSeek-AI 2024, "DeepSeek-V2", section 2.1): queries through a ``q_lora_rank``
bottleneck (none when 0), keys and values through a ``kv_lora_rank`` one, each head's query and key
of ``qk_nope_head_dim + qk_rope_head_dim`` and its value of ``v_head_dim``.

Both are read here (``moe_from_dict``, ``mla_from_dict``) with one-line errors naming the field;
what depends on the layer count (the dense-layer list in range) is checked by ``ModelSpec``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autotune.errors import InputError
from autotune.specs import fields as F

ROUTER_SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True, kw_only=True)
class RouterSpec:
    """How tokens are sent to experts (Megatron-Core's ``--moe-*`` router options)."""

    dropless: bool = True
    """Every routed token is computed (no capacity); False: ``capacity_factor`` required."""
    capacity_factor: float | None = None
    """Per-expert capacity as a multiple of the even share; tokens beyond it are dropped and the
    buffers padded to it (Megatron ``--moe-expert-capacity-factor`` with ``--moe-pad-expert-input-to-capacity``)."""
    force_balance: bool = False
    """Benchmarking: tokens spread evenly over the experts whatever the router scores
    (Megatron ``--moe-router-force-load-balancing``)."""
    aux_loss_coeff: float = 0.0
    """Load-balancing loss weight (``--moe-aux-loss-coeff``)."""
    score: str = "softmax"
    """Router score function: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)."""

    def __post_init__(self) -> None:
        if self.score not in ROUTER_SCORES:
            raise InputError(f"must be one of {', '.join(ROUTER_SCORES)}, got {self.score!r}",
                             field="moe.router.score")
        if not self.dropless and self.capacity_factor is None:
            raise InputError("dropless: false needs a capacity_factor", field="moe.router.capacity_factor")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise InputError(f"must be above 0, got {self.capacity_factor}", field="moe.router.capacity_factor")
        if self.dropless and self.capacity_factor is not None:
            raise InputError("a capacity_factor drops tokens: set dropless: false with it",
                             field="moe.router.capacity_factor")
        if self.aux_loss_coeff < 0:
            raise InputError(f"must be at least 0, got {self.aux_loss_coeff}", field="moe.router.aux_loss_coeff")


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """The experts of a Mixture-of-Experts model (counts, not bytes)."""

    experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Routed experts each token is sent to."""
    expert_ffn_hidden: int
    """Each routed expert's FFN width (the model's activation: SwiGLU three matrices, GELU two)."""
    shared_experts: int = 0
    """Always-on shared experts per MoE layer (DeepSeek, Qwen2-MoE)."""
    shared_ffn_hidden: int = 0
    """Width of EACH shared expert (0 when there are none)."""
    dense_layers: tuple[int, ...] = ()
    """Indices of the layers that keep a plain FFN (DeepSeek-V3: the first three)."""
    dense_ffn_hidden: int | None = None
    """FFN width of the dense layers; None: the model's ``ffn_hidden``."""
    router: RouterSpec = dataclasses.field(default_factory=RouterSpec)

    def __post_init__(self) -> None:
        for name in ("experts", "top_k", "expert_ffn_hidden"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"must be a positive integer, got {v!r}", field=f"moe.{name}")
        if self.top_k > self.experts:
            raise InputError(f"{self.top_k} is above moe.experts ({self.experts})", field="moe.top_k")
        if self.shared_experts < 0 or self.shared_ffn_hidden < 0:
            raise InputError("must be at least 0", field="moe.shared_experts" if self.shared_experts < 0
                             else "moe.shared_ffn_hidden")
        if self.shared_experts and not self.shared_ffn_hidden:
            raise InputError(f"{self.shared_experts} shared experts need their width",
                             field="moe.shared_ffn_hidden")
        if self.shared_ffn_hidden and not self.shared_experts:
            raise InputError("a width without shared experts (set moe.shared_experts)",
                             field="moe.shared_ffn_hidden")
        if len(set(self.dense_layers)) != len(self.dense_layers):
            raise InputError(f"repeats a layer: {list(self.dense_layers)}", field="moe.dense_layers")
        if self.dense_ffn_hidden is not None and self.dense_ffn_hidden < 1:
            raise InputError(f"must be a positive integer, got {self.dense_ffn_hidden}", field="moe.dense_ffn_hidden")

    @property
    def shared_width(self) -> int:
        """Total FFN width of the shared experts (they run as one MLP of this width)."""
        return self.shared_experts * self.shared_ffn_hidden

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dense_layers"] = list(self.dense_layers)
        return d


@dataclass(frozen=True, kw_only=True)
class MLASpec:
    """Multi-head Latent Attention's ranks and head widths (DeepSeek-V2/V3)."""

    q_lora_rank: int = 0
    """Query compression rank; 0: queries projected directly (DeepSeek-V2-Lite)."""
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"must be a positive integer, got {v!r}", field=f"mla.{name}")
        if isinstance(self.q_lora_rank, bool) or not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 0:
            raise InputError(f"must be 0 or a positive integer, got {self.q_lora_rank!r}", field="mla.q_lora_rank")

    @property
    def qk_head_dim(self) -> int:
        """Width of each head's query and key: the non-rope part plus the rope part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_ROUTER_KEYS = {f.name for f in dataclasses.fields(RouterSpec)}
_MOE_KEYS = {f.name for f in dataclasses.fields(MoESpec)} | {"first_dense"}
_MLA_KEYS = {f.name for f in dataclasses.fields(MLASpec)}


def _mapping(v: Any, field: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise InputError(f"expected a mapping of keys, got {type(v).__name__}", field=field)
    return v


def _number(d: dict[str, Any], key: str, field: str, default: float | None) -> float | None:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InputError(f"expected a number, got {v!r}", field=field)
    return float(v)


def router_from_dict(d: Any) -> RouterSpec:
    d = _mapping(d, "moe.router")
    F.reject_unknown(d, _ROUTER_KEYS, "moe.router")
    return RouterSpec(
        dropless=F.get_bool(d, "dropless", "moe.router.dropless", default=True),
        capacity_factor=_number(d, "capacity_factor", "moe.router.capacity_factor", None),
        force_balance=F.get_bool(d, "force_balance", "moe.router.force_balance", default=False),
        aux_loss_coeff=_number(d, "aux_loss_coeff", "moe.router.aux_loss_coeff", 0.0) or 0.0,
        score=F.get_str(d, "score", "moe.router.score", default="softmax", choices=ROUTER_SCORES))


def _dense_layers(d: dict[str, Any]) -> tuple[int, ...]:
    if d.get("dense_layers") is not None and d.get("first_dense") is not None:
        raise InputError("give dense_layers or first_dense, not both", field="moe.first_dense")
    if d.get("first_dense") is not None:
        return tuple(range(F.get_int(d, "first_dense", "moe.first_dense", minimum=0)))
    raw = d.get("dense_layers") or []
    if not isinstance(raw, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in raw):
        raise InputError(f"expected a list of layer indices, got {raw!r}", field="moe.dense_layers")
    return tuple(int(i) for i in raw)


def moe_from_dict(d: Any) -> MoESpec:
    """The ``moe:`` block of a model file."""
    d = _mapping(d, "moe")
    F.reject_unknown(d, _MOE_KEYS, "moe")
    return MoESpec(
        experts=F.get_int(d, "experts", "moe.experts"),
        top_k=F.get_int(d, "top_k", "moe.top_k"),
        expert_ffn_hidden=F.get_int(d, "expert_ffn_hidden", "moe.expert_ffn_hidden"),
        shared_experts=F.get_int(d, "shared_experts", "moe.shared_experts", default=0, minimum=0),
        shared_ffn_hidden=F.get_int(d, "shared_ffn_hidden", "moe.shared_ffn_hidden", default=0, minimum=0),
        dense_layers=_dense_layers(d),
        dense_ffn_hidden=(F.get_int(d, "dense_ffn_hidden", "moe.dense_ffn_hidden")
                          if d.get("dense_ffn_hidden") is not None else None),
        router=router_from_dict(d["router"]) if d.get("router") is not None else RouterSpec())


def mla_from_dict(d: Any) -> MLASpec:
    """The ``mla:`` block of a model file."""
    d = _mapping(d, "mla")
    F.reject_unknown(d, _MLA_KEYS, "mla")
    return MLASpec(
        q_lora_rank=F.get_int(d, "q_lora_rank", "mla.q_lora_rank", default=0, minimum=0),
        kv_lora_rank=F.get_int(d, "kv_lora_rank", "mla.kv_lora_rank"),
        qk_rope_head_dim=F.get_int(d, "qk_rope_head_dim", "mla.qk_rope_head_dim"),
        qk_nope_head_dim=F.get_int(d, "qk_nope_head_dim", "mla.qk_nope_head_dim"),
        v_head_dim=F.get_int(d, "v_head_dim", "mla.v_head_dim"))
