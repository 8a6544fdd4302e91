"""Uneven expert shares priced per EP rank (autotune/cost/expert_ranks.py), against references: the
all-to-all volumes of an explicit per-pair send matrix, even shares on one device type priced as the
busiest-rank formula, a device twice as fast holding twice the experts taking as long, and the
search's expert shares following the EP ranks' device speeds."""

import dataclasses

import numpy as np
import pytest

from autotune.cost import estimate
from autotune.cost import expert_ranks as ER
from autotune.cost import grouped_gemm as GG
from autotune.cost import moe_imbalance as MI
from autotune.cost.compute import rates_for
from autotune.plan import parse_inline
from autotune.specs.catalogue import device_from_catalogue
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model
from search_spaces.base import SearchContext
from search_spaces.default import DefaultSpace

LINK = {"bandwidth": "200GB/s", "latency": "3us"}


def _mixed(fast: str = "A100-80GB", slow: str = "V100", per_node: int = 2):
    return cluster_from_dict({"name": "mixed", "inter_node": {"bandwidth": "200Gbit/s", "latency": "5us"}, "nodes": [
        {"count": 1, "devices_per_node": per_node, "device": fast, "intra_node": LINK},
        {"count": 1, "devices_per_node": per_node, "device": slow, "intra_node": LINK}]})


def _pair_reference(moe, routed, shares, loads, nodes):
    """(inside, across) from the explicit per-pair matrix: rank i sends rank j its tokens' picks
    landing on j's experts; j receives them at its load; per link class the rank moving the most."""
    ep = len(shares)
    pair = np.array([[0.0 if i == j else routed[i] * moe.top_k * shares[j] / moe.experts for j in range(ep)]
                     for i in range(ep)])
    imb = np.array([ld.imbalance for ld in loads])
    out = []
    for same in (True, False):
        mask = np.array([[i != j and (nodes[i] == nodes[j]) == same for j in range(ep)] for i in range(ep)])
        send, recv = (pair * mask).sum(axis=1), (pair * mask).sum(axis=0) * imb
        out.append(max(send.max(), recv.max()))
    return tuple(out)


@pytest.mark.parametrize("shares", [(2, 2, 2, 2), (5, 1, 1, 1), (3, 3, 1, 1), (1, 2, 2, 3)])
@pytest.mark.parametrize("nodes", [(0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 0, 1), (0, 1, 2, 3)])
@pytest.mark.parametrize("tokens", [64.0, 4096.0])
def test_exchange_volume_against_the_pair_matrix(shares, nodes, tokens):
    moe = load_model("tiny-moe").moe
    ep = len(shares)
    loads = ER.loads(moe, ep, 1, tokens, shares)
    routed = (tokens,) * ep
    assert ER.exchange_split(moe, routed, loads, nodes) == pytest.approx(
        _pair_reference(moe, routed, shares, loads, nodes), rel=1e-12)


def test_expert_only_ranks_on_another_node_take_only_their_experts_copies_over_the_network():
    """HeterMoE's layout on two nodes: attention ranks on the first holding most experts, expert-only
    ranks (routing nothing) on the second. What crosses the network is the copies for the second
    node's experts; an even split of the busiest rank's volume over its peers (the price before
    per-pair volumes) put 8 of its 15 peers' share there, over three times as much."""
    moe = load_model("qwen3-30b-a3b").moe
    shares, nodes = (14,) * 8 + (2,) * 8, (0,) * 8 + (1,) * 8
    routed = (4096.0,) * 8 + (0.0,) * 8
    loads = ER.loads(moe, 16, 1, 4096.0 / 2, shares)
    inside, across = ER.exchange_split(moe, routed, loads, nodes)
    send_out = 4096.0 * moe.top_k * sum(shares[8:]) / moe.experts  # an attention rank, to the second node
    recv_v = max(8 * 4096.0 * moe.top_k * 2 / moe.experts * ld.imbalance for ld in loads[8:])
    assert across == pytest.approx(max(send_out, recv_v), rel=1e-12)
    busiest = max(4096.0 * moe.top_k * (128 - 14) / 128,
                  max(7 * 4096.0 * moe.top_k * 14 / 128 * ld.imbalance for ld in loads[:8]))
    assert across < busiest * 8 / 15 / 3


def test_even_shares_on_one_device_type_are_the_busiest_rank_formula():
    """The layer as it was priced before shares could be uneven: every rank at the busiest share."""
    m = load_model("qwen3-30b-a3b")
    c = cluster_from_dict({"name": "h", "inter_node": {"bandwidth": "400Gbit/s", "latency": "10us"}, "nodes": [
        {"count": 2, "devices_per_node": 8, "device": "H100-SXM", "intra_node": LINK}]})
    e = estimate(parse_inline("dp=16,ep=16,zero=1").resolve(m, c, 4096, 64), m, c, 4096, 64)
    x = e.breakdown["moe"]
    n = 4096.0  # one sample per micro-batch, tp 1: every rank routes its sequence
    imb = MI.imbalance(m.moe, 16, 16 * n, 8)
    received = 16 * n * m.moe.top_k * 8 / m.moe.experts * imb
    r = rates_for(c.devices[0].spec, "bf16", m.head_dim)
    g = GG.mlp_gemm_time(r, m, received, m.moe.expert_ffn_hidden, 8) + GG.activation_time(
        r, m, received, m.moe.expert_ffn_hidden, 2)
    micro = 64 // 16
    assert x["experts_s"] == pytest.approx(3.0 * g * micro * x["moe_layers_on_rank"], rel=1e-9)
    assert x["imbalance"] == pytest.approx(imb)


def test_twice_as_fast_holding_twice_the_experts_takes_as_long():
    moe_model = load_model("qwen3-30b-a3b")
    spec = device_from_catalogue("A100-80GB")
    half = dataclasses.replace(spec, name="A100-half", peak_flops={k: v / 2 for k, v in spec.peak_flops.items()},
                               memory_bandwidth=spec.memory_bandwidth / 2)
    fast, slow = rates_for(spec, "fp16", moe_model.head_dim), rates_for(half, "fp16", moe_model.head_dim)
    loads = ER.loads(moe_model.moe, 3, 1, 8192.0, (64, 32, 32))
    t_fast = ER.expert_seconds(fast, moe_model, loads[0], 768, 2)
    t_slow = ER.expert_seconds(slow, moe_model, loads[1], 768, 2)
    assert t_fast == pytest.approx(t_slow, rel=0.05)
    even = ER.loads(moe_model.moe, 3, 1, 8192.0, (43, 43, 42))
    assert ER.expert_seconds(slow, moe_model, even[0], 768, 2) > 1.2 * t_slow  # even: the slow rank lags


def test_uneven_shares_follow_each_rank_on_a_mixed_cluster():
    """dp=4, ep=4 over 2 A100 and 2 V100: the pace is the slowest EP rank's experts; a rank's expert
    weights and dispatch buffers follow its own share."""
    m, c = load_model("tiny-moe"), _mixed()
    price = {}
    for sh in ("2/2/2/2", "3/3/1/1", "1/1/3/3"):
        e = estimate(parse_inline(f"dp=4,ep=4,dtype=fp16,experts={sh}").resolve(m, c, 128, 16), m, c, 128, 16)
        price[sh] = e.breakdown["moe"]["experts_s"]
        if sh == "3/3/1/1":  # ranks 0, 1 (A100) hold 3 experts, ranks 2, 3 (V100) one
            w = {r["rank"]: r["memory"]["expert_weights"] for r in e.breakdown["ranks"]}
            assert w[0] == pytest.approx(3 * w[3]) and w[1] == pytest.approx(w[0])
    assert price["3/3/1/1"] < price["2/2/2/2"] < price["1/1/3/3"]


def test_search_shares_experts_by_speed_only_where_devices_differ():
    m = load_model("tiny-moe")
    for cluster, uneven in ((_mixed(), True), (_mixed("A100-80GB", "A100-80GB"), False)):
        sp = DefaultSpace(SearchContext(model=m, cluster=cluster, seq_len=128, global_batch=16, dtype="fp16"))
        plan = sp.build(sp.params(ep=4, balance=1.0))
        got = plan.shares.experts
        if uneven:
            assert got[0] == got[1] > got[2] == got[3] and sum(got) == m.moe.experts
        else:
            assert got == (2, 2, 2, 2)
        even = sp.build(sp.params(ep=4))
        assert even.shares.experts == (2, 2, 2, 2)


@pytest.mark.parametrize("shares", [(3, 3, 1, 1), (1, 1, 3, 3), (2, 2, 2, 2)])
def test_mixed_ep_group_prices_each_rank_at_its_share_and_device(shares):
    """One EP group over 2 A100 and 2 V100 (dp=4, ep=4): the routed experts' seconds are the slowest
    rank's, each rank's computed from the grouped-GEMM cost at its own experts, its expected routed
    tokens (~ its experts) and its own device's fp16 rates."""
    m, c = load_model("tiny-moe"), _mixed()
    plan = parse_inline(f"dp=4,ep=4,dtype=fp16,experts={'/'.join(map(str, shares))}")
    x = estimate(plan.resolve(m, c, 128, 16), m, c, 128, 16).breakdown["moe"]
    routed, width = 4 * 128.0, m.moe.expert_ffn_hidden  # four ranks, one 128-token sample each
    per_rank = []
    for share, dev in zip(shares, c.devices, strict=True):
        received = routed * m.moe.top_k * share / m.moe.experts * MI.imbalance(m.moe, 4, routed, share)
        r = rates_for(dev.spec, "fp16", m.head_dim)
        per_rank.append(GG.mlp_gemm_time(r, m, received, width, share) + GG.activation_time(r, m, received, width, 2))
    micro = 16 // 4
    assert x["experts_s"] == pytest.approx(3.0 * max(per_rank) * micro * x["moe_layers_on_rank"], rel=1e-9)
