"""The search's early stops: the sampler's patience (autotune/search/phases.py run_sampler) and when
it applies (run.budget_of: the default budget only; --trials N runs its N)."""

from __future__ import annotations

from types import SimpleNamespace

from autotune.search.options import SAMPLER_PATIENCE, SearchOptions
from autotune.search.phases import run_sampler
from autotune.search.run import budget_of


class _Trial(SimpleNamespace):
    pass


class _Mem:
    def __init__(self):
        self.asked = 0

    def ask(self, dists):
        self.asked += 1
        return _Trial(params={"i": self.asked})


class _Workspace:
    def __init__(self, best_before: float | None):
        self.rows = [] if best_before is None else [SimpleNamespace(feasible=True, value=best_before)]
        self.mem, self.dists, self.recorded = _Mem(), {}, 0

    def record(self, params, out, trial=None):
        self.recorded += 1


class _Evaluator:
    """Trial i is worth values[i - 1] (then the last value again)."""

    def __init__(self, values):
        self.values = values

    def evaluate(self, params):
        v = self.values[min(params["i"], len(self.values)) - 1]
        return SimpleNamespace(feasible=v > 0, value=v)


def test_the_sampler_stops_after_patience_trials_without_a_new_best():
    values = [1.0, 3.0, 2.0, 5.0] + [4.0] * 100  # the last new best is trial 4
    ws = _Workspace(best_before=None)
    assert run_sampler(ws, _Evaluator(values), 100, None, patience=10) == 4 + 10
    assert ws.recorded == 14


def test_the_patience_counts_from_the_best_priced_before_the_sampler():
    ws = _Workspace(best_before=10.0)  # the baselines' best: no sampler trial beats it
    assert run_sampler(ws, _Evaluator([1.0, 9.0, 2.0]), 100, None, patience=5) == 5


def test_without_patience_the_sampler_runs_its_trials():
    ws = _Workspace(best_before=None)
    assert run_sampler(ws, _Evaluator([1.0]), 40, None) == 40


def test_patience_applies_to_the_default_budget_only():
    assert budget_of(SearchOptions(), None).patience == SAMPLER_PATIENCE
    assert budget_of(SearchOptions(trials=100), None).patience is None
