"""Pieces of the cost model against their definitions: causal key counts per CP shard, the
alpha-beta collectives (Thakur et al. 2005), the node-level slowest link against the foundation's
pairwise ``ClusterSpec.slowest_link``, and profile interpolation."""

import itertools

import pytest
from _cost_helpers import device

from autotune.cost import comm as C
from autotune.cost.compute import causal_keys, rates_for
from autotune.specs import ClusterSpec, Link, NodeGroup
from autotune.specs.cluster import cluster_from_dict


def _brute_keys(positions):
    return sum(q + 1 for q in positions)


@pytest.mark.parametrize("tokens", [(8,), (4, 4), (2, 6), (6, 2), (4, 8, 4), (2, 2, 2, 10)])
def test_contiguous_shards_count_their_causal_keys(tokens):
    S = sum(tokens)
    start = 0
    for i, n in enumerate(tokens):
        assert causal_keys(tokens, i, False, S) == _brute_keys(range(start, start + n))
        start += n
    assert sum(causal_keys(tokens, i, False, S) for i in range(len(tokens))) == S * (S + 1) / 2


@pytest.mark.parametrize("tokens", [(4, 4), (2, 6), (4, 4, 4, 4), (2, 4, 6)])
def test_zigzag_shards_hold_a_front_chunk_and_its_mirror(tokens):
    S = sum(tokens)
    a = 0
    for i, n in enumerate(tokens):
        half = n // 2
        pos = list(range(a, a + half)) + list(range(S - a - half, S - a))
        assert causal_keys(tokens, i, True, S) == _brute_keys(pos)
        a += half
    even = [causal_keys((4, 4, 4, 4), i, True, 16) for i in range(4)]
    assert len(set(even)) == 1


def test_collectives_follow_the_ring_formulas():
    lk = Link(bandwidth=1e9, latency=1e-5)
    n, x = 4, 8e6
    assert C.all_reduce(lk, n, x) == pytest.approx(2 * 3 * 1e-5 + 2 * 3 / 4 * x / 1e9)
    assert C.all_gather(lk, n, x) == C.reduce_scatter(lk, n, x) == pytest.approx(3 * 1e-5 + 3 / 4 * x / 1e9)
    assert C.all_to_all(lk, n, x) == pytest.approx(3 * 1e-5 + x / 1e9)
    assert C.p2p(lk, x) == pytest.approx(1e-5 + x / 1e9)
    assert C.all_reduce(lk, 1, x) == 0.0


def test_group_link_equals_pairwise_slowest_link():
    cl = cluster_from_dict({
        "nodes": [{"count": 2, "devices_per_node": 2, "device": "H100-SXM"},
                  {"count": 1, "devices_per_node": 2, "device": "A100-80GB", "intra_node": {"bandwidth": "100GB/s"}}],
        "inter_node": {"bandwidth": "25GB/s", "latency": "10us"},
        "overrides": [{"nodes": [0, 2], "bandwidth": "5GB/s", "latency": "20us"}]})
    topo = C.topology(cl)
    for k in (2, 3):
        for devs in itertools.combinations(range(cl.num_devices), k):
            assert topo.group_link(list(devs)) == cl.slowest_link(list(devs)), devs
    for x, y in itertools.product(range(cl.num_devices), repeat=2):
        if x != y:
            assert topo.link(x, y) == cl.link(x, y)


def test_topology_is_cached_per_cluster_object():
    g = NodeGroup(count=1, devices_per_node=2, device=device(), intra_node=Link(bandwidth=1e9))
    a = ClusterSpec(name="a", groups=(g,), inter_node=Link(bandwidth=1e9))
    assert C.topology(a) is C.topology(a)


def test_gemm_points_interpolate_log_linearly_and_clamp():
    prof = {"gemm": {"bf16": {"points": [[1e6, 1e11], [1e8, 3e11]]}}}
    r = rates_for(device(profile=prof), "bf16", 64)
    assert r.gemm_time(1e6) == pytest.approx(1e6 / 1e11)
    assert r.gemm_time(1e7) == pytest.approx(1e7 / 2e11)  # halfway in log(flops)
    assert r.gemm_time(1e10) == pytest.approx(1e10 / 3e11)  # clamped at the largest measured
    assert rates_for(device(), "bf16", 64).gemm_time(1e9) == pytest.approx(1e9 / (1e12 * 0.5))


@pytest.mark.parametrize("factor", [None, 2.5, 3.0])
def test_profiled_attention_backward_is_priced_at_its_measured_time(factor):
    """At a profiled sequence length the priced (forward, backward) of the profiled shape are the
    measured seconds, whatever backward FLOP convention the profile declares (2.5 when absent, the
    profiler's own: profilers/compute.py attention_flops)."""
    from profilers.compute import attention_flops

    att = {"batch": 1, "heads": 4, "by_head_dim": {"64": {"points": [[256, 1.0e-3, 2.5e-3], [1024, 9e-3, 2.6e-2]]}}}
    if factor is not None:
        att["bwd_flops_factor"] = factor
    r = rates_for(device(profile={"attention": att}), "bf16", 64)
    for seq, f_s, b_s in att["by_head_dim"]["64"]["points"]:
        fwd_flops, _ = attention_flops(1, 4, seq, 64)
        f, b = r.attention_time(fwd_flops, seq)
        assert f == pytest.approx(f_s, rel=1e-12) and b == pytest.approx(b_s, rel=1e-12)
