"""The zero-bubble orders the cost model prices are torch's own: the torch-free ports in
autotune/schedules/zero_bubble_orders.py against torch.distributed.pipelining's
``_calculate_single_rank_operations`` (the runtime executes torch's), idle slots dropped."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autotune.schedules import get_schedule
from autotune.schedules.base import B, F, I, Op, W
from autotune.schedules.zero_bubble_orders import interleaved_zb_order, zbv_order

pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
_KIND = {"F": F, "B": B, "I": I, "W": W}


def _ops(actions) -> tuple[Op, ...]:
    return tuple(Op(_KIND[a.computation_type.value], a.stage_index, a.microbatch_index)
                 for a in actions if a is not None)


def _torch_interleaved(pp: int, v: int, m: int, rank: int) -> tuple[Op, ...]:
    rounds = max(1, m // pp)
    # the method reads only these attributes; building the schedule itself needs real stages
    shape = SimpleNamespace(n_local_stages=v, pp_group_size=pp, _n_microbatches=m, number_of_rounds=rounds,
                            microbatches_per_round=m // rounds)
    return _ops(pipelining.ScheduleInterleavedZeroBubble._calculate_single_rank_operations(shape, rank))


def _torch_zbv(pp: int, m: int, rank: int) -> tuple[Op, ...]:
    shape = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
    return _ops(pipelining.ScheduleZBVZeroBubble._calculate_single_rank_operations(shape, rank))


@pytest.mark.parametrize("pp", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("v", [2, 4])
def test_interleaved_zero_bubble_order_is_torchs(pp, v):
    checked = 0
    for m in [pp * k for k in (1, 2, 3, 4, 8)] + [pp * pp]:
        for rank in range(pp):
            assert interleaved_zb_order(pp, v, m, rank) == _torch_interleaved(pp, v, m, rank), (pp, v, m, rank)
            checked += 1
    assert checked == 6 * pp


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 8, 16])
def test_zbv_order_is_torchs(pp):
    # below 2 pp - 1 micro-batches torch plans for more and drops the surplus: those m are covered too
    for m in list(range(1, 2 * pp + 2)) + [4 * pp, 8 * pp + 3]:
        for rank in range(pp):
            assert zbv_order(pp, m, rank) == _torch_zbv(pp, m, rank), (pp, m, rank)


def test_the_schedules_ask_the_ports():
    """What the estimate reads (Schedule.op_order) is the ported order, every op of every micro-batch."""
    zb, zbv = get_schedule("interleaved_zb"), get_schedule("zbv")
    assert zb.op_order(4, 2, 8, 1) == _torch_interleaved(4, 2, 8, 1)
    assert zbv.op_order(4, 2, 8, 3) == _torch_zbv(4, 8, 3)
    for order, chunks in ((zb.op_order(4, 2, 8, 1), 2), (zbv.op_order(4, 2, 8, 3), 2)):
        for kind in (F, I, W):
            assert sum(op.kind == kind for op in order) == 8 * chunks
