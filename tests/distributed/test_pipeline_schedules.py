"""Schedule modules beyond the built-ins run with single-process parity: the zero-bubble ZB-V
schedule (V placement, loss on pipeline rank 0, backward split into input and weight gradients)
and ZB1P (interleaved zero bubble, looped placement, split backward) train the same losses (rtol 1e-5) and the same weights after AdamW as one process, with even and
uneven layer splits, composed with DP and TP. One launch per world size (tests/distributed style:
plans_job runs every plan in the same workers)."""

from __future__ import annotations

import pytest
import torch

from autotune.plan import Plan
from autotune.runtime.launcher import launch
from autotune.runtime.worker import reference_run
from autotune.specs import ModelSpec, local_cluster

pytestmark = pytest.mark.slow

SPEC = ModelSpec(name="sched-equiv", layers=12, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, vocab=128)
SEQ, BATCH, STEPS, SEED = 16, 8, 2, 4321
LOSS_RTOL = 1e-5
WEIGHT_ATOL, WEIGHT_RTOL = 1e-4, 1e-4  # as test_runtime_equivalence: AdamW moves ~0 gradients by ~lr

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
_RUNS: dict[int, dict[str, list[dict]]] = {}
_REF: dict = {}


def run_world(world: int) -> dict[str, list[dict]]:
    if world not in _RUNS:
        names = [n for n, _ in CASES[world]]
        plans = [Plan.from_dict(item).resolve(SPEC, local_cluster(world), SEQ, BATCH).to_dict()
                 for _, item in CASES[world]]
        payload = {"model": SPEC.to_dict(), "plans": plans, "seq_len": SEQ, "global_batch": BATCH,
                   "steps": STEPS, "seed": SEED, "timeout_s": 120}
        res = launch("autotune.runtime.worker:plans_job", payload, world, timeout_s=400, device="cpu")
        assert res.failure is None, f"{res.failure}\n{res.extra.get('traceback', '')}"
        _RUNS[world] = {n: [res.results[r][i] for r in range(world)] for i, n in enumerate(names)}
    return _RUNS[world]


def reference() -> dict:
    if not _REF:
        _REF.update(reference_run(SPEC, SEQ, BATCH, steps=STEPS, seed=SEED))
    return _REF


def check(per_rank: list[dict]) -> None:
    ref = reference()
    losses = per_rank[0]["losses"]
    assert len(losses) == STEPS
    for a, b in zip(losses, ref["losses"], strict=True):
        assert a == pytest.approx(b, rel=LOSS_RTOL), (losses, ref["losses"])
    seen: dict[str, int] = {}
    for rep in per_rank:
        for name, (local, shard) in rep["state"].items():
            full = ref["state"][name]
            want = full if shard is None else full.narrow(shard[0], shard[1], local.shape[shard[0]])
            assert local.shape == want.shape, name
            torch.testing.assert_close(local, want, atol=WEIGHT_ATOL, rtol=WEIGHT_RTOL,
                                       msg=lambda m, n=name: f"{n}: {m}")
            seen[name] = seen.get(name, 0) + local.numel()
    for name, full in ref["state"].items():  # every parameter element is held by some rank
        assert seen.get(name, 0) >= full.numel(), f"{name} not covered by the ranks"


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
