"""Several nodes for real: two torchrun agents on 127.0.0.1 meet through c10d rendezvous, each started
as a user starts one node (``autotune apply --launch --node-rank K`` with MASTER_ADDR/MASTER_PORT set),
and run the plan's ranks as the study's cluster places them. Their losses match one process; a dead
agent fails the other cleanly (every process ends, the error names the node)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.runtime.launcher import free_port

pytestmark = pytest.mark.slow

SEQ, BATCH, STEPS, WARMUP = 32, 4, 2, 2  # warm-up: autotune.export.launch.commands' default


def agents(tmp_path, nodes: int, per_node: int, plan: dict, steps: int = STEPS, how: str = "apply",
           extra: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    """One host's command per node, as a user runs them: ``apply --launch --node-rank K`` or
    ``trial --cluster C --node-rank K``."""
    (tmp_path / "cluster.json").write_text(json.dumps(
        {"name": f"{nodes}x{per_node}", "nodes": [{"count": nodes, "devices_per_node": per_node, "device": "CPU"}]}))
    (tmp_path / "plan.json").write_text(json.dumps({**plan, "dtype": "fp32"}))
    # Two "hosts" share this machine's cores: torchrun leaves OMP_NUM_THREADS unset for one rank per
    # node, and two ranks each spinning all cores' OpenMP threads ran a tiny step 70x slower (6.7 s vs 0.09 s)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    verb = ["apply", "--launch"] if how == "apply" else ["trial"]
    procs = []
    for k in range(nodes):
        if k == 1:  # node-rank 0 first: its agent hosts the rendezvous store, as on hosts named by MASTER_ADDR
            time.sleep(2)
        procs.append(subprocess.Popen([sys.executable, "-m", "autotune", verb[0], "-p", "plan.json", "-m", "tiny", "-s",
                              str(SEQ), "-b", str(BATCH), "-c", "cluster.json", *verb[1:], "--node-rank", str(k),
                              "--steps", str(steps), *extra, "--json"], cwd=tmp_path, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
    return procs


def descendants(pid: int) -> list[int]:
    """Live processes below ``pid`` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(p.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def reference_result(data: dict | None = None) -> dict:
    from autotune.runtime.worker import reference_run
    from autotune.specs.model import load_model

    return reference_run(load_model("tiny"), SEQ, BATCH, steps=WARMUP + STEPS, seed=0, data=data)


def reference_losses(data: dict | None = None) -> list[float]:
    return reference_result(data)["losses"]


def finish(procs) -> list[dict]:
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out))
    return outs


def assert_matches(losses: list[float], ref: list[float]) -> None:
    # AdamW moves a weight whose gradient is ~0 by up to lr on rounding noise: tight first, then looser
    assert losses[:3] == pytest.approx(ref[:3], rel=1e-5)
    assert losses == pytest.approx(ref, rel=1e-3)


def test_apply_launch_on_two_agents_runs_what_the_dry_run_printed(tmp_path):
    outs = finish(agents(tmp_path, 2, 1, {"degrees": {"dp": 2}}))
    dry = subprocess.run([sys.executable, "-m", "autotune", "apply", "-p", "plan.json", "-m", "tiny", "-s", str(SEQ),
                          "-b", str(BATCH), "-c", "cluster.json", "--launch", "--dry-run", "--steps", str(STEPS),
                          "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["commands"] == [o["commands"][0] for o in outs]  # what ran is what was printed
    assert [o["measured"]["ranks"] for o in outs] == [[0], [1]]
    ref = reference_losses()
    for o in outs:
        assert_matches(o["measured"]["losses"], ref)


def test_a_trial_on_two_agents_of_two_ranks_matches_one_process(tmp_path):
    """2 x 2 ranks, pp=2 x dp=2 (the cluster puts ranks 0-1 on node-rank 0), on a token file."""
    import numpy as np

    from autotune.runtime.data import prepare_data

    np.array(np.random.default_rng(3).integers(0, 256, 5000), dtype=np.uint16).tofile(tmp_path / "train.bin")
    outs = finish(agents(tmp_path, 2, 2, {"degrees": {"pp": 2, "dp": 2}}, how="trial",
                         extra=("--data", "train.bin")))
    assert [o["measured"]["ranks"] for o in outs] == [[0, 1], [2, 3]]
    ref = reference_result(prepare_data(tmp_path / "train.bin", 256, SEQ, BATCH, WARMUP + STEPS))
    for o in outs:  # each node reports the world's losses and global gradient norms
        assert_matches(o["losses"], ref["losses"])
        assert_matches(o["grad_norms"], ref["grad_norms"])


def test_a_dead_agent_fails_the_launch_cleanly(tmp_path):
    # --timeout 60: a rank still joining its process group when its peer dies waits that long for it
    procs = agents(tmp_path, 2, 1, {"degrees": {"dp": 2}}, steps=100_000, extra=("--timeout", "60"))
    end = time.monotonic() + 300

    def ranks_up(p) -> bool:
        return any(" -m autotune.runtime.launcher " in cmdline(q) and "torchrun" not in cmdline(q)
                   for q in descendants(p.pid))

    # both nodes' ranks are up (the rendezvous is done) before node-rank 1 dies
    while time.monotonic() < end and not all(ranks_up(p) for p in procs):
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-1000:] for p in procs]
        time.sleep(0.5)
    assert all(ranks_up(p) for p in procs)
    time.sleep(5)  # into the training steps
    node0 = descendants(procs[0].pid)  # its torchrun agent and rank, which must end by themselves
    node1 = [procs[1].pid, *descendants(procs[1].pid)]
    for pid in node1:  # the host of node-rank 1 is gone: its agent, its ranks, all at once
        os.kill(pid, signal.SIGKILL)
    out, err = procs[0].communicate(timeout=300)
    procs[1].wait(timeout=30)
    assert procs[0].returncode == 1, err
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "node 0 (node-rank 0)" in lines[0], err
    deadline = time.monotonic() + 30
    while alive(node0 + node1) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(node0 + node1), f"processes left: {[cmdline(q) for q in alive(node0 + node1)]}"


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def test_a_profile_spans_two_agents(tmp_path):
    from profilers import store

    url = f"sqlite:///{tmp_path}/p.db"
    # two "hosts" on one machine's cores: one OpenMP thread each (as the launch tests above), or under load the two
    # ranks' thread pools fight and the quick profile overran its 300 s in CI
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "autotune", "profile", "--nnodes", "2", "--nproc", "1", "--quick",
                               "--device", "cpu", "--storage", url, "--json"], cwd=tmp_path, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out))
    assert sum(1 for o in outs if o.get("stored") is False) == 1  # one host stores, the other says so
    (prof,) = store.list_profiles(url)
    doc = store.load_profile(prof["id"], url)
    assert prof["nproc"] == 2
    links = doc["fits"]["links"]
    bw = links["p2p_bandwidth"]
    # the matrix spans both agents' ranks: measured both ways between rank 0 (one agent) and rank 1 (the other)
    assert len(bw) == 2 and all(len(row) == 2 for row in bw)
    assert bw[0][1] and bw[1][0] and bw[0][1] > 0 and bw[1][0] > 0
    assert (0, 1) in {tuple(p["pair"]) for p in links["p2p_pairs"]}
    assert set(doc["fits"]["compute"]) == {"0", "1"}  # one rank per agent (--nproc 1 each), both measured
