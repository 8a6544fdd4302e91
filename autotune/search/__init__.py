"""The search: Optuna over a search space, every point priced by the cost model.

One module per part (each small enough to read in one sitting):

* ``options``   what a search is asked (SearchOptions) and answers (SearchResult); the spaces.
* ``pricing``   one point -> plan -> prediction -> Outcome, once per distinct plan (Evaluator).
* ``phases``    baselines, balanced starts, the sampler (TPE or random), the polish (hill climb).
* ``grid``      the grid sampler: every discrete point priced directly, exhaustive where small.
* ``workspace`` a process's view of its study: rows the phases rank by, batches to the storage.
* ``spill``     the write-ahead file that keeps finished trials through SIGKILL; resume recovers it.
* ``workers``   ``--workers K`` processes on one shared study; ``signals`` their Ctrl-C/SIGTERM rules.
* ``report``    the best plans, the best even split, why the best wins, why nothing is feasible.
* ``run``       ``search()``: the phases in order (docs/contracts.md, "Study").

Speed. Optuna's in-memory storage deep-copies every trial it adds or returns and TPE's cost per
trial grows with the trials in its study, so TPE samples on a private study of params and values
only; full trials (plan, breakdown) go to the real study in batches, their big attrs shared rather
than copied (pricing.Shared), and only priced plans become trials in the polish and the grid.
"""

from autotune.search.grid import GRID_KEEP, GridCount, run_grid
from autotune.search.options import (
    DEFAULT_TRIALS,
    POLISH_FACTOR,
    SAMPLERS,
    SearchOptions,
    SearchResult,
    check_options,
    load_space,
    space_names,
)
from autotune.search.phases import run_baselines, run_polish, run_sampler, run_starts
from autotune.search.pricing import TIMELINE_LIMIT, Evaluator, Outcome, default_estimator, plan_dict
from autotune.search.report import collect, infeasibility_report, why_best
from autotune.search.run import search
from autotune.search.workspace import Row, Workspace, make_sampler

__all__ = ["DEFAULT_TRIALS", "GRID_KEEP", "POLISH_FACTOR", "SAMPLERS", "TIMELINE_LIMIT", "Evaluator", "GridCount",
           "Outcome", "Row", "SearchOptions", "SearchResult", "Workspace", "check_options", "collect",
           "default_estimator", "infeasibility_report", "load_space", "make_sampler", "plan_dict", "run_baselines",
           "run_grid", "run_polish", "run_sampler", "run_starts", "search", "space_names", "why_best"]
