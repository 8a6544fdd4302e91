"""Gradients kept and reduced in bf16 (``Plan.grad_reduce``, Megatron's ``--grad-reduce-in-bf16``,
Megatron-Bridge's ``grad_reduce_in_fp32 = False``): half the gradient buffer and half the bytes the
data-parallel and expert-data-parallel groups reduce, against the fp32 default; the flag read back as
Megatron's argument rules read it; refused where nothing runs it."""

from __future__ import annotations

import json
import warnings

import pytest
from _cost_helpers import GELU, cluster, device
from test_export_moe import ctx_for, resolved

from autotune.cost import data_parallel as DP
from autotune.cost import expert_data_parallel as EDP
from autotune.cost import memory as M
from autotune.cost.context import step_context, tp_groups
from autotune.cost.estimate import estimate
from autotune.export import ExportRefused, export
from autotune.export import megatron as MG
from autotune.plan import Degrees, Plan, PlanError, parse_inline


def _ctx(inline: str, model=GELU, cl=None, seq=128, batch=8, kernels=None):
    s = step_context(parse_inline(inline), model, cl or cluster((1, 4, device(peak=1e12), 2e9, 1e-5)), seq, batch,
                     None, kernels)
    return tp_groups(s)[0][2]


def test_round_trip_default_absent_and_16_bit_weights_only():
    p = parse_inline("dp=4,grad_reduce=bf16")
    assert p.to_dict()["grad_reduce"] == "bf16" and Plan.from_dict(json.loads(p.to_json())) == p
    assert "grad_reduce" not in parse_inline("dp=4").to_dict()
    with pytest.raises(PlanError, match="grad_reduce"):
        parse_inline("dp=4,grad_reduce=fp16")
    ctx = ctx_for("tiny-moe", nodes=1, seq=256, batch=16)  # H100s: every dtype
    for dtype in ("fp16", "fp32"):
        with pytest.raises(PlanError, match="grad_reduce: bf16 reduction needs bf16 weights") as e:
            parse_inline(f"dp=8,dtype={dtype},grad_reduce=bf16").resolve(ctx.model, ctx.cluster, 256, 16)
        assert "\n" not in e.value.message


@pytest.mark.parametrize("zero", [0, 1])
def test_half_the_gradient_bytes_reduced_and_kept(zero):
    fp32, bf16 = _ctx(f"dp=4,zero={zero}"), _ctx(f"dp=4,zero={zero},grad_reduce=bf16")
    a, b = DP.step_transfers(fp32), DP.step_transfers(bf16)
    assert a[0].what == b[0].what == "gradients" and b[0].nbytes == pytest.approx(a[0].nbytes / 2)
    assert [t.nbytes for t in a[1:]] == [t.nbytes for t in b[1:]]  # the weight gathers stay in bf16
    g32 = M.model_states(1e9, "bf16", zero, 4, 1e7, framework="megatron")["gradients"]
    g16 = M.model_states(1e9, "bf16", zero, 4, 1e7, framework="megatron", grad_reduce="bf16")["gradients"]
    assert (g32, g16) == (4e9, 2e9)
    assert M.state_bytes("fp8-mx", "megatron", 1, "bf16")[1] == 2.0


def test_expert_gradients_follow_it_and_the_memory_falls_by_the_gradient_bytes():
    ctx = ctx_for("qwen3-30b-a3b")
    text = "dp=16,ep=8,mbs=1,zero=1,dtype=bf16"
    from autotune.targets import kernel_costs

    e32 = estimate(parse_inline(text), ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch,
                   kernels=kernel_costs("megatron"))
    e16 = estimate(parse_inline(text + ",grad_reduce=bf16"), ctx.model, ctx.cluster, ctx.seq_len,
                   ctx.global_batch, kernels=kernel_costs("megatron"))
    m32, m16 = e32.breakdown["ranks"][0]["memory"], e16.breakdown["ranks"][0]["memory"]
    assert m16["gradients"] == pytest.approx(m32["gradients"] / 2)
    assert m16["expert_gradients"] == pytest.approx(m32["expert_gradients"] / 2)
    assert e16.breakdown["moe"]["expert_grad_sync_s"] < e32.breakdown["moe"]["expert_grad_sync_s"]
    s = step_context(parse_inline(text + ",grad_reduce=bf16"), ctx.model, ctx.cluster, ctx.seq_len,
                     ctx.global_batch, None, kernel_costs("megatron"))
    rc = tp_groups(s)[0][2]
    assert EDP.grad_sync(rc) != (0.0, 0.0)


def test_megatron_writes_the_flag_and_its_rules_turn_it_into_bf16_reduction():
    """megatron/training/arguments.py under --bf16: ``--grad-reduce-in-bf16`` sets
    accumulate_allreduce_grads_in_fp32 False (else True), which training.py passes to
    DistributedDataParallelConfig(grad_reduce_in_fp32=...)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core")
    from megatron.core.distributed import DistributedDataParallelConfig

    ctx = ctx_for("qwen3-30b-a3b")
    for reduce in ("fp32", "bf16"):
        plan = resolved(ctx, degrees=Degrees(dp=16, ep=8), micro_batch_size=1, zero_stage=1, grad_reduce=reduce)
        args = MG.parse_script(export(plan, ctx, "megatron").text)
        assert "--bf16" in args
        cfg = DistributedDataParallelConfig(grad_reduce_in_fp32="--grad-reduce-in-bf16" not in args,
                                            use_distributed_optimizer="--use-distributed-optimizer" in args)
        assert cfg.grad_reduce_in_fp32 == (reduce == "fp32")


@pytest.mark.parametrize("target", ["torchtitan", "deepspeed", "accelerate"])
def test_other_targets_refuse_it(target):
    ctx = ctx_for("qwen3-30b-a3b")
    plan = resolved(ctx, degrees=Degrees(dp=16), micro_batch_size=1, zero_stage=1, grad_reduce="bf16")
    with pytest.raises(ExportRefused, match="grad_reduce: bf16"):
        export(plan, ctx, target)
