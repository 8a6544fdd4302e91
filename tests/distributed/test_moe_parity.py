"""MoE plans compute the training of one process (issue 38, "Parity").

For a small MoE model in fp32 (a dense first layer, 8 routed experts, top-2, the auxiliary loss on),
per-step losses and the final weights after AdamW of every MoE layout the runtime runs at worlds 2
and 4 match ``reference_run`` (one process, whole batch): expert parallelism alone and with dp, tp
(tp ranks holding the same tokens, or sequence parallelism), cp (a sequence split at the router),
pp (1F1B, interleaved, with recomputation), expert tensor parallelism, uneven expert shares, ZeRO-1
over both gradient groups, and a second model with a shared expert, sigmoid scores and a capacity
(tokens dropped per sequence). All plans of one world run in one job of the session's workers.
What the runtime refuses is refused with its reason before launch."""

from __future__ import annotations

import functools
import math

import pytest
from helpers.parity import LOW_PRECISION_GRAD_NORM_RTOL, assert_matches_reference, reference, run_plans

from autotune.plan import Plan, PlanError
from autotune.runtime.trial import check_runtime_support
from autotune.runtime.worker import reference_run
from autotune.specs import ModelSpec, local_cluster
from autotune.specs.moe import MoESpec, RouterSpec

pytestmark = pytest.mark.slow

SEQ, BATCH, STEPS, SEED = 16, 4, 2, 99
MOE = ModelSpec(name="parity-moe", layers=4, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=64,
                moe=MoESpec(experts=8, top_k=2, expert_ffn_hidden=32, dense_layers=(0,),
                            router=RouterSpec(aux_loss_coeff=0.01)))
CAPACITY = ModelSpec(name="parity-moe-capacity", layers=4, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=64,
                     moe=MoESpec(experts=8, top_k=2, expert_ffn_hidden=32, dense_layers=(0,), shared_experts=1,
                                 shared_ffn_hidden=16, router=RouterSpec(dropless=False, capacity_factor=1.0,
                                                                         score="sigmoid", aux_loss_coeff=0.01)))
SPECS = {MOE.name: MOE, CAPACITY.name: CAPACITY}


def _plan(degrees: dict, **kw) -> dict:
    return {"degrees": degrees, "dtype": "fp32", **kw}


CASES = {
    (MOE.name, 2): {
        "ep2": _plan({"ep": 2, "dp": 2}),
        "ep2-experts-5/3": _plan({"dp": 2, "ep": 2}, shares={"experts": [5, 3]}),
        "tp2-ep2": _plan({"tp": 2, "ep": 2}),
        "tp2-etp2-sp": _plan({"tp": 2, "etp": 2}, sequence_parallel=True),
        "pp2": _plan({"pp": 2}, shares={"layers": [1, 3]}),
        "cp2-ep2-experts-3/5": _plan({"cp": 2, "ep": 2}, shares={"experts": [3, 5]}),
    },
    (CAPACITY.name, 2): {
        "dp2-ep2": _plan({"dp": 2, "ep": 2}),
        "cp2-ep2": _plan({"cp": 2, "ep": 2}, recompute="full"),
        "tp2-etp2": _plan({"tp": 2, "etp": 2}),
    },
    (MOE.name, 4): {
        "dp2-tp2-ep2": _plan({"dp": 2, "tp": 2, "ep": 2}),
        "pp2-dp2-ep2": _plan({"pp": 2, "dp": 2, "ep": 2}),
        "pp2-dp2-ep2-interleaved-experts-5/3": _plan({"pp": 2, "dp": 2, "ep": 2}, schedule="interleaved_1f1b",
                                                     virtual_stages=2, shares={"experts": [5, 3]}),
        "dp4-ep2-etp2-experts-5/3": _plan({"dp": 4, "ep": 2, "etp": 2}, shares={"experts": [5, 3]}),
        "dp2-tp2-sp-ep2-etp2": _plan({"dp": 2, "tp": 2, "ep": 2, "etp": 2}, sequence_parallel=True),
        "dp4-ep4-experts-3/2/2/1-zero1": _plan({"dp": 4, "ep": 4}, shares={"experts": [3, 2, 2, 1]},
                                               zero_stage=1),
    },
    (CAPACITY.name, 4): {
        "dp2-cp2-ep4-zero1": _plan({"dp": 2, "cp": 2, "ep": 4}, zero_stage=1),
        "pp2-tp2-ep2": _plan({"pp": 2, "tp": 2, "ep": 2}, recompute="selective"),
    },
}


@functools.cache
def run_world(spec_name: str, world: int) -> dict[str, list[dict]]:
    return run_plans("autotune.runtime.worker:plans_job", SPECS[spec_name], list(CASES[spec_name, world].items()),
                     world, SEQ, BATCH, STEPS, SEED)


@pytest.mark.parametrize(("spec_name", "world", "name"),
                         [(s, w, n) for (s, w), cases in CASES.items() for n in cases])
def test_moe_plan_matches_one_process(spec_name, world, name):
    spec = SPECS[spec_name]
    assert_matches_reference(run_world(spec_name, world)[name], reference(spec, SEQ, BATCH, STEPS, SEED))


@pytest.mark.parametrize(("item", "field"), [
    (_plan({"dp": 2, "ep": 2}, zero_stage=2), "zero_stage"),
    (_plan({"dp": 2, "ep": 2}, shares={"samples": [1, 3]}), "shares.samples"),
])
def test_what_the_runtime_does_not_run_is_refused_with_its_reason(item, field):
    world = 2
    plan = Plan.from_dict(item).resolve(MOE, local_cluster(world), SEQ, BATCH)
    with pytest.raises(PlanError, match=field):
        check_runtime_support(plan, MOE)


FP16_CASES = {
    "dp2-ep2": _plan({"dp": 2, "ep": 2}, dtype="fp16", micro_batch_size=1),
    "ep2-experts-5/3-zero1": _plan({"dp": 2, "ep": 2}, dtype="fp16", micro_batch_size=1, shares={"experts": [5, 3]},
                                   zero_stage=1),
}
FP16_LOSS_RTOL = 2.0**-11  # fp16's unit roundoff: one rounding of the loss (as test_runtime_enumeration)
FP16_UPDATE_RTOL = 0.1  # ||w - w_ref|| / ||w_ref - w_0||: ~1 for a wrong gradient (test_runtime_enumeration)


@functools.cache
def fp16_runs() -> tuple[dict, dict, dict]:
    runs = run_plans("autotune.runtime.worker:plans_job", MOE, sorted(FP16_CASES.items()), 2, SEQ, BATCH, STEPS, SEED)
    return (runs, reference_run(MOE, SEQ, BATCH, steps=STEPS, seed=SEED, dtype="fp16"),
            reference_run(MOE, SEQ, BATCH, steps=0, seed=SEED)["state"])


@pytest.mark.parametrize("name", sorted(FP16_CASES))
def test_fp16_moe_plan_trains_as_one_fp16_process(name):
    """fp16 MoE: the dense and expert gradient groups share one dynamic loss scale and one skip
    decision (runtime/optimizer.py ``ExpertSplitOptimizer``), and train as one fp16 process does."""
    runs, ref, init = fp16_runs()
    per_rank = runs[name]
    for a, b in zip(per_rank[0]["losses"], ref["losses"], strict=True):
        assert math.isclose(a, b, rel_tol=FP16_LOSS_RTOL), (per_rank[0]["losses"], ref["losses"])
    for a, b in zip(per_rank[0]["grad_norms"], ref["grad_norms"], strict=True):  # both groups, one scale
        assert (a is None) == (b is None), (per_rank[0]["grad_norms"], ref["grad_norms"])
        assert a is None or math.isclose(a, b, rel_tol=LOW_PRECISION_GRAD_NORM_RTOL["fp16"]), (
            per_rank[0]["grad_norms"], ref["grad_norms"])
    diff2 = upd2 = 0.0
    for rep in per_rank:
        for pname, (local, shard) in rep["state"].items():
            def cut(full, local=local, shard=shard):
                return full if shard is None else full.narrow(shard[0], shard[1], local.shape[shard[0]])
            want, start = cut(ref["state"][pname]), cut(init[pname])
            diff2 += float(((local - want).double() ** 2).sum())
            upd2 += float(((want - start).double() ** 2).sum())
    assert upd2 > 0 and math.sqrt(diff2 / upd2) <= FP16_UPDATE_RTOL, math.sqrt(diff2 / upd2)
