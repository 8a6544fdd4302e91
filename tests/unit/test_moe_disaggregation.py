"""HeterMoE's disaggregation (``Plan.disaggregate``, autotune/cost/disaggregation.py) against
references: the two-micro-batch schedule against timelines built by hand and its lower bound, the
priced step against its slots, each EP rank's experts against the grouped-GEMM cost at the tokens
the attention ranks route, the dispatch against a per-pair send matrix; the plan's rules, the
runtime's and exporters' refusals, and the search's points."""

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.cost import estimate
from autotune.cost import expert_ranks as ER
from autotune.cost import grouped_gemm as GG
from autotune.cost import moe_imbalance as MI
from autotune.cost.compute import rates_for
from autotune.cost.disaggregation import LayerParts, chain, overlapped_period, zebra_seconds
from autotune.export.common import unexpressed
from autotune.plan import Plan, PlanError, parse_inline
from autotune.plan_parts import Placement
from autotune.runtime.trial import check_runtime_support
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model
from search_spaces.base import SearchContext
from search_spaces.default import DefaultSpace

LINK = {"bandwidth": "200GB/s", "latency": "3us"}
SEQ, BATCH = 128, 16
PLAN = "dp=4,ep=4,dtype=fp16,disaggregate=1,samples=8/8/0/0,experts=3/3/1/1"


def _mixed(fast: str = "A100-80GB", slow: str = "V100"):
    return cluster_from_dict({"name": "mixed", "inter_node": {"bandwidth": "200Gbit/s", "latency": "5us"}, "nodes": [
        {"count": 1, "devices_per_node": 2, "device": fast, "intra_node": LINK},
        {"count": 1, "devices_per_node": 2, "device": slow, "intra_node": LINK}]})


def _parts(a, ea, eb, x):
    return LayerParts(attention=a, attention_load=a + ea, expert_only=eb, experts=max(ea, eb), exchange=x)


def test_one_microbatch_walks_the_chain():
    p = _parts(3.0, 1.0, 1.8, 2.0)
    assert zebra_seconds(p, 7, 1) == pytest.approx(7 * chain(p)) == pytest.approx(7 * (3.0 + 2.0 + 1.8))


def test_two_microbatches_against_hand_built_timelines():
    L = 5
    # the network saturated: after the first attention it moves one half-exchange after another,
    # four per layer (two micro-batches, dispatch and combine)
    a, x = 3.0, 8.0
    assert zebra_seconds(_parts(a, 1.0, 1.8, x), L, 2) == pytest.approx(a + 2 * L * x)
    # the expert-only ranks saturated: the first attention and dispatch, then their experts back to
    # back (two per layer), then the last combine
    a, eb, x = 0.5, 2.0, 0.3
    assert zebra_seconds(_parts(a, 0.1, eb, x), L, 2) == pytest.approx(a + x / 2 + 2 * L * eb + x / 2)


@settings(max_examples=60, deadline=None)
@given(st.floats(0.1, 5), st.floats(0.0, 3), st.floats(0.0, 5), st.floats(0.0, 8), st.integers(1, 6))
def test_two_microbatches_between_the_bound_and_no_overlap(a, ea, eb, x, layers):
    p = _parts(a, ea, eb, x)
    t = zebra_seconds(p, layers, 2)
    assert 2 * layers * overlapped_period(p) - 1e-9 <= t <= 2 * layers * chain(p) + 1e-9


@pytest.mark.parametrize("nodes", [(0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 0, 1)])
def test_exchange_against_the_pair_matrix(nodes):
    """Attention ranks send their tokens' picks for other ranks' experts; expert-only ranks route
    nothing; the pairs inside a node and across priced apart."""
    moe = load_model("tiny-moe").moe
    shares, attention, tokens = (3, 3, 1, 1), (True, True, False, False), 128.0
    loads = ER.loads(moe, 4, 1, tokens * 2 / 4, shares)
    pair = np.array([[0.0 if i == j or not attention[i] else tokens * moe.top_k * shares[j] / moe.experts
                      for j in range(4)] for i in range(4)])
    imb = np.array([ld.imbalance for ld in loads])
    ref = []
    for same in (True, False):
        mask = np.array([[i != j and (nodes[i] == nodes[j]) == same for j in range(4)] for i in range(4)])
        ref.append(max((pair * mask).sum(axis=1).max(), ((pair * mask).sum(axis=0) * imb).max()))
    routed = tuple(tokens if a else 0.0 for a in attention)
    assert ER.exchange_split(moe, routed, loads, nodes) == pytest.approx(tuple(ref), rel=1e-12)


def test_expert_seconds_follow_the_shares_at_the_routed_tokens():
    m, c = load_model("tiny-moe"), _mixed()
    e = estimate(parse_inline(PLAN), m, c, SEQ, BATCH)
    d = e.breakdown["disaggregation"]
    n_routed = 2 * SEQ  # two attention ranks, one sample of SEQ tokens each per micro-batch
    width = m.moe.expert_ffn_hidden
    for q, (share, dev) in enumerate(zip((3, 3, 1, 1), c.devices, strict=True)):
        received = n_routed * m.moe.top_k * share / m.moe.experts * MI.imbalance(m.moe, 4, n_routed, share)
        r = rates_for(dev.spec, "fp16", m.head_dim)
        ref = GG.mlp_gemm_time(r, m, received, width, share) + GG.activation_time(r, m, received, width, 2)
        assert d["expert_s"][q] == pytest.approx(ref, rel=1e-9)


def test_step_is_the_attention_ranks_slots():
    """Step = micro-batches x the other work + the MoE layers' interleaved pairs + the exposed
    gradient sync and the optimizer of the replica that ends last, as the uniform model ends a pp=1 step."""
    m, c = load_model("tiny-moe"), _mixed()
    e = estimate(parse_inline(PLAN), m, c, SEQ, BATCH)
    d, b = e.breakdown["disaggregation"], e.breakdown
    keys = ("attention", "attention_load", "expert_only", "experts", "exchange")
    f, w = (LayerParts(**{k: d[pas][k] for k in keys}) for pas in ("forward", "backward"))
    mb, n = d["microbatches"], d["moe_layers"]
    assert mb == 8 and n == m.moe_layer_count
    pairs = mb // 2 * (zebra_seconds(f, n, 2) + zebra_seconds(w, n, 2))
    tail = max(r["dp_exposed_s"] + r["optimizer_s"] for r in b["ranks"])  # the replica that ends last
    ref = mb * d["other_s"] + pairs + tail
    assert e.predicted["step_time_s"] == pytest.approx(ref, rel=1e-9)
    assert e.predicted["step_time_s"] < d["step_unoverlapped_s"] + tail


def test_ep_groups_folded_onto_the_replicas_price_as_one_group_alone():
    """dp=4, ep=2 over two A100 + two V100 nodes of one device each, placed so that each EP group is
    an A100 and a V100 (HeterMoE's pairing): its per-layer parts are those of the same group priced
    alone (dp=2, ep=2 on one A100 and one V100, half the batch)."""
    m = load_model("tiny-moe")
    one = {"devices_per_node": 1, "intra_node": LINK}
    four = cluster_from_dict({"name": "four", "inter_node": {"bandwidth": "200Gbit/s", "latency": "5us"}, "nodes": [
        {"count": 2, "device": "A100-80GB", **one}, {"count": 2, "device": "V100", **one}]})
    two = cluster_from_dict({"name": "two", "inter_node": {"bandwidth": "200Gbit/s", "latency": "5us"}, "nodes": [
        {"count": 1, "device": "A100-80GB", **one}, {"count": 1, "device": "V100", **one}]})
    placement = tuple(Placement(rank=r, node=(0, 2, 1, 3)[r], device=0) for r in range(4))
    big = dataclasses.replace(parse_inline("dp=4,ep=2,dtype=fp16,disaggregate=1,samples=8/0/8/0,experts=5/3"),
                              placement=placement).resolve(m, four, SEQ, BATCH)
    alone = parse_inline("dp=2,ep=2,dtype=fp16,disaggregate=1,samples=8/0,experts=5/3").resolve(m, two, SEQ, BATCH // 2)
    d_big = estimate(big, m, four, SEQ, BATCH).breakdown["disaggregation"]
    d_alone = estimate(alone, m, two, SEQ, BATCH // 2).breakdown["disaggregation"]
    for pas in ("forward", "backward"):
        assert d_big[pas] == pytest.approx(d_alone[pas], rel=1e-9)
    assert d_big["expert_s"] == pytest.approx(d_alone["expert_s"], rel=1e-9)


def test_plan_rules_json_and_inline():
    m, c = load_model("tiny-moe"), _mixed()
    p = parse_inline(PLAN).resolve(m, c, SEQ, BATCH)
    d = p.to_dict()
    assert d["disaggregate"] is True and Plan.from_dict(json.loads(json.dumps(d))) == p
    assert "disaggregate" not in parse_inline("dp=4,ep=4").to_dict()
    for bad, field in (("dp=2,pp=2,ep=2,disaggregate=1,samples=16/0,experts=4/4", "degrees.pp"),
                       ("dp=4,ep=2,disaggregate=1,samples=8/8/0/0", "shares.samples: every EP group"),
                       ("dp=4,ep=4,disaggregate=1,samples=4/4/4/4", "shares.samples")):
        with pytest.raises(PlanError, match=field):
            parse_inline(bad).resolve(m, c, SEQ, BATCH)
    # EP groups of 2 replicas folded onto the 4, each an attention and an expert-only replica
    assert parse_inline("dp=4,ep=2,disaggregate=1,samples=8/0/8/0").resolve(m, c, SEQ, BATCH).degrees.edp == 2
    with pytest.raises(PlanError, match="samples"):  # a replica with no samples needs disaggregate
        parse_inline("dp=4,ep=4,samples=8/8/0/0").resolve(m, c, SEQ, BATCH)
    with pytest.raises(PlanError, match="disaggregate: model"):
        parse_inline("dp=4,disaggregate=1,samples=8/8/0/0").resolve(load_model("tiny"), c, SEQ, BATCH)


def test_runtime_and_exporters_refuse_it_in_one_line():
    m, c = load_model("tiny-moe"), _mixed()
    p = parse_inline(PLAN.replace("fp16", "bf16")).resolve(m, c, SEQ, BATCH)
    with pytest.raises(PlanError) as e:
        check_runtime_support(p, m)
    assert "disaggregate: expert-only ranks" in e.value.message and "\n" not in e.value.message
    for target in ("megatron", "torchtitan", "deepspeed"):
        assert any(r.startswith("disaggregate:") for r in unexpressed(p, target, ("dp", "ep")))
    assert not unexpressed(p.replace(disaggregate=False), "megatron", ("dp", "ep"))


def test_search_has_disaggregated_points_on_mixed_clusters_only():
    m = load_model("tiny-moe")
    sp = DefaultSpace(SearchContext(model=m, cluster=_mixed(), seq_len=SEQ, global_batch=BATCH, dtype="fp16"))
    plan = sp.build({**sp.params(balance=1.0), "disaggregate": True})
    assert plan.disaggregate and plan.shares.samples[2:] == (0, 0) and min(plan.shares.samples[:2]) > 0
    assert plan.shares.experts[0] > plan.shares.experts[2] and sum(plan.shares.experts) == m.moe.experts
    assert any(p.get("disaggregate") for p in sp.grid_points())
    same = DefaultSpace(SearchContext(model=m, cluster=_mixed("A100-80GB", "A100-80GB"), seq_len=SEQ,
                                      global_batch=BATCH, dtype="fp16"))
    assert "disaggregate" not in same.distributions()
    dense = DefaultSpace(SearchContext(model=load_model("tiny"), cluster=_mixed(), seq_len=SEQ, global_batch=BATCH))
    assert "disaggregate" not in dense.distributions()
