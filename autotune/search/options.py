"""What a search is asked to do (SearchOptions), what it answers (SearchResult), and the spaces it
can search (a name of search_spaces/, a Python file or an installed entry point: search/spaces.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotune.errors import InputError
from autotune.plan import GRAD_REDUCE_DTYPE, GRAD_REDUCES
from autotune.plan_parts import compute_dtype
from autotune.plan_record import PlanRecord
from autotune.search.spaces import load_space, space_names  # noqa: F401  (their old home)
from autotune.study import worker_count_ok

SAMPLERS = ("tpe", "random", "grid")
DEFAULT_TRIALS = 100
SAMPLER_PATIENCE = 10  # the default budget's sampler stops after this many trials in a row without a new
# best (an explicit --trials N runs its N: a longer search is asked for by name). 25 before the
# balanced starts priced every layout: past them TPE's trials built 2-3 new plans in 25 and no new
# best on the bench's mixed A100 + V100 setups, at ~30 ms an ask over the ~250-600 trials before it
# (a sixth of a 16-device search). What it adds at 128 devices (a seed from which the polish climbs
# to the best plan) came within its first 5 trials at 128k (b=16) and within 10 at 32k (b=256: with
# 5, 54,900 tok/s against 54,920)
POLISH_FACTOR = 4  # the hill climb may price up to this many times the sampler's trials (it converges
# sooner; each of its points costs one estimate, no sampler work, so it is the cheap part of the search;
# the --trials help in commands/search.py says 4x). 8 before the starts grew to the micro-batch their
# memory allows and the pair moves went to the best climbs only (phases.run_polish): issue 26's mixed
# clusters reach the same plans with 4


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    trials: int | None = None
    """Sampler trials (baselines and the polish's hill climb, up to POLISH_FACTOR x, come on top);
    None: DEFAULT_TRIALS, or the whole grid."""
    timeout_s: float | None = None
    sampler: str = "tpe"
    workers: int = 1
    seed: int = 0
    top: int = 5
    space: str = "default"
    batch_s: float = 1.0
    polish: bool = True
    dtype: str = "auto"
    """The precision (``plan.DTYPE_CHOICES``): ``auto``, as ``--dtype`` defaults, takes bf16 where every
    device of the cluster has it, else fp16, else fp32 (``plan.choose_dtype``, asked by ``search``)."""
    target: str = "runtime"
    """Who will run the plan (autotune/targets.py): the search explores only what it can run."""
    grad_reduce: str = "fp32"
    """The gradient reduction of every plan (``plan.GRAD_REDUCES``): bf16 changes the numerics, so it is
    the user's choice, not a knob (``search_spaces/_recipe.py``); the target must run it."""
    documents: dict[str, Any] | None = None
    """The workload's documents (``autotune.documents.DocumentSource.record``), recorded with the
    study; the plans are priced with their masks by ``cost/documents_estimator.DocumentsEstimator``."""
    doc_mask: bool = True
    """With documents: mask attention at their boundaries (False: priced as whole causal windows)."""


@dataclass
class SearchResult:
    study_name: str
    storage: str
    best: PlanRecord
    """The best plan with its prediction (``study.trial_record`` of the best trial)."""
    top: list[PlanRecord]
    baseline_best: PlanRecord | None
    trials: int
    new_trials: int
    elapsed_s: float
    notes: list[str] = field(default_factory=list)
    why: str = ""
    best_trial: int = -1
    baseline_trial: int | None = None
    stopped: str | None = None
    """Why the search ended before its budget (``timeout``), else None."""
    layouts: list[tuple[dict[str, Any], Any]] = field(default_factory=list)
    """The best plan of each of the best ``top`` layouts with its breakdown (for the table; not in JSON)."""
    targets: dict[str, Any] = field(default_factory=dict)
    """Per export target, the best plan of the study it can express and its ratio to the best
    (``targets.best_per_target``)."""
    front: list[dict[str, Any]] = field(default_factory=list)
    """The Pareto front of step time against cost (per million tokens with prices, else devices
    used), fastest first; each point names its trial and plan (autotune/search/pool.py)."""
    left_out: list[str] = field(default_factory=list)
    """One line per node group the best plan leaves nodes of out, saying why that pays."""
    objective: dict[str, Any] | None = None
    """What a pool search optimised (autotune/objective.py); None: tokens/s."""
    costs: list[dict[str, Any] | None] = field(default_factory=list)
    """A priced search's ``cost`` (``objective.figures``) of ``best``, then of each plan of ``top``."""

    def to_dict(self) -> dict[str, Any]:
        def with_cost(rec: PlanRecord, i: int) -> dict[str, Any]:
            c = self.costs[i] if i < len(self.costs) else None
            return {**rec.to_dict(), **({"cost": c} if c is not None else {})}

        return {"best": with_cost(self.best, 0), "top": [with_cost(p, i + 1) for i, p in enumerate(self.top)],
                "baseline_best": self.baseline_best.to_dict() if self.baseline_best else None,
                "trials": self.trials, "new_trials": self.new_trials, "elapsed_s": self.elapsed_s,
                "study": self.study_name, "storage": self.storage, "best_trial": self.best_trial,
                "baseline_trial": self.baseline_trial, "notes": self.notes, "why": self.why,
                "stopped": self.stopped, "targets": self.targets, "front": self.front, "left_out": self.left_out,
                "objective": self.objective}


def check_grad_reduce(opts: SearchOptions, model: Any, cluster: Any, seq_len: int, global_batch: int) -> None:
    """``--grad-reduce bf16`` needs bf16 weights (the precision chosen) and a target that runs it (its
    own rules: ``targets.expresses``); one line naming the flag otherwise."""
    if opts.grad_reduce == GRAD_REDUCE_DTYPE:
        return
    if compute_dtype(opts.dtype) != "bf16":
        raise InputError(f"{opts.grad_reduce} reduction needs bf16 weights (--dtype bf16 or FP8), got {opts.dtype}",
                         field="--grad-reduce")
    from autotune.targets import context, expresses

    if not expresses(opts.target, "grad_reduce", context(model, cluster, seq_len, global_batch)):
        raise InputError(f"{opts.grad_reduce}: --target {opts.target} reduces gradients in {GRAD_REDUCE_DTYPE} "
                         "(Megatron runs --grad-reduce-in-bf16)", field="--grad-reduce")


def check_options(opts: SearchOptions, storage: str) -> None:
    if opts.sampler not in SAMPLERS:
        from autotune.errors import suggest

        raise InputError(f"unknown sampler {opts.sampler!r}" + suggest(opts.sampler, SAMPLERS), field="--sampler")
    if opts.trials is not None and opts.trials < 1:
        raise InputError(f"must be >= 1, got {opts.trials}", field="--trials")
    if opts.timeout_s is not None and not opts.timeout_s > 0:
        raise InputError(f"must be > 0 seconds, got {opts.timeout_s}", field="--timeout")
    from autotune.targets import check_target

    check_target(opts.target)
    if opts.grad_reduce not in GRAD_REDUCES:
        from autotune.errors import suggest

        raise InputError(f"unknown gradient reduction {opts.grad_reduce!r}" + suggest(opts.grad_reduce, GRAD_REDUCES),
                         field="--grad-reduce")
    if opts.workers < 1:
        raise InputError(f"must be >= 1, got {opts.workers}", field="--workers")
    if opts.top < 1:
        raise InputError(f"must be >= 1, got {opts.top}", field="--top")
    load_space(opts.space)  # a bad --space (name, file, entry point) is refused before anything is written
    worker_count_ok(storage, opts.workers)
