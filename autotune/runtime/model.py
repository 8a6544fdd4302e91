"""The decoder a ModelSpec describes, split by the plan's layout (tp, sp, cp/hp, pp).

Every architecture the spec accepts is built: RMSNorm (Zhang & Sennrich 2019) or LayerNorm (Ba et
al. 2016, weight and bias), rotary embeddings (Su et al. 2021, rotate-half form as in Llama) or a
learned absolute position table (GPT-2, OPT), both at each token's *global* position; GQA
attention through ``scaled_dot_product_attention`` (or the CP/HP ``sharded_attention``); a SwiGLU
(Shazeer 2020) or GELU MLP; linear layers with or without biases; an LM head of its own or tied to
the embedding; cross-entropy.

Which parameters every tp rank holds whole (norms, row-parallel biases, the position table) is
what ``tp_replicated`` says: they act on a rank's own tokens under sequence parallelism, so their
gradients are summed over tp there (and are identical on every tp rank without it).

Every layout builds the same weights, and each rank builds only its own shard: the modules are made
on the ``meta`` device (no storage), then ``materialize`` allocates them on the rank's device and
``init_weights`` draws each *slice* of a parameter along its shard dimension (a row of a
column-parallel weight, a column of a row-parallel one) from its own generator seeded by (seed,
parameter name, slice index), on the device, so a tp=2 run and the single-process reference start
from identical numbers and no rank ever holds a full unsharded tensor. Parameter names are global (``layers.7.attn.wq.weight``)
whichever stage holds the layer, so a run's final weights can be compared name by name.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from autotune.runtime.attention import causal_sdpa
from autotune.runtime.expert_parallel import single_groups
from autotune.runtime.mesh import Axis
from autotune.runtime.moe import MoEContext, MoELayer
from autotune.runtime.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    enter_parallel,
    param_shard,
    vocab_parallel_cross_entropy,
)
from autotune.specs.model import ModelSpec

INIT_STD = 0.02
ROPE_THETA = 10000.0
NORM_EPS = 1e-5


@dataclass
class Layout:
    """How this rank's piece of the model is split."""

    tp: Axis
    sp: bool = False
    """Sequence parallelism: hidden states between blocks hold S_local / tp tokens."""
    attn_ctx: Any = None
    """AttentionContext for cp/hp (None: plain causal SDPA over the whole sequence)."""
    positions: torch.Tensor | None = None
    """Global positions of this rank's tokens (LongTensor [S_local]; the CP shard, zigzag segments
    included, and the HP slice); None: 0..S-1."""
    recompute: str = "none"
    moe: Any = None
    """The ``moe.MoEContext`` of an MoE model (expert groups, the aux loss's gradient scale); None: dense."""


def unsharded_layout() -> Layout:
    return Layout(tp=Axis(size=1, index=0, ranks=[0], group=None))


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return (y * self.weight.float()).to(x.dtype)


class LayerNorm(nn.Module):
    """Ba et al. 2016, computed in fp32 as ``RMSNorm`` is (the weight starts at ones)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), NORM_EPS)
        return y.to(x.dtype)


NORMS = {"rmsnorm": RMSNorm, "layernorm": LayerNorm}
"""The spec's ``norm`` -> the module built (``specs.model.NORMS`` lists the same names)."""


def make_norm(spec: ModelSpec) -> nn.Module:
    return NORMS[spec.norm](spec.hidden)


class PositionEmbedding(nn.Module):
    """Learned absolute positions (GPT-2, OPT): a ``max_positions x hidden`` table, whole on every tp
    rank (Megatron keeps it unsplit too), added to the token embedding at each token's global
    position. It lives with the embedding, on the first pipeline stage."""

    def __init__(self, max_positions: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_positions, hidden))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions, self.weight)


def hidden_positions(layout: Layout, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions of the tokens of this rank's hidden states: the layout's (CP/HP) positions,
    or 0..S-1, then this tp rank's contiguous part of them under sequence parallelism (the split
    ``ReduceScatterToSP`` makes)."""
    pos = layout.positions if layout.positions is not None else torch.arange(seq_len)
    pos = pos.to(device) if device is not None else pos
    if layout.sp and layout.tp.size > 1:
        n = pos.numel() // layout.tp.size
        pos = pos[layout.tp.index * n:(layout.tp.index + 1) * n]
    return pos


def positions_in_documents(positions: torch.Tensor, docs: Any) -> torch.Tensor:
    """Global positions ``[S]`` -> ``[B, S]`` positions within each row's document (``docs``: per
    row the document lengths, ``runtime/documents.py``). Under document masks a learned position
    table is indexed from 0 at every document start, as the document would be alone; rotary needs no
    restart (a masked score depends on the position difference only)."""
    out = []
    for row in docs:
        lengths = torch.tensor(row, device=positions.device)
        ends = lengths.cumsum(0)
        doc = torch.searchsorted(ends, positions, right=True)  # the document holding each position
        out.append(positions - (ends - lengths)[doc])
    return torch.stack(out)


def rotary(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[S, D]`` for the given global positions (theta_i = 10000^(-2i/D), Su et al. eq. 15)."""
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
                                / head_dim))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, H, S, D]``; rotate-half form."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Any, docs: Any = None,
                   window: int = 0) -> torch.Tensor:
    """Causal attention over global positions: plain SDPA when the sequence is whole on this rank,
    the CP ring / Ulysses ``sharded_attention`` otherwise; ``docs`` (``documents.Docs``, each row's
    document lengths) stops it at document boundaries (None: one causal sequence per row); ``window``
    (a sliding-window layer, ``specs/windows.py``): each query attends itself and the ``window - 1``
    positions before it (0: no window; the sequence is whole on the rank's heads,
    ``trial.check_runtime_support`` refuses the ring and documents with it)."""
    if ctx is None:
        rep = q.shape[1] // k.shape[1]
        if rep > 1:  # GQA: each kv head serves ``rep`` consecutive query heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if docs is not None:
            from autotune.runtime.documents import doc_attention

            return doc_attention(q, k, v, docs)
        return causal_sdpa(q, k, v, window)
    from autotune.runtime.attention import sharded_attention

    return sharded_attention(q, k, v, ctx, docs, window)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layout: Layout, layer: int = 0):
        super().__init__()
        self.window = spec.window if spec.is_window_layer(layer) else 0  # layer ``layer`` of the model
        h, d = spec.hidden, spec.head_dim
        tp, sp = layout.tp, layout.sp
        self.layout, self.head_dim = layout, d
        self.heads = spec.heads // tp.size
        self.kv_heads = spec.kv_heads // tp.size
        bias = spec.bias
        self.wq = ColumnParallelLinear(h, spec.heads * d, tp, sp, gather_input=False, bias=bias)
        self.wk = ColumnParallelLinear(h, spec.kv_heads * d, tp, sp, gather_input=False, bias=bias)
        self.wv = ColumnParallelLinear(h, spec.kv_heads * d, tp, sp, gather_input=False, bias=bias)
        self.wo = RowParallelLinear(spec.heads * d, h, tp, sp, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                docs: Any = None) -> torch.Tensor:
        """``cos``/``sin``: the rotary tables, None under learned positions (added at the embedding);
        ``docs``: the document lengths of the micro-batch (masks at document boundaries), or None."""
        x = enter_parallel(x, self.layout.tp, self.layout.sp)  # one f for q, k and v
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if cos is not None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.layout.recompute == "selective":  # Korthikanti et al.: recompute the attention core only
            o = checkpoint(attention_core, q, k, v, self.layout.attn_ctx, docs, self.window, use_reentrant=False)
        else:
            o = attention_core(q, k, v, self.layout.attn_ctx, docs, self.window)
        o = o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.wo(o)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, layout: Layout):
        super().__init__()
        h, f = spec.hidden, spec.dense_ffn_width  # an MoE model's dense layers may have their own width
        tp, sp = layout.tp, layout.sp
        self.layout = layout
        self.swiglu = spec.activation == "swiglu"
        self.w1 = ColumnParallelLinear(h, f, tp, sp, gather_input=False, bias=spec.bias)
        if self.swiglu:
            self.w3 = ColumnParallelLinear(h, f, tp, sp, gather_input=False, bias=spec.bias)
        self.w2 = RowParallelLinear(f, h, tp, sp, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_parallel(x, self.layout.tp, self.layout.sp)
        a = F.silu(self.w1(x)) * self.w3(x) if self.swiglu else F.gelu(self.w1(x))
        return self.w2(a)


def make_ffn(spec: ModelSpec, layout: Layout, layer: int) -> nn.Module:
    """Layer ``layer``'s FFN: the dense MLP, or where the spec puts experts the MoE layer
    (``runtime/moe.py``: router, this rank's routed experts, the shared experts)."""
    if not spec.is_moe_layer(layer):
        return MLP(spec, layout)
    ctx = layout.moe or MoEContext(groups=single_groups(spec.moe.experts))  # one device: every expert here
    return MoELayer(spec.moe, spec.hidden, spec.activation == "swiglu", ctx, layout.tp, layout.sp)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, layout: Layout, layer: int = 0):
        super().__init__()
        self.layout = layout
        self.attn_norm = make_norm(spec)
        self.attn = Attention(spec, layout, layer)
        self.mlp_norm = make_norm(spec)
        self.mlp = make_ffn(spec, layout, layer)

    def _forward(self, x, cos, sin, docs=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, docs)
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x, cos, sin, docs=None):
        if self.layout.recompute == "full":  # recompute the whole block in backward (with the same documents)
            return checkpoint(self._forward, x, cos, sin, docs, use_reentrant=False)
        return self._forward(x, cos, sin, docs)


class StageModel(nn.Module):
    """The layers ``layer_ids`` of the decoder, with the embedding (and the learned position table)
    if ``first`` and the final norm and LM head if ``last``. Input: token ids ``[B, S_local]``
    (first) or hidden ``[B, S_local/sp, H]``; output: hidden, or vocabulary-parallel logits
    ``[B, S_local, V/tp]`` (last).

    Tied embeddings on a last stage that is not the first: the stage holds its own copy of the
    embedding (``embed.weight``, drawn from the same numbers) as the LM head, and the copies'
    gradients are summed across the stages holding them before every step (Megatron's embedding
    group; ``runtime/tied.py``), so they stay one weight."""

    def __init__(self, spec: ModelSpec, layout: Layout, layer_ids: list[int], first: bool, last: bool,
                 seq_len: int):
        super().__init__()
        self.spec, self.layout, self.first, self.last = spec, layout, first, last
        self.rope = spec.position == "rope"
        tp, sp = layout.tp, layout.sp
        if first or (last and spec.tied_embeddings):
            self.embed = VocabParallelEmbedding(spec.vocab, spec.hidden, tp, sp)
        if first and not self.rope:
            self.pos_embed = PositionEmbedding(spec.max_positions, spec.hidden)
        self.layers = nn.ModuleDict({str(i): Block(spec, layout, i) for i in layer_ids})
        if last:
            self.norm = make_norm(spec)
            if not spec.tied_embeddings:
                self.head = ColumnParallelLinear(spec.hidden, spec.vocab, tp, sp, bias=False)
            self.vocab_start = tp.index * (spec.vocab // tp.size)
        self.seq_len = seq_len
        self.docs: Any = None
        """The document lengths of the micro-batch the next ``forward`` runs (``documents.Docs``), set
        by the trainer before each forward (pipeline: by micro-batch id); None: no document masks."""
        if self.rope:
            cos, sin = self._rotary_tables(None)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        elif first:  # the global positions of this rank's hidden states, for the table
            self.register_buffer("pos_ids", hidden_positions(layout, seq_len), persistent=False)

    def _rotary_tables(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        positions = self.layout.positions
        if positions is None:
            positions = torch.arange(self.seq_len, device=device)
        elif device is not None:
            positions = positions.to(device)
        return rotary(positions, self.spec.head_dim, torch.float32)

    def reset_buffers(self) -> None:
        """Recompute the position buffers on the parameters' device (after ``to_empty`` from meta):
        the rotary tables in fp32 then in the buffers' dtype, as the constructor and ``.to(dtype)``
        would, or the position ids of the learned table."""
        device = next(self.parameters()).device
        if self.rope:
            cos, sin = self._rotary_tables(device)
            self.cos = cos.to(self.cos.dtype)
            self.sin = sin.to(self.sin.dtype)
        elif self.first:
            self.pos_ids = hidden_positions(self.layout, self.seq_len, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)
            if not self.rope:  # after the embedding's reduction: once, on this rank's tokens
                pos = self.pos_ids if self.docs is None else positions_in_documents(self.pos_ids, self.docs)
                x = x + self.pos_embed(pos).to(x.dtype)
        cos, sin = (self.cos.to(x.dtype), self.sin.to(x.dtype)) if self.rope else (None, None)
        docs = self.docs
        for block in self.layers.values():
            x = block(x, cos, sin, docs)
        if self.last:
            x = self.norm(x)
            if self.spec.tied_embeddings:
                x = F.linear(enter_parallel(x, self.layout.tp, self.layout.sp), self.embed.weight)
            else:
                x = self.head(x)
        return x

    def token_losses(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy ``[B, S_local]`` in fp32 (identical on every tp rank)."""
        return vocab_parallel_cross_entropy(logits, target, self.vocab_start, self.layout.tp)


def init_weights(model: nn.Module, spec: ModelSpec, seed: int) -> None:
    """Deterministic init independent of the layout: ones for norm weights, N(0, 0.02) for every
    other parameter, biases included (drawn rather than zero so that a bias added twice, or once too
    few, changes the very first loss the parity tests compare).

    A parameter sharded along dim ``d`` (``tensor.param_shard``: ``(d, offset)``) is drawn one slice
    along ``d`` at a time, global slice ``i`` from a generator seeded by (seed, crc32(name), i), on
    the parameter's device: the rank draws only the slices it holds, and any split of ``d`` yields
    the same numbers. Whether a parameter is sharded, and along which dim, is fixed by its module
    type (not by the layout), so the same name is always drawn the same way."""
    with torch.no_grad():
        for mname, module in model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                name = f"{mname}.{pname}" if mname else pname
                if isinstance(module, tuple(NORMS.values())) and pname == "weight":
                    p.fill_(1.0)
                    continue
                base = seed * 1_000_003 + zlib.crc32(name.encode())
                shard = param_shard(module, pname)
                if shard is None:
                    g = _generator(p.device, base)
                    p.copy_(torch.empty(p.shape, device=p.device).normal_(0.0, INIT_STD, generator=g))
                    continue
                dim, off = shard
                moved = p.movedim(dim, 0)  # a view: slice i of the shard dim is moved[i]
                buf = torch.empty(moved.shape, device=p.device)
                for i in range(moved.shape[0]):
                    buf[i].normal_(0.0, INIT_STD, generator=_generator(p.device, base * 65_537 + off + i))
                moved.copy_(buf)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed % (2**63))


def build_on_meta(build):
    """``build()`` with every tensor it creates on the meta device (shapes only, no storage)."""
    with torch.device("meta"):
        return build()


def materialize(model: nn.Module, spec: ModelSpec, seed: int, device: torch.device,
                dtype: torch.dtype) -> nn.Module:
    """Allocate a meta-built ``model`` on ``device``, draw its (sharded) weights there, recompute its
    buffers and cast it to ``dtype``: the only full-size storage is this rank's shard."""
    model.to_empty(device=device)
    init_weights(model, spec, seed)
    for m in model.modules():
        if isinstance(m, StageModel):
            m.reset_buffers()
    return model.to(dtype=dtype)


def shard_info(model: nn.Module) -> dict[str, tuple[int, int] | None]:
    """{parameter name: (dim, offset) of its shard in the full tensor, or None when whole}."""
    out: dict[str, tuple[int, int] | None] = {}
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            out[f"{mname}.{pname}" if mname else pname] = param_shard(module, pname)
    return out


def tp_replicated(modules: list[nn.Module]) -> set[int]:
    """``id``s of the parameters every tp rank holds whole (not split by ``param_shard``): the
    norms' weights and biases, the row-parallel biases, the learned position table. Under sequence
    parallelism each tp rank applies them to its own tokens only, so their gradients are partial
    sums to be added over tp (Korthikanti et al. 2022, section 4.2.2); without it every tp rank
    computes the same gradient for them."""
    out: set[int] = set()
    for m in modules:
        for module in m.modules():
            for pname, p in module.named_parameters(recurse=False):
                if param_shard(module, pname) is None:
                    out.add(id(p))
    return out
