"""HelixPipe in the cost model: the estimate follows the schedule's own simulation, prices memory as
every micro-batch held on every rank, and explores the fold count and the recomputation."""

from __future__ import annotations

import pytest

from autotune.cost import estimate
from autotune.plan import Plan, PlanError
from autotune.schedules import helixpipe as H
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model

MODEL = load_model("llama2-7b")
CLUSTER = cluster_from_dict({"name": "h100-16", "nodes": [{"count": 2, "devices_per_node": 8, "device": "H100-SXM"}],
                             "inter_node": {"bandwidth": "50GB/s", "latency": "10us"}})
SEQ, BATCH = 65536, 8


def est(**kw):
    d = {"degrees": {"pp": 4, "tp": 4}, "sequence_parallel": True, "dtype": "bf16", **kw}
    return estimate(Plan.from_dict(d), MODEL, CLUSTER, SEQ, BATCH, timeline=True)


def test_the_step_is_the_schedules_simulation_and_the_timeline_its_order():
    e = est(schedule="helixpipe", helix_folds=2, recompute="full")
    tl = e.breakdown["timeline"]
    ops = [x for x in tl if x["kind"] in ("fwd", "bwd")]
    assert len(ops) == 2 * BATCH * (2 * MODEL.layers + 1)
    assert e.breakdown["pipeline_s"] == pytest.approx(max(x["end"] for x in ops))
    for s in range(4):  # each stage's operations in rank_order's order
        mine = [x for x in ops if x["stage"] == s]
        order = H.rank_order(4, MODEL.layers, BATCH, 2, s)
        assert [(x["chunk"], x["microbatch"]) for x in mine] == [(o.k, o.microbatch) for o in order]


def test_memory_holds_every_microbatch_the_same_on_every_rank_but_the_ends():
    e = est(schedule="helixpipe", helix_folds=2, recompute="full")
    rows = e.breakdown["ranks"]
    acts = [r["memory"]["activations"] for r in rows]
    assert len({round(a) for a in acts[4:]}) == 1  # ranks of stages 1..3
    inflight = {r["memory"]["layers_microbatches_in_flight"] for r in rows}
    assert inflight == {BATCH * MODEL.layers // 4}
    none = est(schedule="helixpipe", helix_folds=2, recompute="none")
    assert none.breakdown["ranks"][4]["memory"]["activations"] > acts[4]


def test_helix_beats_1f1b_at_long_sequences_and_two_folds_hide_the_hops():
    f1b = est(schedule="1f1b", recompute="full").predicted["step_time_s"]
    h1 = est(schedule="helixpipe", helix_folds=1, recompute="full").predicted["step_time_s"]
    h2 = est(schedule="helixpipe", helix_folds=2, recompute="full").predicted["step_time_s"]
    assert h2 < f1b
    assert h2 <= h1


def test_plans_it_cannot_run_are_refused_with_the_rule():
    with pytest.raises(PlanError, match="divisible by pp"):
        estimate(Plan.from_dict({"degrees": {"pp": 4, "tp": 4}, "schedule": "helixpipe", "helix_folds": 2}),
                 MODEL, CLUSTER, SEQ, 4)
    with pytest.raises(PlanError, match="selective"):
        est(schedule="helixpipe", recompute="selective")


MIXED = cluster_from_dict({"name": "h100-a100", "nodes": [
    {"count": 2, "devices_per_node": 8, "device": "H100-SXM"}, {"count": 2, "devices_per_node": 8,
                                                               "device": "A100-80GB"}],
    "inter_node": {"bandwidth": "50GB/s", "latency": "10us"}})


def test_on_a_mixed_cluster_the_slow_devices_gate_the_published_rotation_and_shares_by_speed_help():
    """Stages 0-1 on H100, 2-3 on A100: every micro-batch's attention visits the A100s; giving the
    H100 ranks more of the attention (3:1, their speed ratio) shortens the step."""
    def step(**kw):
        d = {"degrees": {"pp": 4, "tp": 8}, "sequence_parallel": True, "recompute": "full", "dtype": "bf16",
             "schedule": "helixpipe", "helix_folds": 2, **kw}
        return estimate(Plan.from_dict(d), MODEL, MIXED, 131072, 16)

    even = step()
    busy = [s["pipeline_s"] - s["bubble_s"] for s in even.breakdown["stages"]]
    assert min(busy[2:]) > 2 * max(busy[:2])  # the A100 stages carry the same work at a third of the speed
    weighted = step(helix_attention=[12, 12, 4, 4])
    assert weighted.predicted["step_time_s"] < even.predicted["step_time_s"]
    rows = weighted.breakdown["ranks"]
    assert rows[0]["memory"]["layers_microbatches_in_flight"] == 16 * 12
    assert rows[-1]["memory"]["layers_microbatches_in_flight"] == 16 * 4
