"""Optuna studies: where every searched, estimated and measured plan is kept (docs/contracts.md, "Study").

One study per name in a storage URL: any SQLAlchemy URL Optuna's ``RDBStorage`` accepts (default
``sqlite:///results/autotune.db``, PostgreSQL for many machines), or a path ending in ``.log`` for
Optuna's ``JournalStorage`` file backend (shared file systems; measured ~4x faster per trial and
free of SQLite's create race, shared/torch-cpu-facts.md). ``:memory:`` keeps a study in this process.

A study records what it is for in its user attributes (model, cluster, workload, space); a name that
already belongs to another model, cluster or workload is refused rather than mixed. The storage and
the study are created here once, in the parent, before any worker starts: several workers creating
the same SQLite schema at once race ("table studies already exists").
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import InputError, suggest
from autotune.plan import RECORD_KEYS, Plan
from autotune.plan_record import PlanRecord

MEMORY_URL = ":memory:"
# SQLite waits this long on a lock held by another worker instead of failing with "database is locked".
SQLITE_TIMEOUT_S = 120


def _quiet() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


_MEMORY_STORAGES: dict[str, Any] = {}
# one RDBStorage per URL and process: opening one checks the schema (alembic), which costs more than
# a search's first hundred trials; a child process opens its own (an engine must not cross a fork)
_RDB_STORAGES: dict[tuple[str, int], Any] = {}


def storage_for(url: str, *, create: bool = True) -> Any:
    """An Optuna storage object for ``url`` (RDB URL, ``*.log`` journal file or ``:memory:``)."""
    import optuna

    _quiet()
    if not isinstance(url, str) or not url.strip():
        raise InputError("empty storage URL", field="--storage")
    if url == MEMORY_URL:
        return _MEMORY_STORAGES.setdefault(url, optuna.storages.InMemoryStorage())
    if url.endswith(".log") and "://" not in url:
        return _journal_storage(url, create)
    if "://" not in url:
        raise InputError(f"bad storage {url!r}; write a SQLAlchemy URL such as sqlite:///results/autotune.db, "
                         "a journal file path ending in .log, or :memory:", field="--storage")
    from autotune.specs.profiles import absolute_sqlite

    engine_url = absolute_sqlite(url)
    # keyed by the absolute file: a relative URL names another file once the working directory
    # changes (a cached engine kept answering from the first directory's database)
    cached = _RDB_STORAGES.get((engine_url, os.getpid()))
    if cached is not None and (not url.startswith("sqlite:///") or Path(engine_url[len("sqlite:///"):]).exists()):
        return cached
    sqlite = url.startswith("sqlite:///")
    fresh, known = _sqlite_file(engine_url, create) if sqlite else (False, False)
    engine_kwargs: dict[str, Any] = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if sqlite else {}
    try:
        if known:  # the schema Optuna wrote and its check would pass: opened without Alembic
            from autotune.study_known import KnownSchemaStorage

            st = KnownSchemaStorage(engine_url, engine_kwargs)
        else:
            # the schema check (alembic reading its ~30 migration scripts again) can only pass on a
            # schema this process just created: skipped there
            st = optuna.storages.RDBStorage(engine_url, engine_kwargs=engine_kwargs, skip_compatibility_check=fresh)
        if sqlite:
            _sqlite_wal(st)
        _RDB_STORAGES[(engine_url, os.getpid())] = st
        return st
    except (ImportError, ModuleNotFoundError) as exc:
        raise InputError(f"storage {url!r} needs a database driver that is not installed: {exc}",
                         field="--storage") from None
    except Exception as exc:  # noqa: BLE001 - sqlalchemy raises many kinds for a bad URL
        raise InputError(f"cannot open storage {url!r}: {type(exc).__name__}: {exc}".splitlines()[0],
                         field="--storage") from None


def _sqlite_file(engine_url: str, create: bool) -> tuple[bool, bool]:
    """(fresh: a file Optuna's constructor creates now, known: a file whose schema is current) for a
    ``sqlite:///`` URL, the file SQLAlchemy will open; its folder is made, a missing file refused
    when not ``create``."""
    from sqlalchemy.engine import make_url

    path = make_url(engine_url).database
    if not path or path == ":memory:":
        return False, False
    if not create and not Path(path).exists():
        raise InputError(f"no such database file {path!r}; run `autotune search` first or pass --storage",
                         field="--storage")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    known = _known_schema(path)
    return not known and not Path(path).exists(), known


def _known_schema(path: str) -> bool:
    """A new SQLite file made as a copy of Optuna's empty template, or an existing one whose schema
    is the one Optuna's check passes (autotune/study_sqlite.py); False: Optuna's own constructor."""
    from autotune.study_sqlite import create_from_template, current

    if not Path(path).exists() and create_from_template(path):
        return True
    return Path(path).exists() and current(path)


def _journal_storage(url: str, create: bool) -> Any:
    """Optuna's journal storage on the file ``url`` (a path ending in ``.log``)."""
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    path = Path(url)
    if not create and not path.exists():
        raise InputError(f"no such journal file {url!r}; run `autotune search` first", field="--storage")
    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


def _sqlite_wal(st: Any) -> None:
    """WAL journal and synchronous=NORMAL: readers never block the writer (several workers on one
    file) and a commit costs no fsync of the whole journal; measured ~2.7x faster trial writes here."""
    from sqlalchemy import event

    def pragmas(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    event.listen(st.engine, "connect", pragmas)
    st.engine.dispose()  # connections opened before the listener get the pragmas on reconnect


@dataclass(frozen=True, kw_only=True)
class StudyRecord:
    """What a study is for: written once as study user attrs, compared on every later open."""

    model: Any
    cluster: Any
    seq_len: int
    global_batch: int
    space: str = "default"
    target: str = "runtime"
    """Who runs its plans (autotune/targets.py): a study keeps to one target."""
    documents: dict[str, Any] | None = None
    """The workload's documents (``autotune.documents.DocumentSource.record``: the length
    histogram's summary and its source), so a resumed or validated study prices and runs the same
    windows; None: whole causal windows (studies before documents)."""

    def cluster_digest(self) -> str:
        if self.cluster.digest:
            return self.cluster.digest
        d = {k: v for k, v in self.cluster.to_dict().items() if k not in ("digest",)}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()

    def attrs(self) -> dict[str, Any]:
        return {"model": self.model.name, "model_spec": self.model.to_dict(), "cluster": self.cluster.name,
                "cluster_spec": self.cluster.to_dict(), "cluster_digest": self.cluster_digest(),
                "seq_len": self.seq_len, "global_batch": self.global_batch, "space": self.space,
                "target": self.target, **({"documents": self.documents} if self.documents else {})}


def default_study_name(model: Any, cluster: Any, seq_len: int, global_batch: int) -> str:
    return f"{model.name}@{cluster.name}-s{seq_len}-b{global_batch}"


def _mismatch(have: dict[str, Any], want: dict[str, Any]) -> list[str]:
    out = []
    if have.get("model_spec") != want["model_spec"]:
        out.append(f"model {have.get('model')!r} (this search: {want['model']!r})")
    if have.get("cluster_digest") != want["cluster_digest"]:
        out.append(f"cluster {have.get('cluster')!r} (this search: {want['cluster']!r})")
    for key in ("seq_len", "global_batch", "space"):
        if have.get(key) != want[key]:
            out.append(f"{key} {have.get(key)!r} (this search: {want[key]!r})")
    if have.get("target", "runtime") != want.get("target", "runtime"):  # studies before targets: runtime
        out.append(f"target {have.get('target', 'runtime')!r} (this search: {want['target']!r})")
    docs = [((d or {}).get("digest"), (d or {}).get("doc_mask")) for d in (have.get("documents"), want.get("documents"))]
    if docs[0] != docs[1]:
        out.append(f"documents {(have.get('documents') or {}).get('source', 'none')!r} (this search: "
                   f"{(want.get('documents') or {}).get('source', 'none')!r})")
    return out


def create_or_open(name: str, storage: str, record: StudyRecord, *, direct: bool = False) -> Any:
    """Create the study (maximise predicted tokens/s) or reopen it; refuse one made for something else.
    ``direct``: a new study in a SQLite file of the known schema is written without SQLAlchemy
    (autotune/study_direct.py: a DirectStudy, for one search process); any other goes through Optuna."""
    want = record.attrs()
    if direct and (got := _create_direct(name, storage, want)) is not None:
        return got
    import optuna

    st = storage_for(storage, create=True)
    try:
        study = optuna.create_study(study_name=name, storage=st, direction="maximize", load_if_exists=True)
    except Exception as exc:  # noqa: BLE001 - a race or a study with another direction
        raise InputError(f"cannot create study {name!r} in {storage}: {exc}".splitlines()[0], field="--study") from None
    if study.direction != optuna.study.StudyDirection.MAXIMIZE:
        raise InputError(f"study {name!r} exists and does not maximise tokens/s; pick another --study", field="--study")
    have = study.user_attrs
    if "model_spec" not in have:
        for k, v in want.items():
            study.set_user_attr(k, v)
        return study
    problems = _mismatch(have, want)
    if problems:
        raise InputError(f"study {name!r} belongs to " + "; ".join(problems) + "; pick another --study name",
                         field="--study")
    return study


def _create_direct(name: str, storage: str, attrs: dict[str, Any]) -> Any | None:
    """A new study ``name`` written by autotune/study_direct.py where ``storage`` is a SQLite file that
    is new (made as a copy of Optuna's empty template) or of the known schema; None: Optuna's path
    (another URL, a file of another schema, a study of that name already there)."""
    if not isinstance(storage, str) or not storage.startswith("sqlite:///"):
        return None
    from autotune.specs.profiles import absolute_sqlite
    from autotune.study_direct import create, sqlite_path

    path = sqlite_path(absolute_sqlite(storage))
    if path is None:
        return None
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # Optuna's path says why in its own words
        return None
    if not _known_schema(path):
        return None
    _quiet()  # as storage_for: the search's in-memory sampler study would log its creation
    return create(path, name, attrs)


def open_study(name: str, storage: str) -> Any:
    """Load an existing study; an unknown name is an InputError with the nearest names."""
    import optuna

    st = storage_for(storage, create=False)
    try:
        return optuna.load_study(study_name=name, storage=st)
    except KeyError:
        names = optuna.get_all_study_names(storage=st)
        raise InputError(f"no study named {name!r} in {storage}" + (suggest(name, names) if names else
                                                                    " (the storage holds no study)"),
                         field="--study") from None


def list_studies(storage: str) -> list[dict[str, Any]]:
    """One row per study: name, model, cluster, workload, trial count, best predicted tokens/s."""
    import optuna

    st = storage_for(storage, create=False)
    rows = []
    for s in optuna.get_all_study_summaries(storage=st, include_best_trial=False):
        ua = s.user_attrs
        study = optuna.load_study(study_name=s.study_name, storage=st)
        best = best_feasible(study)
        rows.append({"name": s.study_name, "model": ua.get("model"), "cluster": ua.get("cluster"),
                     "seq_len": ua.get("seq_len"), "global_batch": ua.get("global_batch"),
                     "space": ua.get("space"), "trials": s.n_trials,
                     "best_tokens_per_s": best.value if best is not None else None,
                     "best_trial": best.number if best is not None else None,
                     "best_plan": best.user_attrs.get("plan") if best is not None else None,
                     "best_measured_trial": ua.get("best_measured_trial")})
    return rows


def is_feasible(t: Any) -> bool:
    """Completed, every constraint <= 0, no infeasible reason, and a plan stored."""
    import optuna

    if t.state != optuna.trial.TrialState.COMPLETE or t.value is None:
        return False
    cons = t.constraints if hasattr(t, "constraints") else None
    values = cons.values() if isinstance(cons, dict) else (cons or [])
    if any(c > 0 for c in values):
        return False
    return not t.user_attrs.get("infeasible_reason") and "plan" in t.user_attrs


def best_feasible(study: Any) -> Any | None:
    """The feasible trial the tie-break rule puts first (``autotune.cost.tiebreak``: within 1% of the
    fastest, the simpler plan), so search, apply and the dashboard name the same best plan."""
    from autotune.cost.tiebreak import best, ties
    from autotune.objective import of_study

    if not of_study(study).plain:  # a pool search's objective and limits rank (autotune/objective.py)
        return next((t for t, _ in iter_trial_plans(study)), None)
    ok = [t for t in study.get_trials(deepcopy=False) if is_feasible(t)]
    if not ok:
        return None
    top = max(t.value for t in ok)
    near = sorted((t for t in ok if ties(t.value, top)), key=lambda t: (-t.value, t.number))
    if len(near) == 1:  # no tie: nothing to parse
        return near[0]
    return best([(t, Plan.from_dict(t.user_attrs["plan"])) for t in near], plan=lambda tp: tp[1],
                tokens_per_s=lambda tp: tp[0].value)[0]


def trial_plans(study: Any, *, feasible_only: bool = True, distinct: bool = True) -> list[tuple[Any, Plan]]:
    """(trial, Plan) pairs, best predicted tokens/s first; ``distinct`` keeps the first of equal plans."""
    return list(iter_trial_plans(study, feasible_only=feasible_only, distinct=distinct))


def iter_trial_plans(study: Any, *, feasible_only: bool = True, distinct: bool = True,
                     where: Any = None) -> Any:
    """``trial_plans`` lazily (a Plan is parsed only when reached: a search's study holds thousands);
    ``where(plan_dict)`` skips the trials it refuses before parsing."""
    from autotune.objective import admissible, of_study, sort_key

    obj = of_study(study)
    trials = [t for t in study.get_trials(deepcopy=False) if "plan" in t.user_attrs
              and (is_feasible(t) or not feasible_only) and (obj.plain or not feasible_only
                                                            or admissible(obj, t.user_attrs))]
    # best first (by the study's objective: tokens/s unless a pool search said otherwise); among
    # equal plans the validated copy (it holds ``measured``) comes before its original
    trials.sort(key=lambda t: (*((-(t.value or 0.0),) if obj.plain else sort_key(obj, t.value, t.user_attrs)), 0 if ("measured" in t.user_attrs or "failure" in t.user_attrs
                                                          and t.user_attrs.get("validated_from") is not None) else 1,
                               t.number))
    seen = set()
    for t in trials:
        if where is not None and not where(t.user_attrs["plan"]):
            continue
        if distinct:
            key = plan_key(t.user_attrs["plan"])
            if key in seen:
                continue
            seen.add(key)
        stored = t.user_attrs["plan"]
        # a plan dict this process wrote from a Plan (search/pricing.PlanDict) carries it: no parse
        known = getattr(stored, "plan", None)
        yield t, known if isinstance(known, Plan) else Plan.from_dict(stored)


def trial_record(t: Any, source: str | None = None, plan: Plan | None = None) -> PlanRecord:
    """A trial's plan with what the study knows of it: the prediction stored with the plan and, on a
    validated copy (``set_trial_attrs``), what the trial measured. ``plan``: the trial's plan when
    already parsed (``iter_trial_plans`` yields it), so it is not parsed again."""
    stored = t.user_attrs["plan"]
    rec = PlanRecord.from_dict(stored, source=source or f"trial {t.number}") if plan is None else PlanRecord(
        plan, **{k: stored.get(k) for k in RECORD_KEYS})
    measured = t.user_attrs.get("measured")
    return rec.replace(measured=measured) if rec.measured is None and measured else rec


_KEY_MARK = "\x00placement\x00"


def plan_key(plan_dict: dict[str, Any]) -> str:
    """What makes two plans the same plan (not their predictions or provenance): the plan's JSON with
    sorted keys. A placement this process encoded once for its layout (search/bulk.EncodedList, one
    entry per rank) is spliced in as its own sorted JSON, the same text ``json.dumps`` writes for it
    (at 1,024 devices the placement was 0.9 CPU s of a search's report, encoded again per trial)."""
    d = {k: v for k, v in plan_dict.items() if k not in ("predicted", "measured", "provenance", "workload")}
    done = getattr(d.get("placement"), "sorted_json", None)
    if done is None:
        return json.dumps(d, sort_keys=True)
    return json.dumps({**d, "placement": _KEY_MARK}, sort_keys=True).replace(json.dumps(_KEY_MARK), done, 1)


def set_trial_attrs(study: Any, trial: Any, attrs: dict[str, Any]) -> Any:
    """Attach ``attrs`` (measured figures) to a finished trial. Optuna refuses to update a finished
    trial in every storage, so a copy of the trial (same params, value, plan and constraints) carrying
    the attrs and ``validated_from: N`` is added; ``trial_plans`` prefers such a copy over its original.
    Returns the copy."""
    import optuna

    copy = optuna.trial.create_trial(
        params=trial.params, distributions=trial.distributions, value=trial.value,
        user_attrs={**trial.user_attrs, **attrs, "validated_from": trial.number},
        system_attrs={k: v for k, v in trial.system_attrs.items() if not k.startswith("constraints")},
        constraints=dict(getattr(trial, "constraints", {}) or {}) or None, state=trial.state)
    study.add_trial(copy)
    return study.get_trials(deepcopy=False)[-1]


def worker_count_ok(storage: str, workers: int) -> None:
    if workers > 1 and storage == MEMORY_URL:
        raise InputError("--workers > 1 needs a shared storage (SQLite, PostgreSQL or a .log journal), "
                         "not :memory:", field="--workers")
    if workers > max(1, 4 * (os.cpu_count() or 1)):
        raise InputError(f"--workers {workers} is more than 4 per core on this machine", field="--workers")


def cluster_from_record(name: str, spec: dict[str, Any] | None, storage: str | None = None) -> Any:
    """Rebuild a study's cluster (``autotune.specs.cluster.cluster_from_record``, the one rule)."""
    from autotune.specs.cluster import cluster_from_record as rebuild

    return rebuild(name, spec, storage)


def study_documents(study: Any) -> Any:
    """The documents a study was searched for (``autotune.documents.DocumentSource``), or None."""
    rec = study.user_attrs.get("documents")
    if not rec:
        return None
    from autotune.documents import DocumentSource

    return DocumentSource.from_record(rec)


def study_workload(study: Any, storage: str | None = None) -> tuple[Any, Any, int, int]:
    """(model, cluster, seq_len, global_batch) a study was made for, from its user attrs."""
    from autotune.specs.model import load_model, model_from_dict

    ua = study.user_attrs
    if ua.get("model_spec"):
        model = model_from_dict(dict(ua["model_spec"]), source=f"study {study.study_name}")
    elif ua.get("model"):
        model = load_model(ua["model"])
    else:
        raise InputError(f"study {study.study_name!r} does not record its model; was it made by autotune search?",
                         field="--study")
    for key in ("seq_len", "global_batch"):
        if not isinstance(ua.get(key), int):
            raise InputError(f"study {study.study_name!r} does not record {key}", field="--study")
    cluster = cluster_from_record(str(ua.get("cluster") or ""), ua.get("cluster_spec"), storage)
    return model, cluster, ua["seq_len"], ua["global_batch"]
