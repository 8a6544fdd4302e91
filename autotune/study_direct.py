"""A new study in a SQLite study file, written with the standard library's ``sqlite3``: no SQLAlchemy.

Why. A search's default storage is a SQLite file. Opening it through Optuna's ``RDBStorage`` imports
SQLAlchemy and its ORM (~0.35 CPU s here), builds an engine and sessions, and writes each study
attribute in a transaction of its own: together with the trials' batches through SQLAlchemy, a
sixth of a 16-device ``autotune search`` (measured: benchmarks/bench_search.py ``--only plain``;
docs/figures.md). A *new* study in a file whose schema is the one Optuna writes (a copy of the
empty template Optuna made, or a file whose Alembic stamp is the head revision:
autotune/study_sqlite.py) needs none of that: it is a few rows in tables whose layout is known.

What. ``create`` writes the study row, its direction and its user attributes as Optuna's
``create_study`` and ``Study.set_user_attr`` write them; ``DirectStudy.add_trials`` writes a batch of
finished trials in one transaction, the rows autotune/search/bulk.py writes through SQLAlchemy
(``bulk.child_rows``: one encoding for both; tests/unit/test_study_direct.py compares the two
files table by table and reads the trials back through ``optuna.load_study``). Everything else, a
study that exists (a resumed search), several workers, a pool, a journal or PostgreSQL storage, a
file of another schema, goes through Optuna as before (``autotune.study.create_or_open``).

Numbers. As bulk.py: the batch's transaction takes the database's write lock first (``BEGIN
IMMEDIATE``), counts the study's trials and numbers the batch from there, so Optuna's own writers in
other processes (``autotune show``, ``validate``, a dashboard) and this one never number a trial twice.
"""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path
from typing import Any

TIMEOUT_S = 120  # as autotune.study.SQLITE_TIMEOUT_S: wait on another writer's lock, do not fail
_DATETIME = "%Y-%m-%d %H:%M:%S.%f"  # SQLAlchemy's SQLite DATETIME text (naive UTC, as bulk.utc gives)


def value_repr(value: float) -> tuple[float | None, str]:
    """Optuna's ``TrialValueModel.value_to_stored_repr``, the type as the text its Enum column holds."""
    if value == math.inf:
        return None, "INF_POS"
    if value == -math.inf:
        return None, "INF_NEG"
    return value, "FINITE"


def step_repr(value: float) -> tuple[float | None, str]:
    """Optuna's ``TrialIntermediateValueModel.intermediate_value_to_stored_repr``, likewise."""
    if math.isnan(value):
        return None, "NAN"
    return value_repr(value)


def _connect(path: str) -> sqlite3.Connection:
    """Autocommit (transactions are explicit), WAL and synchronous=NORMAL as autotune.study's engine
    sets them (readers never block the writer; a commit costs no fsync of the whole journal)."""
    con = sqlite3.connect(path, timeout=TIMEOUT_S, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=NORMAL")
    return con


class DirectStudy:
    """The parts of an Optuna study a search process uses (``study_name``, ``_study_id``, user attrs,
    ``add_trials`` of encoded batches, the trials it wrote) over one SQLite connection."""

    def __init__(self, path: str, study_id: int, name: str, attrs: dict[str, Any]):
        self.path, self._study_id, self.study_name = path, study_id, name
        self._attrs = dict(attrs)
        self._con = _connect(path)
        self._written: list[Any] = []

    @property
    def user_attrs(self) -> dict[str, Any]:
        return dict(self._attrs)

    def set_user_attr(self, key: str, value: Any) -> None:
        """``Study.set_user_attr``: the row, created or replaced."""
        js = json.dumps(value)
        self._con.execute('INSERT INTO study_user_attributes (study_id, "key", value_json) VALUES (?, ?, ?) '
                          'ON CONFLICT (study_id, "key") DO UPDATE SET value_json = excluded.value_json',
                          (self._study_id, key, js))
        self._attrs[key] = json.loads(js)

    def get_trials(self, deepcopy: bool = False) -> list[Any]:
        """The trials this process wrote (a new study holds no others until a later process opens it)."""
        assert not deepcopy, "the trials are handed out as they are"
        return list(self._written)

    def add_trials(self, trials: list[Any], user_json: list[dict[str, str]] | None = None) -> None:
        """bulk.add_trials for this file: finished ``trials`` in one transaction, each told its number
        and trial id as stored; ``user_json``: their user attrs already encoded."""
        if not trials:
            return
        from autotune.search.bulk import child_rows  # here: autotune.search imports this module

        assert all(t.state.is_finished() for t in trials), "only finished trials are bulk-written"
        con = self._con
        con.execute("BEGIN IMMEDIATE")  # the write lock first: the count below stays true until commit
        try:
            base = con.execute("SELECT count(*) FROM trials WHERE study_id = ?", (self._study_id,)).fetchone()[0]
            ids = []
            for k, t in enumerate(trials):
                cur = con.execute("INSERT INTO trials (number, study_id, state, datetime_start, datetime_complete) "
                                  "VALUES (?, ?, ?, ?, ?)", (base + k, self._study_id, t.state.name,
                                                             _text(t.datetime_start), _text(t.datetime_complete)))
                ids.append(cur.lastrowid)
            rows: dict[str, list[tuple]] = {k: [] for k in _INSERTS}
            dist_json: dict[int, str] = {}
            for i, (tid, t) in enumerate(zip(ids, trials, strict=True)):
                got = child_rows(tid, t, user_json[i] if user_json else None, value_repr, step_repr, dist_json)
                for k, v in got.items():
                    rows[k] += [tuple(r.values()) for r in v]
            for k, sql in _INSERTS.items():
                if rows[k]:
                    con.executemany(sql, rows[k])
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        for k, (tid, t) in enumerate(zip(ids, trials, strict=True)):
            t.number, t._trial_id = base + k, tid
        self._written += trials

    def close(self) -> None:
        self._con.close()


# the columns in the order bulk.child_rows fills each row's dict
_INSERTS = {
    "values": "INSERT INTO trial_values (trial_id, objective, value, value_type) VALUES (?, ?, ?, ?)",
    "params": "INSERT INTO trial_params (trial_id, param_name, param_value, distribution_json) VALUES (?, ?, ?, ?)",
    "user": 'INSERT INTO trial_user_attributes (trial_id, "key", value_json) VALUES (?, ?, ?)',
    "system": 'INSERT INTO trial_system_attributes (trial_id, "key", value_json) VALUES (?, ?, ?)',
    "steps": "INSERT INTO trial_intermediate_values (trial_id, step, intermediate_value, intermediate_value_type) "
             "VALUES (?, ?, ?, ?)",
}


def _text(t: Any) -> str | None:
    from autotune.search.bulk import utc

    u = utc(t)
    return None if u is None else u.strftime(_DATETIME)


def create(path: str, name: str, attrs: dict[str, Any]) -> DirectStudy | None:
    """A new study ``name`` (maximise) in the known-schema file ``path`` with user ``attrs``, written
    in one transaction; None when a study of that name is there (or got there first: Optuna's path
    then opens it, checks its record and resumes it)."""
    con = _connect(path)
    try:
        con.execute("BEGIN IMMEDIATE")
        try:
            cur = con.execute("INSERT INTO studies (study_name) VALUES (?)", (name,))
        except sqlite3.IntegrityError:  # the unique study name: it exists
            con.execute("ROLLBACK")
            return None
        sid = cur.lastrowid
        con.execute("INSERT INTO study_directions (direction, study_id, objective) VALUES ('MAXIMIZE', ?, 0)", (sid,))
        con.executemany('INSERT INTO study_user_attributes (study_id, "key", value_json) VALUES (?, ?, ?)',
                        [(sid, k, json.dumps(v)) for k, v in attrs.items()])
        con.execute("COMMIT")
    finally:
        con.close()
    return DirectStudy(path, sid, name, {k: json.loads(json.dumps(v)) for k, v in attrs.items()})


def sqlite_path(url: str) -> str | None:
    """The file of a ``sqlite:///`` URL as autotune.study opens it (relative to the working
    directory), or None for any other URL (an in-memory database, a query string, another driver)."""
    if not url.startswith("sqlite:///") or "?" in url:
        return None
    path = url[len("sqlite:///"):]
    return str(Path(path).absolute()) if path and path != ":memory:" else None
