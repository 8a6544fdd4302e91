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
    # 3 plans: each priced with the calibration fitted on the other two (the distortion is uniform)
    assert out["median_error_held_out"] == pytest.approx(0, abs=1e-9)
    assert all(r["error_held_out"] == pytest.approx(0, abs=1e-9) for r in out["validated"])
    assert out["calibration"] == {"CPU": {"compute": pytest.approx(1.3), "comm": pytest.approx(1.3)}}
    study = open_study("v", url)
    assert study.user_attrs["calibration"]["CPU"]["compute"] == pytest.approx(1.3)
    assert study.user_attrs["calibration_errors"]["held_out"] == pytest.approx(0, abs=1e-9)
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
    first = res.top[0].plan.degrees.inline()
    out = validate("f", url, options=ValidateOptions(top=3), runner=toy_runner(1.3, fail_degrees=(first,)),
                   estimator=toy_estimate)
    failed = [r for r in out["validated"] if r["failure"]]
    assert failed and all(r["failure"]["message"] == "boom" for r in failed)
    assert out["best_measured"] is not None and out["best_measured"]["degrees"] != res.top[0].plan.degrees.to_dict()
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


# ---- calibration fit and held-out error on synthetic runs with known factors -------------------
def _synthetic_runs(true_compute, true_comm, mixes, noise=None):
    """Runs whose prediction is compute + comm seconds and whose measurement is the true factors'
    mix of them (times ``noise[i]``); ``step_of`` prices a run under a calibration the same way."""
    from autotune.plan import Plan

    cluster = load_cluster("local:2")
    plan = Plan.from_dict({"degrees": {"dp": 2}}).resolve(load_model("tiny"), cluster, 32, 4)
    runs = []
    for i, (comp, comm) in enumerate(mixes):
        meas = (true_compute * comp + true_comm * comm) * (noise[i] if noise else 1.0)
        runs.append({"plan": plan, "predicted": {"step_time_s": comp + comm}, "compute": comp, "comm": comm,
                     "breakdown": {"ranks": [{"compute_s": comp, "comm_s": comm}] * 2},
                     "measured": {"step_time_s": meas, "time_split": []}})
    return runs, cluster


def _step_of(run, cal):
    c = cal.get("CPU", {})
    return c.get("compute", 1.0) * run["compute"] + c.get("comm", 1.0) * run["comm"]


MIXES = [(1.0, 0.1), (0.5, 0.5), (0.2, 1.0), (2.0, 0.05), (0.8, 0.3), (0.3, 0.6)]


def test_calibration_recovers_known_factors_and_holds_out():
    from autotune.validate import calibrate_runs, held_out_errors, leave_one_out

    runs, cluster = _synthetic_runs(1.7, 3.0, MIXES)
    cal = calibrate_runs(runs, cluster, _step_of)
    assert cal["CPU"]["compute"] == pytest.approx(1.7, rel=0.03)
    assert cal["CPU"]["comm"] == pytest.approx(3.0, rel=0.03)
    loo = leave_one_out(runs, cluster, _step_of)
    assert len(loo) == len(runs) and max(abs(e) for e in loo) < 0.03
    assert held_out_errors(runs[:1], cluster, _step_of) == []


def test_held_out_error_sees_what_in_sample_hides():
    """Two factors fitted on three plans whose comm never varies cannot predict a comm-heavy plan:
    in-sample the error is ~0, held out it is large (so the held-out figure is the honest one)."""
    from autotune.validate import calibrate_runs, leave_one_out

    mixes = [(1.0, 0.0), (2.0, 0.0), (0.5, 0.0), (0.1, 1.0)]
    runs, cluster = _synthetic_runs(1.5, 4.0, mixes)
    cal = calibrate_runs(runs, cluster, _step_of)
    inside = [abs(_step_of(r, cal) / r["measured"]["step_time_s"] - 1) for r in runs]
    assert max(inside) < 0.03
    loo = leave_one_out(runs, cluster, _step_of)
    assert abs(loo[3]) > 0.5  # the comm factor cannot be learnt from plans without comm
    assert max(abs(e) for e in loo[:3]) < 0.03


def test_held_out_error_holds_out_a_plans_twin():
    """The comm-heavy plan above measured twice (the same layout at the same price): held out by run,
    each copy would be priced by a calibration fitted on the other (error ~0); held out by plan, both
    are priced by the fit on the other plans alone, as a plan that took no part in it."""
    from autotune.validate import _rel_error, calibrate_runs, leave_one_out

    mixes = [(1.0, 0.0), (2.0, 0.0), (0.5, 0.0), (0.1, 1.0), (0.1, 1.0)]
    runs, cluster = _synthetic_runs(1.5, 4.0, mixes)
    loo = leave_one_out(runs, cluster, _step_of)
    without_twins = calibrate_runs(runs[:3], cluster, _step_of)
    for i in (3, 4):
        assert loo[i] == pytest.approx(_rel_error(_step_of(runs[i], without_twins), runs[i]["measured"]["step_time_s"]))
        assert abs(loo[i]) > 0.5
    by_run = calibrate_runs(runs[:3] + runs[4:], cluster, _step_of)  # what leaving one run out fitted on
    assert abs(_rel_error(_step_of(runs[3], by_run), runs[3]["measured"]["step_time_s"])) < 0.05


def test_one_bad_plan_does_not_drag_the_calibration():
    from autotune.validate import calibrate_runs

    noise = [1.0] * len(MIXES)
    noise[2] = 3.0  # a plan the model gets badly wrong (or a disturbed measurement)
    runs, cluster = _synthetic_runs(1.7, 3.0, MIXES, noise)
    cal = calibrate_runs(runs, cluster, _step_of)
    others = [abs(_step_of(r, cal) / r["measured"]["step_time_s"] - 1) for i, r in enumerate(runs) if i != 2]
    assert sorted(others)[len(others) // 2] < 0.05


def test_calibration_is_never_worse_than_none():
    from autotune.validate import calibrate_runs

    runs, cluster = _synthetic_runs(1.0, 1.0, MIXES)
    cal = calibrate_runs(runs, cluster, _step_of)
    assert all(_step_of(r, cal) == pytest.approx(r["measured"]["step_time_s"]) for r in runs)


@pytest.mark.parametrize("diverse", [True, False])
def test_validate_takes_distinct_layouts_first(tmp_path, diverse):
    from autotune.study import trial_plans

    url = f"sqlite:///{tmp_path}/d.db"
    make_study(url, "d")
    ranked = trial_plans(open_study("d", url))

    def layout(p):
        return (p.degrees, p.schedule, p.virtual_stages, p.micro_batch_size)

    want, seen = [], set()
    for t, p in ranked:  # the reference: rank order, skipping a layout already taken
        if len(want) < 3 and (not diverse or layout(p) not in seen):
            want.append(t.number)
            seen.add(layout(p))
    for t, _ in ranked:  # fill with the next best when there are fewer distinct layouts than K
        if len(want) < 3 and t.number not in want:
            want.append(t.number)
    out = validate("d", url, options=ValidateOptions(top=3, diverse=diverse), runner=toy_runner(1.3),
                   estimator=toy_estimate)
    copies = {t.number: t for t in open_study("d", url).get_trials()}  # measured trials are stored as copies
    got = [copies[r["trial"]].user_attrs.get("validated_from", r["trial"]) for r in out["validated"]]
    assert got == sorted(want, key=lambda n: -dict((t.number, t.value) for t, _ in ranked)[n])
    plain = [t.number for t, _ in ranked[:3]]
    assert (want != plain) == diverse  # this study's top 3 hold a repeated layout: the two modes differ
    if diverse:
        assert len({layout(p) for t, p in ranked if t.number in want}) == min(3, len({layout(p) for _, p in ranked}))
