"""Optuna's RDBStorage on a SQLite file whose schema is known current (autotune/study_sqlite.py says
which files are): opened without the table creation and the Alembic check."""

from __future__ import annotations

from typing import Any

import sqlalchemy
import sqlalchemy.orm
from optuna.storages import RDBStorage


class KnownSchemaStorage(RDBStorage):
    """Optuna's RDBStorage on a file whose schema is known current (``current`` or a template copy):
    the attributes ``RDBStorage.__init__`` sets, without ``create_all`` and the Alembic version
    manager; the manager (``upgrade``, ``get_current_version``) is made when asked for."""

    def __init__(self, url: str, engine_kwargs: dict[str, Any]) -> None:
        self.engine_kwargs = dict(engine_kwargs)
        self.url = self._fill_storage_url_template(url)
        self.skip_compatibility_check = True  # done: the file's stamp is the head (module docstring)
        self.heartbeat_interval = self.grace_period = None
        self.heartbeat_stale_trial_callback = self.failed_trial_callback = None
        self.engine = sqlalchemy.engine.create_engine(self.url, **self.engine_kwargs)
        self.scoped_session = sqlalchemy.orm.scoped_session(sqlalchemy.orm.sessionmaker(bind=self.engine))

    def __getattr__(self, name: str) -> Any:
        if name != "_version_manager":
            raise AttributeError(name)
        from optuna.storages._rdb.storage import _VersionManager

        vm = self.__dict__["_version_manager"] = _VersionManager(self.url, self.engine, self.scoped_session)
        return vm

    def __getstate__(self) -> dict[Any, Any]:
        self._version_manager  # noqa: B018 - RDBStorage.__getstate__ deletes it: it must exist
        return super().__getstate__()
