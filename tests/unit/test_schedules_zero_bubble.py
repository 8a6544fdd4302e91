"""The zero-bubble ZB-V schedule module (autotune/schedules/zero_bubble.py) against its references:
torch's own ScheduleZBVZeroBubble order (the class the runtime runs), the zero-bubble paper's
bubble and memory (Qi et al. 2023), the backward split of its table 1 (W = the forward's GEMMs),
and the frameworks that read its export back."""

from __future__ import annotations

import pytest

from autotune.cost.estimate import estimate
from autotune.cost.pipeline import simulate
from autotune.dashboard.timeline import Timeline, time_by_kind
from autotune.export import ExportRefused, export
from autotune.export.common import ExportContext
from autotune.plan import Degrees, Plan
from autotune.schedules import F, I, W, get_schedule
from autotune.specs.cluster import cluster_from_dict, load_cluster
from autotune.specs.model import PRESETS, load_model

ZBV = get_schedule("zbv")


def h100(nodes=2):
    return cluster_from_dict({"name": "h100", "nodes": [{"count": nodes, "devices_per_node": 8,
                                                          "device": "H100-SXM"}]})


@pytest.mark.parametrize("name,torch_name,p,v,m", [
    ("zbv", "ZBVZeroBubble", 2, 2, 1), ("zbv", "ZBVZeroBubble", 2, 2, 4), ("zbv", "ZBVZeroBubble", 3, 2, 7),
    ("zbv", "ZBVZeroBubble", 4, 2, 8), ("zbv", "ZBVZeroBubble", 4, 2, 3), ("zbv", "ZBVZeroBubble", 8, 2, 16),
    ("interleaved_zb", "InterleavedZeroBubble", 2, 2, 4), ("interleaved_zb", "InterleavedZeroBubble", 4, 2, 8),
    ("interleaved_zb", "InterleavedZeroBubble", 4, 4, 8), ("interleaved_zb", "InterleavedZeroBubble", 4, 2, 12)])
def test_order_is_torchs_own(name, torch_name, p, v, m):
    """One source: the order the simulation times is the pipeline_order of torch's class, built as
    torch's schedule visualiser builds it (mock stages), i.e. what the runtime executes."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    sched = get_schedule(name)
    assert sched.targets["torchtitan"] == torch_name
    ops = get_schedule_ops(torch_name, p, m, v)
    for r in range(p):
        want = [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in ops[r] if a is not None]
        got = [("FBIW"[o.kind], o.stage, o.microbatch) for o in sched.op_order(p, v, m, r)]
        assert got == want


def test_v_placement_puts_both_ends_on_rank_0():
    for p in (2, 4, 8):
        assert ZBV.stages_of_rank(0, p, 2) == (0, 2 * p - 1)
        assert ZBV.stages_of_rank(p - 1, p, 2) == (p - 1, p)  # the turn stays on one rank
    assert ZBV.check_shape(1, 2) and ZBV.check_shape(4, 4) and not ZBV.check_shape(4, 2)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_bubble_with_equal_f_i_w_is_one_chunk_op_per_stage_step(p):
    """Qi et al. 2023 (section 6): with T_F = T_B(input) = T_W the V schedule leaves almost no bubble
    once m >= 2p - 1. torch's ZB-V leaves (p - 1) chunk operations per rank; 1F1B over the same
    layers leaves (p - 1) x (F + B) of a whole stage, interleaved 1F1B half of that."""
    m = 2 * p
    n = 2 * p
    f = 1.0
    sim = simulate("zbv", p, 2, m, (f,) * n, (2 * f,) * n, (0.0,) * (n - 1), (f,) * n)
    work = m * 2 * 3 * f  # two chunks, F + I + W each
    assert sim.makespan == pytest.approx(work + (p - 1) * f)
    ob = simulate("1f1b", p, 1, m, (2 * f,) * p, (4 * f,) * p, (0.0,) * (p - 1))
    assert ob.makespan == pytest.approx(work + (p - 1) * 6 * f)
    il = simulate("interleaved_1f1b", p, 2, m, (f,) * n, (2 * f,) * n, (0.0,) * (n - 1))
    zb1p = simulate("interleaved_zb", p, 2, m, (f,) * n, (2 * f,) * n, (0.0,) * (n - 1), (f,) * n)
    assert sim.makespan <= zb1p.makespan < il.makespan < ob.makespan


@pytest.mark.parametrize("p", [2, 4, 8])
def test_memory_is_the_price_of_the_small_bubble(p):
    """Every rank holds 2p chunk-micro-batches (p stages' worth) once m >= 2p: the same as 1F1B's
    first rank, on every rank (1F1B's rank s holds p - s); activations stay until W."""
    m = 2 * p
    for r in range(p):
        held, logits = ZBV.in_flight(p, 2, m, r, (1, 1))
        assert held == 2 * p
        assert (logits > 0) == (r == 0)  # the loss sits on rank 0
        assert get_schedule("1f1b").in_flight(p, 1, m, r, (2,))[0] == 2 * (p - r)


def test_weight_gradient_is_the_forwards_gemms():
    """The split of table 1 (Qi et al. 2023): W = the forward's GEMM FLOPs, so W is at most F and its
    share of F falls as attention (which has no weights) grows with the sequence."""
    from autotune.cost.context import step_context, tp_groups
    from autotune.cost.rank import rank_cost

    model, cl = load_model("llama2-7b"), h100()
    ratios = {}
    for seq in (1024, 65536):
        # no tp: a forward is then compute only (the collectives belong to the input-gradient part)
        s = step_context(Plan(degrees=Degrees(pp=4, dp=4), schedule="zbv", virtual_stages=2), model, cl, seq, 8, None)
        mid = next(ctx for _, _, ctx in tp_groups(s) if ctx.pp_index == 1)  # blocks only, no embedding or head
        c = rank_cost(mid)
        assert all(0 < w < b for w, b in zip(c.wgt, c.bwd, strict=True))
        ratios[seq] = [w / f for w, f in zip(c.wgt, c.fwd, strict=True)]
    assert all(0.0 < r <= 1.0 for r in ratios[1024])
    # falls with the sequence; by less than the FLOPs alone say, since the forward also carries the
    # runtime's host time per kernel (cost/kernels.RUNTIME), a larger share of a short forward
    assert all(r < 0.95 * q for r, q in zip(ratios[65536], ratios[1024], strict=True))


def test_estimate_prices_the_trade():
    """Against 1F1B on the same layout: a smaller bubble and a shorter step, more activation memory
    on the later pipeline ranks; the Gantt events are the simulation's, wgrad among them, and add
    up per stage to the pipeline's makespan."""
    model, cl = load_model("llama2-7b"), h100()
    kw = dict(degrees=Degrees(pp=4, tp=2, dp=2), recompute="selective", zero_stage=1)
    ob = estimate(Plan(**kw), model, cl, 8192, 32)
    zb = estimate(Plan(**kw, schedule="zbv", virtual_stages=2), model, cl, 8192, 32, timeline=True)
    assert zb.predicted["bubble_fraction"] < ob.predicted["bubble_fraction"]
    assert zb.predicted["step_time_s"] < ob.predicted["step_time_s"]
    last = 12  # a rank of the last pipeline stage
    assert zb.breakdown["ranks"][last]["memory"]["activations"] > ob.breakdown["ranks"][last]["memory"]["activations"]
    events = zb.breakdown["timeline"]
    assert {e["kind"] for e in events} >= {"fwd", "bwd", "wgrad", "bubble"}
    pipe = [e for e in events if e.get("comm") != "dp"]
    per = time_by_kind(Timeline(pipe, "study"))
    span = zb.breakdown["pipeline_s"]
    for d in per.values():
        assert d["fwd"] + d["bwd"] + d["wgrad"] + d["bubble"] + d["comm"] + d["idle"] == pytest.approx(span)


def test_search_space_builds_and_enumerates_it():
    from search_spaces.base import SearchContext
    from search_spaces.default import space

    sp = space(SearchContext(model=load_model("llama2-7b"), cluster=h100(), seq_len=8192, global_batch=32))
    plan = sp.build(sp.params(pp=4, tp=2, schedule="zbv"))
    assert plan.schedule == "zbv" and plan.virtual_stages == 2
    assert any(p["schedule"] == "zbv" for p in sp.grid_points())


def ctx_for(world=8, seq=256, batch=16):
    return ExportContext(model=PRESETS["small"], cluster=load_cluster(f"local:{world}"), seq_len=seq,
                         global_batch=batch)


def test_torchtitan_runs_it_and_torch_reads_the_name_back():
    import tomllib
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, get_schedule_class

    ctx = ctx_for()
    # ZeRO-2: the plan refuses ZeRO-3 with a split backward (its weight half runs outside FSDP2's hooks)
    plan = Plan(degrees=Degrees(pp=2, dp=4), schedule="zbv", virtual_stages=2, zero_stage=2, dtype="bf16",
                ).resolve(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)
    cfg = tomllib.loads(export(plan, ctx, "torchtitan").text)
    par = cfg["parallelism"]
    assert get_schedule_class(par["pipeline_parallel_schedule"]) is ScheduleZBVZeroBubble
    parts = par["module_fqns_per_model_part"]  # model order; torchtitan places them as a V itself
    assert len(parts) == 4 and parts[0][0] == "tok_embeddings" and parts[-1][-1] == "output"


@pytest.mark.parametrize("fmt,why", [("megatron", "--zero-bubble-v-schedule"), ("deepspeed", "TrainSchedule")])
def test_other_targets_refuse_with_the_reason_and_offer_1f1b(fmt, why):
    ctx = ctx_for()
    plan = Plan(degrees=Degrees(pp=2, dp=4), schedule="zbv", virtual_stages=2, zero_stage=1, dtype="bf16",
                ).resolve(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)
    with pytest.raises(ExportRefused) as info:
        export(plan, ctx, fmt)
    assert any(why in r for r in info.value.reasons)
    near = info.value.nearest.plan
    assert near is not None and near.schedule == "1f1b" and near.virtual_stages == 1


def test_kinds_are_torchs_letters():
    assert (F, I, W) == (0, 2, 3)
