"""The search's parts answer for the rules they share: a crashing cost model is an error with its
message, the space and the plan reject the same degrees (autotune/divisibility.py), and apply
rebuilds a study's cluster the way the study does (autotune.study.cluster_from_record)."""

from __future__ import annotations

import itertools

import pytest
from _search_helpers import flaky_estimate

from autotune.divisibility import degree_problems
from autotune.errors import InputError, WorkError
from autotune.plan import Degrees, Plan, PlanError
from autotune.search import SearchOptions, load_space, search
from autotune.specs import load_cluster, load_model
from autotune.specs.cluster import cluster_from_dict
from search_spaces.base import Infeasible, SearchContext

TINY = load_model("tiny")
L8 = load_cluster("local:8")


def test_a_cost_model_that_always_raises_is_an_error_with_its_message():
    def broken(plan, *a, **kw):
        raise ZeroDivisionError("bandwidth table is empty")

    with pytest.raises(WorkError) as e:
        search(TINY, L8, 256, 16, study_name="broken", storage=":memory:", options=SearchOptions(trials=5),
               estimator=broken)
    text = str(e.value)
    assert "ZeroDivisionError: bandwidth table is empty" in text and "cost model raised" in text
    assert "rejected before pricing" not in text


def test_a_cost_model_that_sometimes_raises_is_said_in_the_notes():
    flaky = flaky_estimate(4, "flaky term")

    res = search(TINY, L8, 256, 16, study_name="flaky-notes", storage=":memory:", options=SearchOptions(trials=20),
                 estimator=flaky)
    assert any("cost model raised" in n and "RuntimeError: flaky term" in n for n in res.notes), res.notes


def test_a_cost_model_that_raises_inside_the_stage_program_is_a_failed_trial_with_its_message():
    """The stage program prices its plans with the search's own estimator (Evaluator.price): where
    that raises, the point that asked is recorded as a failed trial and said in the notes, as a
    crash on any other point is; the search goes on with the points it can price."""
    from autotune.cost.estimate import estimate

    def no_stages(plan, *a, **kw):
        if plan.stages:
            raise ZeroDivisionError("no stage table")
        return estimate(plan, *a, **kw)

    bench = "benchmarks/data/bench/"
    res = search(load_model(bench + "opt-350m.yaml"), load_cluster(bench + "sailor-a100-40x8-v100-16x8.yaml"), 2048,
                 1024, study_name="stage-crash", storage=":memory:",
                 options=SearchOptions(dtype="fp16"), estimator=no_stages)
    assert any("cost model raised" in n and "ZeroDivisionError: no stage table" in n for n in res.notes), res.notes
    assert not res.best.plan.stages


@pytest.mark.parametrize("model", ["tiny", "llama3-8b"])
def test_the_space_and_the_plan_reject_the_same_degrees(model):
    """Reference: Plan.resolve. Every degree layout the default space builds or rejects for
    divisibility is judged the same way by the plan, with the same words."""
    m = load_model(model)
    c = cluster_from_dict({"name": "h", "nodes": [{"count": 2, "devices_per_node": 8, "device": "H100-SXM"}],
                           "inter_node": {"bandwidth": "25GB/s"}})
    sp = load_space("default").space(SearchContext(model=m, cluster=c, seq_len=4096, global_batch=64))
    seen = 0
    for tp, pp, cp, hp in itertools.product(sp.tp_divs, sp.divs, sp.divs, sp.divs):
        if c.num_devices % (tp * pp * cp * hp):
            continue
        deg = Degrees(dp=c.num_devices // (tp * pp * cp * hp), pp=pp, cp=cp, hp=hp, tp=tp)
        built = sp.build(sp.params(tp=tp, pp=pp, cp=cp, hp=hp))
        rules = degree_problems(deg, m, c.num_devices)
        if rules:
            assert isinstance(built, Infeasible) and built.reason == rules[0][1]
            with pytest.raises(PlanError) as e:
                Plan(degrees=deg).resolve(m, c, 4096, 64)
            assert rules[0][1] in e.value.message
            seen += 1
        else:
            assert not (isinstance(built, Infeasible) and built.reason in {t for _, t in
                                                                           degree_problems(deg, m, c.num_devices)})
    assert seen or model != "tiny"  # tiny's few heads and layers refuse some layouts of 16 devices


def test_apply_rebuilds_local_gpu_clusters_as_the_study_does():
    from autotune.export.source import _cluster_from_record
    from autotune.study import cluster_from_record

    for name in ("local:4", "local-H100-SXM:4"):
        a, b = _cluster_from_record(name, None, "", "sqlite://"), cluster_from_record(name, None)
        assert a.num_devices == b.num_devices == 4 and a.name == b.name
    with pytest.raises(InputError, match="--cluster"):
        _cluster_from_record("mixed", None, "", "sqlite://")
