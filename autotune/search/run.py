"""``search``: open (or resume) the study, run the phases in order, answer with the best plans."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.errors import InputError
from autotune.plan import choose_dtype
from autotune.search.grid import GridCount, grid_note, run_grid
from autotune.search.options import (
    DEFAULT_TRIALS,
    POLISH_FACTOR,
    SAMPLER_PATIENCE,
    SearchOptions,
    SearchResult,
    check_grad_reduce,
    check_options,
)
from autotune.search.phases import run_baselines, run_polish, run_sampler, run_starts
from autotune.search.pricing import Evaluator, Outcome
from autotune.search.report import collect, failure_summary
from autotune.search.spill import recover
from autotune.search.workers import run_workers, setup
from autotune.search.workspace import Workspace, make_sampler
from autotune.study import StudyRecord, create_or_open
from autotune.study_direct import DirectStudy
from autotune.units import counted

if TYPE_CHECKING:
    from autotune.progress import Progress


@dataclass
class Budget:
    """How much each phase may do: the sampler's (or the grid's) points and the polish's calls."""

    n_main: int
    n_polish: int
    grid: dict[str, Any] | None = None  # {"index", "of", "limit"} for the grid sampler
    grid_size: int = 0
    patience: int | None = None
    """The sampler's early stop (``run_sampler``): with the default budget only."""


def budget_of(opts: SearchOptions, space: Any) -> Budget:
    if opts.sampler != "grid":
        n_main = opts.trials or DEFAULT_TRIALS
        return Budget(n_main, POLISH_FACTOR * n_main if opts.polish else 0,
                      patience=SAMPLER_PATIENCE if opts.trials is None else None)
    from search_spaces.default import GRID_LIMIT

    size = space.grid_size(GRID_LIMIT)
    if opts.trials is None and size > GRID_LIMIT:
        raise InputError(f"the grid has more than {GRID_LIMIT:,} points; too large to enumerate, use "
                         "--sampler tpe or give --trials N to enumerate the first N", field="--sampler")
    limit = opts.trials if opts.trials is not None and opts.trials < size else None
    return Budget(limit or size, 0, {"index": 0, "of": 1, "limit": limit}, size)


@dataclass
class _Run:
    """One search's moving parts, passed from phase to phase, and what it reports as it goes."""

    name: str
    storage: str
    workload: tuple[Any, Any, int, int]  # model, cluster, seq_len, global_batch
    opts: SearchOptions
    estimator: Callable[..., Any] | None
    space: Any
    ev: Evaluator
    ws: Workspace
    deadline: float | None
    say: Callable[[str], None]
    display: Progress | None
    notes: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # trials recorded per phase
    totals: dict[str, int | None] = field(default_factory=dict)
    phase: str = ""
    best: float = 0.0

    def enter(self, phase: str, total: int | None = None) -> None:
        self.phase, self.totals[phase] = phase, total
        self.counts.setdefault(phase, 0)
        if self.display is not None:
            self.display.phase(phase, total)

    def recorded(self, out: Outcome) -> None:
        """Workspace.on_record: count the trial, keep the best, move the display on."""
        self.counts[self.phase] = self.counts.get(self.phase, 0) + 1
        best = None
        if out.feasible and out.value > self.best:
            self.best = out.value
            best = f"{self.best:,.0f} tok/s"
        if self.display is not None:
            self.display.advance(best=best)

    def how_far(self) -> str:
        return ", ".join(f"{k} {n}" + (f" of {self.totals[k]}" if self.totals.get(k) else "")
                         for k, n in self.counts.items())


def _open(run: _Run) -> int:
    """Recover what killed processes spilled, note a resumed study; returns the trials it held."""
    ws = run.ws
    if ws.persistent is not None:
        got = recover(run.storage, ws.persistent)
        if got:
            ws.pull()
            run.notes.append(f"recovered {got} finished trials that a killed search process had not persisted")
    before = len(ws.rows)
    if before:
        run.notes.append(f"resumed study {run.name!r} with {counted(before, 'trial')}")
    run.ev.prime(ws.rows)
    return before


def _main_phase(run: _Run, b: Budget) -> GridCount | None:
    """The sampler, the grid, or K worker processes running either."""
    if run.opts.workers > 1:
        run.enter(f"{'grid' if b.grid is not None else 'sampler'} ({run.opts.workers} workers)")
        run.ws.flush()
        before = len(run.ws.rows)
        run_workers(run.name, run.storage, *run.workload, run.opts, run.estimator, b.n_main, b.grid, run.deadline)
        run.ws.pull()
        run.counts[run.phase] += len(run.ws.rows) - before  # the workers' trials, recorded in their processes
        return None
    if b.grid is not None:
        run.enter("grid")
        return run_grid(run.ws, run.ev, itertools.islice(run.space.grid_points(), b.grid["limit"]), run.deadline)
    run.enter("sampler", b.n_main)
    run_sampler(run.ws, run.ev, b.n_main, run.deadline, b.patience)
    return None


def _phases(run: _Run) -> None:
    run.enter("baselines", len(run.space.baselines()))
    run.say(f"baselines: {run_baselines(run.ws, run.ev, run.deadline)} trials")
    b = budget_of(run.opts, run.space)
    if b.grid is None and run.opts.polish:  # the starts take at most as many cost-model calls as the polish
        run.enter("balanced starts")
        run.say(f"balanced starts: {run_starts(run.ws, run.ev, run.deadline, b.n_polish, run.opts.seed)} trials")
    gc = _main_phase(run, b)
    run.say("sampler done")
    if b.grid is not None:
        run.notes.append(grid_note(b.grid_size, b.grid["limit"], gc, b.n_main))
    if b.n_polish:
        run.ev.prime(run.ws.rows)
        run.enter("polish")
        run_polish(run.ws, run.ev, b.n_polish, run.deadline)


def search(model: Any, cluster: Any, seq_len: int, global_batch: int, *, study_name: str, storage: str,
           options: SearchOptions | None = None, estimator: Callable[..., Any] | None = None,
           progress: Callable[[str], None] | None = None, display: Progress | None = None) -> SearchResult:
    """Run (or resume) the search and return the best plans. Picklable ``estimator`` for workers > 1.
    ``progress``: told each phase's trial count as a line; ``display``: a live Progress (autotune/progress.py)."""
    opts = options or SearchOptions()
    check_options(opts, storage)
    # the precision is chosen (and a device that lacks it refused) before any point is priced, as the
    # CLI does: an API caller's default ``auto`` means the same as ``--dtype``'s
    opts = dataclasses.replace(opts, dtype=choose_dtype(opts.dtype, cluster))
    check_grad_reduce(opts, model, cluster, seq_len, global_batch)
    t0 = time.monotonic()
    estimator = documents_estimator(opts, estimator)
    _ctx, space, ev = setup(model, cluster, seq_len, global_batch, opts, estimator)
    record = StudyRecord(model=model, cluster=cluster, seq_len=seq_len, global_batch=global_batch, space=opts.space,
                         target=opts.target, documents=opts.documents)
    # once, in the parent, before any worker starts; one process: a new SQLite study without SQLAlchemy
    study = create_or_open(study_name, storage, record, direct=opts.workers == 1)
    ws = Workspace(study_name, storage, space.distributions(), make_sampler(opts.sampler, opts.seed), opts.batch_s,
                   study=study if isinstance(study, DirectStudy) else None)
    say = progress or (display.say if display is not None else (lambda _m: None))
    run = _Run(study_name, storage, (model, cluster, seq_len, global_batch), opts, estimator, space, ev, ws,
               t0 + opts.timeout_s if opts.timeout_s else None, say, display)
    if display is not None:
        display.opened()
        display.deadline(run.deadline)
    _workload_notes(run, model, cluster, opts)
    ws.on_record = run.recorded
    before = _open(run)
    _run_phases(run, ws)
    stopped = None
    if run.deadline is not None and time.monotonic() >= run.deadline:
        stopped = "timeout"
        run.notes.append(f"--timeout {opts.timeout_s:g} s stopped the search during the {run.phase} after "
                         f"{time.monotonic() - t0:.1f} s; trials per phase: {run.how_far()}")
    known = ws.finished()
    if ev.failures:
        run.notes.append(failure_summary(known.get_trials(deepcopy=False)) + "; they are recorded as failed trials")
    res = collect(known, storage, opts.top, time.monotonic() - t0, before, run.notes, run.workload)
    res.stopped = stopped
    return res


def documents_estimator(opts: SearchOptions, estimator: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """The estimator given, or a document-masked one when the options name documents with doc_mask
    (every search path asks this: the plain one here, a pool's or an objective's ``search/pool.py``)."""
    if estimator is None and opts.documents is not None and opts.doc_mask:
        from autotune.cost.documents_estimator import DocumentsEstimator
        from autotune.documents import DocumentSource

        estimator = DocumentsEstimator(DocumentSource.from_record(opts.documents).dist)
    return estimator


def _workload_notes(run: _Run, model: Any, cluster: Any, opts: SearchOptions) -> None:
    """Add the notes about the workload itself (a model the runtime cannot build, precision) to ``run``."""
    from autotune.targets import model_problems

    if (why := model_problems(opts.target, model)) is not None:
        run.notes.append(f"autotune's runtime cannot build {model.name} ({why}): the plans are priced for the "
                         "frameworks that can; `validate` and `trial` will refuse them")
    from autotune.cost.layers import precision_notes

    run.notes += precision_notes(cluster, model, opts.dtype)


def _run_phases(run: _Run, ws: Workspace) -> None:
    """Run the search's phases, closing the workspace whatever happens; Ctrl-C is raised after the close."""
    interrupted = False
    try:
        _phases(run)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        ws.close()
    if interrupted:
        raise KeyboardInterrupt
