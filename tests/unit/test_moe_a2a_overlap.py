"""The MoE all-to-all overlapped across micro-batches (``Plan.moe_a2a_overlap``, Megatron-Core's
``--overlap-moe-expert-parallel-comm --delay-wgrad-compute``): the plan field, its refusals, its price
(``cost/expert_dispatch.paired_exposed`` / ``paired_fraction``) against Megatron-Core's own schedule
arithmetic and hand-built stream timelines, and the export read back by Megatron Core."""

from __future__ import annotations

import json
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_export_moe import ctx_for, megatron_config, resolved

from autotune.cost import expert_dispatch as XD
from autotune.cost.estimate import estimate
from autotune.export import ExportRefused, export
from autotune.export import megatron as M
from autotune.plan import Degrees, Plan, PlanError, parse_inline
from autotune.specs.model import load_model

times = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


def test_no_exchange_or_short_exchanges_cost_nothing_and_no_compute_exposes_them_all():
    assert XD.paired_exposed(0.0, 1.0, 2.0, 3.0, 4.0) == 0.0
    # each exchange shorter than the compute beside it: dispatch_f + dispatch_b within both MLPs
    assert XD.paired_exposed(0.5, 1.0, 1.0, 2.0, 2.0) == 0.0
    assert XD.paired_exposed(1.5, 0.0, 0.0, 0.0, 0.0) == pytest.approx(6.0)


def test_a_hand_built_timeline():
    """comm 2 each, attention 1 / 2, MLP 1 / 2 (forward / backward): combine_b 0-2; mlp_b 2-4 (after
    it); dispatch_f 2-4 (attention_f ended at 1); dispatch_b 4-6; mlp_f 4-5; combine_f 6-8;
    attention_b 6-8 (after dispatch_b). The pair ends at 8 against 6 of compute: 2 exposed."""
    assert XD.paired_exposed(2.0, 1.0, 1.0, 2.0, 2.0) == pytest.approx(2.0)


@settings(max_examples=200, deadline=None)
@given(c=times, af=times, mf=times, ab=times, mb=times)
def test_never_more_than_waiting_for_each_exchange_nor_less_than_the_comm_streams_excess(c, af, mf, ab, mb):
    exposed = XD.paired_exposed(c, af, mf, ab, mb)
    assert -1e-9 <= exposed <= 4.0 * c + 1e-9
    assert exposed >= 4.0 * c - (af + mf + ab + mb) - 1e-9  # the comm stream alone takes 4c


def _megatron_warmup(pp: int, v: int, rank: int, m: int) -> tuple[int, int]:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    parallel_state.set_pipeline_model_parallel_world_size(pp)
    parallel_state.set_pipeline_model_parallel_rank(rank)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(v if v > 1 else None)
    try:
        total, _, warm, _ = get_pp_rank_microbatches(m, v, pp, overlap_moe_expert_parallel_comm=True)
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_rank(None)
    return total, warm


@pytest.mark.parametrize("pp,v,m", [(2, 2, 8), (4, 2, 16), (8, 4, 32), (2, 12, 128), (4, 3, 4)])
def test_paired_forwards_are_megatron_cores_warmup_complement(pp, v, m):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core")
    for rank in range(pp):
        total, warm = _megatron_warmup(pp, v, rank, m)
        assert XD.paired_fraction(pp, v, rank, m) == pytest.approx((total - warm) / total)


def test_without_pipelining_the_first_forward_runs_alone():
    """combined_1f1b_schedule_for_no_pipelining: forward 1 alone, then m - 1 forward/backward pairs."""
    assert XD.paired_fraction(1, 1, 0, 8) == pytest.approx(7 / 8)
    assert XD.paired_fraction(1, 1, 0, 1) == 0.0


# ---- the plan and the price -------------------------------------------------------------------------
PLAN = "dp=16,pp=2,ep=8,vpp=2,schedule=interleaved_1f1b,mbs=1,zero=1,dtype=bf16"


def test_round_trip_and_absent_by_default():
    p = parse_inline(PLAN + ",moe_a2a_overlap=1")
    d = p.to_dict()
    assert d["moe_a2a_overlap"] is True and Plan.from_dict(json.loads(json.dumps(d))) == p
    assert "moe_a2a_overlap" not in parse_inline(PLAN).to_dict()


def test_refused_without_experts_to_overlap_or_with_the_layer_recomputed():
    ctx = ctx_for("qwen3-30b-a3b")
    for text, what in (("dp=16,moe_a2a_overlap=1", "ep > 1"),
                       ("dp=16,ep=8,recompute=full,moe_a2a_overlap=1", "not recomputed"),
                       ("dp=16,ep=8,recompute=selective,recompute_modules=moe,moe_a2a_overlap=1", "not recomputed")):
        with pytest.raises(PlanError, match=what) as e:
            parse_inline(text).resolve(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)
        assert "moe_a2a_overlap" in e.value.message and "\n" not in e.value.message
    dense = load_model("small")
    with pytest.raises(PlanError, match="moe_a2a_overlap"):
        parse_inline("dp=16,moe_a2a_overlap=1").resolve(dense, ctx.cluster, 256, 16)


def _moe(ctx, text):
    est = estimate(parse_inline(text), ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch,
                   kernels=M.KERNELS)
    return est.breakdown["moe"], est.predicted["step_time_s"]


def test_the_overlap_hides_part_of_the_exchange_across_nodes_and_nothing_else_moves():
    """ep=16 over two nodes: the all-to-all crosses the 50 GB/s NICs and is long; overlapped, the
    exposed part falls and the step with it, by no more than the exchange; the experts, router and
    host terms are the same."""
    ctx = ctx_for("qwen3-30b-a3b")
    text = "dp=16,ep=16,mbs=1,zero=1,dtype=bf16"
    plain, t0 = _moe(ctx, text)
    over, t1 = _moe(ctx, text + ",moe_a2a_overlap=1")
    assert 0.0 < over["ep_exposed_s"] < plain["ep_exposed_s"]
    assert t0 - t1 == pytest.approx(plain["ep_exposed_s"] - over["ep_exposed_s"], rel=0.05)
    for k in ("experts_s", "router_s", "moe_host_s", "ep_comm_s"):
        assert over[k] == pytest.approx(plain[k])


# ---- the export ----------------------------------------------------------------------------------
def test_megatron_core_takes_the_exported_overlap():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core")
    ctx = ctx_for("qwen3-30b-a3b")
    plan = resolved(ctx, degrees=Degrees(dp=8, pp=2, ep=8), virtual_stages=2, schedule="interleaved_1f1b",
                    micro_batch_size=1, zero_stage=1, moe_a2a_overlap=True)
    args = M.parse_script(export(plan, ctx, "megatron").text)
    cfg = megatron_config(args, pp=2, vpp=2)
    assert cfg.overlap_moe_expert_parallel_comm and cfg.delay_wgrad_compute
    assert not cfg.moe_shared_expert_overlap  # Megatron Core refuses it beside the overlap


def test_megatron_refuses_the_overlap_on_one_chunk_per_rank_as_megatron_core_does():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core")
    ctx = ctx_for("qwen3-30b-a3b")
    plan = resolved(ctx, degrees=Degrees(dp=8, pp=2, ep=8), micro_batch_size=1, zero_stage=1,
                    moe_a2a_overlap=True)
    with pytest.raises(ExportRefused, match="moe_a2a_overlap"):
        export(plan, ctx, "megatron")
    args = M.arguments(plan, ctx)  # what it would have written: Megatron Core's own check refuses it
    with pytest.raises(AssertionError, match="virtual_pipeline_model_parallel_size"):
        megatron_config(args, pp=2)


@pytest.mark.parametrize("target", ["torchtitan", "deepspeed", "accelerate"])
def test_other_targets_refuse_the_overlap(target):
    ctx = ctx_for("qwen3-30b-a3b")
    plan = resolved(ctx, degrees=Degrees(dp=16, ep=8), micro_batch_size=1, zero_stage=1, moe_a2a_overlap=True)
    with pytest.raises(ExportRefused, match="moe_a2a_overlap"):
        export(plan, ctx, target)


def test_the_runtime_refuses_the_overlap_in_one_line():
    from autotune.runtime.trial import check_runtime_support

    ctx = ctx_for("tiny-moe", nodes=1, seq=256, batch=16)
    plan = resolved(ctx, degrees=Degrees(dp=8, ep=4), micro_batch_size=1, moe_a2a_overlap=True)
    with pytest.raises(PlanError, match="moe_a2a_overlap: the runtime waits") as e:
        check_runtime_support(plan, ctx.model)
    assert "\n" not in e.value.message
