"""Expert parallelism: routed tokens travel to the ranks holding their experts and back.

The groups (``ExpertGroups``) fold onto the attention's ranks of one pipeline stage as Megatron-Core's
"parallel folding" does: the stage's ranks, numbered in the attention mesh's order (dp, cp, hp, tp;
tp innermost), are renumbered as (edp, ep, etp; etp innermost). EP rank ``i`` holds
``shares[i]`` consecutive experts (uneven shares: a faster device holds more); the etp ranks of an
EP rank each hold a slice of every one of its experts; the edp ranks hold the same experts and sum
their gradients (``TrainOptimizer`` over ``edp``), as the dense weights sum theirs over dp.

One MoE layer's forward on a rank (Megatron's all-to-all token dispatcher, in this order):

1. the token's ``k`` choices are sorted by expert, so the rows bound for EP rank ``j`` are contiguous;
   every EP rank learns every other's per-expert counts (an all-gather of ``E`` integers);
2. ``all_to_all_single`` with those split sizes over ``ep`` (its backward is the reverse all-to-all);
3. under etp, the rows are gathered over ``etp`` (an all-gather of unequal sizes, written as an
   all-to-all with split sizes because gloo's all-gather needs equal ones), each etp rank computes
   its slice of every expert, and the partial sums go back to the rank that sent the row (the
   reverse all-to-all, summed over the etp slices: a reduce-scatter of unequal sizes);
4. each local expert runs on its rows (one GEMM set per expert: torch's grouped GEMM wants strides
   aligned to 16 bytes on CPU, which small widths are not);
5. the reverse all-to-all over ``ep``, then each row is weighted by its routing weight and added to
   its token (``index_add``): the combine.

When the tp ranks hold the same tokens (tp without sequence parallelism), each first keeps its
``1/tp`` part of them (``split_tokens``: backward all-gathers the gradient) and the layer's output is
all-gathered over tp after the combine (``gather_tokens``: backward keeps the rank's part), so every
token is sent once, as Megatron splits them over tp before its dispatcher.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from autotune.plan import expert_groups
from autotune.runtime.mesh import Axis, _new_group


def _solo() -> Axis:
    return Axis(size=1, index=0, ranks=[0], group=None)


@dataclass
class ExpertGroups:
    """This rank's view of the expert mesh of its pipeline stage."""

    shares: tuple[int, ...]
    """Experts held by each EP rank (sum: the model's routed experts)."""
    ep: Axis
    etp: Axis
    edp: Axis
    """Ranks holding the same expert slices: expert gradients are summed over it."""
    route: Axis
    """Ranks holding parts of the same sequences at the router (cp x hp, and tp under sequence
    parallelism): the per-sequence counts are summed over it."""
    token_split: Axis
    """tp when its ranks hold the same tokens (no sequence parallelism): each routes its 1/tp part."""


def single_groups(experts: int) -> ExpertGroups:
    """Every expert on this rank, nothing split (the one-process reference)."""
    return ExpertGroups(shares=(experts,), ep=_solo(), etp=_solo(), edp=_solo(), route=_solo(), token_split=_solo())


def shard_groups(experts: int, ep: int, tp: int, etp: int = 1) -> ExpertGroups:
    """One process timing the work of EP rank 0 of ``ep`` (and expert-TP rank 0 of ``etp``) under even
    shares, with ``tp`` ranks that hold the same tokens (``profile --layers``): axes of their sizes and
    no process group. The exchanges loop back (``_loopback``): the rank routes its ``1/tp`` of the
    tokens, the rows it sends to EP rank ``j`` stand for the rows it receives from ``j``, as when every
    EP rank routes as this one does, and under etp every etp rank's rows stand for its own (the slice
    computes ``etp`` copies of them at ``1/etp`` of each expert's width); what would travel is priced
    by the link model, not timed here."""
    if ep < 1 or experts % ep:
        raise ValueError(f"ep({ep}) does not divide the {experts} experts evenly")
    return ExpertGroups(shares=(experts // ep,) * ep, ep=Axis(size=ep, index=0, ranks=list(range(ep)), group=None),
                        etp=Axis(size=etp, index=0, ranks=list(range(etp)), group=None), edp=_solo(), route=_solo(),
                        token_split=Axis(size=tp, index=0, ranks=list(range(tp)), group=None))


def _loopback(axis: Axis) -> bool:
    """An axis of several ranks without a group: one process standing for them (``shard_groups``)."""
    return axis.size > 1 and axis.group is None


def _axis(groups: list[list[int]], rank: int, timeout_s: float | None) -> Axis:
    """This rank's group among ``groups``; every group is created on every rank, in the same order
    (``new_group`` is collective)."""
    mine = next(g for g in groups if rank in g)
    axis = Axis(size=len(mine), index=mine.index(rank), ranks=mine, group=None)
    if len(mine) > 1:
        for g in groups:
            pg = _new_group(g, timeout_s)
            if rank in g:
                axis.group = pg
    return axis


def _attention_groups(plan, fixed: tuple[str, ...]) -> list[list[int]]:
    """The ranks that share their attention-mesh coordinates along ``fixed`` (the others vary)."""
    out: dict[tuple[int, ...], list[int]] = {}
    for r in range(plan.world):
        c = plan.coords(r)
        out.setdefault(tuple(c[n] for n in fixed), []).append(r)
    return list(out.values())


def build_expert_groups(plan, rank: int, experts: int, timeout_s: float | None = None) -> ExpertGroups:
    """Every group of the plan's expert mesh (``autotune.plan.expert_groups``: edp, ep, etp within
    each stage) and the two token groups, created collectively over the default group, seen from
    ``rank``."""
    d = plan.degrees
    sp = plan.sequence_parallel and d.tp > 1
    route = ("pp", "dp") if sp else ("pp", "dp", "tp")  # cp x hp (x tp under sp) split a sequence
    split = ("pp", "dp", "cp", "hp") if d.tp > 1 and not sp else ("pp", "dp", "cp", "hp", "tp")
    return ExpertGroups(
        shares=tuple(plan.shares.experts or (experts,)),
        ep=_axis(expert_groups(d, "ep"), rank, timeout_s),
        etp=_axis(expert_groups(d, "etp"), rank, timeout_s),
        edp=_axis(expert_groups(d, "edp"), rank, timeout_s),
        route=_axis(_attention_groups(plan, route), rank, timeout_s),
        token_split=_axis(_attention_groups(plan, split), rank, timeout_s))


def expert_range(shares: tuple[int, ...], ep_index: int) -> tuple[int, int]:
    """(first global expert, count) held by EP rank ``ep_index``."""
    return sum(shares[:ep_index]), shares[ep_index]


# ---- tokens split over tp when its ranks hold the same ones -----------------------------------------
def _part(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    if x.shape[0] % axis.size:
        raise ValueError(f"{x.shape[0]} tokens do not split over tp({axis.size})")
    n = x.shape[0] // axis.size
    return x[axis.index * n:(axis.index + 1) * n]


def _gather(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    if _loopback(axis):  # every rank's part taken to be this one's: the same bytes copied
        return x.repeat(axis.size, *([1] * (x.dim() - 1)))
    out = x.new_empty((x.shape[0] * axis.size, *x.shape[1:]))
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x.contiguous(), group=axis.group)
    return out


class _Split(torch.autograd.Function):
    """Keep this rank's part of tokens every rank of ``axis`` holds; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _part(x, axis).clone()

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.axis), None


class _Gather(torch.autograd.Function):
    """All-gather the ranks' parts; backward keeps this rank's part of the (identical) gradient."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _gather(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return _part(grad, ctx.axis).clone(), None


def split_tokens(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """This rank's ``1/size`` of the rows of ``x`` (which every rank of ``axis`` holds whole)."""
    if not x.is_floating_point():
        return _part(x, axis)
    return _Split.apply(x, axis)


def gather_tokens(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return _Gather.apply(x, axis)


# ---- the exchange ---------------------------------------------------------------------------------
def _exchange(x: torch.Tensor, send: list[int], recv: list[int], axis: Axis) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=axis.group)
    return out


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; backward sends the gradients back the reverse way
    (as ``torch.distributed.nn.functional.all_to_all_single``, deprecated in torch 2.13, whose
    successor in ``_functional_collectives`` bypasses the ``torch.distributed`` calls the
    worker's communication clock times)."""

    @staticmethod
    def forward(ctx, x, send, recv, axis):
        ctx.send, ctx.recv, ctx.axis = send, recv, axis
        return _exchange(x, send, recv, axis)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.axis), None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], axis: Axis) -> torch.Tensor:
    """Rows ``send[j]`` of ``x`` to rank ``j`` of ``axis``, ``recv[j]`` rows from it (differentiable)."""
    return _AllToAll.apply(x, send, recv, axis)


def _gather_counts(counts: torch.Tensor, axis: Axis) -> torch.Tensor:
    """``[axis.size, *counts.shape]``: every rank's ``counts`` (equal sizes)."""
    if axis.group is None:
        return counts.unsqueeze(0)
    return _gather(counts.unsqueeze(0), axis)


@dataclass(frozen=True)
class Exchange:
    """The row counts of one dispatch seen from this rank."""

    send: list[int]  # rows to each EP rank
    recv: list[int]  # rows from each EP rank
    per_expert: torch.Tensor  # [sources, local experts]: rows received for each local expert, by source


def plan_exchange(counts: torch.Tensor, groups: ExpertGroups) -> Exchange:
    """``counts`` ``[E]``: this rank's rows per global expert."""
    first, n = expert_range(groups.shares, groups.ep.index)
    bounds = [expert_range(groups.shares, j) for j in range(len(groups.shares))]
    send = [int(counts[a:a + c].sum()) for a, c in bounds]
    if _loopback(groups.ep):  # the rows sent to EP rank j (sorted by expert) come back as j's rows
        return Exchange(send=send, recv=send, per_expert=counts.view(groups.ep.size, n))
    every = _gather_counts(counts, groups.ep)  # [ep, E]
    per_expert = every[:, first:first + n]
    return Exchange(send=send, recv=[int(v) for v in per_expert.sum(dim=1)], per_expert=per_expert)


def run_experts(rows: torch.Tensor, per_expert: torch.Tensor, experts: nn.ModuleDict, first: int) -> torch.Tensor:
    """Rows arriving as blocks (source, then local expert, counts ``per_expert``) through their
    experts; the outputs in the same order."""
    n_local = per_expert.shape[1]
    expert_of_row = torch.arange(n_local, device=rows.device).repeat(per_expert.shape[0])
    expert_of_row = expert_of_row.repeat_interleave(per_expert.reshape(-1).to(rows.device))
    order = torch.argsort(expert_of_row, stable=True)
    sizes = per_expert.sum(dim=0).tolist()
    grouped = rows[order].split(sizes)
    outs = [experts[str(first + e)](grouped[e]) for e in range(n_local)]
    out = torch.cat(outs) if outs else rows[:0]
    return out[torch.argsort(order)]


def through_experts(rows: torch.Tensor, ex: Exchange, experts: nn.ModuleDict, first: int,
                    etp: Axis) -> torch.Tensor:
    """The experts' outputs of the rows this rank received, with their etp slices summed."""
    if etp.size == 1:
        return run_experts(rows, ex.per_expert, experts, first)
    mine = rows.shape[0]
    if _loopback(etp):  # every etp rank's rows taken to be this one's (``shard_groups``)
        partial = run_experts(rows.repeat(etp.size, 1), ex.per_expert.repeat(etp.size, 1), experts, first)
        return partial.view(etp.size, mine, -1).sum(dim=0)
    sizes = [int(v) for v in _gather_counts(torch.tensor([mine], device=rows.device), etp).reshape(-1)]
    per_expert = _gather_counts(ex.per_expert, etp).reshape(-1, ex.per_expert.shape[1])
    # all-gather of unequal sizes as an all-to-all: send my rows to every etp rank
    together = _all_to_all(rows.repeat(etp.size, 1), [mine] * etp.size, sizes, etp)
    partial = run_experts(together, per_expert, experts, first)
    # each slice's partial sums back to the rows' owner, then summed over the slices
    back = _all_to_all(partial, sizes, [mine] * etp.size, etp)
    return back.view(etp.size, mine, -1).sum(dim=0)


@dataclass(frozen=True)
class Permuted:
    """A micro-batch's routed copies in expert order (the dispatch's permutation)."""

    rows: torch.Tensor
    """``[copies, H]``: each kept (token, choice) pair's hidden state, sorted by expert."""
    token_of: torch.Tensor
    """``[copies]``: the token each row came from."""
    weights: torch.Tensor
    """``[copies]``: each row's routing weight."""
    counts: torch.Tensor
    """``[E]``: rows per global expert."""


def permute(tokens: torch.Tensor, experts_idx: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor | None,
            n_experts: int) -> Permuted:
    """Each kept choice's copy of its token, sorted by expert, so the rows bound for each expert (hence
    each EP rank) are contiguous."""
    n, k = experts_idx.shape
    flat_e = experts_idx.reshape(-1)
    token_of = torch.arange(n, device=tokens.device).repeat_interleave(k)
    flat_w = weights.reshape(-1)
    if keep is not None:
        kept = keep.reshape(-1)
        flat_e, token_of, flat_w = flat_e[kept], token_of[kept], flat_w[kept]
    order = torch.argsort(flat_e, stable=True)
    token_of, flat_w = token_of[order], flat_w[order]
    return Permuted(rows=tokens[token_of], token_of=token_of, weights=flat_w,
                    counts=torch.bincount(flat_e, minlength=n_experts))


def combine(tokens: torch.Tensor, token_of: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each row's expert output weighted by its routing weight and added to its token ``[N, H]``."""
    return tokens.new_zeros(tokens.shape).index_add(0, token_of, out * weights.unsqueeze(-1))


def dispatch_and_combine(tokens: torch.Tensor, experts_idx: torch.Tensor, weights: torch.Tensor,
                         keep: torch.Tensor | None, experts: nn.ModuleDict, first: int,
                         groups: ExpertGroups) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{idx[t, j]}(tokens[t])`` for every token ``t`` ``[N, H]``, the
    choices ``keep`` drops left out: ``permute``, the exchange over ep, ``through_experts``, the
    exchange back, ``combine`` (``profilers/moe_parts.py`` times each of these steps)."""
    p = permute(tokens, experts_idx, weights, keep, sum(groups.shares))
    ex = plan_exchange(p.counts, groups)
    rows = p.rows
    if groups.ep.group is not None:
        rows = _all_to_all(rows, ex.send, ex.recv, groups.ep)
    out = through_experts(rows, ex, experts, first, groups.etp)
    if groups.ep.group is not None:
        out = _all_to_all(out, ex.recv, ex.send, groups.ep)
    return combine(tokens, p.token_of, out, p.weights)
