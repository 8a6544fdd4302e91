"""A write-ahead file of finished trials that a search process has not persisted yet.

The search persists its trials to the study's storage in batches (autotune/search/workspace.py: one
write per batch, not per trial). Without this file a process killed with SIGKILL (the OOM
killer, ``kill -9``, a preempted node) would lose the trials it finished since its last batch. Each
finished trial is appended here as one JSON line before it goes into the batch (a plain ``write``:
the kernel keeps it even when the process dies at once), and the file is emptied once the batch is
in the storage. The next search of the same study reads the files of dead processes, adds the trials
the storage lacks (by their unique ``origin`` attr) and removes the files.

A live process holds an exclusive ``flock`` on its own file, so recovery never takes the file of a
process that is still running (another worker, another machine on the same shared directory);
the kernel drops the lock when the process dies, however it dies.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from autotune.search.pricing import Shared

SUFFIX = ".jsonl"


def spill_dir(storage_url: str) -> Path:
    """Where a storage's spill files live: beside a SQLite file or journal file, else in a per-URL
    folder of the user's cache (a PostgreSQL URL has no file of its own)."""
    if storage_url.startswith("sqlite:///"):
        path = Path(storage_url[len("sqlite:///"):])
        return path.parent / f".{path.name}.spill"
    if storage_url.endswith(".log") and "://" not in storage_url:
        path = Path(storage_url)
        return path.parent / f".{path.name}.spill"
    digest = hashlib.sha1(storage_url.encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "autotune" / "spill" / digest


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]


def _study_prefix(study_name: str) -> str:
    # the digest keeps two names that _safe maps to the same text apart
    return f"{_safe(study_name)}-{hashlib.sha1(study_name.encode()).hexdigest()[:8]}-"


_DIST_JSON: dict[int, tuple[Any, str]] = {}  # id -> (the distribution, kept alive so ids stay unique; its JSON)


def _dist_json(d: Any) -> str:
    """distribution_to_json, once per distribution object (a study's trials share them)."""
    hit = _DIST_JSON.get(id(d))
    if hit is None or hit[0] is not d:
        from optuna.distributions import distribution_to_json

        if len(_DIST_JSON) > 4096:  # objects made per trial would otherwise pile up
            _DIST_JSON.clear()
        hit = _DIST_JSON[id(d)] = (d, distribution_to_json(d))
    return hit[1]


_DISTS_JSON: dict[int, tuple[Any, str]] = {}  # id -> (a Shared distributions dict, its JSON object's text)
_DISTS_MARK = "\x00distributions\x00"


def _dists_json(dists: Any) -> str:
    """The ``distributions`` object of a line: encoded once per Shared dict (every trial of a search
    carries the same one, never mutated: search/pricing.Shared), else each time."""
    if type(dists) is not Shared:
        return json.dumps({k: _dist_json(d) for k, d in dists.items()}, separators=(",", ":"))
    hit = _DISTS_JSON.get(id(dists))
    if hit is None or hit[0] is not dists:
        if len(_DISTS_JSON) > 4096:
            _DISTS_JSON.clear()
        hit = _DISTS_JSON[id(dists)] = (dists, json.dumps({k: _dist_json(d) for k, d in dists.items()},
                                                          separators=(",", ":")))
    return hit[1]


def trial_to_json(t: Any, user_json: dict[str, str] | None = None) -> str:
    """One line; ``user_json``: the user attrs already encoded, key by key (search/bulk.encode_attrs),
    spliced in rather than encoded twice, as are the distributions (``_dists_json``)."""
    head = json.dumps({
        "state": t.state.name, "value": t.value, "params": t.params, "distributions": _DISTS_MARK,
        "constraints": dict(getattr(t, "constraints", None) or {}),
        **({"user_attrs": t.user_attrs} if user_json is None else {}),
    }, separators=(",", ":"), default=str).replace(json.dumps(_DISTS_MARK), _dists_json(t.distributions), 1)
    if user_json is None:
        return head
    attrs = ",".join(f"{json.dumps(k)}:{v}" for k, v in user_json.items())
    return head[:-1] + ',"user_attrs":{' + attrs + "}}"


def trial_from_json(line: str) -> Any:
    import optuna
    from optuna.distributions import json_to_distribution

    d = json.loads(line)
    return optuna.trial.create_trial(
        state=optuna.trial.TrialState[d["state"]], value=d["value"], params=d["params"],
        distributions={k: json_to_distribution(v) for k, v in d["distributions"].items()},
        user_attrs=d["user_attrs"], constraints=d["constraints"] or None)


class Spill:
    """This process's spill file for one study (created on the first append)."""

    def __init__(self, storage_url: str, study_name: str, origin: str):
        self.path = spill_dir(storage_url) / f"{_study_prefix(study_name)}{origin}{SUFFIX}"
        self._fh: Any = None

    def _open(self) -> Any:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held for the process's life
            fcntl.flock(self._fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return self._fh

    def append(self, trial: Any, user_json: dict[str, str] | None = None) -> None:
        fh = self._open()
        fh.write(trial_to_json(trial, user_json) + "\n")
        fh.flush()  # into the kernel: survives SIGKILL of this process

    def clear(self) -> None:
        """The batch is in the storage: forget it."""
        if self._fh is not None:
            self._fh.seek(0)
            self._fh.truncate()
            self._fh.flush()

    def close(self) -> None:
        """At a clean end every trial is persisted: remove the file."""
        if self._fh is not None:
            self.clear()
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            self._fh.close()
            self._fh = None


def recover(storage_url: str, study: Any) -> int:
    """Add the trials that dead processes spilled but never persisted to ``study``; return how many.

    Files of live processes (locked) are left alone; a torn last line (the process died mid-write)
    is skipped."""
    folder = spill_dir(storage_url)
    if not folder.is_dir():
        return 0
    files = sorted(folder.glob(f"{_study_prefix(study.study_name)}*{SUFFIX}"))
    if not files:
        return 0
    have = {t.user_attrs.get("origin") for t in study.get_trials(deepcopy=False)}
    added = 0
    for f in files:
        try:
            fh = open(f, encoding="utf-8")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its process is alive and will persist these itself
                continue
            if os.fstat(fh.fileno()).st_nlink == 0:  # another recovery took it while we waited to open
                continue
            new = []
            for line in fh:
                try:
                    t = trial_from_json(line)
                except (ValueError, KeyError, TypeError):
                    continue
                if t.user_attrs.get("origin") not in have:
                    have.add(t.user_attrs.get("origin"))
                    new.append(t)
            if new:
                study.add_trials(new)
                added += len(new)
            f.unlink()
        finally:
            fh.close()
    return added
