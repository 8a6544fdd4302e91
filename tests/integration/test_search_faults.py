"""Faults of a running search (issue 6): Ctrl-C, a worker killed by SIGTERM or SIGKILL.

What a user relies on: no trial that a process finished is lost, no process is left behind, the
study stays consistent (no duplicates) and the next run of the same study resumes from it.
"Finished" is checked exactly: every trial a process records gets the next number of its ``origin``
(``<process id>:<n>``), so the trials of one origin in the storage must be 0..n-1 with no gap.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from helpers.cli import run_autotune
from helpers.origins import assert_no_gaps

pytestmark = pytest.mark.slow

CLUSTER = {"name": "a100x16", "nodes": [{"count": 2, "devices_per_node": 8, "device": "A100-80GB"}],
           "inter_node": {"bandwidth": "25GB/s"}}
WORK = ("--model", "llama3-8b", "--seq-len", "8192", "--global-batch", "8")


def trials_of(url: str, name: str) -> list[optuna.trial.FrozenTrial]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False)
    except KeyError:  # not created yet
        return []


def session_processes(sid: int) -> list[int]:
    """Live processes of a session (what Ctrl-C in a terminal reaches), zombies excluded."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(p.name))
    return out


def wait_for(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.25)
    pytest.fail(f"timed out waiting for {what}")


def cli(*args: str, **kw):
    return subprocess.Popen([sys.executable, "-m", "autotune", "search", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def stored_origins(db: Path) -> int:
    """How many search processes have stored trials in the SQLite file ``db``, read through a
    read-only connection: polling with ``optuna.load_study`` creates the schema when the file is new,
    racing the search that is creating it (UNIQUE constraint failed: alembic_version), and loads every
    trial each time (seconds once thousands are stored, on a loaded machine)."""
    if not db.exists():
        return 0
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as con:
            rows = con.execute("SELECT value_json FROM trial_user_attributes WHERE key = 'origin'").fetchall()
    except sqlite3.OperationalError:  # no tables yet, or a writer holds the file past the timeout
        return 0
    return len({json.loads(v).rsplit(":", 1)[0] for (v,) in rows})


def default_sigint() -> None:
    """In the child before exec: SIGINT back to its default disposition (an ignored one survives exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_with_two_workers_keeps_every_trial_and_resumes(in_tmp):
    (in_tmp / "c.json").write_text(json.dumps(CLUSTER))
    url = f"sqlite:///{in_tmp}/results/f.db"
    args = (*WORK, "--cluster", "c.json", "--storage", url, "--study", "f", "--workers", "2")
    # Started as a terminal starts a foreground job, SIGINT at its default: a test run started in the
    # background (``pytest ... &``, nohup, some CI runners) ignores SIGINT, the search inherited that,
    # Python then installs no KeyboardInterrupt, and the Ctrl-C stopped only the workers (they set
    # their own handler): the search finished its phases and exited 0 instead of 130.
    p = cli(*args, "--trials", "100000", "--timeout", "120", "--json", start_new_session=True,
            preexec_fn=default_sigint)
    try:
        # both workers have persisted at least one batch (the parent's baselines come first)
        wait_for(lambda: stored_origins(in_tmp / "results" / "f.db") >= 3 or p.poll() is not None, 90,
                 "two workers' trials")
        assert p.poll() is None, p.stderr.read()
        os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: every process of the group
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:  # the wait or the Ctrl-C failed: leave no search running
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 130 and "interrupted" in out, (out, err)
    assert "Traceback" not in err, err
    wait_for(lambda: not session_processes(p.pid), 10, "no process of the search left")
    before = trials_of(url, "f")
    seqs = assert_no_gaps(before)
    assert len(seqs) >= 3 and all(t.state == optuna.trial.TrialState.COMPLETE or t.state.name == "FAIL"
                                  for t in before)
    r = run_autotune("search", *args, "--trials", "20", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert any("resumed" in n for n in out["notes"])
    after = trials_of(url, "f")
    assert out["trials"] == len(after) == len(before) + out["new_trials"] and out["new_trials"] > 0
    assert_no_gaps(after)
    assert {t.number for t in before} <= {t.number for t in after}


def test_a_worker_ended_with_sigterm_flushes_and_the_search_goes_on(in_tmp):
    (in_tmp / "c.json").write_text(json.dumps(CLUSTER))
    url = f"sqlite:///{in_tmp}/results/f.db"
    p = cli(*WORK, "--cluster", "c.json", "--storage", url, "--study", "t", "--workers", "2", "--trials", "100000",
            "--timeout", "25", "--json", start_new_session=True)
    wait_for(lambda: stored_origins(in_tmp / "results" / "f.db") >= 3 or p.poll() is not None, 90,
             "two workers' trials")
    workers = [pid for pid in session_processes(p.pid) if pid != p.pid]
    assert workers, "no worker process found"
    os.kill(workers[0], signal.SIGTERM)  # `kill PID`: the worker persists what it has and stops
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    res = json.loads(out)
    assert res["trials"] == len(trials_of(url, "t"))
    # the note's trials per phase count the workers' trials too: its phases add up to the study
    phases = next(n for n in res["notes"] if "trials per phase" in n).split("trials per phase: ")[1]
    counts = [int(part.split(" of ")[0].split()[-1]) for part in phases.split(", ")]
    assert sum(counts) == res["trials"], (phases, res["trials"])
    assert_no_gaps(trials_of(url, "t"))


def _search_forever(url: str) -> None:
    from autotune.search import SearchOptions, search
    from autotune.specs import load_model
    from autotune.specs.cluster import cluster_from_dict

    # batch_s: never persist before the end, so every finished trial exists only in the spill file
    search(load_model("llama3-8b"), cluster_from_dict(CLUSTER), 8192, 8, study_name="k", storage=url,
           options=SearchOptions(trials=100000, timeout_s=120, batch_s=1e9))


def test_sigkill_loses_no_finished_trial(tmp_path):
    from autotune.search import SearchOptions, search
    from autotune.search.spill import spill_dir
    from autotune.specs import load_model
    from autotune.specs.cluster import cluster_from_dict

    url = f"sqlite:///{tmp_path}/k.db"
    p = mp.get_context("spawn").Process(target=_search_forever, args=(url,))
    p.start()

    def spilled() -> int:
        return sum(f.read_text().count("\n") for f in spill_dir(url).glob("*.jsonl")) if spill_dir(url).is_dir() \
            else 0

    wait_for(lambda: spilled() >= 60 or not p.is_alive(), 120, "60 finished trials")
    os.kill(p.pid, signal.SIGKILL)  # the OOM killer: no handler runs
    p.join()
    finished = spilled()
    persisted = len(trials_of(url, "k"))
    assert finished >= 60 and persisted < finished  # the finished trials were not in the storage yet
    res = search(load_model("llama3-8b"), cluster_from_dict(CLUSTER), 8192, 8, study_name="k", storage=url,
                 options=SearchOptions(trials=5, polish=False))
    assert any("recovered" in n for n in res.notes), res.notes
    trials = trials_of(url, "k")
    seqs = assert_no_gaps(trials)
    killed = [ns for ns in seqs.values() if len(ns) >= finished]
    assert killed, f"the killed process's {finished} trials are not all in the study: {[len(v) for v in seqs.values()]}"
    assert not list(spill_dir(url).glob("*.jsonl")), "spill files left after a clean run"
