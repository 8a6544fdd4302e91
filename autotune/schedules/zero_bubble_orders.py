"""The operation orders of torch's two zero-bubble schedules, computed without importing torch.

``torch.distributed.pipelining`` computes each rank's order in
``ScheduleInterleavedZeroBubble._calculate_single_rank_operations`` (with ``_get_warmup_ops`` and
``_get_1f1b_rank_ops``) and ``ScheduleZBVZeroBubble._calculate_single_rank_operations``. The cost
model needs those orders for every plan it prices, and importing the pipelining package costs about
3 s of a CLI search's start (it pulls in all of torch.distributed), so these are line-for-line ports
of torch 2.13's code (BSD-3-Clause, (c) Meta Platforms) with the idle slots (``None``) dropped: an
idle slot does not change the order of a rank's own actions, which is all the estimate reads.

Equality with torch is pinned by ``tests/unit/test_zero_bubble_orders.py`` over every (pp, v, m,
rank) the search space can produce and more; when torch changes its orders that test fails, and
the runtime (which executes torch's schedule) and the estimate must be brought back together.
"""

from __future__ import annotations

from functools import lru_cache

from autotune.schedules.base import F, I, Op, W


@lru_cache(maxsize=1024)
def interleaved_zb_order(pp: int, v: int, m: int, rank: int) -> tuple[Op, ...]:
    """Rank ``rank``'s actions in torch's ``ScheduleInterleavedZeroBubble`` (pp ranks, v chunks
    each, m micro-batches)."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + ((pp - 1) - rank), m * v)  # _get_warmup_ops, multiply_factor=1
    fwd_bwd = v * m - warmup
    total = warmup + fwd_bwd + warmup  # cooldown = warmup

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * pp + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * pp + rank

    fwd_mb: dict[int, int] = {}
    bwd_mb: dict[int, int] = {}
    w_mb: dict[int, int] = {}
    ops: list[Op] = []
    backward_steps: list[int] = []  # the step of each backward, in order: each W follows one
    ops_w: list[int] = []

    def take(counter: dict[int, int], stage: int) -> int:
        counter[stage] = counter.get(stage, 0) + 1
        return counter[stage] - 1

    def weight() -> None:
        stage = bwd_stage(backward_steps[len(ops_w)])
        ops.append(Op(W, stage, take(w_mb, stage)))
        ops_w.append(stage)

    for step in range(total):
        if step < warmup + fwd_bwd:
            stage = fwd_stage(step)
            ops.append(Op(F, stage, take(fwd_mb, stage)))
            if step < warmup:
                continue
        stage = bwd_stage(step)
        ops.append(Op(I, stage, take(bwd_mb, stage)))
        backward_steps.append(step)
        if step - warmup >= rank:  # num_1f1b_microbatches = rank
            weight()
    while len(ops_w) < len(backward_steps):
        weight()
    return tuple(ops)


@lru_cache(maxsize=1024)
def zbv_order(pp: int, m: int, rank: int) -> tuple[Op, ...]:
    """Rank ``rank``'s actions in torch's ``ScheduleZBVZeroBubble`` (pp ranks, two chunks each in
    a V, m micro-batches; torch plans for at least 2 pp - 1 and drops the surplus)."""
    n_micro = max(2 * pp - 1, m)
    c0, c1 = rank, 2 * pp - 1 - rank
    ops: list[Op] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (pp - rank) - 1):
        ops.append(Op(F, c0, f0))
        f0 += 1
    for _ in range(rank):
        ops += [Op(F, c1, f1), Op(F, c0, f0)]
        f1 += 1
        f0 += 1
    for _ in range(pp - rank):
        ops += [Op(F, c1, f1), Op(I, c1, b1), Op(W, c1, b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n_micro:
        if f0 < n_micro:
            ops.append(Op(F, c0, f0))
            f0 += 1
        ops += [Op(I, c0, b0), Op(W, c0, b0), Op(F, c1, f1), Op(I, c1, b1), Op(W, c1, b1)]
        b0 += 1
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [Op(I, c0, b0), Op(I, c1, b1)]
        b0 += 1
        b1 += 1
    for _ in range(pp - rank):
        ops += [Op(I, c0, b0), Op(W, c0, w0)]
        b0 += 1
        w0 += 1
    ops += [Op(W, c1, k) for k in range(w1, b1)]
    ops += [Op(W, c0, k) for k in range(w0, b0)]
    return tuple(op for op in ops if op.microbatch < m)
