"""HelixPipe's hand-written runtime computes the same training as one process.

fp32, fixed seed: per-step losses (rtol 1e-5) and the weights after AdamW of helixpipe plans with
p = 2 and 4 pipeline ranks, F = 1 and 2 folds, without and with recomputation (checkpointed
parameter blocks, attention kept), composed with DP and TP (with and without sequence parallelism),
with the published attention rotation and with uneven attention shares (``helix_attention``),
against ``reference_run``. All plans of one world size run in ONE launch (start-up dominates).
"""

from __future__ import annotations

import functools

import pytest
from helpers.parity import assert_matches_reference, reference, run_plans

from autotune.specs import ModelSpec

pytestmark = pytest.mark.slow

SPEC = ModelSpec(name="helix-equiv", layers=8, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, vocab=128)
TIED = ModelSpec(name="helix-tied", layers=4, hidden=64, heads=4, kv_heads=4, ffn_hidden=128, vocab=128,
                 tied_embeddings=True)
SEQ, BATCH, STEPS, SEED = 16, 8, 2, 4321

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


@functools.cache
def run_world(spec: ModelSpec, world: int) -> dict[str, list]:
    cases = {SPEC.name: CASES, TIED.name: TIED_CASES}[spec.name]
    return run_plans("autotune.runtime.helix:helix_plans_job", spec, cases[world], world, SEQ, BATCH, STEPS, SEED)


def check(spec: ModelSpec, per_rank: list[dict]) -> None:
    assert_matches_reference(per_rank, reference(spec, SEQ, BATCH, STEPS, SEED))


@pytest.mark.parametrize("name", [n for n, _ in CASES[2]])
def test_world2_helix_matches_single_process(name):
    check(SPEC, run_world(SPEC, 2)[name])


@pytest.mark.parametrize("name", [n for n, _ in CASES[4]])
def test_world4_helix_matches_single_process(name):
    check(SPEC, run_world(SPEC, 4)[name])


@pytest.mark.parametrize("name", [n for n, _ in TIED_CASES[2]])
def test_tied_embeddings_helix_matches_single_process(name):
    check(TIED, run_world(TIED, 2)[name])
