"""SQLite study files opened without Alembic (autotune/study_sqlite.py) against the reference: files
Optuna's own ``RDBStorage`` created and checked. A template-copied file must hold Optuna's schema,
row for row, and a study written through it must read back through ``optuna.load_study`` (with
Optuna's schema check) exactly as one written to a file Optuna created; a file of another schema
revision must still meet Optuna's check."""

from __future__ import annotations

import pickle
import sqlite3

import optuna
import pytest
from test_search_bulk import fields, trials

from autotune import study as S
from autotune import study_sqlite as Q
from autotune.errors import InputError
from autotune.search.bulk import add_trials, rdb_backend
from autotune.study_known import KnownSchemaStorage

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """A template cache of this test's own (built here, by Optuna), nothing cached in the process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(Q, "_TEMPLATES", {})
    monkeypatch.setattr(S, "_RDB_STORAGES", {})


def schema(path) -> list[tuple]:
    con = sqlite3.connect(path)
    try:
        tables = con.execute("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name").fetchall()
        versions = [con.execute(f"SELECT * FROM {t}").fetchall() for t in ("alembic_version", "version_info")]
    finally:
        con.close()
    return tables + versions


def write(url: str, batch) -> None:
    """A study as a search writes it: created, its attrs set, trials bulk-written and one added by Optuna."""
    st = S.storage_for(url)
    s = optuna.create_study(study_name="s", storage=st, direction="maximize", load_if_exists=True)
    s.set_user_attr("model", "tiny")
    s.set_user_attr("cluster_spec", {"nodes": [{"count": 2, "device": "H100-SXM"}]})
    add_trials(rdb_backend(s), s._study_id, batch[:20])
    add_trials(rdb_backend(s), s._study_id, batch[20:])
    s.add_trial(trials(1, "own")[0])


def test_a_template_copied_study_reads_back_as_one_optuna_created(tmp_path):
    made = tmp_path / "made" / "autotune.db"
    ref = tmp_path / "ref.db"
    optuna.storages.RDBStorage(f"sqlite:///{ref}").engine.dispose()  # Optuna's own new file
    st = S.storage_for(f"sqlite:///{made}")
    assert type(st) is KnownSchemaStorage  # the fast path was taken
    assert (Q.template_dir()).is_dir()
    assert schema(made) == schema(ref)
    batch = trials(40)
    write(f"sqlite:///{made}", batch)
    write(f"sqlite:///{ref}", trials(40))
    for path in (made, ref):  # Optuna's own reader, with its schema check, on each file
        checked = optuna.storages.RDBStorage(f"sqlite:///{path}")
        assert checked.get_current_version() == checked.get_head_version()
    got, want = (optuna.load_study(study_name="s", storage=f"sqlite:///{p}") for p in (made, ref))
    assert got.user_attrs == want.user_attrs and got.direction == want.direction
    assert [fields(t)[:-2] for t in got.get_trials()] == [fields(t)[:-2] for t in want.get_trials()]  # less
    # the datetimes, each write's own
    assert [t.number for t in got.get_trials()] == list(range(41))


def test_an_existing_file_at_the_head_revision_is_opened_without_alembic_and_resumes(tmp_path):
    url = f"sqlite:///{tmp_path}/old.db"
    optuna.create_study(study_name="s", storage=optuna.storages.RDBStorage(url)).add_trials(trials(5))
    st = S.storage_for(url, create=False)
    assert type(st) is KnownSchemaStorage
    study = optuna.load_study(study_name="s", storage=st)
    study.add_trials(trials(3, "more"))  # resumed: Optuna's numbering goes on
    assert [t.number for t in optuna.load_study(study_name="s", storage=url).get_trials()] == list(range(8))


def test_a_file_of_another_schema_revision_meets_optunas_check(tmp_path):
    path = tmp_path / "older.db"
    optuna.storages.RDBStorage(f"sqlite:///{path}").engine.dispose()
    con = sqlite3.connect(path)
    con.execute("UPDATE alembic_version SET version_num = 'v3.0.0.d'")  # as an older Optuna left it
    con.commit()
    con.close()
    assert not Q.current(str(path))
    with pytest.raises(InputError, match="storage upgrade"):
        S.storage_for(f"sqlite:///{path}")


def test_known_schema_storage_sets_what_rdbstorage_sets(tmp_path):
    url = f"sqlite:///{tmp_path}/a.db"
    own = optuna.storages.RDBStorage(url, skip_compatibility_check=True)  # checked: by its stamp
    fast = KnownSchemaStorage(url, {})
    assert isinstance(fast, optuna.storages.RDBStorage)
    assert set(vars(fast)) | {"_version_manager"} == set(vars(own))  # an Optuna that sets more fails here
    assert {k: v for k, v in vars(fast).items() if k not in ("engine", "scoped_session")} == \
        {k: v for k, v in vars(own).items() if k not in ("engine", "scoped_session", "_version_manager")}
    assert fast.get_current_version() == fast.get_head_version()  # the manager, made when asked for
    back = pickle.loads(pickle.dumps(fast))
    assert optuna.get_all_study_names(back) == []


def test_no_template_falls_back_to_optunas_own_constructor(tmp_path, monkeypatch):
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-folder"))  # the cache cannot be written
    st = S.storage_for(f"sqlite:///{tmp_path}/x.db")
    assert type(st) is optuna.storages.RDBStorage
    optuna.create_study(study_name="s", storage=st).add_trials(trials(2))
    assert len(optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/x.db").trials) == 2


def test_a_file_another_process_made_meanwhile_is_kept(tmp_path):
    path = tmp_path / "there.db"
    path.write_bytes(b"someone else's")
    assert Q.create_from_template(str(path)) is False
    assert path.read_bytes() == b"someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "there.db"]  # no temporary copy left behind


def test_a_file_optuna_is_writing_is_waited_for_and_an_old_unstamped_one_is_not(tmp_path):
    """Optuna's constructor running beside another one on a half-written file stamps it twice and
    one of them fails: a file with Optuna's tables and no stamp yet, written just now, is waited for."""
    import os
    import threading
    import time

    import sqlalchemy
    from optuna.storages._rdb import models

    path = tmp_path / "half.db"
    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    models.BaseModel.metadata.create_all(engine)  # Optuna's first step; no version row, no stamp
    engine.dispose()
    assert Q._stamp(path) is None and Q._being_created(str(path))
    finish = threading.Timer(0.5, lambda: optuna.storages.RDBStorage(f"sqlite:///{path}").engine.dispose())
    finish.start()
    t = time.monotonic()
    assert Q.current(str(path))  # after the other writer stamped it
    assert time.monotonic() - t >= 0.4
    finish.join()
    old = tmp_path / "old.db"
    engine = sqlalchemy.create_engine(f"sqlite:///{old}")
    models.BaseModel.metadata.create_all(engine)
    engine.dispose()
    os.utime(old, (time.time() - 2 * Q.CREATING_S,) * 2)
    assert not Q._being_created(str(old)) and not Q.current(str(old))
    assert type(S.storage_for(f"sqlite:///{old}")) is optuna.storages.RDBStorage  # Optuna completes it
    assert Q.current(str(old))
