"""Tensor-parallel layers against the unsharded computation, and the launcher's failure handling."""

from __future__ import annotations

import os
import socket

import pytest
from helpers.pool import run_in_pool

from autotune.runtime.launcher import launch

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world", [2, 4])
def test_tp_layers_match_unsharded(world):
    res = run_in_pool("_runtime_targets:tp_layers", {}, world, timeout_s=120)
    assert res.failure is None, res.extra.get("traceback")
    for rank_result in res.results:
        for name, err in rank_result.items():
            assert err < 1e-4, (name, err)


def _gone(pids):
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


@pytest.mark.parametrize("kind", ["error", "oom"])
def test_a_failing_rank_is_classified_and_ends_every_process(kind):
    res = launch("_runtime_targets:fail_on", {"rank": 1, "kind": kind}, 3, timeout_s=60, device="cpu")
    assert res.results is None
    assert res.failure["kind"] == kind and res.failure["rank"] == 1
    assert ("boom" if kind == "error" else "out of memory") in res.failure["message"]
    assert _gone(res.extra["pids"])


def test_a_hang_times_out_and_leaves_no_process():
    res = launch("_runtime_targets:hang", {}, 2, timeout_s=8, device="cpu")
    assert res.failure["kind"] == "timeout"
    assert _gone(res.extra["pids"])


def test_port_clash_is_retried(monkeypatch):
    """The first port offered is taken by someone else: the launch retries on another."""
    import autotune.runtime.launcher as L

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    ports = iter([busy.getsockname()[1]])
    real = L.free_port
    monkeypatch.setattr(L, "free_port", lambda: next(ports, None) or real())
    try:
        res = launch("_runtime_targets:ok", {}, 2, timeout_s=60, device="cpu")
    finally:
        busy.close()
    assert res.failure is None, res.failure
    assert res.attempts == 2
    assert [r["sum"] for r in res.results] == [1.0, 1.0]


def test_the_same_worker_runs_under_torchrun(tmp_path):
    """torchrun-compatible entry: a job file, `-m autotune.runtime.worker`, results per rank."""
    import subprocess
    import sys

    from autotune.plan import Plan
    from autotune.runtime.launcher import read_results, write_job
    from autotune.specs import load_model

    spec = load_model("tiny")
    plan = Plan.from_dict({"degrees": {"dp": 2}, "dtype": "fp32"}).resolve(
        spec, __import__("autotune.specs", fromlist=["local_cluster"]).local_cluster(2), 32, 4)
    payload = {"plan": plan.to_dict(), "model": spec.to_dict(), "seq_len": 32, "global_batch": 4, "steps": 1,
               "warmup": 0, "seed": 0}
    job = write_job(tmp_path / "job.pt", "autotune.runtime.worker:trial_job", payload, device="cpu")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "autotune.runtime.worker", "--job", str(job), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    res = read_results(tmp_path, 2)
    assert res.failure is None
    assert res.results[0]["losses"] == res.results[1]["losses"]
