"""Monotonicity properties of the cost model over random plans (hypothesis): more bandwidth is
never slower, more micro-batches never give a larger bubble fraction, recomputation never holds
more activation memory."""

import pytest
from _cost_helpers import device
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from autotune.cost import estimate
from autotune.plan import Plan, PlanError
from autotune.specs import ClusterSpec, Link, NodeGroup, load_model

TINY = load_model("tiny")  # 4 layers, 8 heads, 4 kv heads: tp, hp, cp of 2 and 4 divide it
DEV_A = device("A", peak=2e11, mem_bw=1e11)
DEV_B = device("B", peak=1e11, mem_bw=5e10)


def _cluster(scale: float) -> ClusterSpec:
    """8 devices: two nodes of 4, two device types; every link scaled by ``scale``."""
    return ClusterSpec(name=f"x{scale}", groups=(
        NodeGroup(count=1, devices_per_node=4, device=DEV_A, intra_node=Link(bandwidth=5e9 * scale, latency=3e-6)),
        NodeGroup(count=1, devices_per_node=4, device=DEV_B, intra_node=Link(bandwidth=2e9 * scale, latency=3e-6))),
        inter_node=Link(bandwidth=5e8 * scale, latency=1e-5, kind="inter"))


def _factorisations(n=8):
    out = []
    for dp in (1, 2, 4, 8):
        for pp in (1, 2, 4):
            for cp in (1, 2):
                for hp in (1, 2):
                    for tp in (1, 2, 4):
                        if dp * pp * cp * hp * tp == n:
                            out.append({"dp": dp, "pp": pp, "cp": cp, "hp": hp, "tp": tp})
    return out


plans = st.builds(
    lambda deg, sched, rec, zero, sp, layout, mbs: {"degrees": deg, "schedule": sched, "recompute": rec,
                                                    "zero_stage": zero, "sequence_parallel": sp,
                                                    "cp_layout": layout, "micro_batch_size": mbs},
    st.sampled_from(_factorisations()), st.sampled_from(["1f1b", "gpipe"]),
    st.sampled_from(["none", "selective", "full"]), st.sampled_from([0, 1, 2, 3]), st.booleans(),
    st.sampled_from(["zigzag", "contiguous"]), st.sampled_from([1, 2]))

SEQ = 512
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])


def _est(d, cluster, batch, **kw):
    try:
        return estimate(Plan.from_dict(d), TINY, cluster, SEQ, batch, **kw)
    except PlanError:
        assume(False)


@SETTINGS
@given(d=plans, scale=st.floats(1.0, 100.0))
def test_more_bandwidth_is_never_slower(d, scale):
    slow = _est(d, _cluster(1.0), 16)
    fast = _est(d, _cluster(scale), 16)
    assert fast.predicted["step_time_s"] <= slow.predicted["step_time_s"] * (1 + 1e-12)


@SETTINGS
@given(d=plans, extra=st.integers(1, 4))
def test_more_micro_batches_never_a_larger_bubble_fraction(d, extra):
    dp, mbs = d["degrees"]["dp"], d["micro_batch_size"]
    base = dp * mbs * max(d["degrees"]["pp"], 1)
    few = _est(d, _cluster(1.0), base)
    many = _est(d, _cluster(1.0), base * (1 + extra))
    assert many.predicted["bubble_fraction"] <= few.predicted["bubble_fraction"] + 1e-9


@SETTINGS
@given(d=plans)
def test_recomputation_never_holds_more_activation_memory(d):
    acts = {}
    for rec in ("none", "selective", "full"):
        est = _est({**d, "recompute": rec}, _cluster(1.0), 16)
        acts[rec] = [r["memory"]["activations"] for r in est.breakdown["ranks"]]
    for a, b, c in zip(acts["none"], acts["selective"], acts["full"], strict=True):
        assert a >= b >= c


@pytest.mark.parametrize("rec", ["selective", "full"])
def test_recomputation_costs_time(rec):
    d = {"degrees": {"dp": 2, "tp": 4}}
    base = _est(d, _cluster(1.0), 8).predicted["step_time_s"]
    assert _est({**d, "recompute": rec}, _cluster(1.0), 8).predicted["step_time_s"] > base


@SETTINGS
@given(d=plans, scale=st.floats(0.01, 10.0))
def test_stage_terms_add_up_inside_the_step(d, scale):
    est = _est(d, _cluster(scale), 16)
    step = est.predicted["step_time_s"]
    for s in est.breakdown["stages"]:
        assert s["compute_s"] + s["exposed_comm_s"] <= s["pipeline_s"] * (1 + 1e-9)
        assert s["pipeline_s"] + s["dp_exposed_s"] + s["optimizer_s"] <= s["end_s"] * (1 + 1e-9)
        assert s["end_s"] <= step * (1 + 1e-12)
    for r in est.breakdown["ranks"]:
        busy = r["compute_s"] + r["exposed_comm_s"] + r["dp_exposed_s"] + r["optimizer_s"]
        assert busy <= step * (1 + 1e-9) and r["bubble_s"] == pytest.approx(max(0.0, step - busy), abs=1e-12)
