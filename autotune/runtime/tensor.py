"""Megatron tensor parallelism written by hand (exact with any group, on gloo and NCCL).

Shoeybi et al. 2019 ("Megatron-LM", section 3) splits an MLP as column-parallel then row-parallel
linears joined by two conjugate autograd functions:

* ``f`` (:class:`CopyToTP`): identity forward, all-reduce of the gradient backward (enters a
  column-parallel region);
* ``g`` (:class:`ReduceFromTP`): all-reduce forward, identity backward (leaves a row-parallel region).

With sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation", section 4.2)
``f`` becomes an all-gather along the sequence (backward reduce-scatter) and ``g`` a reduce-scatter
(backward all-gather), so norms between the regions see only ``S/tp`` tokens. The vocabulary-parallel
embedding and cross-entropy follow Megatron's ``VocabParallelEmbedding`` and
``vocab_parallel_cross_entropy``. DTensor is not used: it is exact only for even sizes
(shared/torch-cpu-facts.md) and these layers must also take the comparisons in the tests bit-for-bit.
All tensors are ``[batch, seq, ...]``; sequence splits act on dim 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autotune.runtime.mesh import Axis


# torch >= 2.13 renamed the tensor forms (the old names warn on every call)
# (looked up at call time so the worker's timing wrappers see them)
def _all_gather_single(out, x, group):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def _reduce_scatter_single(out, x, group):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, group=group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _gather_seq(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """[B, s, ...] per rank -> [B, s*tp, ...] (equal shards)."""
    xt = x.transpose(0, 1).contiguous()
    out = torch.empty((xt.shape[0] * axis.size, *xt.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, xt, group=axis.group)
    return out.transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """[B, S, ...] partial sums -> [B, S/tp, ...] summed shard of this rank."""
    xt = x.transpose(0, 1).contiguous()
    out = torch.empty((xt.shape[0] // axis.size, *xt.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, xt, group=axis.group)
    return out.transpose(0, 1).contiguous()


def _split_seq(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    s = x.shape[1] // axis.size
    return x[:, axis.index * s:(axis.index + 1) * s].contiguous()


class CopyToTP(torch.autograd.Function):
    """Megatron ``f``: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.axis.group), None


class ReduceFromTP(torch.autograd.Function):
    """Megatron ``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, axis):
        return _all_reduce(x.clone(), axis.group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSP(torch.autograd.Function):
    """Sequence-parallel ``f``: all-gather along the sequence, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _gather_seq(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.axis), None


class ReduceScatterToSP(torch.autograd.Function):
    """Sequence-parallel ``g``: reduce-scatter along the sequence, all-gather backward."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _reduce_scatter_seq(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.axis), None


def enter_parallel(x: torch.Tensor, axis: Axis, sp: bool) -> torch.Tensor:
    """Into a column-parallel region (``f``)."""
    if axis.group is None:
        return x
    return GatherFromSP.apply(x, axis) if sp else CopyToTP.apply(x, axis)


def leave_parallel(x: torch.Tensor, axis: Axis, sp: bool) -> torch.Tensor:
    """Out of a row-parallel region (``g``)."""
    if axis.group is None:
        return x
    return ReduceScatterToSP.apply(x, axis) if sp else ReduceFromTP.apply(x, axis)


def shard_range(total: int, axis: Axis) -> tuple[int, int]:
    """Even contiguous shard ``[start, end)`` of ``total`` for this rank (tp sizes divide evenly)."""
    if total % axis.size:
        raise ValueError(f"{total} does not divide by tp({axis.size})")
    n = total // axis.size
    return axis.index * n, (axis.index + 1) * n


def param_shard(module: nn.Module, name: str) -> tuple[int, int] | None:
    """(dim, offset) of ``module``'s parameter ``name`` in the full tensor when it is split over tp,
    None when every tp rank holds it whole. Fixed by the module type, not by the layout: a
    ``ColumnParallelLinear`` weight is always split along dim 0, also at tp = 1."""
    return getattr(module, "shards", {}).get(name)


class ColumnParallelLinear(nn.Module):
    """``Y_i = X A_i + b_i``: weight rows (output features) split over tp, the bias with them (it
    belongs to the same output features); input enters through ``f``."""

    def __init__(self, in_features: int, out_features: int, axis: Axis, sp: bool, *, gather_input: bool = True,
                 bias: bool = False):
        super().__init__()
        self.axis, self.sp, self.gather_input = axis, sp, gather_input
        self.out_start, self.out_end = shard_range(out_features, axis)
        self.weight = nn.Parameter(torch.empty(self.out_end - self.out_start, in_features))
        self.bias = nn.Parameter(torch.empty(self.out_end - self.out_start)) if bias else None
        # (dim, offset) of each parameter's shard in the full tensor
        self.shards = {"weight": (0, self.out_start), "bias": (0, self.out_start)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather_input:
            x = enter_parallel(x, self.axis, self.sp)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``Y = sum_i X_i A_i + b``: weight columns (input features) split over tp; output leaves through
    ``g``. The bias is whole on every rank and added once, after the reduction (Megatron's
    ``RowParallelLinear``: added before it, the sum would count it tp times); under sequence
    parallelism each rank adds it to its own tokens, so its gradient is partial and summed over tp
    like the norms' (``model.tp_replicated``)."""

    def __init__(self, in_features: int, out_features: int, axis: Axis, sp: bool, *, bias: bool = False):
        super().__init__()
        self.axis, self.sp = axis, sp
        self.in_start, self.in_end = shard_range(in_features, axis)
        self.weight = nn.Parameter(torch.empty(out_features, self.in_end - self.in_start))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.shards = {"weight": (1, self.in_start)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = leave_parallel(F.linear(x, self.weight), self.axis, self.sp)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split over tp: each rank looks up the ids it owns (zeros elsewhere) and
    ``g`` sums them (a reduce-scatter along the sequence under sequence parallelism)."""

    def __init__(self, vocab: int, hidden: int, axis: Axis, sp: bool):
        super().__init__()
        self.axis, self.sp = axis, sp
        self.start, self.end = shard_range(vocab, axis)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden))
        self.shards = {"weight": (0, self.start)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.axis.group is None:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_parallel(out, self.axis, self.sp)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over logits whose vocabulary is split over tp (Megatron's
    ``_VocabParallelCrossEntropy``): global max, global sum of exp and the target logit are
    all-reduced; the gradient is ``softmax - onehot`` on the local slice."""

    @staticmethod
    def forward(ctx, logits, target, start, axis):
        ctx.dtype = logits.dtype
        logits = logits.float()
        vmax = logits.max(dim=-1).values
        if axis.group is not None:
            dist.all_reduce(vmax, op=dist.ReduceOp.MAX, group=axis.group)
        shifted = logits - vmax.unsqueeze(-1)
        n = logits.shape[-1]
        outside = (target < start) | (target >= start + n)
        local = (target - start).masked_fill(outside, 0)
        tlogit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sumexp = exp.sum(dim=-1)
        if axis.group is not None:
            both = torch.stack([tlogit, sumexp])
            dist.all_reduce(both, group=axis.group)
            tlogit, sumexp = both[0], both[1]
        loss = sumexp.log() - tlogit
        softmax = exp / sumexp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local, outside)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        onehot = torch.zeros_like(g).scatter_(-1, local.unsqueeze(-1), 1.0)
        onehot.masked_fill_(outside.unsqueeze(-1), 0.0)
        g = (g - onehot) * grad.unsqueeze(-1)
        return g.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int, axis: Axis) -> torch.Tensor:
    """Per-token loss ``[B, S]`` (fp32) for local logits ``[B, S, V/tp]`` covering ``[start, start+V/tp)``."""
    if axis.group is None:
        return F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), reduction="none").view(target.shape)
    return _VocabParallelCE.apply(logits, target, start, axis)
