"""New studies written with sqlite3 (autotune/study_direct.py) against the reference, the same study
written through Optuna and SQLAlchemy (``optuna.create_study`` + ``set_user_attr`` + bulk.add_trials):
the two files must hold the same rows, table by table, and read back through ``optuna.load_study``
alike; a search through the direct path must store what the Optuna path stores, and never import
SQLAlchemy."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import optuna
import pytest
from test_search_bulk import fields, trials

from autotune import study as S
from autotune import study_direct as SD
from autotune.search.bulk import add_trials, encode_attrs, rdb_backend
from autotune.study_sqlite import create_from_template

ATTRS = {"model": "m", "model_spec": {"layers": 2, "ü": [1.5, None]}, "seq_len": 256, "space": "default"}
TABLES = ("studies", "study_directions", "study_user_attributes", "study_system_attributes", "trials",
          "trial_params", "trial_values", "trial_user_attributes", "trial_system_attributes",
          "trial_intermediate_values", "trial_heartbeats", "version_info", "alembic_version")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    S._RDB_STORAGES.clear()


def dump(path) -> dict[str, list[tuple]]:
    con = sqlite3.connect(path)
    try:
        return {t: con.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in TABLES}
    finally:
        con.close()


def reference(path, batches):
    """The study as Optuna writes it, with the search's bulk writer for the trials."""
    st = S.storage_for(f"sqlite:///{path}")
    s = optuna.create_study(study_name="s", storage=st, direction="maximize")
    for k, v in ATTRS.items():
        s.set_user_attr(k, v)
    for b in batches:
        add_trials(rdb_backend(s), s._study_id, b, [encode_attrs(t.user_attrs) for t in b])
    return s


def direct(path, batches):
    assert create_from_template(str(path))
    d = SD.create(str(path), "s", ATTRS)
    for b in batches:
        d.add_trials(b, [encode_attrs(t.user_attrs) for t in b])
    return d


def test_the_direct_file_holds_the_rows_optuna_and_sqlalchemy_write(tmp_path):
    a, b = trials(30, "x"), trials(30, "x")  # equal trials (FAIL, inf, intermediate values, constraints)
    for t, u in zip(a, b, strict=True):
        u.datetime_start, u.datetime_complete = t.datetime_start, t.datetime_complete
    reference(tmp_path / "ref.db", [a[:12], a[12:]])
    d = direct(tmp_path / "direct.db", [b[:12], b[12:]])
    ref, got = dump(tmp_path / "ref.db"), dump(tmp_path / "direct.db")
    for t in TABLES:
        assert got[t] == ref[t], t
    assert [t.number for t in b] == list(range(30)) and [t._trial_id for t in b] == [t._trial_id for t in a]
    # read back through Optuna (with its schema check), field by field
    ra = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/ref.db")
    rb = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/direct.db")
    assert [fields(t) for t in rb.get_trials()] == [fields(t) for t in ra.get_trials()]
    assert rb.user_attrs == ra.user_attrs == d.user_attrs
    assert rb.direction == optuna.study.StudyDirection.MAXIMIZE
    assert d.get_trials() == b


def test_numbers_follow_other_writers_and_optuna_continues_them(tmp_path):
    path = tmp_path / "n.db"
    d = direct(path, [trials(5, "a")])
    url = f"sqlite:///{path}"
    other = optuna.create_study(study_name="other", storage=S.storage_for(url))
    other.add_trials(trials(4, "o"))  # another study's trials between the batches
    mine = optuna.load_study(study_name="s", storage=S.storage_for(url))
    mine.add_trial(trials(1, "own")[0])  # Optuna's own writer, in the same study
    batch = trials(6, "b")
    d.add_trials(batch)
    assert [t.number for t in batch] == list(range(6, 12))
    mine.add_trial(trials(1, "own2")[0])
    assert [t.number for t in mine.get_trials()] == list(range(13))
    assert [t.number for t in other.get_trials()] == list(range(4))
    d.set_user_attr("model", "again")  # replaced, not a second row
    assert optuna.load_study(study_name="s", storage=url).user_attrs["model"] == "again"


def test_a_study_that_exists_is_left_to_optuna(tmp_path):
    path = tmp_path / "e.db"
    direct(path, [])
    assert SD.create(str(path), "s", ATTRS) is None  # the same name: Optuna's path resumes it
    assert dump(path)["studies"] == [(1, "s")]


def test_a_failed_batch_writes_nothing(tmp_path):
    path = tmp_path / "f.db"
    d = direct(path, [trials(3, "a")])
    bad = trials(2, "b")
    bad[1].params["x"] = "not a float"  # the distribution refuses it inside the transaction
    with pytest.raises(Exception):  # noqa: B017 - whatever it raises, the batch must be all or nothing
        d.add_trials(bad)
    assert len(dump(path)["trials"]) == 3
    ok = trials(2, "c")
    d.add_trials(ok)
    assert [t.number for t in ok] == [3, 4]


def _search(tmp_path, name, storage, monkeypatch=None, direct_ok=True):
    from _search_helpers import toy_estimate

    from autotune.search import SearchOptions, search
    from autotune.specs import load_cluster, load_model

    if not direct_ok:
        monkeypatch.setattr(S, "_create_direct", lambda *a, **k: None)
    return search(load_model("tiny"), load_cluster("local:8"), 256, 16, study_name=name, storage=storage,
                  options=SearchOptions(trials=10, seed=5), estimator=toy_estimate)


def _stored(url, name):
    out = []
    for t in optuna.load_study(study_name=name, storage=url).get_trials():
        ua = {k: v for k, v in t.user_attrs.items() if k != "origin"}
        out.append((t.number, t.state, t.values, t.params, ua, t.system_attrs))
    return out


def test_a_search_stores_through_sqlite3_what_it_stores_through_optuna(tmp_path, monkeypatch):
    a = _search(tmp_path, "d", f"sqlite:///{tmp_path}/direct.db")
    b = _search(tmp_path, "o", f"sqlite:///{tmp_path}/optuna.db", monkeypatch, direct_ok=False)
    assert a.best.to_dict() == b.best.to_dict() and a.trials == b.trials > 0
    assert _stored(f"sqlite:///{tmp_path}/direct.db", "d") == _stored(f"sqlite:///{tmp_path}/optuna.db", "o")
    ua = optuna.load_study(study_name="d", storage=f"sqlite:///{tmp_path}/direct.db").user_attrs
    ub = optuna.load_study(study_name="o", storage=f"sqlite:///{tmp_path}/optuna.db").user_attrs
    assert ua == ub and "baseline_best_trial" in ua
    monkeypatch.undo()
    # the same name again: resumed through Optuna, numbered on
    c = _search(tmp_path, "d", f"sqlite:///{tmp_path}/direct.db")
    assert c.trials > a.trials and any("resumed study" in n for n in c.notes)


_PROBE = """
import sys
sys.argv = ["autotune", "search", "-m", "tiny", "-c", "local:8", "-s", "256", "-b", "16", "--trials", "5", "--json"]
from autotune.cli import main
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
print("SQLALCHEMY", "sqlalchemy" in sys.modules, file=sys.stderr)
"""


@pytest.mark.slow
def test_a_new_search_in_the_default_storage_never_imports_sqlalchemy(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    seen = []
    for run in ("first", "second"):  # the first builds the template through Optuna (SQLAlchemy) once
        d = tmp_path / run
        d.mkdir()
        r = subprocess.run([sys.executable, "-c", _PROBE], cwd=d, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        seen.append(r.stderr.strip().splitlines()[-1])
        assert json.loads(r.stdout)["trials"] > 0
    assert seen == ["SQLALCHEMY True", "SQLALCHEMY False"]
