"""The dashboard's reading of a study (autotune.dashboard.data), on studies built directly with Optuna
in the documented shape (docs/contracts.md, "Study"). ``make_study`` is also used by the other
dashboard tests (terminal, report, serve, browser)."""

from __future__ import annotations

import optuna
import pytest

from autotune.dashboard.data import load_view
from autotune.errors import InputError
from autotune.plan import Degrees, Plan, Shares
from autotune.plan_record import PlanRecord
from autotune.specs.cluster import load_cluster
from autotune.specs.model import PRESETS

MODEL, SEQ, BATCH, CLUSTER = PRESETS["small"], 256, 16, "local:8"
DONE, FAIL, RUNNING = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.RUNNING


def gpipe_timeline(fwd: list[float], bwd: list[float], m: int) -> list[dict]:
    """A hand-built GPipe schedule (all forwards, then all backwards) for stage times ``fwd``/``bwd``:
    stage s runs micro-batch i once stage s-1 has finished it and s has finished i-1; gaps are
    bubbles. The dashboard only draws it, so any consistent schedule serves as test data."""
    p = len(fwd)
    ev, end_f = [], [[0.0] * m for _ in range(p)]
    for s in range(p):
        t = 0.0
        for i in range(m):
            start = max(t, end_f[s - 1][i] if s else 0.0)
            if start > t:
                ev.append({"stage": s, "rank": s, "kind": "bubble", "microbatch": None, "start": t, "end": start})
            ev.append({"stage": s, "rank": s, "kind": "fwd", "microbatch": i, "start": start, "end": start + fwd[s]})
            t = end_f[s][i] = start + fwd[s]
    end_b = [[0.0] * m for _ in range(p)]
    for s in reversed(range(p)):
        t = end_f[s][-1]
        for i in range(m):
            start = max(t, end_b[s + 1][i] if s + 1 < p else 0.0)
            if start > t:
                ev.append({"stage": s, "rank": s, "kind": "bubble", "microbatch": None, "start": t, "end": start})
            ev.append({"stage": s, "rank": s, "kind": "bwd", "microbatch": i, "start": start, "end": start + bwd[s]})
            t = end_b[s][i] = start + bwd[s]
        if s:
            ev.append({"stage": s, "rank": s, "kind": "comm", "microbatch": None, "start": t, "end": t + 0.001})
    return ev


def resolved(**kw) -> Plan:
    return Plan(**kw).resolve(MODEL, load_cluster(CLUSTER), SEQ, BATCH)


def plan_attrs(plan: Plan, tps: float | None, mem_gib: float, feasible: bool = True) -> dict:
    if tps is None:  # not estimated (failed or still running)
        return plan.to_dict()
    cap = load_cluster(CLUSTER).devices[0].spec.memory_bytes
    pred = {"step_time_s": SEQ * BATCH / tps, "tokens_per_s": tps, "mfu": 0.3,
            "memory_bytes": [mem_gib * 2**30 * (1 + 0.05 * r) for r in range(plan.world)],
            "capacity_bytes": [cap] * plan.world, "feasible": feasible}
    return PlanRecord(plan, predicted=pred).to_dict()


def make_study(url: str, name: str = "s", *, timelines: bool = True, measured: bool = True) -> optuna.Study:
    """Trials: #0 dp=8 (even), #1 pp=2 with uneven layers [3,5] (the best), #2 tp=4 faster but
    infeasible, #3 failed, #4 pp=2 even layers [4,4] (the even baseline), #5 still running."""
    study = optuna.create_study(study_name=name, storage=url, direction="maximize")
    cl = load_cluster(CLUSTER)
    for k, v in {"model": MODEL.name, "model_spec": MODEL.to_dict(), "cluster": CLUSTER, "cluster_spec": cl.to_dict(),
                 "cluster_digest": "d1", "seq_len": SEQ, "global_batch": BATCH, "space": "default"}.items():
        study.set_user_attr(k, v)
    m = 8

    def bd(fwd, bwd):
        return {"timeline": gpipe_timeline(fwd, bwd, m)} if timelines else {"stages": []}

    trials = [
        (resolved(degrees=Degrees(dp=8)), 100.0, 1.0, True, DONE, bd([0.01], [0.02]), 90.0, None),
        (resolved(degrees=Degrees(dp=4, pp=2), shares=Shares(layers=(3, 5))), 300.0, 1.5, True, DONE,
         bd([0.006, 0.010], [0.012, 0.020]), 280.0, None),
        (resolved(degrees=Degrees(dp=2, tp=4)), 900.0, 5.0, False, DONE, bd([0.005], [0.01]), None, None),
        (resolved(degrees=Degrees(dp=4, tp=2)), None, 1.0, True, FAIL, None, None, None),
        (resolved(degrees=Degrees(dp=4, pp=2)), 250.0, 1.4, True, DONE, bd([0.008, 0.012], [0.016, 0.024]),
         240.0, "megatron-even"),
        (resolved(degrees=Degrees(dp=2, pp=4)), None, 1.0, True, RUNNING, None, None, None),
    ]
    for plan, tps, mem, feasible, state, breakdown, meas, baseline in trials:
        ua = {"plan": plan_attrs(plan, tps, mem, feasible), "breakdown": breakdown,
              "infeasible_reason": None if feasible else "rank 0 memory 5.0GiB > 2.9GiB: activations 4GiB",
              "baseline": baseline}
        if meas is not None and measured:
            ua["measured"] = {"step_time_s": SEQ * BATCH / meas, "tokens_per_s": meas,
                              "peak_memory_bytes": [mem * 0.9 * 2**30] * plan.world}
        if state == FAIL:
            ua["failure"] = {"kind": "error", "rank": 1, "message": "cost model raised"}
        study.add_trial(optuna.trial.create_trial(
            state=state, value=tps if state == DONE else None, user_attrs=ua,
            constraints={"memory": -1.0 if feasible else 1.0} if state == DONE else None))
    return study


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path / 'autotune.db'}"
    make_study(url)
    return url


def test_rows_best_first_with_reasons(db):
    v = load_view("s", db)
    assert [r.number for r in v.rows] == [1, 4, 0, 2, 5, 3]  # best, feasible by tps, infeasible, running, failed
    assert v.best.number == 1 and v.even_best.number == 4
    by = {r.number: r for r in v.rows}
    assert not by[2].feasible and "memory" in by[2].reason
    assert by[3].state == "FAIL" and by[3].reason == "error on rank 1: cost model raised"
    assert by[5].state == "RUNNING" and by[5].reason is None
    # error = (predicted - measured) / measured, from the stored figures
    assert by[1].error == pytest.approx((300 - 280) / 280)
    assert by[2].error is None
    assert by[1].even is False and by[4].even is True and by[0].even is True
    assert v.states == {"COMPLETE": 4, "FAIL": 1, "RUNNING": 1}


def test_best_even_split_prefers_the_study_record(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    st = make_study(url)
    st.set_user_attr("baseline_best_trial", 0)
    v = load_view("s", url)
    assert v.even_best.number == 0
    assert v.to_dict()["speedup_vs_even"] == pytest.approx(280 / 90)  # both measured


def test_best_measured_trial_wins(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    make_study(url).set_user_attr("best_measured_trial", 4)
    v = load_view("s", url)
    assert v.best.number == 4 and v.rows[0].number == 4


def test_memory_fraction_against_capacity(db):
    v = load_view("s", db)
    r = next(r for r in v.rows if r.number == 2)
    cap = load_cluster(CLUSTER).devices[0].spec.memory_bytes
    assert r.memory_fraction == pytest.approx(max(r.memory_bytes) / cap)


def test_capacity_from_cluster_when_prediction_lacks_it(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    study = optuna.create_study(study_name="c", storage=url, direction="maximize")
    study.set_user_attr("cluster", CLUSTER)
    plan = PlanRecord(resolved(degrees=Degrees(dp=8)), predicted={"tokens_per_s": 5.0, "memory_bytes": [1.0] * 8})
    study.add_trial(optuna.trial.create_trial(state=DONE, value=5.0, user_attrs={"plan": plan.to_dict()}))
    r = load_view("c", url).rows[0]
    assert r.capacity_bytes == [d.spec.memory_bytes for d in load_cluster(CLUSTER).devices]


def test_validated_copy_replaces_its_original(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    st = make_study(url, measured=False)
    orig = st.trials[1]
    st.add_trial(optuna.trial.create_trial(
        state=DONE, value=orig.value, user_attrs={**orig.user_attrs, "validated_from": 1,
                                                  "measured": {"tokens_per_s": 150.0}}))
    v = load_view("s", url)
    assert 1 not in [r.number for r in v.rows] and 6 in [r.number for r in v.rows]


def test_missing_study_lists_the_ones_that_exist(db, tmp_path):
    make_study(db, "other")
    with pytest.raises(InputError) as e:
        load_view("nope", db)
    assert e.value.field == "--study" and "other" in str(e.value) and "s" in str(e.value)


def test_empty_study_is_an_input_error(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    optuna.create_study(study_name="e", storage=url)
    with pytest.raises(InputError, match="no trials"):
        load_view("e", url)
    assert load_view("e", url, allow_empty=True).rows == []


def test_missing_database_file_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="no such database"):
        load_view("s", f"sqlite:///{tmp_path / 'missing.db'}")
    assert not (tmp_path / "missing.db").exists()


def test_journal_storage(tmp_path):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = str(tmp_path / "j.log")
    make_study(JournalStorage(JournalFileBackend(path)))
    assert load_view("s", path).best.number == 1


def test_infeasible_plans_nearest_to_fitting_first(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    study = optuna.create_study(study_name="m", storage=url, direction="maximize")
    for degrees, mem, tps in ((Degrees(dp=8), 9.0, 500.0), (Degrees(dp=4, tp=2), 3.5, 100.0),
                              (Degrees(dp=2, tp=4), 6.0, 900.0)):
        study.add_trial(optuna.trial.create_trial(
            state=DONE, value=0.0, constraints={"memory": 1.0},
            user_attrs={"plan": plan_attrs(resolved(degrees=degrees), tps, mem, feasible=False),
                        "infeasible_reason": "memory: too big"}))
    v = load_view("m", url)
    assert v.best is None and [r.degrees_text() for r in v.rows] == ["dp=4,tp=2", "dp=2,tp=4", "dp=8"]
