"""Sweep shapes, FLOP counts, nccl-tests factors and the fits of compute and link samples."""

import itertools

import pytest

from profilers.compute import (
    attention_flops,
    attention_points,
    compute_plan,
    compute_steps,
    fit_compute,
    gemm_shapes,
)
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
    from profilers.overheads import call_gemm_shapes, op_points

    calls = len(plan.gemm_dtypes) * len(call_gemm_shapes("cpu")) + len(op_points("cpu"))
    n_points = len(plan.gemm_dtypes) * len(shapes) + calls + len(attention_points(plan)) + 1
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
