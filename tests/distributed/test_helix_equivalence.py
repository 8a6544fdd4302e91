"""HelixPipe's hand-written runtime computes the same training as one process.

fp32, fixed seed: per-step losses (rtol 1e-5) and the weights after AdamW of helixpipe plans with
p = 2 and 4 pipeline ranks, F = 1 and 2 folds, without and with recomputation (checkpointed
parameter blocks, attention kept), composed with DP and TP (with and without sequence parallelism),
with the published attention rotation and with uneven attention shares (``helix_attention``),
against ``reference_run``. All plans of one world size run in ONE launch (start-up dominates).
"""

from __future__ import annotations

import pytest

from autotune.plan import Plan
from autotune.runtime.launcher import launch
from autotune.runtime.worker import reference_run
from autotune.specs import ModelSpec, local_cluster
from tests.distributed.test_runtime_equivalence import WEIGHT_ATOL, WEIGHT_RTOL

pytestmark = pytest.mark.slow

SPEC = ModelSpec(name="helix-equiv", layers=8, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, vocab=128)
TIED = ModelSpec(name="helix-tied", layers=4, hidden=64, heads=4, kv_heads=4, ffn_hidden=128, vocab=128,
                 tied_embeddings=True)
SEQ, BATCH, STEPS, SEED = 16, 8, 2, 4321
LOSS_RTOL = 1e-5

H = {"schedule": "helixpipe", "dtype": "fp32"}
CASES = {
    2: [("pp2-F1", dict(H, degrees={"pp": 2})),
        ("pp2-F2", dict(H, degrees={"pp": 2}, helix_folds=2)),
        ("pp2-F2-recompute", dict(H, degrees={"pp": 2}, helix_folds=2, recompute="full")),
        ("pp2-F1-recompute-mbs2", dict(H, degrees={"pp": 2}, recompute="full", micro_batch_size=2)),
        ("pp2-F2-attention-5-3", dict(H, degrees={"pp": 2}, helix_folds=2, helix_attention=[5, 3]))],
    4: [("pp4-F1", dict(H, degrees={"pp": 4})),
        ("pp4-F2", dict(H, degrees={"pp": 4}, helix_folds=2)),
        ("pp4-F1-recompute", dict(H, degrees={"pp": 4}, recompute="full")),
        ("pp4-F2-recompute", dict(H, degrees={"pp": 4}, helix_folds=2, recompute="full")),
        ("pp2-dp2-F2", dict(H, degrees={"pp": 2, "dp": 2}, helix_folds=2)),
        ("pp2-dp2-F1-recompute-zero1", dict(H, degrees={"pp": 2, "dp": 2}, recompute="full", zero_stage=1)),
        ("pp2-tp2-F2", dict(H, degrees={"pp": 2, "tp": 2}, helix_folds=2)),
        ("pp2-tp2-sp-F2-recompute", dict(H, degrees={"pp": 2, "tp": 2}, helix_folds=2, sequence_parallel=True,
                                         recompute="full")),
        ("pp4-F1-recompute-attention-3-3-2-0", dict(H, degrees={"pp": 4}, recompute="full",
                                                    helix_attention=[3, 3, 2, 0]))],
}
TIED_CASES = {2: [("tied-pp2-F2-recompute", dict(H, degrees={"pp": 2}, helix_folds=2, recompute="full"))]}
_RUNS: dict[tuple[str, int], dict[str, list]] = {}
_REF: dict[str, dict] = {}


def run_world(spec: ModelSpec, cases: dict, world: int) -> dict[str, list]:
    key = (spec.name, world)
    if key not in _RUNS:
        names = [n for n, _ in cases[world]]
        plans = [Plan.from_dict(item).resolve(spec, local_cluster(world), SEQ, BATCH).to_dict()
                 for _, item in cases[world]]
        payload = {"model": spec.to_dict(), "plans": plans, "seq_len": SEQ, "global_batch": BATCH,
                   "steps": STEPS, "seed": SEED, "timeout_s": 120}
        res = launch("autotune.runtime.helix:helix_plans_job", payload, world, timeout_s=400, device="cpu")
        assert res.failure is None, f"{res.failure}\n{res.extra.get('traceback', '')}"
        _RUNS[key] = {n: [res.results[r][i] for r in range(world)] for i, n in enumerate(names)}
    return _RUNS[key]


def reference(spec: ModelSpec) -> dict:
    if spec.name not in _REF:
        _REF[spec.name] = reference_run(spec, SEQ, BATCH, steps=STEPS, seed=SEED)
    return _REF[spec.name]


def check(spec: ModelSpec, per_rank: list[dict]) -> None:
    import torch

    ref = reference(spec)
    losses = per_rank[0]["losses"]
    for a, b in zip(losses, ref["losses"], strict=True):
        assert a == pytest.approx(b, rel=LOSS_RTOL), (losses, ref["losses"])
    seen: dict[str, int] = {}
    for rep in per_rank:
        for name, (local, shard) in rep["state"].items():
            full = ref["state"][name]
            want = full if shard is None else full.narrow(shard[0], shard[1], local.shape[shard[0]])
            torch.testing.assert_close(local, want, atol=WEIGHT_ATOL, rtol=WEIGHT_RTOL,
                                       msg=lambda m, n=name: f"{n}: {m}")
            seen[name] = seen.get(name, 0) + local.numel()
    for name, full in ref["state"].items():
        assert seen.get(name, 0) >= full.numel(), f"{name} not covered by the ranks"


@pytest.mark.parametrize("name", [n for n, _ in CASES[2]])
def test_world2_helix_matches_single_process(name):
    check(SPEC, run_world(SPEC, CASES, 2)[name])


@pytest.mark.parametrize("name", [n for n, _ in CASES[4]])
def test_world4_helix_matches_single_process(name):
    check(SPEC, run_world(SPEC, CASES, 4)[name])


@pytest.mark.parametrize("name", [n for n, _ in TIED_CASES[2]])
def test_tied_embeddings_helix_matches_single_process(name):
    check(TIED, run_world(TIED, TIED_CASES, 2)[name])
