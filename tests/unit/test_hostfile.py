"""``--hosts FILE`` (autotune/hostfile.py): the DeepSpeed/MPI hostfile read and checked (a bad one is
one line, exit 2, before anything starts), and the lines that start each node: bash reads them, the
remote shell gets the host and one command, the variables reach the command."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from autotune import hostfile as H
from autotune.errors import InputError


def write(tmp_path, text: str):
    f = tmp_path / "hosts"
    f.write_text(text)
    return f


def test_the_deepspeed_format_with_comments_and_bare_hosts(tmp_path):
    f = write(tmp_path, "# the job's hosts\n\nworker-0 slots=8   # node-rank 0\nworker-1 slots = 8\n  worker-2\n")
    assert H.read_hosts(f) == [H.Host("worker-0", 8, 3), H.Host("worker-1", 8, 4), H.Host("worker-2", None, 5)]
    H.check_hosts(H.read_hosts(f), [8, 8, 8], "the plan", f)  # a bare host takes the plan's count


@pytest.mark.parametrize("text, words", [
    ("a slots=2\nb slots=2 max_slots=4\n", ["line 2", "max_slots=4"]),
    ("a slots=2\nb foo\n", ["line 2", "'b foo'"]),
    ("slots=2\n", ["line 1"]),
    ("a slots=two\n", ["line 1", "'two'"]),
    ("a slots=0\n", ["line 1", ">= 1"]),
    ("a slots=1\nb slots=1\na slots=1\n", ["line 3", "'a'", "node-rank 0", "two names"]),
    ("# nothing but comments\n\n", ["no host"]),
])
def test_bad_files_are_one_line_naming_the_line(tmp_path, text, words):
    with pytest.raises(InputError) as e:
        H.read_hosts(write(tmp_path, text))
    msg = e.value.render()
    assert "\n" not in msg and str(tmp_path / "hosts") in msg
    for w in words:
        assert w in msg, msg


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        H.read_hosts(tmp_path / "nope")


def test_hosts_must_be_the_runs_nodes(tmp_path):
    f = write(tmp_path, "a slots=2\nb slots=4\n")
    hosts = H.read_hosts(f)
    with pytest.raises(InputError, match="runs on 3 node"):
        H.check_hosts(hosts, [2, 2, 2], "the plan", f)
    with pytest.raises(InputError, match=r"line 2: b has slots=4, but the plan puts 2 rank\(s\) on node-rank 1"):
        H.check_hosts(hosts, [2, 2], "the plan", f)
    H.check_hosts(hosts, [2, 4], "the plan", f)


def test_the_remote_shell_option_then_the_variable_then_ssh(monkeypatch):
    monkeypatch.delenv(H.SHELL_ENV, raising=False)
    assert H.remote_shell(None) == ["ssh"]
    monkeypatch.setenv(H.SHELL_ENV, "ssh -o BatchMode=yes")
    assert H.remote_shell(None) == ["ssh", "-o", "BatchMode=yes"]
    assert H.remote_shell("ssh -p 2222") == ["ssh", "-p", "2222"]
    with pytest.raises(InputError):
        H.remote_shell("ssh 'unclosed")


def test_the_lines_bash_runs_give_the_remote_shell_one_command_that_sees_the_rendezvous(tmp_path, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    hosts = [H.Host("first", 1, 1), H.Host("second host's", 1, 2)]
    addr, port = H.rendezvous(hosts)
    assert (addr, port) == ("first", 29999)  # MASTER_ADDR unset: the first host
    # the node's command uses the variables as apply's torchrun lines do (expanded by the shell)
    cmd = 'printf "%s\\n" "${MASTER_ADDR:?unset}:${MASTER_PORT}" "$OMP_NUM_THREADS" "$PWD" \'a b\''
    fake = tmp_path / "fake-ssh"
    fake.write_text(f"#!/bin/bash\nprintf '%s\\n' \"$1\" > {tmp_path}/host\nshift\nexec bash -c \"$*\"\n")
    fake.chmod(0o755)
    lines = H.node_lines(hosts, [cmd, cmd], [str(fake)], addr, port, cwd=tmp_path)
    assert shlex.split(lines[1])[:2] == [str(fake), "second host's"]
    for line in lines:
        r = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"},
                           cwd="/")
        assert r.returncode == 0, r.stderr
        got = r.stdout.splitlines()
        assert got[:2] == ["first:29999", "1"] and got[3] == "a b"
    assert got[2] == str(tmp_path.resolve())  # the other host runs in this directory
    assert (tmp_path / "host").read_text() == "second host's\n"


def run_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


def test_apply_refuses_a_hosts_file_that_is_not_the_plans_nodes(tmp_path):
    (tmp_path / "cluster.json").write_text(json.dumps(
        {"name": "2x1", "nodes": [{"count": 2, "devices_per_node": 1, "device": "CPU"}]}))
    (tmp_path / "plan.json").write_text(json.dumps({"degrees": {"dp": 2}, "dtype": "fp32"}))
    write(tmp_path, "localhost slots=2\n127.0.0.1 slots=2\n")
    r = run_cli(tmp_path, "apply", "-p", "plan.json", "-m", "tiny", "-s", "32", "-b", "4", "-c", "cluster.json",
                "--launch", "--dry-run", "--hosts", "hosts")
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "slots=2" in lines[0] and "line 1" in lines[0], r.stderr
    assert r.stdout == "" and not (tmp_path / "results").exists()


def test_validate_refuses_a_hosts_file_that_is_not_the_studys_cluster(tmp_path):
    from autotune.search import SearchOptions, search
    from autotune.specs import load_cluster, load_model
    from autotune.study import open_study

    (tmp_path / "c.json").write_text(json.dumps(
        {"name": "2x1", "nodes": [{"count": 2, "devices_per_node": 1, "device": "CPU"}]}))
    url = f"sqlite:///{tmp_path}/s.db"
    search(load_model("tiny"), load_cluster(str(tmp_path / "c.json")), 32, 4, study_name="s", storage=url,
           options=SearchOptions(trials=6))
    before = [json.dumps(t.user_attrs, sort_keys=True, default=str) for t in open_study("s", url).get_trials()]
    write(tmp_path, "localhost slots=1\n")
    r = run_cli(tmp_path, "validate", "--study", "s", "--storage", url, "--hosts", "hosts")
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "runs on 2 node(s)" in lines[0] and "lists 1 host(s)" in lines[0], r.stderr
    assert [json.dumps(t.user_attrs, sort_keys=True, default=str) for t in open_study("s", url).get_trials()] == before
    r = run_cli(tmp_path, "validate", "--study", "s", "--node-rank", "1")  # no MASTER_ADDR
    assert r.returncode == 2 and "MASTER_ADDR" in r.stderr


def test_tune_searches_the_files_hosts_each_like_this_machine(tmp_path):
    from autotune.commands.tune import host_slots, hosts_cluster
    from autotune.specs import load_cluster

    f = write(tmp_path, "localhost slots=2\n127.0.0.1 slots=2\nworker-3\n")
    assert host_slots(str(f)) == 2
    c = hosts_cluster("CPU", str(f), f"sqlite:///{tmp_path}/x.db", 2)
    assert c.num_nodes == 3 and [c.node_group(k).devices_per_node for k in range(3)] == [2, 2, 2]
    assert c.groups[0].device.name == load_cluster("local").groups[0].device.name
    with pytest.raises(InputError, match=r"slots \[1, 2\]"):
        host_slots(str(write(tmp_path, "a slots=1\nb slots=2\n")))


def test_profile_takes_the_files_hosts_as_its_nodes(tmp_path):
    from profilers.run import hosts_request as _hosts_request

    f = str(write(tmp_path, "localhost slots=2\n127.0.0.1 slots=2\n"))
    assert _hosts_request(f, 1, None, None) == (2, 2, 0)  # nodes, ranks a host, this host's node-rank
    assert _hosts_request(f, 2, 2, None) == (2, 2, 0)
    for nnodes, nproc, node_rank, words in ((3, None, None, "--nnodes 3"), (1, 4, None, "[2, 4]"),
                                            (1, None, 1, "drop --node-rank")):
        with pytest.raises(InputError, match=re.escape(words)):
            _hosts_request(f, nnodes, nproc, node_rank)
    with pytest.raises(InputError, match=re.escape("[1, 2]")):
        _hosts_request(str(write(tmp_path, "a slots=1\nb slots=2\n")), 1, None, None)
