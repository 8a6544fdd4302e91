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

Per-stage plans (``autotune/stages.py``, run by ``runtime/stages.py``): the first and the last stage
may split the vocabulary over different tp (a tp=2 embedding beside a tp=1 head), so tp rank i of
the first stage's replica r and tp rank j of the last stage's replica r hold different rows. The
copies are matched row by row instead (``staged_tied_segments``): each rank swaps, with every rank of
the other stage's same replica whose rows overlap its own, the gradient of the overlap, and adds what
it receives, so every holder of a row has the replica's embedding + head gradient of that row (a + b
on one side, b + a on the other: the same number). The reduction over replicas that follows
(``PieceOptimizer``) then sums those, and both copies take the same step, as Megatron's group of the
first and last stage of each data-parallel rank does for equal tp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autotune.plan import Plan
from autotune.runtime.mesh import Axis, _new_group

TIED_NAME = "embed.weight"
"""The parameter name of the embedding (and of a tied head's copy of it)."""
TIED_TAG = (1 << 31) - 2
"""Point-to-point tag of the per-stage exchange (apart from ``runtime/stages.py``'s activation tags)."""


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


def vocab_rows(vocab: int, tp: int, tp_index: int) -> tuple[int, int]:
    """[start, end) of the embedding rows tp rank ``tp_index`` of a tp-``tp`` group holds
    (``VocabParallelEmbedding``'s contiguous split)."""
    n = vocab // tp
    return tp_index * n, (tp_index + 1) * n


def staged_tied_segments(stages: tuple, rank: int, vocab: int, first_stage: int, last_stage: int
                         ) -> list[tuple[int, int, int]]:
    """(peer rank, start row, end row) for each rank of the other tied stage's same replica whose
    embedding rows overlap this rank's, in ascending row order; empty when this rank holds no copy or
    both copies sit on one stage (the same cell holds the same rows: no exchange)."""
    from autotune.stages import layout_of

    if first_stage == last_stage:
        return []
    lay = layout_of(stages)
    me = lay.slots[rank]
    if me.stage not in (first_stage, last_stage):
        return []
    other = last_stage if me.stage == first_stage else first_stage
    lo, hi = vocab_rows(vocab, me.tp, me.tp_index)
    r0 = lay.cell_first[(other, me.replica, me.cp_index, me.hp_index)]  # the same tokens' cell
    t = stages[other].replicas[me.replica].tp
    out = []
    for j in range(t):
        a, b = vocab_rows(vocab, t, j)
        if max(a, lo) < min(b, hi):
            out.append((r0 + j, max(a, lo), min(b, hi)))
    return out


def exchange_tied_rows(grads: list[torch.Tensor], start: int, segments: list[tuple[int, int, int]]) -> None:
    """Sum this rank's copies' gradients (rows from global row ``start``) locally, then add the other
    stage's gradient of each overlapping segment (``staged_tied_segments``), swapped with its holder;
    every copy ends with the sum."""
    if not grads:
        return
    reduce_tied(grads, None)
    total = grads[0]
    ops, got = [], []
    for peer, a, b in segments:
        mine = total.narrow(0, a - start, b - a).contiguous()
        theirs = torch.empty_like(mine)
        ops += [dist.P2POp(dist.isend, mine, peer, tag=TIED_TAG), dist.P2POp(dist.irecv, theirs, peer, tag=TIED_TAG)]
        got.append((a, b, theirs))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for a, b, theirs in got:  # after every send completed: the sent rows are read before they change
        total.narrow(0, a - start, b - a).add_(theirs)
    for g in grads[1:]:
        g.copy_(total)
