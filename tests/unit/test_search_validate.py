"""Validation plumbing with contract doubles: measured stored beside predicted, calibration fitted
against a known distortion (measured = 1.3 x predicted), failures recorded, best measured chosen."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _search_helpers import toy_estimate, toy_runner  # noqa: E402

from autotune.search import SearchOptions, search  # noqa: E402
from autotune.specs import load_cluster, load_model  # noqa: E402
from autotune.study import open_study  # noqa: E402
from autotune.validate import ValidateOptions, fit_calibration, validate  # noqa: E402


def make_study(url, name):
    return search(load_model("tiny"), load_cluster("local:4"), 256, 8, study_name=name, storage=url,
                  options=SearchOptions(trials=40), estimator=toy_estimate)


@pytest.mark.parametrize("journal", [False, True])
def test_validate_stores_measured_and_calibrates(tmp_path, journal):
    url = str(tmp_path / "v.log") if journal else f"sqlite:///{tmp_path}/v.db"
    make_study(url, "v")
    out = validate("v", url, options=ValidateOptions(top=3), runner=toy_runner(1.3), estimator=toy_estimate)
    assert len(out["validated"]) == 3
    for r in out["validated"]:
        assert r["error"] == pytest.approx(1 / 1.3 - 1)
        assert r["error_calibrated"] == pytest.approx(0, abs=1e-9)
    assert out["median_error_before"] == pytest.approx(1 - 1 / 1.3)
    assert out["median_error_after"] == pytest.approx(0, abs=1e-9)
    assert out["calibration"] == {"CPU": {"compute": pytest.approx(1.3), "comm": pytest.approx(1.3)}}
    study = open_study("v", url)
    assert study.user_attrs["calibration"]["CPU"]["compute"] == pytest.approx(1.3)
    by_number = {t.number: t for t in study.get_trials()}
    best = by_number[study.user_attrs["best_measured_trial"]]
    assert best.user_attrs["measured"]["tokens_per_s"] == max(r["measured"]["tokens_per_s"] for r in out["validated"])
    assert best.user_attrs["plan"]["predicted"] and out["best_measured"]["measured"]
    for n in study.user_attrs["validated_trials"]:
        assert by_number[n].user_attrs["measured"] is not None
    assert out["reranked"] and out["reranked"][0]["calibrated_tokens_per_s"] >= out["reranked"][-1][
        "calibrated_tokens_per_s"]


def test_a_failed_real_trial_is_recorded_and_the_rest_run(tmp_path):
    url = f"sqlite:///{tmp_path}/f.db"
    res = make_study(url, "f")
    first = res.top[0].degrees.inline()
    out = validate("f", url, options=ValidateOptions(top=3), runner=toy_runner(1.3, fail_degrees=(first,)),
                   estimator=toy_estimate)
    failed = [r for r in out["validated"] if r["failure"]]
    assert failed and all(r["failure"]["message"] == "boom" for r in failed)
    assert out["best_measured"] is not None and out["best_measured"]["degrees"] != res.top[0].degrees.to_dict()
    t = {x.number: x for x in open_study("f", url).get_trials()}[failed[0]["trial"]]
    assert t.user_attrs["failure"]["kind"] == "error"


def test_calibration_is_per_device_type_and_kind():
    from autotune.plan import Plan

    cluster = load_cluster("local:2")
    plan = Plan.from_dict({"degrees": {"dp": 2}}).resolve(load_model("tiny"), cluster, 32, 4)
    runs = [{"plan": plan, "predicted": {"step_time_s": 1.0},
             "breakdown": {"ranks": [{"compute_s": 1.0, "comm_s": 0.5}, {"compute_s": 1.0, "comm_s": 0.5}]},
             "measured": {"step_time_s": 2.0, "time_split": [
                 {"rank": 0, "compute_s": 2.0, "comm_s": 0.25, "emulated_s": 0.0},
                 {"rank": 1, "compute_s": 3.0, "comm_s": 0.25, "emulated_s": 1.0}]}}]
    assert fit_calibration(runs, cluster) == {"CPU": {"compute": 2.0, "comm": 0.5}}
