"""A Mixture-of-Experts FFN (Shazeer et al. 2017; Switch, Fedus et al. 2022; Mixtral; DeepSeek-V3) as
torch modules: the router, the routed experts, the shared experts, and the layer that joins them.

What it computes, on the tokens of one micro-batch:

* **Router**: logits ``x W_r^T`` over the ``E`` routed experts; scores by softmax (Switch, Mixtral,
  Qwen) or sigmoid (DeepSeek-V3); the ``k`` best scores per token, renormalised to sum to 1 (for
  softmax the same as a softmax over the top-k logits, Mixtral's form). ``force_balance`` (for
  benchmarking, Megatron's ``--moe-router-force-load-balancing``) replaces the choice by a
  round-robin over the token's global position (token ``t`` goes to experts ``(t k + j) mod E``),
  weighted by the router's own scores for those experts, so every expert gets the same tokens and
  gradients still reach the router.
* **Auxiliary load-balancing loss**, per sequence (DeepSeek-V2/V3's sequence-wise form of Switch's
  loss): ``aux_b = sum_e f_e P_e`` with ``f_e = E / (k S) x`` (tokens of sequence ``b`` routed to
  ``e``) and ``P_e`` the mean normalised score of ``e`` over the sequence's ``S`` tokens. Per
  sequence, not per micro-batch, so that it does not depend on how a layout groups samples into
  micro-batches; the objective gains ``aux_loss_coeff x mean over the global batch's sequences``
  per MoE layer. Its gradient is injected in the backward (``AuxLossToGrad``, Megatron's
  ``MoEAuxLossAutoScaler``): the reported loss stays the language-model loss.
* **Capacity** (``dropless: false``): each expert takes at most ``C = ceil(cf S k / E)`` tokens of
  each sequence, the earliest positions first (Megatron's "position" drop policy); the rest of that
  token's choice is dropped (its residual carries it). Decided on the whole sequence, whichever
  ranks hold its tokens (``SequenceRouting``), so every layout drops the same tokens.
* **Routed experts**: one FFN (SwiGLU or GELU as the model's) per expert, each with its own weights
  named by its global index (``experts.5.w1``): whichever rank holds expert 5 draws the same numbers
  (``model.init_weights``). Under expert tensor parallelism each holds a column slice of ``w1``/``w3``
  and a row slice of ``w2`` (``shards``), as Megatron's ``ColumnParallelLinear``/``RowParallelLinear``.
* **Shared experts** (DeepSeek, Qwen2-MoE): always-on FFNs of ``shared_experts x shared_ffn_hidden``,
  split over the attention's tp like the dense MLP (Megatron runs them on the tp group too).

Where the routed tokens go (expert parallelism, expert-TP) is ``expert_parallel.py``; this module
calls ``dispatch_and_combine`` and is unchanged by the layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autotune.runtime.expert_parallel import (
    ExpertGroups,
    dispatch_and_combine,
    expert_range,
    gather_tokens,
    split_tokens,
)
from autotune.runtime.mesh import Axis
from autotune.runtime.tensor import ColumnParallelLinear, RowParallelLinear, enter_parallel


@dataclass
class MoEContext:
    """What every MoE layer of a rank shares: the groups tokens and experts travel over, and the
    scale of the auxiliary loss's gradient (set by the trainer before each step)."""

    groups: ExpertGroups
    seq_len: int | None = None
    """Tokens of a whole sequence (the capacity and the aux loss are per sequence); None: the
    input's (a rank holding whole sequences: one process, ``profile --layers``)."""
    aux_grad_scale: float = 1.0
    """d(objective)/d(aux of one sequence) before ``aux_loss_coeff``: 1 / global batch (the mean
    over the global batch's sequences), times the fp16 loss scale."""
    positions: torch.Tensor | None = None
    """Global positions of the hidden states' tokens on this rank ``[S_local]`` (None: 0..S-1)."""


class Router(nn.Module):
    """``E x H`` weight, whole on every rank (its gradient is reduced as a dense weight's)."""

    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))

    def forward(self, x: torch.Tensor, score: str) -> torch.Tensor:
        """Normalised scores ``[N, E]`` in fp32 (softmax, or sigmoid divided by its sum)."""
        logits = F.linear(x.float(), self.weight.float())
        if score == "softmax":
            return logits.softmax(dim=-1)
        s = logits.sigmoid()
        return s / s.sum(dim=-1, keepdim=True)


class AuxLossToGrad(torch.autograd.Function):
    """Identity on ``x``; backward also gives ``aux`` the gradient ``scale`` (Megatron's
    ``MoEAuxLossAutoScaler``): the aux loss joins the objective without joining the reported loss,
    and reaches the router wherever the pipeline stage holding the layer is."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


@dataclass(frozen=True)
class Routing:
    """Each token's ``k`` experts, their weights and whether the capacity keeps them."""

    experts: torch.Tensor  # [N, k] long
    weights: torch.Tensor  # [N, k] fp32 (differentiable)
    keep: torch.Tensor | None  # [N, k] bool, None when dropless
    aux: torch.Tensor  # this rank's part of sum_b aux_b (differentiable)


def choose(scores: torch.Tensor, k: int, positions: torch.Tensor | None, force_balance: bool) -> tuple[
        torch.Tensor, torch.Tensor]:
    """(experts ``[N, k]``, renormalised weights ``[N, k]``) of ``scores`` ``[N, E]``; ``positions``
    ``[N]``: each token's position in its sequence (for the forced round-robin)."""
    n_exp = scores.shape[-1]
    if force_balance:
        idx = (positions[:, None] * k + torch.arange(k, device=scores.device)[None, :]) % n_exp
        top = scores.gather(-1, idx)
    else:
        top, idx = scores.topk(k, dim=-1)
    return idx, top / top.sum(dim=-1, keepdim=True)


class SequenceRouting:
    """The per-sequence statistics of one micro-batch: which experts every token of each whole
    sequence chose (``[B, S, E]`` 0/1), summed over the ranks that hold parts of the sequence
    (``route`` axis: cp x hp, and tp under sequence parallelism); from it the capacity's keep mask
    and the aux loss's token fractions. Non-differentiable: only counts travel."""

    def __init__(self, experts: torch.Tensor, batch: int, positions: torch.Tensor, seq_len: int, n_exp: int,
                 route: Axis):
        local = experts.view(batch, positions.numel(), -1)
        chosen = torch.zeros(batch, seq_len, n_exp, dtype=torch.float32, device=experts.device)
        rows = chosen[:, positions]  # this rank's tokens, at their global positions
        rows.scatter_(-1, local, 1.0)
        chosen[:, positions] = rows
        if route.group is not None:
            dist.all_reduce(chosen, group=route.group)
        self.chosen, self.positions, self.local = chosen, positions, local

    def counts(self) -> torch.Tensor:
        """Tokens of each sequence routed to each expert ``[B, E]``."""
        return self.chosen.sum(dim=1)

    def keep(self, capacity: int) -> torch.Tensor:
        """``[B * S_local, k]``: the token's choice is within the expert's first ``capacity`` tokens
        of the sequence (by position)."""
        order = self.chosen.cumsum(dim=1)  # 1-based rank of each token within its expert, by position
        mine = order[:, self.positions].gather(-1, self.local)  # [B, S_local, k]
        return (mine <= capacity).reshape(-1, self.local.shape[-1])


def capacity(seq_len: int, top_k: int, experts: int, factor: float) -> int:
    """Tokens an expert takes from one sequence: ``ceil(cf S k / E)`` (GShard's expert capacity)."""
    return math.ceil(factor * seq_len * top_k / experts)


def route(router: Router, x: torch.Tensor, moe: Any, ctx: MoEContext) -> Routing:
    """Route the micro-batch ``x`` ``[B, s, H]`` (this rank's tokens)."""
    b, s, h = x.shape
    r = moe.router
    scores = router(x.reshape(-1, h), r.score)  # [N, E]
    pos = ctx.positions if ctx.positions is not None else torch.arange(s, device=x.device)
    pos = pos.to(x.device)
    seq_len = ctx.seq_len or s
    idx, weights = choose(scores, moe.top_k, pos.repeat(b), r.force_balance)
    seq = SequenceRouting(idx, b, pos, seq_len, moe.experts, ctx.groups.route)
    keep = None if r.dropless else seq.keep(capacity(seq_len, moe.top_k, moe.experts, r.capacity_factor))
    # aux: sum_b sum_e f_be P_be with P's sum over this rank's tokens only (the ranks' parts add up)
    f = seq.counts() * (moe.experts / (moe.top_k * seq_len))
    p_local = scores.view(b, s, -1).sum(dim=1) / seq_len
    return Routing(experts=idx, weights=weights, keep=keep, aux=(f * p_local).sum())


class Expert(nn.Module):
    """One routed expert's FFN, or its expert-tensor-parallel slice (``etp`` of ``Axis``): ``w1``
    (and ``w3`` for SwiGLU) ``[F/etp, H]`` column-parallel, ``w2`` ``[H, F/etp]`` row-parallel; the
    output is a partial sum over etp (``expert_parallel`` reduces it with the tokens)."""

    def __init__(self, hidden: int, ffn: int, swiglu: bool, etp: Axis):
        super().__init__()
        if ffn % etp.size:
            raise ValueError(f"expert_ffn_hidden({ffn}) does not divide by etp({etp.size})")
        n = ffn // etp.size
        off = etp.index * n
        self.swiglu = swiglu
        self.w1 = nn.Parameter(torch.empty(n, hidden))
        if swiglu:
            self.w3 = nn.Parameter(torch.empty(n, hidden))
        self.w2 = nn.Parameter(torch.empty(hidden, n))
        self.shards = {"w1": (0, off), "w3": (0, off), "w2": (1, off)}  # model.init_weights, the parity checks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3) if self.swiglu else F.gelu(F.linear(x, self.w1))
        return F.linear(a, self.w2)


class SharedExperts(nn.Module):
    """``count`` always-on experts as one FFN of width ``count x width`` (their sum), tp-split."""

    def __init__(self, hidden: int, width: int, swiglu: bool, tp: Axis, sp: bool):
        super().__init__()
        self.tp, self.sp, self.swiglu = tp, sp, swiglu
        self.w1 = ColumnParallelLinear(hidden, width, tp, sp, gather_input=False)
        if swiglu:
            self.w3 = ColumnParallelLinear(hidden, width, tp, sp, gather_input=False)
        self.w2 = RowParallelLinear(width, hidden, tp, sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_parallel(x, self.tp, self.sp)
        a = F.silu(self.w1(x)) * self.w3(x) if self.swiglu else F.gelu(self.w1(x))
        return self.w2(a)


class MoELayer(nn.Module):
    """Router, this rank's routed experts (``experts.<global index>``) and the shared experts;
    ``forward(x)`` ``[B, s, H]`` -> ``[B, s, H]`` on the same tokens (the FFN of an MoE block)."""

    def __init__(self, moe: Any, hidden: int, swiglu: bool, ctx: MoEContext, tp: Axis, sp: bool):
        super().__init__()
        self.moe, self.ctx, self.tp, self.sp = moe, ctx, tp, sp
        g = ctx.groups
        self.router = Router(hidden, moe.experts)
        first, count = expert_range(g.shares, g.ep.index)
        self.experts = nn.ModuleDict({str(e): Expert(hidden, moe.expert_ffn_hidden, swiglu, g.etp)
                                      for e in range(first, first + count)})
        self.first_expert = first
        if moe.shared_experts:
            self.shared = SharedExperts(hidden, moe.shared_experts * moe.shared_ffn_hidden, swiglu, tp, sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        routing = route(self.router, x, self.moe, self.ctx)
        g = self.ctx.groups
        tokens, idx, weights, keep = x.reshape(-1, h), routing.experts, routing.weights, routing.keep
        if g.token_split.size > 1:  # tp ranks hold the same tokens: each sends its own part
            tokens, weights = split_tokens(tokens, g.token_split), split_tokens(weights, g.token_split)
            idx = split_tokens(idx, g.token_split)
            keep = None if keep is None else split_tokens(keep, g.token_split)
        y = dispatch_and_combine(tokens, idx, weights.to(x.dtype), keep, self.experts, self.first_expert, g)
        if g.token_split.size > 1:
            y = gather_tokens(y, g.token_split)
        y = y.view(b, s, h)
        if self.moe.shared_experts:
            y = y + self.shared(x)
        scale = self.moe.router.aux_loss_coeff * self.ctx.aux_grad_scale
        return AuxLossToGrad.apply(y, routing.aux, scale) if scale else y


def expert_params(modules: list[nn.Module]) -> set[int]:
    """``id``s of the routed experts' parameters among ``modules`` (their gradients are reduced over
    expert-DP, the rest over the dense gradient group)."""
    return {id(p) for m in modules for e in m.modules() if isinstance(e, Expert) for p in e.parameters()}
