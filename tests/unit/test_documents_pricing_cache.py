"""A plan with documents is priced through caches (issue 40). Given windows: each replica's context
copied from one template per place (``RankContext.with_work``), the rank-cost memo keyed by the
place's token and the replica's attention work, the part of a rank's cost its attention does not
move kept once per place (``rank._fixed_memo``), and one report per plan (of the step ``combine``
keeps). A distribution: its two summarised works (``documents_summary``) each given to every
replica, so replicas of a place share a context, as without documents. Against the reference that
caches nothing: every tp group of every priced step its own context built from the step
(``context._rank_context``), priced by ``rank_cost`` afresh, every step reported, the same
``combine`` (and for a distribution the same ``expected_step``). The figures must be the same,
breakdown included, whatever the caches held before (each plan is priced twice, after plans that
share its places)."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

import autotune.cost.estimate  # noqa: F401 - the package re-exports the function under this name
from autotune import documents as W
from autotune.cost import context as CX
from autotune.cost import documents as DOC
from autotune.cost import rank as RK
from autotune.cost.data_parallel import exposure
from autotune.cost.pipeline_parallel import replica_stages, simulate_replicas
from autotune.cost.steps import step_context
from autotune.plan import Plan
from autotune.specs import load_model, local_cluster
from autotune.specs.cluster import cluster_from_dict

E = sys.modules["autotune.cost.estimate"]
TINY = load_model("tiny")
DISTS = (W.lognormal(5.0, 1.2, n=4000, seed=1),  # many short documents per window
         W.LengthDistribution((32, 4096), (12800, 100)),  # snippets among whole-window files
         W.lognormal(7.6, 1.0, n=3000, seed=2))  # documents about as long as the window
PLANS = ({"dp": 4}, {"dp": 4, "balance": "cost"}, {"dp": 2, "cp": 2}, {"dp": 2, "cp": 2, "cp_layout": "contiguous"},
         {"dp": 2, "pp": 2}, {"dp": 2, "tp": 2, "balance": "cost"})


def _mixed() -> object:
    return cluster_from_dict({"name": "mix", "inter_node": {"bandwidth": "25GB/s"},
                              "nodes": [{"count": 1, "devices_per_node": 2, "device": "H100-SXM"},
                                        {"count": 1, "devices_per_node": 2, "device": "A100-80GB"}]})


def _plan(spec: dict) -> Plan:
    spec = dict(spec)
    knobs = {k: spec.pop(k) for k in ("balance", "cp_layout") if k in spec}
    return Plan.from_dict({"degrees": spec, "doc_mask": True, **knobs})


def _reference(plan, model, cluster, seq, gb, dist):
    """(predicted, breakdown) with no cache: contexts built per tp group, rank costs priced afresh."""
    import statistics

    from autotune.cost import documents_summary as SUM

    s = step_context(plan, model, cluster, seq, gb, None)
    on_cpu = any(g.device.kind == "cpu" for g in cluster.groups)
    if isinstance(dist, DOC.GivenWindows):
        works = DOC.drawn_work(s.plan, dist, seq, gb, on_cpu)
    else:
        wk = SUM.works(s.plan, dist, seq, gb, on_cpu)
        works = [wk.typical, wk.heavy] if wk.varies else [wk.typical]
    reports, times, ends = [], [], []
    for work in works:
        st = dataclasses.replace(s, doc_work=work)
        groups = []
        for (r0, c), (spec, _, links) in zip(CX._tp_group_coords(st.plan.degrees), st.group_links, strict=True):
            ctx = CX._rank_context(st, c, spec, links, st.microbatches[c["dp"]], {})
            groups.append((r0, c["dp"], ctx, RK.rank_cost(ctx)))
        per = replica_stages(groups)
        sims = simulate_replicas(st, per)
        step, stage_end, exposed_of = exposure(st.pp, st.dp, sims, per)
        sim = E._Simulated(st, groups, per, sims, step, stage_end, exposed_of)
        reports.append(E._report(sim, False))
        times.append(step)
        ends.append(E._replica_ends(sim))
    if isinstance(dist, DOC.GivenWindows):
        mean = statistics.fmean(times)
    else:
        mean = SUM.expected_step(wk, SUM.replica_pairs(s.plan, dist, seq, gb, wk) if wk.varies else None,
                                 ends if wk.varies else [], times)
    return DOC.combine(times, lambda i: reports[i], dist, s.plan, model, seq, gb, mean)


def _text(d: dict) -> str:
    return json.dumps(d, sort_keys=True, default=str)


@pytest.mark.parametrize("cpu", [False, True])
def test_cached_pricing_is_the_uncached_reference(cpu):
    cluster = local_cluster(4) if cpu else _mixed()
    seq, gb = 2048, 8
    checked = 0
    for dist in (*DISTS, DOC.GivenWindows(DOC.drawn_steps(DISTS[0], seq, gb, 4, DOC.SEED))):
        for spec in PLANS:
            plan = _plan(spec)
            want = _reference(plan, TINY, cluster, seq, gb, dist)
            for _ in range(2):  # the second time every cache holds this plan's places and work
                got = E.estimate(plan, TINY, cluster, seq, gb, documents=dist)
                assert got.predicted["step_time_s"] == want[0]["step_time_s"], (spec, dist.source)
                assert _text(got.predicted) == _text(want[0]), (spec, dist.source)
                assert _text(got.breakdown) == _text(want[1]), (spec, dist.source)
                checked += 1
    assert checked == 2 * (len(DISTS) + 1) * len(PLANS)


def test_replicas_share_the_cost_of_what_their_attention_does_not_move():
    """The cache does work: a plan of 4 replicas over given windows prices its places' fixed part once,
    not per replica and step (a cache that were never read would leave the figures right and the
    time as it was); over a distribution its replicas share one rank cost per place and summarised work."""
    given = DOC.GivenWindows(DOC.drawn_steps(DISTS[0], 2048, 8, 4, DOC.SEED))
    RK._FIXED.clear()
    RK._MEMO.clear()
    E.estimate(_plan({"dp": 4}), TINY, _mixed(), 2048, 8, documents=given)
    assert 0 < len(RK._FIXED) <= 2  # one place per device type
    assert len(RK._MEMO) > len(RK._FIXED)  # the replicas' own attention: priced one by one
    RK._FIXED.clear()
    RK._MEMO.clear()
    E.estimate(_plan({"dp": 4}), TINY, _mixed(), 2048, 8, documents=DISTS[0])
    assert len(RK._FIXED) == 2 and len(RK._MEMO) == 2 * 2  # two places, two works each
