"""The global gradient norm of a step, each parameter counted once (Megatron's ``get_grad_norm_fp32``).

Megatron logs ``grad-norm`` every step: the 2-norm of the whole model's gradient after the
reduction over data parallelism, after unscaling, before clipping
(``megatron/core/optimizer/clip_grads.py``). Its rank adds the squares of the gradients it holds,
leaving out what another rank also holds (``param_is_not_tensor_parallel_duplicate``: a parameter
every tp rank holds whole counts on tp rank 0 only; ``param_is_not_shared``: the second copy of a
tied embedding does not count), and sums these squares over the model-parallel ranks (and over the
data-parallel ranks too when the distributed optimizer gives each one its own slice).

Here every rank computes its part ``grad_sq`` in its optimizer, once the gradients are reduced and
unscaled, and ``worker.train`` sums the parts over the whole world with the step's loss (one
all-reduce, outside the timed step). Who counts what:

* a parameter split over tp, ep or etp, or held by one pipeline stage: every holder its own shard;
* a parameter every tp rank holds whole (``model.tp_replicated``: norms, router, row-parallel
  biases, the position table): tp rank 0 only (the gradients are equal on every tp rank: summed over
  tp under sequence parallelism, computed from the same tokens without it);
* a tied embedding held by the first and the last stage (or twice by one rank, a V): one copy;
* replicas that reduce their gradients (dense over dp x cp x hp, experts over expert-DP): all equal
  after an all-reduce, so the group's rank 0 counts them; under ZeRO-1 each rank its own slice of
  the reduced flat gradients, under ZeRO-2/3 each its FSDP2 shard.

A plan whose reduction had the wrong factor (an average where the losses are already divided by the
global tokens, expert gradients summed twice) trains to the same losses for a while, because AdamW
divides a constant factor out of its update (``m / sqrt(v)``); the norm shows it at once. The
parity tests compare it with one process's (tests/helpers/parity.py).
"""

from __future__ import annotations

import math

import torch

from autotune.runtime.mesh import Axis

Square = torch.Tensor | float
"""A part of the squared norm: a 0-dim tensor on the gradients' device (read only after the step's
one synchronisation, so nothing inside the step waits for a GPU), or a float (0, or SKIPPED)."""


def sq_sum(tensors: list[torch.Tensor]) -> Square:
    """Sum of the squares of every element of ``tensors`` (torch's foreach norm; 0 for none)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return 0.0
    return torch.nn.utils.get_total_norm(tensors, norm_type=2.0).double() ** 2


def counted(n: int, whole: set[int], tp: Axis | None, tied: list[int], tied_axis: Axis | None) -> list[bool]:
    """Which of a rank's ``n`` parameters it counts (the module docstring's rules): ``whole`` the
    indices of the parameters every tp rank holds whole, ``tied`` the indices of its copies of a
    tied embedding (``tied_axis``: the ranks holding a copy, runtime/tied.py)."""
    lead = tp is None or tp.index == 0
    out = [lead or i not in whole for i in range(n)]
    for k, i in enumerate(tied):
        out[i] = out[i] and k == 0 and (tied_axis is None or tied_axis.index == 0)
    return out


def replica_sq_sum(grads: list[torch.Tensor], count: list[bool], replicas: Axis | None) -> Square:
    """The squares of ``grads`` (equal on every rank of ``replicas`` after their all-reduce) this rank
    counts: its ``count``-ed ones if it is the replicas' rank 0, else none."""
    if replicas is not None and replicas.index != 0:
        return 0.0
    return sq_sum([g for g, c in zip(grads, count, strict=True) if c])


def slice_sq_sum(mine: torch.Tensor, start: int, sizes: list[int], count: list[bool]) -> Square:
    """The squares of ``mine``, this rank's slice from element ``start`` of the parameters' gradients
    flattened one after another (``sizes`` elements each; ZeRO-1), over the ``count``-ed ones."""
    parts, off, end = [], 0, start + mine.numel()
    for n, c in zip(sizes, count, strict=True):
        lo, hi = max(start, off), min(end, off + n)
        if c and lo < hi:
            parts.append(mine[lo - start:hi - start])
        off += n
    return sq_sum(parts)


SKIPPED = math.nan
"""``grad_sq`` of a step the fp16 loss scale skipped (an overflow: no finite norm; reported null)."""


def norm_of(total_sq: Square) -> float | None:
    """The global norm from the world's summed squares (None for a skipped step)."""
    total = float(total_sq)
    return math.sqrt(total) if math.isfinite(total) else None
