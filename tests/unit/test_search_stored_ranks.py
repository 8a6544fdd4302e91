"""What a search stores of each plan's per-rank rows (autotune/search/workspace.py KEEP_RANKS_NEAR):
the plans near the best so far keep them, the cost model's own rows (an estimate of the same plan is
the reference); the others keep their totals and stage rows and say how many rows they dropped."""

from __future__ import annotations

from autotune.cost.estimate import estimate
from autotune.plan import Plan
from autotune.search import SearchOptions, search
from autotune.search.workspace import KEEP_RANKS_NEAR
from autotune.specs import load_cluster, load_model
from autotune.study import is_feasible, open_study

TINY, L4 = load_model("tiny"), load_cluster("local:4")


def test_plans_near_the_best_keep_their_rank_rows_and_the_rest_drop_them(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    res = search(TINY, L4, 256, 8, study_name="s", storage=url, options=SearchOptions(trials=12))
    trials = sorted(open_study("s", url).get_trials(), key=lambda t: t.number)
    best, kept, dropped = 0.0, 0, 0
    for t in trials:  # replay the rule in the order the trials were recorded
        bd = t.user_attrs.get("breakdown")
        if not isinstance(bd, dict):
            continue
        near = is_feasible(t) and t.value >= KEEP_RANKS_NEAR * best
        if near:
            assert len(bd["ranks"]) == 4 and "ranks_dropped" not in bd, t.number
            kept += 1
        else:
            assert bd["ranks"] is None and bd["ranks_dropped"] == 4, t.number
            assert bd["stages"] and bd["step_time_s"] > 0  # the totals and the stage rows stay
            dropped += 1
        if is_feasible(t):
            best = max(best, t.value)
    assert kept and dropped
    top = next(t for t in trials if t.number == res.best_trial)  # the plan the search reports
    again = estimate(Plan.from_dict(top.user_attrs["plan"]), TINY, L4, 256, 8).breakdown["ranks"]
    assert top.user_attrs["breakdown"]["ranks"] == again
