"""The gradient-norm comparison catches what the losses cannot (issue 38, "Parity").

AdamW divides a constant factor out of its update (m / sqrt(v)), so a plan that reduces its
gradients with a wrong factor trains to the losses of one process for several steps. Here the
optimizer is broken on purpose inside the workers (tests/distributed/_grad_norm_targets.py): the
dense gradients averaged over dp where the runtime sums them (every loss is already divided by the
global token count), or an MoE model's expert gradients summed over expert-DP twice. Each broken
plan still matches one process's losses at the parity tests' tolerance, and its global gradient
norm (autotune/runtime/grad_norm.py) does not: the comparison in tests/helpers/parity.py has teeth.
The same plans unbroken, run in the same launch, match both."""

from __future__ import annotations

import functools

import pytest
from helpers.parity import assert_grad_norms_match, assert_losses_match, reference, run_plans

from autotune.specs import ModelSpec
from autotune.specs.moe import MoESpec, RouterSpec

pytestmark = pytest.mark.slow

SEQ, BATCH, STEPS, SEED, WORLD = 16, 4, 3, 7, 2
DENSE = ModelSpec(name="teeth-dense", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=64)
MOE = ModelSpec(name="teeth-moe", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=64,
                moe=MoESpec(experts=4, top_k=2, expert_ffn_hidden=32, router=RouterSpec(aux_loss_coeff=0.01)))
FAULTS = {  # fault: (launcher target, model, plan)
    "dp-average": ("dp_average_job", DENSE, {"degrees": {"dp": 2}, "dtype": "fp32"}),
    "expert-dp-twice": ("expert_dp_twice_job", MOE, {"degrees": {"dp": 2}, "dtype": "fp32"}),
}


@functools.cache
def runs(fault: str) -> tuple[list[dict], list[dict]]:
    """(broken, sound) reports of the fault's plan."""
    job, spec, plan = FAULTS[fault]
    broken = run_plans(f"tests.distributed._grad_norm_targets:{job}", spec, [("plan", plan)], WORLD, SEQ, BATCH,
                       STEPS, SEED)["plan"]
    sound = run_plans("autotune.runtime.worker:plans_job", spec, [("plan", plan)], WORLD, SEQ, BATCH, STEPS,
                      SEED)["plan"]
    return broken, sound


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_wrong_reduction_factor_keeps_the_losses_and_moves_the_grad_norm(fault):
    broken, sound = runs(fault)
    ref = reference(FAULTS[fault][1], SEQ, BATCH, STEPS, SEED)
    assert_losses_match(sound[0], ref)
    assert_grad_norms_match(sound[0], ref)
    assert_losses_match(broken[0], ref)  # blind: AdamW divides the factor out
    with pytest.raises(AssertionError, match="grad norms"):
        assert_grad_norms_match(broken[0], ref)


def test_the_norm_moves_by_the_wrong_factor():
    """Averaging over dp=2 halves every gradient: the first step's norm (before any update) is half
    of one process's; counting the experts twice over edp=2 doubles a part of it: between 1x and 2x."""
    ref_dense = reference(DENSE, SEQ, BATCH, STEPS, SEED)["grad_norms"][0]
    assert runs("dp-average")[0][0]["grad_norms"][0] == pytest.approx(ref_dense / 2, rel=1e-5)
    ratio = runs("expert-dp-twice")[0][0]["grad_norms"][0] / reference(MOE, SEQ, BATCH, STEPS, SEED)["grad_norms"][0]
    assert 1.0 + 1e-3 < ratio < 2.0
