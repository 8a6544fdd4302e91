"""Schedule modules beyond the built-ins run with single-process parity: the zero-bubble ZB-V
schedule (V placement, loss on pipeline rank 0, backward split into input and weight gradients)
and ZB1P (interleaved zero bubble, looped placement, split backward) train the same losses (rtol 1e-5) and the same weights after AdamW as one process, with even and
uneven layer splits, composed with DP and TP. One launch per world size (tests/distributed style:
plans_job runs every plan in the same workers)."""

from __future__ import annotations

import functools

import pytest
from helpers.parity import assert_matches_reference, reference, run_plans

from autotune.plan import Plan
from autotune.specs import ModelSpec, local_cluster

pytestmark = pytest.mark.slow

SPEC = ModelSpec(name="sched-equiv", layers=12, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, vocab=128)
SEQ, BATCH, STEPS, SEED = 16, 8, 2, 4321

BASE = {"schedule": "zbv", "virtual_stages": 2, "dtype": "fp32"}
IZB = {"schedule": "interleaved_zb", "virtual_stages": 2, "dtype": "fp32"}
CASES = {
    2: [
        ("pp2-even", dict(BASE, degrees={"pp": 2})),
        ("pp2-uneven", dict(BASE, degrees={"pp": 2}, shares={"layers": [1, 5, 2, 4]})),
        ("pp2-mbs2-recompute", dict(BASE, degrees={"pp": 2}, micro_batch_size=2, recompute="full",
                                    shares={"layers": [4, 2, 3, 3]})),
        ("izb-pp2-uneven", dict(IZB, degrees={"pp": 2}, shares={"layers": [2, 4, 1, 5]})),
    ],
    4: [
        ("pp4-uneven", dict(BASE, degrees={"pp": 4}, shares={"layers": [1, 2, 1, 2, 1, 2, 2, 1]})),
        ("pp2-dp2-uneven", dict(BASE, degrees={"pp": 2, "dp": 2}, shares={"layers": [2, 4, 5, 1]})),
        ("pp2-tp2-sp", dict(BASE, degrees={"pp": 2, "tp": 2}, sequence_parallel=True,
                            shares={"layers": [3, 3, 2, 4]})),
        ("izb-pp2-dp2-uneven", dict(IZB, degrees={"pp": 2, "dp": 2}, shares={"layers": [3, 2, 5, 2]})),
    ],
}


@functools.cache
def run_world(world: int) -> dict[str, list[dict]]:
    return run_plans("autotune.runtime.worker:plans_job", SPEC, CASES[world], world, SEQ, BATCH, STEPS, SEED)


def check(per_rank: list[dict]) -> None:
    assert_matches_reference(per_rank, reference(SPEC, SEQ, BATCH, STEPS, SEED))


@pytest.mark.parametrize("name", [n for n, _ in CASES[2]])
def test_world2_matches_single_process(name):
    check(run_world(2)[name])


@pytest.mark.parametrize("name", [n for n, _ in CASES[4]])
def test_world4_matches_single_process(name):
    check(run_world(4)[name])


def test_zbv_holds_the_v():
    """The plans above really are V-shaped: rank 0 holds the first and the last chunk (the loss)."""
    plan = Plan.from_dict(CASES[4][0][1]).resolve(SPEC, local_cluster(4), SEQ, BATCH)
    assert [plan.stages_of_rank(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert plan.layers_of_stage(0) == [1, 1] and plan.layers_of_stage(3) == [2, 1]
