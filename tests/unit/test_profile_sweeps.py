"""Sweep shapes, FLOP counts, nccl-tests factors and the fits of compute and link samples."""

import itertools

import pytest

from profilers.compute import (
    attention_flops,
    attention_points,
    compute_plan,
    compute_steps,
    cpu_attention_points,
    fit_compute,
    gemm_shapes,
)
from profilers.dtypes import trial_dtype
from profilers.links import COLLECTIVES, bus_factor, fit_links, group_sizes, link_plan, link_steps, pairs


def test_gemm_shapes_are_a_layers_matmuls_within_the_cap():
    plan = compute_plan("cpu", quick=False)
    shapes = gemm_shapes(plan)
    want = set()
    for m, h in itertools.product(plan.gemm_tokens, plan.gemm_hidden):
        for k, n in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)):
            if 2 * m * n * k <= plan.max_gemm_flops:
                want.add((m, k, n))
    assert set(shapes) == want and len(shapes) == len(want)
    assert compute_steps("cpu", True) < compute_steps("cpu", False)
    from profilers.block_ref import ref_points
    from profilers.overheads import call_gemm_shapes, op_points

    # the reference block and head (profilers/block_ref.py): one item per piece and size per dtype
    calls = len(plan.gemm_dtypes) * (len(call_gemm_shapes("cpu")) + len(ref_points("cpu"))) + len(op_points("cpu"))
    attn = len(attention_points(plan)) + len(attention_points(plan, trial=True))
    attn += len(cpu_attention_points(plan, trial_dtype("cpu")))  # the SDPA tiles' price (cost/cpu_attention.py)
    n_points = len(plan.gemm_dtypes) * len(shapes) + calls + attn + 1
    assert compute_steps("cpu", False) == plan.rounds * n_points


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("quick", [True, False])
def test_compute_and_link_rounds_interleave_one_to_one(device, quick):
    """The worker alternates one compute round with one link round; plans with different round
    counts would leave the tail of one sweep without the other's interleaving."""
    assert compute_plan(device, quick).rounds == link_plan(device, quick).rounds
    from profilers.compute import MIN_ROUNDS

    assert compute_plan(device, quick).rounds >= MIN_ROUNDS


def test_attention_flops_by_hand():
    # b=1, h=2, s=4, d=8: full QK^T + PV = 2 matmuls x 2 FLOP x b*h*s*s*d = 1024; causal halves it.
    fwd, bwd = attention_flops(1, 2, 4, 8)
    assert fwd == 512 and bwd == 1280
    plan = compute_plan("cpu", quick=False)
    assert all(sum(attention_flops(1, plan.attn_heads, s, d)) <= plan.max_attn_flops
               for d, s in attention_points(plan))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_bus_factors_follow_nccl_tests(n):
    assert bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(op, n) == pytest.approx((n - 1) / n)
    with pytest.raises(ValueError):
        bus_factor("broadcast", n)


def test_groups_and_pairs_by_enumeration():
    assert group_sizes(1) == [] and group_sizes(2) == [2] and group_sizes(6) == [2, 4, 6]
    assert group_sizes(8) == [2, 4, 8]
    for w in range(1, 7):
        assert pairs(w) == [(i, j) for i, j in itertools.combinations(range(w), 2)]
    assert link_steps(1, "cpu", True) == 0
    rounds = link_plan("cpu", True).rounds
    assert link_steps(3, "cpu", True) == rounds * (3 + 2 * len(COLLECTIVES))


def _timing(med, unstable=False):
    return {"median_s": med, "spread": 0.0, "unstable": unstable, "samples": [med]}


def test_fit_compute_on_synthetic_samples():
    peak, over = 1e11, 1e-4
    samples = []
    for f in (1e8, 1e9, 4e9):
        t = over + f / peak
        samples.append({"kind": "gemm", "params": {"dtype": "fp32"}, "work": f, "timing": _timing(t),
                        "metrics": {"flops_per_s": f / t}})
    for s in (256, 512):
        p = {"dtype": "fp32", "batch": 1, "heads": 4, "seq": s, "head_dim": 64}
        ff, fb = attention_flops(1, 4, s, 64)
        samples.append({"kind": "attention_fwd", "params": p, "work": ff, "timing": _timing(ff / 2e10), "metrics": {}})
        samples.append({"kind": "attention_fwd_bwd", "params": p, "work": ff + fb,
                        "timing": _timing(ff / 2e10 + fb / 1e10), "metrics": {"bwd_s": fb / 1e10}})
    samples.append({"kind": "memory_copy", "params": {}, "work": 1, "timing": _timing(1.0),
                    "metrics": {"capacity_bytes": 8e9, "available_bytes": 4e9, "bandwidth_bytes_per_s": 1e10}})
    fit = fit_compute(samples)
    g = fit["gemm"]["fp32"]
    assert g["peak_flops_per_s"] == pytest.approx(peak, rel=1e-6)
    assert g["overhead_s"] == pytest.approx(over, rel=1e-6)
    assert [p[0] for p in g["points"]] == [1e8, 1e9, 4e9]
    a = fit["attention"]["by_head_dim"]["64"]
    assert a["fwd"]["flops_per_s"] == pytest.approx(2e10) and a["bwd"]["flops_per_s"] == pytest.approx(1e10)
    assert fit["memory"] == {"capacity_bytes": 8e9, "available_bytes": 4e9, "bandwidth_bytes_per_s": 1e10}


def test_fit_links_matrix_classes_and_collective_rows():
    """Three ranks on two hosts: pair (0,1) intra, (0,2) and (1,2) inter; known alpha/beta per class."""
    hosts = ["a", "a", "b"]
    cls = {"intra": (1e-5, 1e10), "inter": (1e-4, 1e9)}
    samples = []
    for i, j in pairs(3):
        alpha, beta = cls["intra" if hosts[i] == hosts[j] else "inter"]
        for size in (8, 1 << 16, 1 << 20):
            ow = alpha + size / beta
            samples.append({"rank": i, "kind": "p2p", "params": {"src": i, "dst": j, "bytes": size}, "work": size,
                            "timing": _timing(2 * ow), "metrics": {"one_way_s": ow, "bandwidth_bytes_per_s": size / ow}})
    for rank, t in ((0, 1e-3), (1, 3e-3)):  # the slowest member counts
        samples.append({"rank": rank, "kind": "collective", "params": {"op": "all_reduce", "group_size": 2,
                        "bytes": 1 << 20}, "work": 1 << 20, "timing": _timing(t, unstable=rank == 1), "metrics": {}})
    f = fit_links(samples, hosts)
    bw, lat = f["p2p_bandwidth"], f["p2p_latency"]
    for i, j in itertools.product(range(3), repeat=2):
        assert bw[i][j] == bw[j][i] and lat[i][j] == lat[j][i]
        assert (bw[i][j] is None) == (i == j)
    assert lat[0][1] == pytest.approx(1e-5 + 8 / 1e10)
    assert bw[1][2] == pytest.approx((1 << 20) / (1e-4 + (1 << 20) / 1e9))
    for c, (alpha, beta) in cls.items():
        assert f["alpha_beta"][c]["alpha_s"] == pytest.approx(alpha, rel=1e-6)
        assert f["alpha_beta"][c]["beta_bytes_per_s"] == pytest.approx(beta, rel=1e-6)
    assert f["alpha_beta"]["inter"]["pairs"] == [[0, 2], [1, 2]]
    (row,) = f["collective_table"]
    assert row["time_s"] == 3e-3 and row["unstable"]
    assert row["algbw_bytes_per_s"] == pytest.approx((1 << 20) / 3e-3)
    assert row["busbw_bytes_per_s"] == pytest.approx(row["algbw_bytes_per_s"] * bus_factor("all_reduce", 2))
    assert fit_links([], ["a"]) == {}


def test_fit_overheads_recovers_known_per_call_costs():
    """Synthetic samples with a known per-call GEMM cost (per dtype) and a known fixed elementwise
    cost: the fit gets them back (the call points' FLOPs priced at the large-GEMM rate)."""
    from profilers.overheads import CALL_GEMM_KN, CALL_GEMM_M, CALL_POINTS, OP_ELEMS

    rate = {"bf16": 1e12, "fp32": 2e11}
    call = {"bf16": 2e-5, "fp32": 3e-6}
    op_fixed, per_elem = 2e-6, 2e-10
    samples = []
    for dt in rate:
        for f in (1e9, 4e9):  # the large sweep: no call cost at these sizes, the rate alone
            samples.append({"kind": "gemm", "params": {"dtype": dt}, "work": f, "timing": _timing(f / rate[dt]),
                            "metrics": {"flops_per_s": rate[dt]}})
        for k, n in CALL_GEMM_KN:
            f = 2.0 * CALL_GEMM_M * k * n
            samples.append({"kind": "gemm_call", "params": {"dtype": dt, "m": CALL_GEMM_M, "k": k, "n": n},
                            "work": f, "timing": _timing(call[dt] + f / rate[dt]), "metrics": {}})
    # one spoilt point among the smallest must not move the median
    smallest = min((s for s in samples if s["kind"] == "gemm_call" and s["params"]["dtype"] == "bf16"),
                   key=lambda s: s["work"])
    smallest["timing"] = _timing(smallest["timing"]["median_s"] * 5)
    assert CALL_POINTS >= 3
    for e in OP_ELEMS:
        samples.append({"kind": "op", "params": {"dtype": "bf16", "elems": e, "op": "mul", "autograd": True},
                        "work": float(e), "timing": _timing(op_fixed + e * per_elem), "metrics": {}})
    fit = fit_compute(samples)
    over = fit["overheads"]
    assert over["gemm_call_s"] == {dt: pytest.approx(call[dt], rel=1e-6) for dt in call}
    assert over["op_s"] == pytest.approx(op_fixed, rel=1e-6)
    assert over["op"]["per_element_s"] == pytest.approx(per_elem, rel=1e-6)
    assert all(s["kind"] != "gemm_call" for s in samples if s["work"] in [p[0] for p in fit["gemm"]["bf16"]["points"]])
    # a call faster than its FLOPs at the large rate (noise) clamps at zero, never negative
    fast = [dict(s, timing=_timing(0.5 * s["work"] / rate["bf16"])) if s["kind"] == "gemm_call" else s
            for s in samples]
    assert fit_compute(fast)["overheads"]["gemm_call_s"]["bf16"] == 0.0
    # nothing measured (CUDA): no keys, so the cost model keeps its defaults
    assert fit_compute([s for s in samples if s["kind"] == "gemm"])["overheads"] == {}


def test_trial_attention_is_fitted_apart_from_the_priced_rows():
    rows = []
    for kind, dt in (("attention", "fp32"), ("attention_trial", "bf16")):
        for s in (64, 256):
            p = {"dtype": dt, "batch": 1, "heads": 4, "seq": s, "head_dim": 32 if kind == "attention_trial" else 64}
            ff, fb = attention_flops(1, 4, s, p["head_dim"])
            rows.append({"kind": f"{kind}_fwd", "params": p, "work": ff, "timing": _timing(ff / 1e10), "metrics": {}})
            rows.append({"kind": f"{kind}_fwd_bwd", "params": p, "work": ff + fb,
                         "timing": _timing(ff / 1e10 + fb / 5e9), "metrics": {"bwd_s": fb / 5e9}})
    fit = fit_compute(rows)
    assert fit["attention"]["dtype"] == "fp32" and set(fit["attention"]["by_head_dim"]) == {"64"}
    assert fit["attention_trial"]["dtype"] == "bf16" and set(fit["attention_trial"]["by_head_dim"]) == {"32"}
    plan = compute_plan("cpu", quick=True)
    assert attention_points(plan, trial=True) and compute_plan("cuda", quick=True).trial_attn_seq == ()
