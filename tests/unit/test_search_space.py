"""The default search space against exhaustive enumeration and hand-computed balanced splits."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autotune.plan import Plan
from autotune.search import load_space, space_names
from autotune.specs import load_cluster, load_model
from autotune.specs.cluster import cluster_from_dict
from search_spaces import _balance as B
from search_spaces.base import Infeasible, SearchContext

MIXED = {"name": "mixed", "nodes": [{"count": 1, "devices_per_node": 8, "device": "H100-SXM"},
                                    {"count": 1, "devices_per_node": 8, "device": "A100-80GB"}],
         "inter_node": {"bandwidth": "25GB/s"}}


def space_for(model="tiny", cluster="local:8", seq=256, batch=16):
    c = cluster_from_dict(cluster) if isinstance(cluster, dict) else load_cluster(cluster)
    ctx = SearchContext(model=load_model(model), cluster=c, seq_len=seq, global_batch=batch)
    return load_space("default").space(ctx)


def test_space_registry_names_default_and_refuses_unknown():
    assert "default" in space_names()
    with pytest.raises(Exception, match="unknown search space"):
        load_space("defualt")


@pytest.mark.parametrize("n", [4, 8, 12, 16])
def test_degree_tuples_equal_exhaustive_factorisations(n):
    sp = space_for(cluster=f"local:{n}")
    ref = set()
    for dp, pp, cp, hp, tp in itertools.product(range(1, n + 1), repeat=5):
        if dp * pp * cp * hp * tp == n and n % tp == 0:  # one node of n workers: tp divides it
            ref.add((tp, pp, cp, hp))
    assert set(sp._degree_tuples()) == ref


def test_every_grid_point_is_a_resolved_plan_or_a_named_limit():
    sp = space_for(cluster="local:4", batch=8)
    model, cluster = sp.ctx.model, sp.ctx.cluster
    built = 0
    for p in sp.grid():
        out = sp.build(p)
        if isinstance(out, Infeasible):
            assert out.kind in ("divisibility", "batch") and out.reason
            continue
        built += 1
        assert out.world == 4
        assert out.resolve(model, cluster, 256, 8) == out  # already resolved and valid
        if out.degrees.pp == 1:
            assert out.schedule == "1f1b" and out.virtual_stages == 1
        if out.degrees.tp == 1:
            assert not out.sequence_parallel
    assert built > 100


def test_distributions_are_fixed_per_name():
    a, b = space_for().distributions(), space_for().distributions()
    assert a == b


def test_baselines_are_even_and_cover_the_families():
    sp = space_for(cluster="local:8")
    fams = {name for name, _ in sp.baselines()}
    assert fams == {"megatron", "megatron+cp", "cp", "ulysses", "cp+ulysses"}
    for name, p in sp.baselines():
        plan = sp.build(p)
        if isinstance(plan, Plan):
            assert plan.is_even(), name
        if name == "cp":
            assert plan.degrees.cp == 8


def test_balanced_tokens_follow_device_speed_hand_computed():
    # tp=8 inside each node, cp=2 across the H100 node and the A100 node, seq 8192:
    # zigzag granule 2 -> 4096 units, share ~ 0.6*989 : 0.6*312 TFLOP/s
    sp = space_for(model="llama3-8b", cluster=MIXED, seq=8192, batch=8)
    p = sp.params(tp=8, cp=2, placement="cp", balance=1.0)
    plan = sp.build(p)
    assert isinstance(plan, Plan), plan
    h_units = round(4096 * 989 / (989 + 312))
    assert plan.shares.tokens == (2 * h_units, 8192 - 2 * h_units)
    types = [plan.placement[r] for r in (plan.rank_of(cp=0), plan.rank_of(cp=1))]
    assert [sp.ctx.cluster.devices[t.node * 8 + t.device].spec.name for t in types] == ["H100-SXM", "A100-80GB"]
    even = sp.build(sp.params(tp=8, cp=2, placement="cp", balance=0.0))
    assert even.shares.tokens == (4096, 4096)


def test_balanced_layers_count_the_head_on_the_last_stage():
    sp = space_for(model="llama3-8b", cluster=MIXED, seq=8192, batch=8)
    plan = sp.build(sp.params(tp=8, pp=2, balance=1.0, placement="pp"))
    m = sp.ctx.model
    head = m.head_flops_fwd() / (m.layer_matmul_flops_fwd() + m.layer_attention_flops_fwd(8192))
    ideal_first = (32 + head) * 989 / (989 + 312)
    assert abs(plan.shares.layers[0] - ideal_first) <= 1
    assert sum(plan.shares.layers) == 32


@given(st.integers(1, 500), st.lists(st.floats(0.01, 10), min_size=1, max_size=9), st.integers(1, 3))
def test_proportional_split_sums_and_respects_the_minimum(total, w, minimum):
    import numpy as np

    out = B.proportional_split(total, np.array(w), minimum)
    if total < len(w) * minimum:
        assert out is None
    else:
        assert sum(out) == total and min(out) >= minimum
        ideal = np.array(w) / sum(w) * total
        # never further than the minimum forces, plus one unit of rounding
        assert all(o <= max(i, minimum) + 1 + len(w) * minimum for o, i in zip(out, ideal, strict=False))


def test_proportional_split_equal_weights_is_the_even_split():
    from autotune.plan import even_split

    for total in range(3, 40):
        for n in range(1, 4):
            assert B.proportional_split(total, [1.0] * n) == even_split(total, n)


def test_neighbours_stay_inside_the_distributions():
    sp = space_for()
    dists = sp.distributions()
    p = sp.params(tp=2, pp=2)
    for q in sp.neighbours(p):
        for k, v in q.items():
            assert dists[k]._contains(dists[k].to_internal_repr(v)), (k, v)


def test_plan_dict_equals_to_dict_and_is_shared_not_copied():
    import copy

    from autotune.plan_record import PlanRecord
    from autotune.search import plan_dict

    sp = space_for(model="llama3-8b", cluster=MIXED, seq=8192, batch=8)
    plan = sp.build(sp.params(tp=2, pp=2, cp=2, placement="pp", balance=1.0))
    assert isinstance(plan, Plan)
    d = plan_dict(plan)
    assert d == PlanRecord(plan).to_dict() and Plan.from_dict(dict(d)) == plan
    assert copy.deepcopy(d) is d
    assert d.plan is plan  # read back in this process without parsing (study.iter_trial_plans)
    # stored as json.dumps writes it, though its placement is encoded once per layout (EncodedList)
    import json

    from autotune.search.bulk import EncodedList, encode_attrs

    assert type(d["placement"]) is EncodedList and plan_dict(plan)["placement"] is d["placement"]
    assert encode_attrs({"plan": d})["plan"] == json.dumps(dict(d), separators=(",", ":"))


def test_distinct_placements_lose_no_plan():
    sp = space_for(model="llama3-8b", cluster=MIXED, seq=8192, batch=8)
    from autotune.plan import Degrees

    for tp, pp, cp, hp in sp._degree_tuples():
        deg = Degrees(dp=16 // (tp * pp * cp * hp), pp=pp, cp=cp, hp=hp, tp=tp)
        kept = sp.distinct_placements(deg)
        plans = {sp.build(sp.params(tp=tp, pp=pp, cp=cp, hp=hp, placement=pl)) for pl in
                 ("node", "pp", "dp", "cp", "hp")}
        assert plans == {sp.build(sp.params(tp=tp, pp=pp, cp=cp, hp=hp, placement=pl)) for pl in kept}


def test_a_schedule_move_reaches_every_virtual_stage_count_the_schedule_offers():
    """A climb from 1F1B reaches interleaved 1F1B at each count in one move (the vpp count alone does
    nothing under 1F1B, so without this 4 chunks sat two moves away where 2 chunks are worse)."""
    from autotune.schedules import get_schedule

    sp = space_for(model="llama3-8b", seq=1024, batch=64)  # enough layers for 4 chunks a rank
    p = sp.params(pp=2)
    sampled = {2 ** e for e in range(sp.distributions()["vpp_exp"].low, sp.distributions()["vpp_exp"].high + 1)}
    for name in sp.distributions()["schedule"].choices:
        if name == p["schedule"]:
            continue
        offered = set(get_schedule(name).virtual_stage_choices(2))
        got = {b.virtual_stages for q in sp.neighbours(p) if q["schedule"] == name
               and all(q[k] == p[k] for k in p if k not in ("schedule", "vpp_exp"))
               and not isinstance(b := sp.build(q), Infeasible)}
        want = offered & sampled if len(offered) > 1 else offered
        assert got == want, (name, got, want)


def test_memory_repairs_turn_one_knob_towards_less_memory():
    from autotune.cost import estimate

    sp = space_for(model="llama3-8b", seq=1024, batch=64)
    c = sp.ctx
    p = sp.params(pp=2, mbs=2, recompute="none", zero=0)
    assert not isinstance(sp.build(p), Infeasible)
    peak = max(estimate(sp.build(p), c.model, c.cluster, c.seq_len, c.global_batch).predicted["memory_bytes"])
    repairs = sp.memory_repairs(p)
    assert len(repairs) == 3 + 2 + 1  # ZeRO 1, 2, 3; selective, full; half the micro-batch
    for q in repairs:
        assert sum(q[k] != p[k] for k in p) == 1
        got = max(estimate(sp.build(q), c.model, c.cluster, c.seq_len, c.global_batch).predicted["memory_bytes"])
        assert got <= peak, (q, got, peak)
