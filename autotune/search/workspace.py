"""A search process's view of its study: what the phases rank by, and how trials reach the storage.

The sampler (TPE) works on a private in-memory study that holds only params and values, so
Optuna's per-trial copies stay small; the full trials (plan, breakdown, reasons) go to the real
study in batches (at least every ``batch_s`` seconds, at the end, and on Ctrl-C / SIGTERM), each
finished trial first appended to a spill file so SIGKILL loses none (autotune/search/spill.py).
On an RDB storage (SQLite, PostgreSQL) a batch is one transaction (autotune/search/bulk.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from autotune.search.bulk import add_trials, encode_attrs, rdb_backend
from autotune.search.pricing import Outcome, Row, Shared  # noqa: F401  (Row: its old home)
from autotune.search.signals import signals_deferred
from autotune.search.spill import Spill
from autotune.study import MEMORY_URL, is_feasible, storage_for
from autotune.study_direct import DirectStudy

# A stored trial keeps its per-rank rows (21 KB of a 32-rank plan's 24 KB breakdown) when it is
# feasible and within this fraction of the best plan this process had seen when it was recorded: the
# plans `validate` proves and calibrates from, the best plan the report and the dashboard describe
# (a best plan was the best so far when it was recorded, so it always keeps them). The others keep
# their totals and their per-stage rows; the rows are the cost model's, so `estimate` gives them
# again for any plan. Writing every trial's rows was a sixth of a 32-device search (measured: 17.6 MB
# of JSON for 760 trials, 0.6 s of `autotune search`'s 3.9 s).
KEEP_RANKS_NEAR = 0.9


def make_sampler(name: str, seed: int) -> Any:
    import optuna

    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    from autotune.search.tpe import MemoTPESampler

    # grid points are added as fixed trials; TPE stays the sampler of record
    return MemoTPESampler(seed=seed, multivariate=True, n_startup_trials=16)


def finished_trial(params: dict[str, Any], dists: Shared, value: float | None, state: Any,
                   user_attrs: dict[str, Any] | None = None, constraints: dict[str, float] | None = None) -> Any:
    """``optuna.trial.create_trial`` for a finished trial, keeping ``dists`` as they are (shared by
    every trial, never copied: see Shared). create_trial first rebuilds the distributions dict,
    passing each through Optuna's converter of pre-3.0 distributions: a tenth of a 16-device
    search's time, for distributions this process made with today's classes. The trial is
    validated as create_trial validates it."""
    import datetime

    import optuna

    now = datetime.datetime.now()
    trial = optuna.trial.FrozenTrial(number=-1, trial_id=-1, state=state, value=value, datetime_start=now,
                                     datetime_complete=now, params=params, distributions=dists,
                                     user_attrs=user_attrs or {}, system_attrs={}, intermediate_values={})
    for key, v in (constraints or {}).items():
        trial.set_constraint(key, v)
    trial._validate()
    return trial


class Workspace:
    """This process's view of the study.

    ``rows`` lists every trial this process has seen (its own and, on a shared storage, the ones
    other workers persisted, pulled before every batch so TPE learns from them too). Each trial this
    process records carries ``origin`` = ``<process id>:<n>``, n counting from 0 without gaps: what
    the spill recovery and the fault tests check against."""

    def __init__(self, name: str, storage: str, distributions: dict[str, Any], sampler: Any, batch_s: float,
                 pull_each_batch: bool = False, keep: Callable[[Any], bool] | None = None,
                 stored: list[Any] | None = None, study: DirectStudy | None = None):
        import optuna

        # a worker pulls the others' trials before each batch so its sampler learns from them; the
        # parent pulls once, after its workers (autotune/search/run.py)
        self.pull_each_batch = pull_each_batch
        # which stored trials are this workspace's to rank and learn from (a pool search: one
        # subset's; autotune/search/pool.py); None: all of them
        self.keep = keep
        # ``stored``: the study's trials as the caller already read them (a pool search reads them
        # once for its ~15 subsets: each reading the whole study back took a quarter of its time)

        self.name, self.storage_url, self.batch_s = name, storage, batch_s
        self.dists = Shared(distributions)  # shared by every trial (never mutated; see Shared)
        self.origin = uuid.uuid4().hex[:12]
        self.local = 0
        # ``study``: the new study autotune/study_direct.py wrote (this process's only), else Optuna's
        self.persistent = study if study is not None else None if storage == MEMORY_URL else \
            optuna.load_study(study_name=name, storage=storage_for(storage))
        # where the full trials go: the shared storage, or the :memory: study itself
        self.dest = self.persistent if self.persistent is not None else \
            optuna.load_study(study_name=name, storage=storage_for(storage))
        self.mem = optuna.create_study(direction="maximize", sampler=sampler)  # the sampler's, params only
        self.rows: list[Row] = []
        self.pending: list[Any] = []
        self.pending_json: list[dict[str, str]] = []  # their user attrs encoded (with a spill file)
        self.taken: list[Any] = []  # finished trials found in the storage (others', earlier runs')
        self.written: list[Any] = []  # this process's trials bulk-written, numbered as stored
        self.seen_ids: set[int] = set()
        self.persisted_mine: set[str] = set()  # origins of this process's trials the storage holds
        self.last_flush = time.monotonic()
        self.best = 0.0  # the best feasible value seen so far (``KEEP_RANKS_NEAR``)
        self.on_record: Callable[[Outcome], None] | None = None  # told of every trial recorded (progress)
        # every finished trial is also in this file until its batch is persisted
        self.spill = Spill(storage, name, self.origin) if self.persistent is not None else None
        self._take(self.dest.get_trials(deepcopy=False) if stored is None else stored)

    def _take(self, trials: list[Any]) -> list[Any]:
        """Trials found in the storage (a resumed study, other workers) into rows and the sampler."""
        import optuna

        new, light = [], []
        for t in trials:
            if t._trial_id in self.seen_ids or t.state not in (optuna.trial.TrialState.COMPLETE,
                                                               optuna.trial.TrialState.FAIL):
                continue
            if self.keep is not None and not self.keep(t):
                continue
            self.seen_ids.add(t._trial_id)
            origin = str(t.user_attrs.get("origin", ""))
            if origin.startswith(self.origin + ":"):
                self.persisted_mine.add(origin)
                continue
            new.append(t)
            self.taken.append(t)
            self.rows.append(Row(dict(t.params), t.value, is_feasible(t), t.user_attrs,
                                 dict(getattr(t, "constraints", None) or {})))
            if self.rows[-1].feasible and t.value is not None:
                self.best = max(self.best, float(t.value))
            if t.params and all(k in self.dists for k in t.params):
                light.append(optuna.trial.create_trial(params=t.params, distributions=t.distributions,
                                                       value=t.value, state=t.state))
        if light:
            self.mem.add_trials(light)
        return new

    def pull(self) -> list[Any]:
        """Take the trials other processes persisted since the last pull."""
        if self.persistent is None:
            return []
        return self._take(self.persistent.get_trials(deepcopy=False))  # _take keeps finished trials only

    def record(self, params: dict[str, Any], out: Outcome, extra: dict[str, Any] | None = None,
               trial: Any = None, sampler: bool = True) -> None:
        """A finished point: into rows, the sampler's study (``sampler=False``: not, e.g. for the
        grid, whose points TPE never learns from) and the next batch for the real study."""
        import optuna

        attrs = {"baseline": None, **out.attrs, **(extra or {}), "origin": f"{self.origin}:{self.local}"}
        state = optuna.trial.TrialState.FAIL if out.failed else optuna.trial.TrialState.COMPLETE
        value = None if out.failed else out.value
        dists = self.dists
        if trial is not None:  # asked from the sampler: tell it
            dists = Shared(trial.distributions)
            self.mem.tell(trial, value, state=state)
        own = dists if len(dists) == len(params) else Shared({k: dists[k] for k in params})
        if trial is None and sampler:
            self.mem.add_trial(finished_trial(params, own, value, state))
        frozen = finished_trial(params, own, value, state, self._stored(attrs, out), out.constraints or None)
        if out.feasible and out.value is not None:  # after _stored: a plan is compared with those before it
            self.best = max(self.best, float(out.value))
        self.rows.append(Row(dict(params), value, out.feasible, attrs, out.constraints, mine=True))
        self.local += 1  # after the trial exists: the origins of one process stay gap-free
        self.pending.append(frozen)  # first: an interrupt inside the spill write loses nothing
        if self.spill is not None:
            js = encode_attrs(frozen.user_attrs)  # once, for the spill line and the batch
            self.pending_json.append(js)
            self.spill.append(frozen, js)
        if self.on_record is not None:
            self.on_record(out)
        if time.monotonic() - self.last_flush >= self.batch_s:
            self.flush()

    def _stored(self, attrs: dict[str, Any], out: Outcome) -> dict[str, Any]:
        """``attrs`` as the storage gets them: without the per-rank rows unless the plan is near the
        best so far (``KEEP_RANKS_NEAR``); this process's rows keep them all (the phases read them)."""
        near = out.feasible and out.value is not None and out.value >= KEEP_RANKS_NEAR * self.best
        bd = attrs.get("breakdown")
        if near or not isinstance(bd, dict) or not bd.get("ranks"):
            return attrs
        return {**attrs, "breakdown": Shared({**bd, "ranks": None, "ranks_dropped": len(bd["ranks"])})}

    def flush(self) -> None:
        """Persist the pending batch. Safe to repeat after an interrupt part-way: trials the storage
        already holds (by origin) are not written twice, and the spill is emptied only after."""
        if not self.pending:
            self.last_flush = time.monotonic()
            return
        if self.persistent is None:  # :memory: one process, nothing to pull or spill
            batch, self.pending = self.pending, []
            self.dest.add_trials(batch)
            self.last_flush = time.monotonic()
            return
        rdb = rdb_backend(self.persistent)
        direct = isinstance(self.persistent, DirectStudy)  # a new study: no other process writes to it
        if self.pull_each_batch or (rdb is None and not direct):  # others' trials for TPE; or, trial by trial, ours
            self.pull()
        keep = [i for i, t in enumerate(self.pending) if t.user_attrs["origin"] not in self.persisted_mine]
        batch = [self.pending[i] for i in keep]
        # a Ctrl-C between a trial's two appends in ``record`` leaves pending_json one short: encode it here
        encoded = [self.pending_json[i] if i < len(self.pending_json) else encode_attrs(self.pending[i].user_attrs)
                   for i in keep]
        with signals_deferred():  # the batch and the record that it is in the storage go together
            if rdb is not None:  # one transaction (bulk.py); numbers the trials as stored
                add_trials(rdb, self.persistent._study_id, batch, encoded)
                self.written += batch
            elif direct:  # the same rows through sqlite3 (autotune/study_direct.py)
                self.persistent.add_trials(batch, encoded)
                self.written += batch
            else:  # the journal file: Optuna's own writes (pull() above skips what is already in)
                self.persistent.add_trials(batch)
            self.persisted_mine.update(t.user_attrs["origin"] for t in batch)
            self.pending, self.pending_json = [], []
        self.spill.clear()
        self.last_flush = time.monotonic()

    def close(self) -> None:
        """The last flush, shielded from a second Ctrl-C or the parent's SIGTERM (which would
        otherwise interrupt it inside a database transaction); then the spill file goes."""
        with signals_deferred():
            self.flush()
            if self.spill is not None:
                self.spill.close()

    @property
    def study(self) -> Any:
        return self.dest

    def finished(self) -> StudyView | Any:
        """The study's finished trials as this process knows them, to report from after ``close``:
        on an RDB storage those it found plus those it wrote (reading a study of thousands of
        trials back costs more than the search: measured 2x its time at 128 devices), else the
        study itself."""
        if self.persistent is None or (rdb_backend(self.persistent) is None
                                       and not isinstance(self.persistent, DirectStudy)):
            return self.dest
        return StudyView(self.dest, sorted(self.taken + self.written, key=lambda t: t.number))


class StudyView:
    """A study's name, trials and ``set_user_attr`` (what report.collect and iter_trial_plans use)
    over a list of trials already in memory."""

    def __init__(self, study: Any, trials: list[Any]):
        self._study, self._trials, self.study_name = study, trials, study.study_name

    def get_trials(self, deepcopy: bool = False) -> list[Any]:
        assert not deepcopy, "a view hands out its own trials"
        return self._trials

    def set_user_attr(self, key: str, value: Any) -> None:
        self._study.set_user_attr(key, value)

    @property
    def user_attrs(self) -> dict[str, Any]:
        return self._study.user_attrs
