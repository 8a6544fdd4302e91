"""`autotune trial` end to end through the installed CLI."""

from __future__ import annotations

import json

import pytest
from helpers.cli import run_autotune


def run(*args):
    return run_autotune("trial", *args, timeout=300)


@pytest.mark.slow
def test_trial_json_reports_the_contract_shape(in_tmp):
    r = run("--plan", "dp=2,dtype=fp32", "--model", "tiny", "--seq-len", "32", "--global-batch", "4",
            "--steps", "2", "--warmup", "1", "--emulate-slowdown", "1=1.5", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["failure"] is None
    m = out["measured"]
    assert m["step_time_s"] > 0 and m["tokens_per_s"] == pytest.approx(4 * 32 / m["step_time_s"])
    assert len(m["peak_memory_bytes"]) == 2 and all(x > 0 for x in m["peak_memory_bytes"])
    assert [s["rank"] for s in m["time_split"]] == [0, 1]
    assert m["time_split"][1]["emulated_s"] > 0 and m["time_split"][0]["emulated_s"] == 0
    assert len(out["losses"]) == 3
    assert len(out["grad_norms"]) == 3 and all(g > 0 for g in out["grad_norms"])  # the values: the parity tests
    assert out["plan"]["measured"]["step_time_s"] == m["step_time_s"]


def test_trial_bad_input_is_one_line_exit_2(in_tmp):
    r = run("--plan", "dp=3", "--model", "tiny", "--seq-len", "32", "--global-batch", "4", "--nproc", "2")
    assert r.returncode == 2
    assert "--nproc(2)" in r.stderr and "Traceback" not in r.stderr
    r = run("--plan", "dp=2", "--model", "tiny", "--seq-len", "32", "--global-batch", "4",
            "--emulate-slowdown", "x=2", "--json")
    assert r.returncode == 2
    assert json.loads(r.stdout)["error"]["field"] == "--emulate-slowdown"


def test_trial_timeout_is_a_result_exit_1(in_tmp):
    r = run("--plan", "dp=2", "--model", "tiny", "--seq-len", "32", "--global-batch", "4", "--timeout", "1",
            "--json")
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)  # exactly one object: the result with its failure
    assert out["failure"]["kind"] == "timeout" and out["measured"] is None
