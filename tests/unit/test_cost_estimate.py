"""``estimate`` against hand-computed cases: one device, pure DP, a pipeline (bubble, slow stage),
calibration, profiles, refusals. References come from the model's FLOP counts (autotune.specs,
Narayanan et al. 2021) and the alpha-beta formulas, not from the cost model's own output."""

import pytest
from _cost_helpers import GELU, HUGE, cluster, device, one_node

from autotune.cost import estimate
from autotune.errors import InputError
from autotune.plan import Plan, PlanError, parse_inline
from autotune.specs import CATALOGUE, load_model

S, PEAK, FRAC = 256, 1e12, 0.5


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_single_device_is_hardware_flops_over_achievable_throughput(recompute):
    cl = one_node(1)
    est = estimate(parse_inline(f"dp=1,recompute={recompute}"), GELU, cl, S, 4)
    flops = GELU.hardware_flops_per_token(S, recompute) * 4 * S
    assert est.predicted["step_time_s"] == pytest.approx(flops / (PEAK * FRAC), rel=1e-9)
    mfu = GELU.model_flops_per_token(S) * 4 * S / (est.predicted["step_time_s"] * PEAK)
    assert est.predicted["mfu"] == pytest.approx(mfu)
    assert est.predicted["tokens_per_s"] == pytest.approx(4 * S / est.predicted["step_time_s"])
    assert est.predicted["bubble_fraction"] == pytest.approx(0.0)
    assert est.predicted["feasible"] and est.record().predicted == est.predicted


def test_pure_dp_exposes_the_all_reduce_beyond_the_last_backward():
    bw, lat, n, batch = 5e8, 5e-6, 4, 8
    cl = one_node(n, bw=bw, lat=lat)
    est = estimate(parse_inline("dp=4"), GELU, cl, S, batch)
    m = batch // n  # micro-batches per replica
    t_mb = GELU.model_flops_per_token(S) * S / (PEAK * FRAC)  # one micro-batch, forward + backward
    grad_bytes = 4.0 * GELU.param_count()  # bf16 compute, gradients reduced in fp32 (plan.GRAD_REDUCE_DTYPE)
    ring = 2 * (n - 1) * lat + 2 * (n - 1) / n * grad_bytes / bw  # Thakur et al. 2005 ring all-reduce
    exposed = max(0.0, ring - 2.0 / 3.0 * t_mb)  # overlapped with the last backward (2/3 of the work)
    assert ring > t_mb  # the case is meant to expose communication
    assert est.predicted["step_time_s"] == pytest.approx(m * t_mb + exposed, rel=1e-9)
    assert est.breakdown["dp_comm_s"] == pytest.approx(ring)
    assert all(r["dp_comm_s"] == pytest.approx(ring) for r in est.breakdown["ranks"])


def test_pipeline_bubble_emerges_from_the_simulation():
    # tiny vocabulary: the LM head is < 1% of a stage, so the stages are (almost) equal
    model = GELU.__class__(**{**GELU.to_dict(), "vocab": 8, "layers": 8})
    for p, m in [(2, 4), (4, 8), (4, 16), (8, 32)]:
        est = estimate(parse_inline(f"pp={p}"), model, one_node(p), S, m)
        assert est.predicted["bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1), rel=0.02)


def test_slow_last_stage_sets_the_pace():
    fast, slow = device("fast", peak=3 * PEAK), device("slow", peak=PEAK)
    cl = cluster((1, 1, fast, HUGE, 0.0), (1, 1, slow, HUGE, 0.0))
    m = 8
    est = estimate(parse_inline("pp=2"), GELU, cl, S, m)
    layer = 3 * (GELU.layer_matmul_flops_fwd() + GELU.layer_attention_flops_fwd(S)) * S
    head = 3 * GELU.head_flops_fwd() * S
    t0 = 2 * layer / (3 * PEAK * FRAC)  # stage 0: 2 layers on the fast device
    t1 = (2 * layer + head) / (PEAK * FRAC)  # stage 1: 2 layers and the head on the slow one
    # 1F1B with the slow stage last: stage 0's forward, then the slow stage never idles
    # (tests/unit/test_cost_pipeline.py derives sum_{j<k}(F_j+B_j) + m(F_k+B_k))
    assert est.predicted["step_time_s"] == pytest.approx(t0 + m * t1, rel=1e-9)
    st = est.breakdown["stages"]
    assert st[1]["bubble_fraction"] < st[0]["bubble_fraction"]
    # moving layers to the fast stage makes the step shorter
    uneven = estimate(Plan.from_dict({"degrees": {"pp": 2}, "shares": {"layers": [3, 1]}}), GELU, cl, S, m)
    assert uneven.predicted["step_time_s"] < est.predicted["step_time_s"]


def test_uneven_samples_follow_device_speed():
    fast, slow = device("fast", peak=3 * PEAK), device("slow", peak=PEAK)
    cl = cluster((1, 1, fast, HUGE, 0.0), (1, 1, slow, HUGE, 0.0))
    even = estimate(parse_inline("dp=2"), GELU, cl, S, 8)
    uneven = estimate(Plan.from_dict({"degrees": {"dp": 2}, "shares": {"samples": [6, 2]}}), GELU, cl, S, 8)
    t_mb = GELU.model_flops_per_token(S) * S / (PEAK * FRAC)
    assert even.predicted["step_time_s"] == pytest.approx(4 * t_mb, rel=1e-9)  # the slow replica's 4
    assert uneven.predicted["step_time_s"] == pytest.approx(2 * t_mb, rel=1e-9)  # 6/3 = 2 on each


def test_tensor_parallel_all_reduces_per_layer():
    bw, lat, t = 1e10, 2e-6, 2
    cl = one_node(t, bw=bw, lat=lat)
    est = estimate(parse_inline("tp=2"), GELU, cl, S, 1)
    msg = 2.0 * S * GELU.hidden  # bf16 activations of the micro-batch
    ar = 2 * (t - 1) * lat + 2 * (t - 1) / t * msg / bw
    # 2 all-reduces forward and 2 backward per layer (Megatron f/g), one on the embedding output
    assert est.breakdown["tp_comm_s"] == pytest.approx(GELU.layers * 4 * ar + ar)
    comp = GELU.model_flops_per_token(S) * S / t / (PEAK * FRAC)
    assert est.predicted["step_time_s"] == pytest.approx(comp + GELU.layers * 4 * ar + ar, rel=1e-9)


def test_calibration_scales_compute_of_that_device_type():
    cl = one_node(1)
    base = estimate(parse_inline("dp=1"), GELU, cl, S, 2).predicted["step_time_s"]
    cal = estimate(parse_inline("dp=1"), GELU, cl, S, 2, calibration={"X": {"compute": 2.0, "comm": 1.0}})
    assert cal.predicted["step_time_s"] == pytest.approx(2 * base)
    other = estimate(parse_inline("dp=1"), GELU, cl, S, 2, calibration={"Y": {"compute": 2.0}})
    assert other.predicted["step_time_s"] == pytest.approx(base)


def test_measured_gemm_and_attention_profile_are_used():
    R, A = 4e11, 1e11  # measured GEMM rate (affine fit, no overhead) and attention throughput
    d, hd, batch_heads = GELU.head_dim, GELU.head_dim, 8
    pts = [[s, 2.0 * batch_heads * s * s * hd / A, 2.5 * 2.0 * batch_heads * s * s * hd / (2 * A)]
           for s in (64, 128, 512, 2048)]  # forward at A, backward (2.5x FLOPs convention) at 2A
    profile = {"gemm": {"bf16": {"points": [[1e9, R]], "peak_flops_per_s": R, "overhead_s": 0.0}},
               "attention": {"dtype": "bf16", "batch": 1, "heads": batch_heads,
                             "by_head_dim": {str(d): {"points": pts}}}}
    cl = one_node(1, dev=device(profile=profile, provenance="measured"))
    est = estimate(parse_inline("dp=1"), GELU, cl, S, 2)
    matmul = 3 * (GELU.layers * GELU.layer_matmul_flops_fwd() + GELU.head_flops_fwd()) * 2 * S
    attn_fwd = GELU.layers * GELU.layer_attention_flops_fwd(S) * 2 * S
    # the measured backward (2.5x the forward's FLOPs at 2A) is priced at its measured time; every
    # kernel autotune's runtime issues adds its host time (cost/kernels.RUNTIME: a profiled GPU pays
    # it as a datasheet GPU does; this profile measured none, so the catalogue's EAGER_HOST_S)
    from autotune.cost.kernels import RUNTIME

    per_mb = GELU.layers * (RUNTIME.block_fwd + RUNTIME.block_bwd) + RUNTIME.head_fwd + RUNTIME.head_bwd
    expected = matmul / R + attn_fwd / A + 2.5 * attn_fwd / (2 * A) + 2 * per_mb * RUNTIME.host_s
    assert est.predicted["step_time_s"] == pytest.approx(expected, rel=1e-9)
    assert any("measured" in s for s in est.breakdown["throughput_source"])


def test_gemm_overhead_makes_small_gemms_inefficient():
    # affine fit time = overhead + flops/rate: the overhead costs a larger share of a short step
    with_overhead = one_node(1, dev=device(profile={"gemm": {"bf16": {"peak_flops_per_s": PEAK, "overhead_s": 1e-5}}}))
    without = one_node(1, dev=device(profile={"gemm": {"bf16": {"peak_flops_per_s": PEAK, "overhead_s": 0.0}}}))

    def slowdown(seq):
        a = estimate(parse_inline("dp=1"), GELU, with_overhead, seq, 1).predicted["step_time_s"]
        b = estimate(parse_inline("dp=1"), GELU, without, seq, 1).predicted["step_time_s"]
        # 4 GEMMs per layer forward, x3 with backward, plus the head's 3
        assert a - b == pytest.approx(1e-5 * (GELU.layers * 4 * 3 + 3))
        return a / b

    assert slowdown(64) > slowdown(4096) > 1.0


def test_context_parallel_ring_is_hidden_behind_attention_when_fast():
    cl_fast, cl_slow = one_node(2, bw=1e15), one_node(2, bw=1e6)
    plan = parse_inline("cp=2")
    fast = estimate(plan, GELU, cl_fast, 1024, 1)
    slow = estimate(plan, GELU, cl_slow, 1024, 1)
    assert fast.breakdown["exposed_comm_s"] == pytest.approx(0.0, abs=1e-12)
    assert fast.breakdown["cp_comm_s"] > 0
    assert slow.breakdown["exposed_comm_s"] > 0
    assert slow.predicted["step_time_s"] > fast.predicted["step_time_s"]


def test_contiguous_causal_shards_are_unbalanced_and_zigzag_balances():
    cl = one_node(2)
    zig = estimate(parse_inline("cp=2,cp_layout=zigzag"), GELU, cl, 1024, 1)
    cont = estimate(parse_inline("cp=2,cp_layout=contiguous"), GELU, cl, 1024, 1)
    rz, rc = zig.breakdown["ranks"], cont.breakdown["ranks"]
    assert rz[0]["compute_s"] == pytest.approx(rz[1]["compute_s"])
    assert rc[1]["compute_s"] > rc[0]["compute_s"]
    assert cont.predicted["step_time_s"] > zig.predicted["step_time_s"]


def test_ulysses_uneven_heads_pace_the_exchange():
    cl = one_node(2, bw=1e10, lat=1e-6)
    even = estimate(parse_inline("hp=2"), GELU, cl, 1024, 1)
    uneven = estimate(Plan.from_dict({"degrees": {"hp": 2}, "shares": {"heads": [6, 2]}}), GELU, cl, 1024, 1)
    assert uneven.breakdown["hp_comm_s"] > even.breakdown["hp_comm_s"] > 0


def test_timeline_only_on_request_and_well_formed():
    cl = one_node(4)
    est = estimate(parse_inline("pp=2,dp=2"), GELU, cl, S, 8)
    assert est.breakdown["timeline"] is None
    tl = estimate(parse_inline("pp=2,dp=2"), GELU, cl, S, 8, timeline=True).breakdown["timeline"]
    kinds = {e["kind"] for e in tl}
    assert {"fwd", "bwd"} <= kinds <= {"fwd", "bwd", "comm", "bubble"}
    assert all(e["end"] >= e["start"] for e in tl)
    assert {e["stage"] for e in tl} == {0, 1}
    assert sum(1 for e in tl if e["kind"] == "fwd") == 2 * 4  # 2 stages x 4 micro-batches
    assert max(e["end"] for e in tl) <= est.predicted["step_time_s"] + 1e-12


def test_over_capacity_is_infeasible_and_names_the_term():
    m = load_model("llama3-70b")
    cl = cluster((1, 1, CATALOGUE["H100-SXM"], HUGE, 0.0))
    est = estimate(parse_inline("dp=1"), m, cl, 2048, 1)
    pr = est.predicted
    assert not pr["feasible"]
    assert pr["memory_bytes"][0] > pr["capacity_bytes"][0] == CATALOGUE["H100-SXM"].memory_bytes
    assert "rank 0" in pr["infeasible_reason"] and "optimizer" in pr["infeasible_reason"]


def test_bad_plans_raise_the_plan_error():
    with pytest.raises(PlanError, match="devices"):
        estimate(parse_inline("dp=3"), GELU, one_node(4), S, 8)
    with pytest.raises(PlanError, match="no layers"):
        estimate(parse_inline("pp=5"), GELU, one_node(5), S, 8)
    with pytest.raises(PlanError, match="shares.layers"):
        estimate(Plan.from_dict({"degrees": {"pp": 2}, "shares": {"layers": [1, 2]}}), GELU, one_node(2), S, 8)


def test_device_without_the_dtype_is_a_clear_error():
    cl = cluster((1, 1, CATALOGUE["V100"], HUGE, 0.0), (1, 1, CATALOGUE["H100-SXM"], HUGE, 0.0))
    with pytest.raises(InputError, match="V100 has no bf16"):
        estimate(parse_inline("dp=2"), GELU, cl, S, 2)


def test_rows_cover_every_rank_with_its_device():
    cl = cluster((1, 4, device("a"), HUGE, 0.0), (1, 4, device("b", peak=2 * PEAK), HUGE, 0.0))
    est = estimate(parse_inline("pp=2,tp=2,dp=2"), GELU, cl, S, 4)
    rows = est.breakdown["ranks"]
    assert [r["rank"] for r in rows] == list(range(8))
    assert [r["device"] for r in rows] == ["a"] * 4 + ["b"] * 4
    assert len(est.predicted["memory_bytes"]) == len(est.predicted["capacity_bytes"]) == 8
