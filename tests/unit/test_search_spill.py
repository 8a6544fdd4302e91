"""The spill file: finished trials survive SIGKILL of the process that held them (autotune/search/spill.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from autotune.search.spill import Spill, recover, spill_dir, trial_from_json, trial_to_json

DISTS = {"x": FloatDistribution(0.0, 2.0), "k": IntDistribution(0, 3), "s": CategoricalDistribution(("a", "b"))}


def make(i: int, origin: str = "w") -> optuna.trial.FrozenTrial:
    return optuna.trial.create_trial(params={"x": i / 10, "k": i % 4, "s": "ab"[i % 2]}, distributions=DISTS,
                                     value=float(i), user_attrs={"origin": f"{origin}:{i}", "plan": {"i": i}},
                                     constraints={"memory": -1.0 + i, "divisibility": 0.0})


def test_a_trial_round_trips():
    t = make(3)
    u = trial_from_json(trial_to_json(t))
    assert (u.params, u.value, u.user_attrs, u.constraints, u.state) == \
        (t.params, t.value, t.user_attrs, t.constraints, t.state)
    assert u.distributions == t.distributions


def _spill_and_die(url: str, name: str, n: int) -> None:
    sp = Spill(url, name, "dead")
    for i in range(n):
        sp.append(make(i, "dead"))
    os.kill(os.getpid(), signal.SIGKILL)  # no flush, no finally: what the OOM killer does


def test_trials_of_a_killed_process_are_recovered_once(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(study_name="st", storage=url, direction="maximize")
    p = mp.get_context("fork").Process(target=_spill_and_die, args=(url, "st", 5))
    p.start()
    p.join()
    assert p.exitcode == -signal.SIGKILL
    study.add_trials([make(0, "dead"), make(1, "dead")])  # its first batch made it to the storage
    assert recover(url, study) == 3
    origins = sorted(t.user_attrs["origin"] for t in study.get_trials())
    assert origins == [f"dead:{i}" for i in range(5)]
    assert not list(spill_dir(url).glob("*.jsonl"))
    assert recover(url, study) == 0


def test_a_live_process_file_is_left_alone_and_a_torn_line_skipped(tmp_path):
    url = f"{tmp_path}/j.log"
    study = optuna.create_study(study_name="st", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(url)), direction="maximize")
    live = Spill(url, "st", "live")
    live.append(make(7, "live"))
    assert recover(url, study) == 0 and live.path.exists()  # locked: its owner will persist it
    live.clear()
    live.close()
    assert not live.path.exists()
    torn = Spill(url, "st", "torn")
    torn.append(make(1, "torn"))
    torn._fh.write(trial_to_json(make(2, "torn"))[:30])  # died mid-write
    torn._fh.flush()
    torn._fh.close()  # the lock goes with the file, as at process death
    torn._fh = None
    assert recover(url, study) == 1
    assert [t.user_attrs["origin"] for t in study.get_trials()] == ["torn:1"]


def test_other_studies_files_are_not_taken(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    a = optuna.create_study(study_name="a", storage=url, direction="maximize")
    sp = Spill(url, "b", "x")
    sp.append(make(1, "x"))
    sp._fh.close()
    sp._fh = None
    assert recover(url, a) == 0
    b = optuna.create_study(study_name="b", storage=url, direction="maximize")
    assert recover(url, b) == 1


@pytest.mark.parametrize("url", ["postgresql://u@h/db", "mysql+pymysql://u@h/x"])
def test_server_storages_spill_under_the_cache(url, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert spill_dir(url).is_relative_to(tmp_path) and spill_dir(url) != spill_dir(url + "2")
