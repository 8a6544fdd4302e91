"""What the search's table says of its first plan is true (issue 39 items 2, 6 and 7, as the terminal
shows them): the table's #1 is the plan the search chose (``best``, what ``apply --study`` exports),
not a plan the tie-break passed over; the best even split is the best itself when the best is one;
the targets are measured against the best; the line under #1 says what put it first (the
objective, or the tie-break with the plan it passed over); a per-stage plan that is the mesh of its
degrees is shown by them, so one layout is never listed under two names.

References: the study's own trials (the fastest feasible prediction among them, the trial the
search calls best), cost/tiebreak.py's rule and ``Plan.layout``."""

from __future__ import annotations

import optuna
import pytest

from autotune import stages as ST
from autotune.commands.search import show
from autotune.cost.tiebreak import TIE_TOLERANCE
from autotune.objective import Objective
from autotune.plan import Degrees, Plan
from autotune.search import search
from autotune.specs import load_cluster, load_model
from autotune.study import is_feasible, storage_for

M = load_model("tiny")


@pytest.fixture(scope="module")
def searched():
    """tiny on 2 local workers: the dp=2 plans of ZeRO 0 and 1 tie within 0.1%, and the tie-break
    chooses ZeRO 0, the slower by a hair (the search quoted in issue 39 item 2, at 1,024 tokens)."""
    res = search(M, load_cluster("local:2"), 1024, 8, study_name="table-truth", storage=":memory:")
    trials = optuna.load_study(study_name="table-truth", storage=storage_for(":memory:")).get_trials(deepcopy=False)
    return res, {t.number: t for t in trials if is_feasible(t)}


def test_the_tables_first_plan_is_the_best_and_the_even_split_and_the_targets_measure_against_it(searched):
    res, trials = searched
    fastest = max(trials.values(), key=lambda t: t.value)
    best = trials[res.best_trial]
    assert fastest.value > best.value >= (1 - TIE_TOLERANCE) * fastest.value, \
        "the workload no longer has a plan the tie-break passes over: the test checks nothing"
    assert res.layouts[0][0] == best.user_attrs["plan"]
    assert Plan.from_dict(best.user_attrs["plan"]).is_even() and res.baseline_trial == res.best_trial
    runs_best = [t for t, v in res.targets.items() if v and v["trial"] == res.best_trial]
    assert runs_best and all(res.targets[t]["ratio"] == 1.0 for t in runs_best), res.targets


def test_the_line_under_the_first_plan_says_what_put_it_first(searched, capsys):
    res, trials = searched
    show(res.to_dict(), top=res.layouts)
    out = capsys.readouterr().out
    fastest = max(trials.values(), key=lambda t: t.value)
    slower = fastest.value / trials[res.best_trial].value - 1  # step time ratio = tokens/s ratio
    assert f"#1 chosen ({slower:.1%} slower than " in out and "#1 fastest" not in out, out
    assert "best plan each target can run, its tokens/s against the best's: " in out


def test_what_put_the_first_plan_first_is_the_objective_unless_a_faster_plan_was_passed_over():
    from autotune.commands.search import first_place

    dp2 = Plan(degrees=Degrees(dp=2)).resolve(M, load_cluster("local:2"), 128, 8).to_dict()

    def plan(step: float) -> dict:
        return {**dp2, "predicted": {"step_time_s": step}}

    best, faster, slower = plan(1.0), plan(0.995), plan(1.2)
    assert first_place(best, [best, slower], Objective().text()) == "fastest"
    assert first_place(best, [faster, slower], Objective().text()).startswith("chosen (0.5% slower than dp=2 ")
    cost = Objective(kind="cost")
    assert first_place(best, [faster, slower], cost.text()) == "cheapest per token"


def test_a_per_stage_plan_is_shown_by_its_degrees_exactly_when_it_is_their_mesh():
    def staged(*st):
        p = Plan(stages=tuple(ST.Stage(layers=n, replicas=tuple(ST.Replica(tp=len(d), devices=tuple(d))
                                                                for d in reps)) for n, reps in st))
        return p.resolve(M, load_cluster(f"local:{p.world}"), 128, 8)

    for stage_plan, mesh in ((staged((4, [[0], [1], [2], [3]])), Degrees(dp=4)),
                             (staged((2, [[0, 1]]), (2, [[2, 3]])), Degrees(pp=2, tp=2)),
                             (staged((2, [[0, 1]]), (2, [[2], [3]][:1])), None)):
        q = Plan(degrees=mesh or stage_plan.degrees)
        mesh_plan = q.resolve(M, load_cluster(f"local:{q.world}"), 128, 8)
        same = stage_plan.layout() == mesh_plan.layout()
        assert same == (mesh is not None)
        text = ST.degrees_text(stage_plan.to_dict())
        assert (text == ST.degrees_text(mesh_plan.to_dict())) == same, text
        assert text.startswith("stages ") != same
