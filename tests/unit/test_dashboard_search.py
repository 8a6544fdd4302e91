"""The dashboard on studies the real search and validate wrote (with the search tests' contract
doubles ``toy_estimate``/``toy_runner``, tests/unit/_search_helpers.py, so this runs whether or not
the cost model is built): the view agrees with the study's own records, and ``watch`` follows a
search running in another thread on the same storage."""

from __future__ import annotations

import os
import sys
import threading

import pytest
from rich.console import Console

sys.path.insert(0, os.path.dirname(__file__))
from _search_helpers import toy_estimate, toy_runner  # noqa: E402

from autotune.dashboard.data import load_view  # noqa: E402
from autotune.dashboard.report import build_charts  # noqa: E402
from autotune.dashboard.terminal import watch  # noqa: E402
from autotune.search import SearchOptions, search  # noqa: E402
from autotune.specs import load_cluster, load_model  # noqa: E402
from autotune.study import best_feasible, is_feasible, open_study  # noqa: E402

TINY, L4 = load_model("tiny"), load_cluster("local:4")


def searched(url: str, name: str = "s", trials: int = 30):
    return search(TINY, L4, 256, 8, study_name=name, storage=url, options=SearchOptions(trials=trials),
                  estimator=toy_estimate)


@pytest.mark.parametrize("journal", [False, True])
def test_view_agrees_with_the_search_records(tmp_path, journal):
    url = str(tmp_path / "s.log") if journal else f"sqlite:///{tmp_path}/s.db"
    res = searched(url)
    study = open_study("s", url)
    view = load_view("s", url)
    trials = {t.number: t for t in study.get_trials()}
    # best: the search's own best feasible trial (nothing validated yet)
    assert view.best.number == best_feasible(study).number == res.best_trial
    # feasibility per trial as autotune.study decides it
    assert {r.number for r in view.rows if r.feasible} == {n for n, t in trials.items() if is_feasible(t)}
    assert len(view.rows) == len(trials)
    # even-split comparison: the search's recorded baseline when it is even
    by = {r.number: r for r in view.rows}
    base = study.user_attrs.get("baseline_best_trial")
    if base is not None and by[base].even and by[base].feasible:
        assert view.even_best.number == base
    assert view.even_best is None or view.even_best.even
    charts, facts = build_charts(view)
    assert {"history", "degrees", "memory"} <= set(facts["charts"])


def test_view_after_validate_shows_measured_and_failures(tmp_path):
    from autotune.validate import ValidateOptions, validate

    url = f"sqlite:///{tmp_path}/v.db"
    res = searched(url, "v")
    first = res.top[0].plan.degrees.inline()
    out = validate("v", url, options=ValidateOptions(top=3), runner=toy_runner(1.3, fail_degrees=(first,)),
                   estimator=toy_estimate)
    view = load_view("v", url)
    assert view.best.number == out["best_measured_trial"] == open_study("v", url).user_attrs["best_measured_trial"]
    by = {r.number: r for r in view.rows}
    for v in out["validated"]:
        row = by[v["trial"]]
        if v["failure"]:
            assert row.run_failed and "boom" in row.reason and row.measured_tps is None
        else:
            assert row.measured_tps == pytest.approx(v["measured"]["tokens_per_s"])
            # the dashboard's error is on throughput: predicted / measured - 1
            assert row.error == pytest.approx(row.predicted_tps / row.measured_tps - 1)
    _, facts = build_charts(view)
    assert "accuracy" in facts["charts"]


def test_watch_follows_a_running_search(tmp_path):
    url = f"sqlite:///{tmp_path}/w.db"
    searched(url, "w", trials=5)  # the study exists, as after a first search
    before = len(load_view("w", url).rows)
    done = threading.Event()

    def more() -> None:
        searched(url, "w", trials=40)  # resumes the same study from another thread
        done.set()

    t = threading.Thread(target=more)
    t.start()

    def sleep(_s: float) -> None:
        done.wait(timeout=120)

    try:
        view = watch("w", url, Console(file=open(os.devnull, "w")), interval=0.1, max_refreshes=2,  # noqa: SIM115
                     sleep=sleep)
    finally:
        t.join(timeout=120)
    assert len(view.rows) > before and len(view.rows) == len(load_view("w", url).rows)
