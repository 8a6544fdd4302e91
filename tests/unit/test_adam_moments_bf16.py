"""Adam's moments kept in bf16 (``Plan.moments``: Megatron's precision-aware optimizer,
``--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``, as DeepSeek-V3 trained):
the optimizer states fall from 12 bytes a parameter to the moments' 2 + 2 and the master Megatron keeps
beside them (its 16-bit remainder under bf16 or delayed FP8, the fp32 copy under the other FP8 recipes);
nothing else moves; the flags written for Megatron and refused elsewhere; the plans Megatron-Core's own
``OptimizerConfig`` refuses refused here too."""

from __future__ import annotations

import json
import warnings

import pytest
from test_export_moe import ctx_for, resolved

from autotune.cost import memory as M
from autotune.cost.estimate import estimate
from autotune.export import ExportRefused, export
from autotune.export import megatron as MG
from autotune.plan import Degrees, Plan, PlanError, parse_inline
from autotune.targets import kernel_costs


def test_round_trip_default_absent_and_bad_values_named():
    p = parse_inline("dp=4,zero=1,moments=bf16")
    assert p.to_dict()["moments"] == "bf16" and Plan.from_dict(json.loads(p.to_json())) == p
    assert "moments" not in parse_inline("dp=4").to_dict()
    with pytest.raises(PlanError, match="moments"):
        parse_inline("dp=4,moments=fp8")


@pytest.mark.parametrize("inline,why", [("dp=8,zero=0,moments=bf16", "zero 0"),
                                         ("dp=8,zero=1,dtype=fp16,moments=bf16", "dtype fp16")])
def test_plans_megatron_cannot_run_are_refused_in_one_line(inline, why):
    ctx = ctx_for("tiny-moe", nodes=1, seq=256, batch=16)
    with pytest.raises(PlanError, match="moments: bf16 moments are Megatron's precision-aware optimizer") as e:
        parse_inline(inline).resolve(ctx.model, ctx.cluster, 256, 16)
    assert why in e.value.message and "\n" not in e.value.message


def test_megatron_core_refuses_it_without_the_distributed_optimizer():
    """The zero >= 1 rule is Megatron-Core's (``OptimizerConfig.__post_init__``), asked of it here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core")
    from megatron.core.optimizer import OptimizerConfig

    with pytest.raises(AssertionError, match="only supported with distributed optimizer"):
        OptimizerConfig(optimizer="adam", bf16=True, use_precision_aware_optimizer=True,
                        use_distributed_optimizer=False)


@pytest.mark.parametrize("dtype,master", [("bf16", 2.0), ("fp8", 2.0), ("fp8-current", 4.0),
                                          ("fp8-blockwise", 4.0), ("fp8-mx", 4.0)])
def test_optimizer_bytes_are_the_moments_in_bf16_and_megatrons_master(dtype, master):
    w32, g32, o32, _ = M.state_bytes(dtype, "megatron", 1)
    w16, g16, o16, _ = M.state_bytes(dtype, "megatron", 1, moments="bf16")
    assert (w16, g16) == (w32, g32) and o32 == 12.0
    assert o16 == master + 2.0 + 2.0
    assert M.state_bytes_per_param(dtype, moments="bf16")[2] == o16


def test_only_the_optimizer_states_of_a_moe_plan_move():
    ctx = ctx_for("qwen3-30b-a3b")
    text = "dp=16,ep=8,mbs=1,zero=1,dtype=bf16"
    est = {m: estimate(parse_inline(text + f",moments={m}"), ctx.model, ctx.cluster, ctx.seq_len,
                       ctx.global_batch, kernels=kernel_costs("megatron")) for m in ("fp32", "bf16")}
    a, b = (est[m].breakdown["ranks"][0]["memory"] for m in ("fp32", "bf16"))
    assert b["optimizer"] == pytest.approx(a["optimizer"] * 6.0 / 12.0)
    assert b["expert_optimizer"] == pytest.approx(a["expert_optimizer"] * 6.0 / 12.0)
    assert {k: a[k] for k in ("weights", "gradients", "activations")} == {
        k: b[k] for k in ("weights", "gradients", "activations")}
    assert est["fp32"].predicted["step_time_s"] == est["bf16"].predicted["step_time_s"]


def test_megatron_writes_the_flags():
    ctx = ctx_for("qwen3-30b-a3b")
    for m in ("fp32", "bf16"):
        plan = resolved(ctx, degrees=Degrees(dp=16, ep=8), micro_batch_size=1, zero_stage=1, moments=m)
        args = MG.parse_script(export(plan, ctx, "megatron").text)
        on = "--use-precision-aware-optimizer" in args
        assert on == (m == "bf16") and "--use-distributed-optimizer" in args
        if on:
            for flag in ("--exp-avg-dtype", "--exp-avg-sq-dtype"):
                assert args[args.index(flag) + 1] == "bf16"


@pytest.mark.parametrize("target", ["torchtitan", "deepspeed", "accelerate"])
def test_other_targets_refuse_it(target):
    ctx = ctx_for("qwen3-30b-a3b")
    plan = resolved(ctx, degrees=Degrees(dp=16), micro_batch_size=1, zero_stage=1, moments="bf16")
    with pytest.raises(ExportRefused, match="moments: bf16"):
        export(plan, ctx, target)


def test_only_megatron_expresses_it_and_the_runtime_refuses_it():
    from autotune.targets import context, expresses, refusals

    ctx = ctx_for("qwen3-30b-a3b")
    tctx = context(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)
    assert [t for t in ("megatron", "torchtitan", "deepspeed", "accelerate", "runtime")
            if expresses(t, "moments", tctx)] == ["megatron"]
    plan = resolved(ctx, degrees=Degrees(dp=16), micro_batch_size=1, zero_stage=1, moments="bf16")
    assert any(r.startswith("moments: bf16: the runtime's Adam") for r in refusals("runtime", plan, tctx))
