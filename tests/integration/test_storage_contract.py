"""One storage contract, run against every backend a user can pass as ``--storage``: SQLite, an Optuna
journal file, a real PostgreSQL server (tests/conftest.py starts a throw-away one; the cases skip
with the reason where none can be started, and fail instead under AUTOTUNE_REQUIRE_POSTGRES=1, as
in CI) and in-memory.

The contract: profiles and studies live side by side (a study's cluster can name a profile of the
same storage); 4 search workers share one study without losing or duplicating a trial; a worker
killed with SIGKILL loses no finished trial and the next run resumes the study; ``validate`` runs
the study's best plan for real and stores the measurement, which ``dashboard`` then reads.
An in-memory study lives in one process: several workers are refused there (exit 2), and there is
nothing left to resume after a SIGKILL.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time

import pytest
from helpers.cli import cli
from helpers.origins import assert_no_gaps

from autotune.errors import InputError
from autotune.search import SearchOptions, search
from autotune.specs import load_cluster, load_model
from autotune.specs.cluster import cluster_from_dict
from autotune.study import MEMORY_URL, list_studies, open_study
from profilers import store

pytestmark = pytest.mark.slow

BACKENDS = ["sqlite", "journal", "postgres", "memory"]
TINY = load_model("tiny")
SMALL = load_model("small")
QUICK = SearchOptions(trials=8, polish=False)


@pytest.fixture(params=BACKENDS)
def storage(request, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # spill files of a server URL
    kind = request.param
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/results/autotune.db"
    if kind == "journal":
        return str(tmp_path / "results" / "autotune.log")
    if kind == "postgres":
        return request.getfixturevalue("postgres_url")
    from autotune import study as study_mod

    study_mod._MEMORY_STORAGES.clear()  # a fresh in-memory storage per test
    store._ENGINES.pop(MEMORY_URL, None)
    return MEMORY_URL


def trials_of(url, name):
    return open_study(name, url).get_trials(deepcopy=False)




@pytest.fixture(scope="module")
def cpu_profile():
    """One real quick profile of this machine (2 ranks), stored into each backend by the test."""
    from profilers.launch import check_request, launch_local

    return launch_local(check_request("cpu", 2), 2, quick=True, timeout_s=120.0)


def test_profiles_and_studies_side_by_side(storage, cpu_profile):
    pid = store.save_profile(cpu_profile, storage, label="contract", nproc=2)
    cluster = cluster_from_dict({"name": "profiled", "nodes": [{"count": 1, "devices_per_node": 2,
                                                                 "device": f"profile:{pid}"}]}, storage=storage)
    res = search(TINY, cluster, 128, 8, study_name="on-profile", storage=storage, options=QUICK)
    search(TINY, load_cluster("local:2"), 128, 8, study_name="on-catalogue", storage=storage, options=QUICK)
    assert [p["id"] for p in store.list_profiles(storage)] == [pid]
    assert store.load_profile(pid, storage)["run"]["label"] == "contract"
    studies = {s["name"]: s for s in list_studies(storage)}
    assert set(studies) == {"on-profile", "on-catalogue"}
    assert studies["on-profile"]["trials"] == res.trials == len(trials_of(storage, "on-profile")) > 0
    # the study's cluster is rebuilt from the profile in the same storage
    attrs = open_study("on-profile", storage).user_attrs
    assert f"profile:{pid}" in json.dumps(attrs["cluster_spec"])


def test_four_workers_share_one_study(storage):
    opts = SearchOptions(trials=60, workers=4, seed=1, polish=False)
    if storage == MEMORY_URL:
        with pytest.raises(InputError, match="shared storage"):
            search(SMALL, load_cluster("local:8"), 256, 16, study_name="w4", storage=storage, options=opts)
        return
    res = search(SMALL, load_cluster("local:8"), 256, 16, study_name="w4", storage=storage, options=opts)
    trials = trials_of(storage, "w4")
    seqs = assert_no_gaps(trials)
    assert res.trials == len(trials)
    assert len(seqs) >= 1 + 4, f"expected the parent and 4 workers to record trials, got {sorted(seqs)}"
    assert len({t.number for t in trials}) == len(trials)


def _search_until_killed(url: str, cache: str) -> None:
    os.environ["XDG_CACHE_HOME"] = cache
    # batch_s: never persist before the end, so every finished trial exists only in the spill file
    search(SMALL, load_cluster("local:8"), 256, 16, study_name="k", storage=url,
           options=SearchOptions(trials=100_000, timeout_s=300, batch_s=1e9))


def test_sigkill_of_a_worker_loses_no_trial_and_resumes(storage, tmp_path):
    if storage == MEMORY_URL:
        pytest.skip("an in-memory study lives and dies with its process: there is nothing to resume")
    from autotune.search.spill import spill_dir

    p = mp.get_context("spawn").Process(target=_search_until_killed, args=(storage, os.environ["XDG_CACHE_HOME"]))
    p.start()

    def spilled() -> int:
        d = spill_dir(storage)
        return sum(f.read_text().count("\n") for f in d.glob("*.jsonl")) if d.is_dir() else 0

    end = time.monotonic() + 240
    while spilled() < 40 and p.is_alive() and time.monotonic() < end:
        time.sleep(0.25)
    assert p.is_alive(), "the search ended before it could be killed"
    os.kill(p.pid, signal.SIGKILL)  # what the OOM killer does: no handler runs
    p.join()
    finished = spilled()
    assert finished >= 40
    res = search(SMALL, load_cluster("local:8"), 256, 16, study_name="k", storage=storage,
                 options=SearchOptions(trials=5, polish=False))
    assert any("recovered" in n for n in res.notes), res.notes
    seqs = assert_no_gaps(trials_of(storage, "k"))
    assert any(len(ns) >= finished for ns in seqs.values()), \
        f"the killed process's {finished} trials are not all in the study: {[len(v) for v in seqs.values()]}"
    assert not list(spill_dir(storage).glob("*.jsonl")), "spill files left after a clean run"


def test_validate_and_dashboard_read_the_result(storage, capsys):
    from autotune.validate import ValidateOptions, validate

    search(TINY, load_cluster("local:2"), 32, 4, study_name="v", storage=storage, options=QUICK)
    out = validate("v", storage, options=ValidateOptions(top=1, steps=1, warmup=0, device="cpu"))
    assert out["best_measured"] is not None, out["validated"]
    trial = out["best_measured_trial"]
    code, stdout, err = cli(capsys, "dashboard", "--study", "v", "--storage", storage, "--json")
    assert code == 0, err
    view = json.loads(stdout)
    want = out["best_measured"]["measured"]["tokens_per_s"]
    shown = [r for r in rows_of(view) if r.get("measured_tokens_per_s") == pytest.approx(want)]
    assert shown, f"the dashboard does not show trial {trial}'s measurement ({want:.1f} tokens/s)"
    assert open_study("v", storage).user_attrs.get("best_measured_trial") == trial


def rows_of(obj):
    """Every dict in a JSON document (the dashboard's rows wherever it keeps them)."""
    if isinstance(obj, dict):
        yield obj
        for v in obj.values():
            yield from rows_of(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from rows_of(v)
