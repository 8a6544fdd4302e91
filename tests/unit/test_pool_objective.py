"""Objectives on a pool: the plan a search chooses is the best of its study's trials by the objective
and within the limits (checked by scanning every trial), the front is what no trial beats on both
step time and cost, and the dashboard, report and apply show them."""

from __future__ import annotations

import optuna
import pytest

from autotune.objective import cost_of, make_objective, step_of
from autotune.search import SearchOptions
from autotune.search.pool import pool_search
from autotune.specs import load_model
from autotune.specs.cluster import cluster_from_dict
from autotune.study import best_feasible, is_feasible, storage_for

POOL = {"name": "duo", "inter_node": {"bandwidth": "100Gbit/s", "latency": "5us"},
        "nodes": [{"available": 2, "devices_per_node": 2, "device": "H100-SXM", "price": "2.10USD/h"},
                  {"available": 1, "devices_per_node": 2, "device": "V100-16GB", "price": "0.40USD/h"}]}


def _search(name, kind="time", budget=None, max_step=None):
    pool = cluster_from_dict(POOL)
    obj = make_objective(kind, budget, max_step, pool)
    res = pool_search(load_model("small"), pool, 2048, 8, study_name=name, storage=":memory:",
                      options=SearchOptions(dtype="fp16", trials=5), objective=obj)
    trials = [t for t in optuna.load_study(study_name=name, storage=storage_for(":memory:")).get_trials(deepcopy=False)
              if is_feasible(t)]
    return res, trials


def _per_hour(t):
    return t.user_attrs["cost"]["per_hour"]


@pytest.mark.parametrize("kind, budget, max_step", [("time", None, None), ("cost", None, None),
                                                    ("time", "9USD/h", None), ("cost", None, "from-fastest")])
def test_the_chosen_plan_is_the_best_trial_by_the_objective_within_its_limits(kind, budget, max_step):
    name = f"obj-{kind}-{budget}-{max_step}"
    if max_step == "from-fastest":  # a limit between the fastest plan and the cheapest one
        res0, trials0 = _search(name + "-0")
        steps = sorted(step_of(t.user_attrs) for t in trials0)
        max_step = f"{steps[len(steps) // 4]}s"
    res, trials = _search(name, kind, budget, max_step)
    lim_h = float(budget[:-5]) if budget else float("inf")
    lim_s = float(max_step[:-1]) if max_step else float("inf")
    ok = [t for t in trials if _per_hour(t) <= lim_h and step_of(t.user_attrs) <= lim_s]
    assert ok
    key = (lambda t: step_of(t.user_attrs)) if kind == "time" else (lambda t: cost_of(t.user_attrs))
    best = min(key(t) for t in ok)
    chosen = next(t for t in trials if t.number == res.best_trial)
    assert chosen in ok and key(chosen) <= best * 1.01  # the tie-break may prefer a simpler plan within 1%
    assert best_feasible(optuna.load_study(study_name=name, storage=storage_for(":memory:"))).number == res.best_trial
    # the front: no feasible trial beats a front point on both axes, and the chosen plan's subset is on it
    for p in res.front:
        assert not any(step_of(t.user_attrs) < p["step_time_s"] * (1 - 1e-9) and
                       cost_of(t.user_attrs) < p["cost"]["per_mtok"] * (1 - 1e-9) for t in trials)
    assert sum(p["chosen"] for p in res.front) == 1


def test_dashboard_and_report_draw_the_front(tmp_path):
    from rich.console import Console

    from autotune.dashboard.data import load_view
    from autotune.dashboard.report import render_html
    from autotune.dashboard.terminal import render

    res, _ = _search("dash", "cost")
    view = load_view("dash", ":memory:")
    con = Console(width=160, record=True)
    con.print(render(view, console=con))
    text = con.export_text()
    assert "Pareto front" in text and f"#{res.front[0]['trial']}" in text
    flat = " ".join(text.split())
    assert all(" ".join(line.split(":")[0].split()) in flat for line in res.left_out)
    page, facts = render_html(view)
    assert "front" in facts["charts"] and "<div id='front' class='chart'>" in page and '"chosen"' in page


def test_a_step_time_no_plan_meets_is_said():
    from autotune.errors import InputError

    # below what the devices could do at their peak: refused before anything is searched (the limits
    # between that floor and the fastest plan: tests/unit/test_pool_truth.py)
    with pytest.raises(InputError, match="1e-09 s is unreachable: even at its devices' peak throughput"):
        _search("unmet", "time", None, "1ns")


def test_a_much_slower_group_is_left_out_and_the_line_says_why():
    """8 H100 + 8 V100-16GB, llama2-7b at 64k tokens: the fastest plan leaves the V100s out, and the
    line compares it with the best plan found with them (which the study holds)."""
    pool = cluster_from_dict({"name": "h100-v100", "inter_node": {"bandwidth": "100Gbit/s", "latency": "5us"},
                              "nodes": [{"available": 1, "devices_per_node": 8, "device": "H100-SXM"},
                                        {"available": 1, "devices_per_node": 8, "device": "V100-16GB"}]})
    res = pool_search(load_model("llama2-7b"), pool, 65536, 8, study_name="slow-group", storage=":memory:",
                      options=SearchOptions(dtype="fp16", trials=30), objective=make_objective("time", None, None, pool))
    assert res.best.plan.uses == (1, 0)
    trials = [t for t in optuna.load_study(study_name="slow-group", storage=storage_for(":memory:"))
              .get_trials(deepcopy=False) if is_feasible(t) and t.user_attrs.get("uses") == "1,1"]
    with_them = min(step_of(t.user_attrs) for t in trials)
    ratio = with_them / res.best.predicted["step_time_s"]
    assert ratio > 1 and len(res.left_out) == 1
    assert res.left_out[0].startswith(f"8 V100-16GB left out: with them the step takes {ratio:.2f}x longer")
    # without prices the front is drawn against the devices used
    assert [p["devices"] for p in res.front] == sorted(p["devices"] for p in res.front)[::-1] or len(res.front) == 1
