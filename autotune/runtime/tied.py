"""Tied embeddings under pipelining: one weight held by the first and the last pipeline stage.

With ``tied_embeddings`` the LM head is the embedding matrix. When the first model chunk (the
embedding) and the last (the head) sit on different pipeline ranks, each of those ranks holds a copy
of ``embed.weight`` (both drawn from the same numbers: ``init_weights`` seeds by name) and the
copies' gradients are summed before every optimizer step, so the copies take identical steps and
stay one weight: Megatron's "embedding group" of the first and last stage (Shoeybi et al. 2019;
``megatron/core/distributed/finalize_model_grads.py``). The cost model prices the copy on the last
stage (``cost/data_parallel.stage_params``).

A schedule that places both chunks on one rank (ZB-V's V: chunk 0 and the last on pp rank 0) holds
two copies in one process; their gradients are summed locally, without a group.

Under ZeRO-2/3 the sum acts on FSDP2's gradient shards: both copies have one shape and the same
gradient group size, and FSDP2 splits each parameter along dim 0 by the rank's index in that group,
which is the same on both stages (the group varies dp, cp and hp at a fixed pp and tp coordinate),
so the shards line up element by element.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autotune.plan import Plan
from autotune.runtime.mesh import Axis, _new_group

TIED_NAME = "embed.weight"
"""The parameter name of the embedding (and of a tied head's copy of it)."""


def tied_pp_indices(plan: Plan) -> list[int]:
    """Pipeline ranks holding a copy of the tied embedding: the first chunk's and the last's."""
    total = len(plan.shares.layers)
    holders = [i for i in range(plan.degrees.pp) if {0, total - 1} & set(plan.stages_of_rank(i))]
    return sorted(holders)


def tied_axis(plan: Plan, tied: bool, rank: int, timeout_s: float | None = None) -> Axis | None:
    """This rank's embedding group (collective: every rank calls it, every group is made in the same
    order); None when the model is not ``tied``, or when this rank holds no copy. The group is None
    when one rank holds every copy (pp = 1, or a V-shaped placement)."""
    if not tied:
        return None
    holders = tied_pp_indices(plan)
    mine = None
    for pp_group in plan.all_groups("pp"):
        ranks = [pp_group[i] for i in holders]
        group = _new_group(ranks, timeout_s) if len(ranks) > 1 else None
        if rank in ranks:
            mine = Axis(size=len(ranks), index=ranks.index(rank), ranks=ranks, group=group)
    return mine


def reduce_tied(grads: list[torch.Tensor], axis: Axis | None) -> None:
    """Sum the gradients of this rank's copies (one, or two under a V) with the other holders',
    and give every copy the sum."""
    if not grads:
        return
    total = grads[0].clone() if len(grads) > 1 else grads[0]
    for g in grads[1:]:
        total.add_(g)
    if axis is not None and axis.group is not None:
        dist.all_reduce(total, group=axis.group)
    for g in grads:
        if g is not total:
            g.copy_(total)
