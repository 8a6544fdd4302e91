"""`autotune search` and `autotune validate` end to end through the CLI (real cost model)."""

from __future__ import annotations

import json

import pytest
from helpers.cli import run_autotune


def run(*args, timeout=300):
    return run_autotune(*args, timeout=timeout)


BASE = ("search", "--model", "tiny", "--cluster", "local:4", "--seq-len", "128", "--global-batch", "8")


def test_search_json_contract_and_resume(in_tmp):
    r = run(*BASE, "--trials", "40", "--study", "cli", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("best", "top", "baseline_best", "trials", "elapsed_s"):
        assert key in out
    assert out["best"]["predicted"]["tokens_per_s"] >= out["baseline_best"]["predicted"]["tokens_per_s"]
    assert out["top"][0] == out["best"] and len(out["top"]) <= 5
    assert (in_tmp / "results" / "autotune.db").exists()
    r2 = run(*BASE, "--trials", "10", "--study", "cli", "--json")
    out2 = json.loads(r2.stdout)
    assert out2["trials"] == out["trials"] + out2["new_trials"] and out2["new_trials"] > 0
    # the table output names the best even-split plan and says why the best wins
    r3 = run(*BASE, "--trials", "5", "--study", "cli")
    assert r3.returncode == 0 and "best even-split plan" in r3.stdout and "best layouts" in r3.stdout


def test_search_bad_input_is_one_line(in_tmp):
    r = run(*BASE, "--sampler", "bayes")
    assert r.returncode == 2 and "--sampler" in r.stderr and "Traceback" not in r.stderr
    r = run(*BASE, "--workers", "2", "--storage", ":memory:", "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["field"] == "--workers"
    run(*BASE, "--trials", "3", "--study", "taken")
    r = run("search", "--model", "small", "--cluster", "local:4", "--seq-len", "128", "--global-batch", "8",
            "--study", "taken")
    assert r.returncode == 2 and "belongs to model 'tiny'" in r.stderr
    r = run("validate", "--study", "nope")
    assert r.returncode == 2 and "no study named 'nope'" in r.stderr


def test_journal_storage_and_grid(in_tmp):
    r = run("search", "--model", "tiny", "--cluster", "local:2", "--seq-len", "64", "--global-batch", "2",
            "--sampler", "grid", "--storage", "results/j.log", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert any("exhaustive" in n for n in out["notes"])


@pytest.mark.slow
def test_validate_runs_real_trials_and_calibrates(in_tmp):
    r = run(*BASE, "--trials", "30", "--study", "val", "--json")
    assert r.returncode == 0, r.stderr
    r = run("validate", "--study", "val", "--top", "2", "--steps", "2", "--json", timeout=600)
    assert r.returncode in (0, 1), r.stderr
    out = json.loads(r.stdout)
    assert len(out["validated"]) == 2
    ok = [v for v in out["validated"] if v["measured"]]
    assert ok and out["calibration"] and out["best_measured"]["measured"]["step_time_s"] > 0
    assert out["median_error_after"] is not None
