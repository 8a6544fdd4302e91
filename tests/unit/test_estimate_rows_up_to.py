"""``estimate(rows_up_to=n)`` skips building the per-rank rows a search would drop: its breakdown is
what ``search.pricing.trim_breakdown`` makes of the full estimate's (the reference), and every other
figure is the full estimate's."""

from __future__ import annotations

import json

from autotune.cost import estimate
from autotune.plan import Degrees, Plan
from autotune.search.pricing import RANKS_LIMIT, Evaluator, trim_breakdown
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model


def _cluster(nodes: int):
    return cluster_from_dict({"name": "mixed", "inter_node": {"bandwidth": "25GB/s"}, "nodes": [
        {"count": nodes, "devices_per_node": 8, "device": "H100-SXM"},
        {"count": nodes, "devices_per_node": 8, "device": "A100-80GB"}]})


def _plans():
    return [Plan(degrees=Degrees(pp=4, dp=8, tp=4), micro_batch_size=1, schedule="1f1b"),
            Plan(degrees=Degrees(pp=2, dp=2, cp=4, hp=2, tp=4), micro_batch_size=1, schedule="interleaved_1f1b",
                 virtual_stages=2, cp_layout="zigzag"),
            Plan(degrees=Degrees(pp=2, dp=2, tp=4), micro_batch_size=1)]


def test_rows_up_to_is_the_trimmed_breakdown():
    model = load_model("llama3-8b")
    for nodes, limit in ((8, RANKS_LIMIT), (8, 200), (1, 8)):
        cluster = _cluster(nodes)
        for plan in _plans():
            if plan.degrees.world != cluster.num_devices:
                continue
            for timeline in (False, True):
                full = estimate(plan, model, cluster, 32768, 64, timeline=timeline)
                got = estimate(plan, model, cluster, 32768, 64, timeline=timeline, rows_up_to=limit)
                want = full.breakdown if plan.degrees.world <= limit else {
                    **full.breakdown, "ranks": None, "ranks_dropped": len(full.breakdown["ranks"])}
                assert got.predicted == full.predicted
                assert json.dumps(got.breakdown, default=str) == json.dumps(want, default=str)
                if limit == RANKS_LIMIT:  # the search's own trim, the same
                    assert json.dumps(got.breakdown, default=str) == json.dumps(trim_breakdown(full.breakdown),
                                                                                default=str)


def test_the_search_asks_for_its_limit():
    """The evaluator passes its RANKS_LIMIT to an estimator that takes ``rows_up_to``, and nothing to
    one that does not (an API caller's)."""
    class _Space:
        ctx = None

    assert Evaluator(_Space(), estimate).rows_up_to == RANKS_LIMIT
    assert Evaluator(_Space(), lambda plan, model, cluster, seq, batch, **kw: None).rows_up_to is None
