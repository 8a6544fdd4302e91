"""A batch of finished trials into an Optuna RDB study in one transaction, the rows Optuna writes.

Why. ``Study.add_trials`` on an RDB storage writes trial by trial through the ORM: per trial a
transaction, a lock of the study row, and per parameter and attribute a query and an insert
(measured: ~0.15 s a trial at 128 devices, 18 params and 10 attrs; 1,324 trials took 200 s of a
250 s profiled search, against 9 s for the same search in memory). Here the batch goes in with a
handful of statements in one transaction: the same tables, columns and encodings as Optuna's own
``RDBStorage._create_new_trial`` (its SQLAlchemy models are the schema, read from optuna, not
restated), so Optuna, optuna-dashboard and ``autotune dashboard`` read the trials as any others.

Numbers. Optuna numbers a trial by the count of the study's trials with a smaller id, under a lock
of the study row. Here the same: the rows are inserted first (on SQLite the first insert takes the
database's write lock; elsewhere the study row is locked ``FOR UPDATE`` first, as Optuna does), the
count of earlier trials is read inside the same transaction, and the batch is numbered from it.
The transaction is atomic: a batch is in the study whole or not at all, so a retry after an
interrupt never writes a trial twice (autotune/search/workspace.py).

tests/unit/test_search_bulk.py reads bulk-written and ``add_trials``-written studies back through
Optuna and compares them field by field.
"""

from __future__ import annotations

import datetime
import json
from functools import cached_property
from typing import Any

from autotune.cost.report import RankRows, RankValues


def rdb_backend(study: Any) -> Any | None:
    """The RDBStorage under an Optuna study (directly or under its cache), else None."""
    from optuna.storages import RDBStorage

    st = getattr(study, "_storage", None)  # autotune/study_direct.py's studies have none
    st = getattr(st, "_backend", st)
    return st if isinstance(st, RDBStorage) else None


def utc(t: datetime.datetime | None) -> datetime.datetime | None:
    # Optuna stores naive UTC and hands out naive local time (optuna.storages._rdb.models.TrialModel)
    return None if t is None else t.astimezone(datetime.timezone.utc).replace(tzinfo=None)


def encode_attrs(attrs: dict[str, Any]) -> dict[str, str]:
    """Each attr as the JSON text Optuna stores (one encoding per trial, shared with the spill file)."""
    return {k: _dumps(v) for k, v in attrs.items()}


class EncodedList(list):
    """A list that is never mutated, encoded once: a plan's placement (one entry per rank: at 128
    devices two thirds of a stored plan's JSON), which every plan of one layout shares."""

    @cached_property
    def json(self) -> str:
        return _ENCODER.encode(self)

    @cached_property
    def sorted_json(self) -> str:
        """``json.dumps(self, sort_keys=True)``: the text ``study.plan_key`` keys plans by."""
        return json.dumps(self, sort_keys=True)


_SEPARATORS = (",", ":")  # compact: ~15% fewer bytes
_ENCODER = json.JSONEncoder(separators=_SEPARATORS, check_circular=False)
"""``json.dumps(v, separators=_SEPARATORS)``'s text, one encoder for every trial and without the
check for circular references (a trial's attrs are trees the search built): the same text in ~10%
less CPU (each trial's plan and breakdown, ~0.6 ms a trial at 16 devices, were 4-7% of a search)."""
_SPLICED_IN = ("predicted",)
"""Keys of an attr whose dict value holds encoded lists too (a plan's ``predicted`` per-rank figures)."""


def _dumps(v: Any) -> str:
    """``json.dumps(v)``, compact, with what is already encoded spliced in (the same text: a mark
    string stands in its place, in its place in the key order): a plan's EncodedList placement, a
    breakdown's per-rank rows (``cost.report.RankRows``, encoded once per template), a plan's
    predicted per-rank memory and capacity (``cost.report.RankValues``, once per distinct value)."""
    if not isinstance(v, dict):
        return _ENCODER.encode(v)
    done: list[tuple[str, str]] = []
    marked = _marked(v, done)
    if not done:
        return _ENCODER.encode(v)
    text = _ENCODER.encode(marked)
    for mark, js in done:
        text = text.replace(mark, js, 1)
    return text


def _marked(v: dict[str, Any], done: list[tuple[str, str]], depth: int = 0) -> dict[str, Any]:
    """``v`` with each value already encoded replaced by a mark (a string no JSON text of the
    trial's holds: NUL is written escaped, ``\\u0000``), its text appended to ``done`` as
    (the mark's JSON, the value's JSON); ``v`` itself where none is."""
    out = None
    for k, x in v.items():
        t = type(x)
        if t is EncodedList:
            js = x.json
        elif t is RankRows or t is RankValues:
            js = x.encoded(_ENCODER.encode)
        elif depth == 0 and k in _SPLICED_IN and isinstance(x, dict):
            inner = _marked(x, done, 1)
            if inner is x:
                continue
            out = out if out is not None else dict(v)
            out[k] = inner
            continue
        else:
            continue
        mark = f"\x00{len(done)}\x00"
        done.append((_ENCODER.encode(mark), js))
        out = out if out is not None else dict(v)
        out[k] = mark
    return v if out is None else out


def child_rows(tid: int, t: Any, user_json: dict[str, str] | None, value_repr: Any, step_repr: Any,
               dist_json: dict[int, str]) -> dict[str, list[dict[str, Any]]]:
    """Trial ``t``'s rows of each child table (as stored under trial id ``tid``), each a dict in the
    table's column order; ``value_repr``/``step_repr``: Optuna's stored representation of a value and
    of an intermediate value (its models' own here; autotune/study_direct.py's for sqlite3)."""
    from optuna.distributions import distribution_to_json

    out: dict[str, list[dict[str, Any]]] = {"values": [], "params": [], "user": [], "system": [], "steps": []}
    values = t.values if t.values is not None else []
    for objective, v in enumerate(values):
        stored, kind = value_repr(v)
        out["values"].append({"trial_id": tid, "objective": objective, "value": stored, "value_type": kind})
    for name, v in t.params.items():
        dist = t.distributions[name]
        js = dist_json.get(id(dist))
        if js is None:
            js = dist_json[id(dist)] = distribution_to_json(dist)
        out["params"].append({"trial_id": tid, "param_name": name, "param_value": dist.to_internal_repr(v),
                              "distribution_json": js})
    for key, js in (user_json if user_json is not None else encode_attrs(t.user_attrs)).items():
        out["user"].append({"trial_id": tid, "key": key, "value_json": js})
    for key, v in t.system_attrs.items():
        out["system"].append({"trial_id": tid, "key": key, "value_json": json.dumps(v)})
    for step, v in t.intermediate_values.items():
        stored, kind = step_repr(v)
        out["steps"].append({"trial_id": tid, "step": step, "intermediate_value": stored,
                             "intermediate_value_type": kind})
    return out


def add_trials(rdb: Any, study_id: int, trials: list[Any], user_json: list[dict[str, str]] | None = None) -> None:
    """Write finished ``trials`` (FrozenTrials, e.g. from ``optuna.trial.create_trial``) into study
    ``study_id`` of ``rdb`` in one transaction and set each one's ``number`` and ``_trial_id`` as
    stored. ``user_json``: the trials' user attrs already encoded (``encode_attrs``)."""
    import sqlalchemy as sa
    from optuna.storages._rdb import models

    if not trials:
        return
    T = models.TrialModel.__table__
    tables = {"values": models.TrialValueModel.__table__, "params": models.TrialParamModel.__table__,
              "user": models.TrialUserAttributeModel.__table__, "system": models.TrialSystemAttributeModel.__table__,
              "steps": models.TrialIntermediateValueModel.__table__}
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in tables}
    dist_json: dict[int, str] = {}
    with rdb.engine.begin() as conn:
        if conn.dialect.name != "sqlite":  # SQLite has no row locks: its first insert locks the database
            S = models.StudyModel.__table__
            conn.execute(sa.select(S.c.study_id).where(S.c.study_id == study_id).with_for_update())
        assert all(t.state.is_finished() for t in trials), "only finished trials are bulk-written"
        ids = list(conn.execute(
            sa.insert(T).returning(T.c.trial_id, sort_by_parameter_order=True),
            [{"study_id": study_id, "number": None, "state": t.state, "datetime_start": utc(t.datetime_start),
              "datetime_complete": utc(t.datetime_complete)} for t in trials]).scalars())
        base = conn.execute(sa.select(sa.func.count()).select_from(T)
                            .where(T.c.study_id == study_id, T.c.trial_id < ids[0])).scalar_one()
        conn.execute(sa.update(T).where(T.c.trial_id == sa.bindparam("tid")).values(number=sa.bindparam("n")),
                     [{"tid": tid, "n": base + k} for k, tid in enumerate(ids)])
        for i, (tid, t) in enumerate(zip(ids, trials, strict=True)):
            got = child_rows(tid, t, user_json[i] if user_json else None, models.TrialValueModel.value_to_stored_repr,
                             models.TrialIntermediateValueModel.intermediate_value_to_stored_repr, dist_json)
            for k, v in got.items():
                rows[k] += v
        for k, table in tables.items():
            if rows[k]:
                conn.execute(sa.insert(table), rows[k])
    for k, (tid, t) in enumerate(zip(ids, trials, strict=True)):
        t.number, t._trial_id = base + k, tid
