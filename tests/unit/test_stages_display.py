"""A per-stage plan on show: the dashboard's terminal table, HTML report and JSON rows, and the
search's "why the best wins" line, show its stages with their own degrees (``stages 3L(tp2x2) |
5L(tp1x2)``), not the envelope degrees the plan also records (pp=2, dp=2, tp=2)."""

from __future__ import annotations

import optuna
from test_dashboard_data import CLUSTER, DONE, MODEL, plan_attrs, resolved
from test_dashboard_terminal import text_of

from autotune import stages as ST
from autotune.dashboard.data import load_view
from autotune.dashboard.report import render_html
from autotune.dashboard.terminal import render
from autotune.plan import Degrees
from autotune.plan_record import PlanRecord
from autotune.search.report import why_best
from autotune.specs.cluster import load_cluster

STAGED = resolved(stages=(ST.Stage(layers=3, replicas=(ST.Replica(tp=2, devices=(0, 1)), ST.Replica(tp=2, devices=(2, 3)))),
                          ST.Stage(layers=5, replicas=(ST.Replica(tp=1, devices=(4,)), ST.Replica(tp=1, devices=(5,))))))
SHOWN = "stages " + ST.inline(STAGED.stages)


def _study(url: str) -> None:
    study = optuna.create_study(study_name="st", storage=url, direction="maximize")
    for k, v in {"model": MODEL.name, "model_spec": MODEL.to_dict(), "cluster": CLUSTER,
                 "cluster_spec": load_cluster(CLUSTER).to_dict(), "cluster_digest": "d1", "seq_len": 256,
                 "global_batch": 16, "space": "default"}.items():
        study.set_user_attr(k, v)
    for plan, tps in ((STAGED, 300.0), (resolved(degrees=Degrees(dp=8)), 200.0)):
        study.add_trial(optuna.trial.create_trial(state=DONE, value=tps, constraints={"memory": -1.0},
                                                  user_attrs={"plan": plan_attrs(plan, tps, 1.0), "breakdown": None}))


def test_per_stage_trial_shows_its_stages_with_their_own_degrees(tmp_path):
    assert SHOWN == "stages 3L(tp2x2) | 5L(tp1x2)"
    url = f"sqlite:///{tmp_path / 'a.db'}"
    _study(url)
    view = load_view("st", url)
    assert view.best.degrees_text() == SHOWN
    assert SHOWN in text_of(render(view))
    html, _ = render_html(view)
    assert SHOWN in html
    rows = view.to_dict()["rows"]
    assert [bool(r["stages"]) for r in rows] == [True, False]


def test_why_the_best_wins_names_the_stages():
    base = resolved(degrees=Degrees(dp=8))
    why = why_best(PlanRecord(STAGED, predicted={"step_time_s": 1.0}), PlanRecord(base, predicted={"step_time_s": 1.5}),
                   None, None)
    assert why.startswith("1.50x the best even-split plan (dp=8)")
    assert f"{SHOWN} instead of dp=8" in why and "pp=2" not in why
    back = why_best(PlanRecord(base, predicted={"step_time_s": 1.0}), PlanRecord(STAGED, predicted={"step_time_s": 2.0}),
                    None, None)
    assert f"({SHOWN})" in back and f"dp=8 instead of {SHOWN}" in back
