"""The control channel of a validation across hosts (autotune/runtime/control.py) on a real TCPStore,
without trials: joining and the machines node 0 gathers, a second host claiming a taken node-rank,
the end (an error from node 0 ends the others with the same line and exit code), node 0 gone; and a
remote line that fails ends a launch with its node's name (autotune/export/launch.py run_node)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from helpers.ports import free_pair

from autotune.errors import InputError, WorkError
from autotune.export import launch as L
from autotune.machines import this_machine
from autotune.runtime import control as C
from autotune.specs.cluster import cluster_from_dict


def two_nodes():
    return cluster_from_dict({"name": "2x1", "nodes": [{"count": 2, "devices_per_node": 1, "device": "CPU"}]})


def follower(port: int, node_rank: int = 1, study: str = "s") -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = C.follow(study, node_rank, addr="127.0.0.1", port=port, say=lambda _m: None)
        except BaseException as e:  # noqa: BLE001 - the test reads what ended it
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_node_0_gathers_every_machine_and_an_error_ends_the_others_with_its_line_and_code():
    port = free_pair()
    with pytest.raises(InputError):
        with C.Leader("s", two_nodes(), addr="127.0.0.1", port=port, device="cpu") as lead:
            t, box = follower(port)
            machines = lead.machines()
            assert machines == [this_machine("cpu")] * 2  # node 1's description came through the store
            raise InputError("study 's' cannot be validated here: the study's cluster node 1 has ...")
    t.join(30)
    assert isinstance(box["error"], InputError) and box["error"].exit_code == 2
    assert box["error"].args[0] == "study 's' cannot be validated here: the study's cluster node 1 has ..."


def test_a_clean_end():
    port = free_pair()
    with C.Leader("s", two_nodes(), addr="127.0.0.1", port=port, device="cpu") as lead:
        t, box = follower(port)
        lead.machines()
    t.join(30)
    assert box["out"] == {"node_rank": 1, "trials_run": 0, "study": "s"}


def test_a_node_rank_taken_twice_ends_every_node():
    port = free_pair()
    with pytest.raises(InputError, match="two hosts joined as node-rank 1"):
        with C.Leader("s", two_nodes(), addr="127.0.0.1", port=port, device="cpu") as lead:
            t, box = follower(port)
            lead.machines()
            t2, box2 = follower(port)  # a second host says node-rank 1 too
            t2.join(30)
            assert "already joined as node-rank 1" in str(box2["error"])
            lead.machines()
    t.join(30)
    assert box["error"].args[0].endswith("give each host its own --node-rank")


def test_other_study_and_node_rank_out_of_range_are_refused():
    port = free_pair()
    with C.Leader("s", two_nodes(), addr="127.0.0.1", port=port, device="cpu"):
        t, box = follower(port, study="other")
        t.join(30)
        assert "validates study 's', not 'other'" in str(box["error"])
        t, box = follower(port, node_rank=2)
        t.join(30)
        assert "runs on 2 node(s)" in str(box["error"])


def test_the_others_end_when_node_0_is_gone():
    port = free_pair()
    lead = C.Leader("s", two_nodes(), addr="127.0.0.1", port=port, device="cpu")
    t, box = follower(port)
    lead.machines()
    del lead.store  # node 0's process is gone: its store with it
    t.join(30)
    assert isinstance(box["error"], WorkError) and "node-rank 0 (127.0.0.1) is gone" in str(box["error"])


def test_a_node_without_heartbeat_is_named():
    port = free_pair()
    lead = C.Leader("s", two_nodes(), addr="127.0.0.1", port=port, device="cpu", hosts=["here", "there"])
    lead.store.set("machine/1", C.machine_to_json(this_machine("cpu")))  # joined, then never beats
    lead.machines()
    lead._beats = {1: (0, time.monotonic() - C.DEAD_AFTER_S - 1)}
    with pytest.raises(WorkError, match=r"node-rank 1 \(there\) is gone \(no heartbeat"):
        lead.check_alive(force=True)
    assert lead.gone == {1}
    lead.close(None, 0)  # no wait for a node that is gone


def test_a_remote_line_that_fails_names_its_node_and_ends_this_nodes_line(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "AGENT_GRACE_S", 0.5)
    cmd = L.NodeCommand(node=0, node_rank=0, argv=[])
    refused = "echo 'ssh: connect to host worker-1 port 22: Connection refused' >&2; exit 255"
    t0 = time.monotonic()
    with pytest.raises(WorkError, match=r"node 1 \(node-rank 1, host worker-1\): its line exited with code 255; "
                                        r"last line: ssh: connect to host worker-1"):
        L.run_node(cmd, tmp_path / "out", world=2, nodes=2, timeout_s=60,
                   line=f"sleep 60 & echo $! > {tmp_path}/pid; wait",
                   remote=[L.RemoteLine(node=1, node_rank=1, host="worker-1", line=refused)])
    assert time.monotonic() - t0 < 15
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):  # this node's line (and what it started) ended with it
        for _ in range(50):
            os.kill(pid, 0)
            time.sleep(0.1)


def test_machines_travel_as_json():
    m = this_machine("cpu")
    assert C.machine_from_json(C.machine_to_json(m)) == m
    assert json.loads(C.machine_to_json(m))["host"] == m.host
