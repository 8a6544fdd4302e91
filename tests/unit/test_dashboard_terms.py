"""Per-stage time terms for the "best against best even split" chart: from the cost model's stages
(hand-written and real), from the timeline otherwise, stored figures before recomputed ones."""

from __future__ import annotations

import sys
import types

import pytest
from test_dashboard_data import gpipe_timeline, make_study

from autotune.dashboard.data import load_view
from autotune.dashboard.terms import COST_TERMS, from_cost_stages, stage_times
from autotune.dashboard.timeline import Timeline, timeline_of


def test_cost_stages_by_hand():
    bd = {"stages": [{"stage": 0, "compute_s": 2.0, "exposed_comm_s": 0.25, "bubble_s": 0.75, "pipeline_s": 3.0,
                      "optimizer_s": 0.1, "end_s": 3.5, "tp_comm_s": 0.25, "dp_comm_s": 0.6},
                     {"stage": 1, "compute_s": 2.5, "bubble_s": 0.5, "pipeline_s": 2.8, "optimizer_s": 0.1,
                      "end_s": 2.9}]}
    per = from_cost_stages(bd)
    # stage 0: bubble = 3.0 - 2.0 - 0.25; dp sync exposed = end - pipeline - optimizer = 3.5 - 3.0 - 0.1
    assert per[0] == pytest.approx({"compute": 2.0, "comm (exposed)": 0.25, "bubble": 0.75, "dp sync (exposed)": 0.4,
                                    "optimizer": 0.1, "wait for step end": 0.0, "tp_comm_s": 0.25, "cp_comm_s": 0.0,
                                    "hp_comm_s": 0.0, "pp_comm_s": 0.0, "dp_comm_s": 0.6})
    # stage 1 ends its pipeline at 2.8 (bubble 2.8 - 2.5), its step at 2.9, then waits for stage 0 (3.5)
    assert per[1]["bubble"] == pytest.approx(0.3) and per[1]["dp sync (exposed)"] == pytest.approx(0.0, abs=1e-12)
    assert per[1]["wait for step end"] == pytest.approx(0.6)
    for d in per.values():
        assert sum(d[k] for k in COST_TERMS) == pytest.approx(3.5)
    assert from_cost_stages({"stages": [{"stage": 0}]}) is None and from_cost_stages({"timeline": []}) is None


def test_stored_timeline_comes_before_a_recomputed_breakdown(tmp_path, monkeypatch):
    def estimate(*a, **k):  # would be used only if nothing were stored
        raise AssertionError("recomputed although the trial stores a timeline")

    monkeypatch.setitem(sys.modules, "autotune.cost", types.SimpleNamespace(estimate=estimate))
    url = f"sqlite:///{tmp_path / 'a.db'}"
    make_study(url)
    view = load_view("s", url)
    tl, _ = timeline_of(view.best, view.context)
    per, src = stage_times(view.best, view.context, tl)
    assert src == "simulated timeline stored with the trial"
    ref = Timeline(gpipe_timeline([0.006, 0.010], [0.012, 0.020], 8), "study")
    assert per[1]["fwd"] == pytest.approx(0.080) and tl.makespan == pytest.approx(ref.makespan)


def test_real_cost_model_terms_add_up_to_its_step_time(tmp_path):
    """A trial stored with the real cost model's breakdown (as the search stores it, no timeline):
    every stage's terms add up to its end time, and the last stage to end to the step time."""
    import autotune.cost as cost
    if not hasattr(cost, "estimate"):
        pytest.skip("autotune.cost has no estimate() yet")
    import optuna

    from autotune.plan import Degrees, Plan, Shares
    from autotune.specs.cluster import load_cluster
    from autotune.specs.model import PRESETS

    model, cl = PRESETS["small"], load_cluster("local:8")
    url = f"sqlite:///{tmp_path / 'a.db'}"
    study = optuna.create_study(study_name="r", storage=url, direction="maximize")
    for k, v in {"model": model.name, "model_spec": model.to_dict(), "cluster": "local:8",
                 "cluster_spec": cl.to_dict(), "seq_len": 256, "global_batch": 16}.items():
        study.set_user_attr(k, v)
    est = cost.estimate(Plan(degrees=Degrees(dp=2, pp=2, tp=2), shares=Shares(layers=(3, 5))), model, cl, 256, 16)
    study.add_trial(optuna.trial.create_trial(value=est.predicted["tokens_per_s"], user_attrs={
        "plan": est.plan.to_dict(), "breakdown": est.breakdown}))
    view = load_view("r", url)
    per, src = stage_times(view.best, view.context, None)
    assert src == "cost model breakdown stored with the trial"
    step = est.breakdown["step_time_s"]
    for s, st in enumerate(est.breakdown["stages"]):
        d = per[s]
        assert d["compute"] + d["comm (exposed)"] + d["bubble"] == pytest.approx(st["pipeline_s"])
        assert st["pipeline_s"] + d["dp sync (exposed)"] + d["optimizer"] == pytest.approx(st["end_s"])
        assert sum(d[k] for k in COST_TERMS) == pytest.approx(step)
        assert d["bubble"] <= st["bubble_s"] + 1e-12  # the cost model's bubble also counts the wait at the end
    # and the Gantt chart's timeline is recomputed (the search stores none)
    tl, why = timeline_of(view.best, view.context)
    assert tl is not None and tl.source == "recomputed", why
