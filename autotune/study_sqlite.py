"""A SQLite study file opened without running Alembic: the schema Optuna itself wrote, checked by its stamp.

Why. Optuna's ``RDBStorage`` on every open creates the missing tables (``create_all``), writes its
version row and asks Alembic for the schema's revision: on a new file it stamps the head revision
(importing Alembic and reading its ~30 migration scripts), on an existing one it compares the
file's revision with the head (the same reading). That is 0.2-0.5 s of CPU per process, a tenth of
a 16-device search, for an answer that only changes when Optuna does.

How. Once per Optuna and SQLAlchemy version, Optuna's own ``RDBStorage`` creates an empty study
file, the *template*, in the user's cache (``$XDG_CACHE_HOME/autotune/optuna-schema/``); its
``alembic_version`` row is the head revision as Optuna's Alembic stamped it. Then

- a new study file is a copy of the template (linked into place: two processes creating the same
  file at once get one file, not a half-written one);
- an existing file whose ``alembic_version`` is the template's and that holds Optuna's version row
  is what Optuna's check would pass (it compares exactly these: current revision against head);
- either is opened by ``KnownSchemaStorage`` (autotune/study_known.py): ``RDBStorage`` less the
  table creation and the Alembic check; a new study in either is written by autotune/study_direct.py
  without SQLAlchemy. Every other file (an older or newer Optuna's schema, one being created by Optuna
  right now, anything unreadable) goes through Optuna's own constructor, which upgrades, refuses
  or creates it as it always did.

tests/unit/test_study_sqlite.py compares a template-copied study with one Optuna created, table by
table and trial by trial, and checks ``KnownSchemaStorage`` sets what ``RDBStorage`` sets.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import time
import warnings
from pathlib import Path

_TEMPLATES: dict[str, tuple[Path, str]] = {}  # this process's template: (path, head revision) per versions


def template_dir() -> Path:
    """Where the templates live (the user's cache; a template is rebuilt if removed)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "autotune" / "optuna-schema"


def _versions() -> str:
    """The template's key: Optuna's and SQLAlchemy's versions (SQLAlchemy's read from its metadata, not
    imported: a new study written by autotune/study_direct.py never imports it)."""
    from importlib.metadata import version

    import optuna

    return f"optuna-{optuna.__version__}-sqlalchemy-{version('sqlalchemy')}"


def _stamp(path: Path | str) -> str | None:
    """The file's Alembic revision if it also holds Optuna's version row, else None (read-only)."""
    try:
        con = sqlite3.connect(Path(path).absolute().as_uri() + "?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return None
    try:
        rev = con.execute("SELECT version_num FROM alembic_version").fetchall()
        info = con.execute("SELECT count(*) FROM version_info").fetchone()
    except sqlite3.Error:
        return None
    finally:
        con.close()
    return str(rev[0][0]) if len(rev) == 1 and info and info[0] == 1 else None


def template() -> tuple[Path, str] | None:
    """(the template file, its head revision), built by Optuna's own RDBStorage on first use; None
    when the cache cannot be written (the caller then takes Optuna's path)."""
    key = _versions()
    hit = _TEMPLATES.get(key)
    if hit is not None and hit[0].exists():
        return hit
    path = template_dir() / f"{key}.db"
    head = _stamp(path) if path.exists() else None
    if head is None:
        head = _build(path)
    if head is None:
        return None
    _TEMPLATES[key] = (path, head)
    return path, head


def _build(path: Path) -> str | None:
    """Optuna writes an empty study file (tables, version row, Alembic's head stamp) under a temporary
    name, which then replaces ``path`` whole."""
    import optuna

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".building-", suffix=".db", dir=path.parent)
    except OSError:
        return None
    os.close(fd)
    os.unlink(tmp)  # Optuna creates the file itself, as it does for a user's new file
    try:
        st = optuna.storages.RDBStorage(f"sqlite:///{tmp}")
        st.engine.dispose()
        head = _stamp(tmp)
        if head is None:
            return None
        os.replace(tmp, path)
        return head
    except Exception as e:  # noqa: BLE001 - the template only saves time: Optuna's own path opens the study
        warnings.warn(f"autotune: could not build the study template in {path.parent} ({type(e).__name__}: {e}); "
                      "study files open through Optuna's own (slower) path", stacklevel=2)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def create_from_template(path: str) -> bool:
    """A new study file at ``path`` as a copy of the template; False when there is no template (the
    caller creates it through Optuna) or another process made the file meanwhile (kept as it is)."""
    tpl = template()
    if tpl is None:
        return False
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{Path(path).name}.", suffix=".new", dir=Path(path).parent)
    except OSError:  # a folder this process cannot write: Optuna's path says why
        return False
    os.close(fd)
    try:
        shutil.copyfile(tpl[0], tmp)
        os.link(tmp, path)  # atomic and exclusive: never over a file another process made
        return True
    except OSError:  # there now (FileExistsError), a full disk, or a file system without hard links
        return False
    finally:
        os.unlink(tmp)


def current(path: str) -> bool:
    """Whether the file at ``path`` carries the schema Optuna's check passes (its stamp is the head),
    once another process that is writing Optuna's schema into it has done so (``_being_created``):
    running Optuna's constructor beside it, both stamp the file and one fails ("UNIQUE constraint
    failed: alembic_version.version_num"; a poller of tests/integration/test_search_faults.py did)."""
    tpl = template()
    if tpl is None:
        return False
    stamp = _stamp(path)
    while stamp is None and _being_created(path):
        time.sleep(0.05)
        stamp = _stamp(path)
    return stamp == tpl[1]


CREATING_S = 30.0
"""A file without the stamp that changed this recently may be Optuna's, half written (its tables,
its version row and the stamp are three transactions); an older one is left to Optuna's constructor."""


def _being_created(path: str) -> bool:
    """Empty, or with Optuna's ``studies`` table and no stamp yet, and written in the last CREATING_S."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if time.time() - st.st_mtime > CREATING_S:
        return False
    if st.st_size == 0:
        return True
    try:
        con = sqlite3.connect(Path(path).absolute().as_uri() + "?mode=ro", uri=True, timeout=5)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()
    except sqlite3.Error:
        return False
    return "studies" in tables
