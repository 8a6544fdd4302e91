"""validate across hosts, and the hosts file: two nodes on 127.0.0.1 for real.

Node-rank 0 owns the study and sends each trial to node-rank 1 through its control store; node 1
never opens the storage. What node 0 stores is what a one-host trial of the same plan measures (the
same keys, a figure per rank of both nodes), and the losses match one process. The other host's
machine is checked too (a study whose node 1 is an H100 is refused on both hosts, study unchanged);
a host that dies mid-trial ends node 0 with one line naming it and nothing of that trial stored.
``--hosts FILE`` starts the other host through a remote shell: here a fake ``ssh`` that drops the
host name and runs the command on this machine, logging what it was asked to run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.ports import free_pair
from test_multinode import alive, assert_matches, cmdline, descendants

pytestmark = pytest.mark.slow

SEQ, BATCH = 32, 4
CPU2 = [{"count": 2, "devices_per_node": 1, "device": "CPU"}]


def make_study(tmp_path: Path, nodes: list[dict]) -> str:
    from autotune.search import SearchOptions, search
    from autotune.specs import load_cluster, load_model

    (tmp_path / "cluster.json").write_text(json.dumps({"name": "two-hosts", "nodes": nodes}))
    url = f"sqlite:///{tmp_path}/s.db"
    search(load_model("tiny"), load_cluster(str(tmp_path / "cluster.json")), SEQ, BATCH, study_name="s",
           storage=url, options=SearchOptions(trials=12, dtype="fp32"))
    return url


def node_env() -> dict[str, str]:
    # two "hosts" on this machine's cores: one OpenMP thread a rank (docs/running.md)
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_pair()), "OMP_NUM_THREADS": "1"}


def autotune(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autotune", *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def fake_ssh(tmp_path: Path) -> Path:
    """A remote shell that runs here: logs the command it was given, drops the host, runs it."""
    f = tmp_path / "fake-ssh"
    f.write_text(f"#!/bin/bash\nprintf '%s\\n' \"$2\" >> {tmp_path}/remote.log\nshift\nexec bash -c \"$*\"\n")
    f.chmod(0o755)
    (tmp_path / "hosts").write_text("# two names of this machine, one a node\nlocalhost slots=1\n"
                                    "127.0.0.1 slots=1  # node-rank 1\n")
    return f


def snapshot(url: str) -> tuple:
    from autotune.study import open_study

    st = open_study("s", url)
    return (json.dumps(st.user_attrs, sort_keys=True, default=str),
            [(t.number, t.state.name, json.dumps(t.user_attrs, sort_keys=True, default=str)) for t in st.get_trials()])


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def one_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_validate_across_two_agents_stores_what_a_one_host_trial_measures(tmp_path):
    from autotune.plan import Plan
    from autotune.runtime.trial import run_trial
    from autotune.runtime.worker import reference_run
    from autotune.specs.model import load_model
    from autotune.study import open_study

    url = make_study(tmp_path, CPU2)
    env = node_env()
    lead = autotune(tmp_path, env, "validate", "--study", "s", "--storage", url, "--node-rank", "0", "--top", "1",
                    "--steps", "2", "--json")
    other = autotune(tmp_path, env, "validate", "--study", "s", "--node-rank", "1", "--json")  # no storage there
    outs = []
    for p in (lead, other):
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out))
    assert outs[1] == {"node_rank": 1, "trials_run": 1, "study": "s"}
    assert not (tmp_path / "results" / "autotune.db").exists()  # node 1 never opened a storage
    (row,) = outs[0]["validated"]
    assert row["failure"] is None
    trial = next(t for t in open_study("s", url).get_trials() if t.number == row["trial"])
    measured, losses = trial.user_attrs["measured"], trial.user_attrs["losses"]
    assert len(trial.user_attrs["measured_on"]["hosts"]) == 2
    # the reference: the same plan as a one-host trial (local processes)
    plan = Plan.from_dict(row["plan"])
    ref = run_trial(plan, "tiny", SEQ, BATCH, steps=2, warmup=1, device="cpu")
    assert ref.ok and set(measured) == set(ref.measured)
    for key in ("peak_memory_bytes", "memory_baseline_bytes", "time_split"):
        assert len(measured[key]) == len(ref.measured[key]) == 2
    assert [s["rank"] for s in measured["time_split"]] == [0, 1] and len(measured["step_times_s"]) == 2
    one = reference_run(load_model("tiny"), SEQ, BATCH, steps=3, seed=0)["losses"]
    assert_matches(losses, one)
    assert_matches(ref.losses, one)
    st = open_study("s", url)
    assert st.user_attrs["calibration"] and st.user_attrs["best_measured_trial"] == row["trial"]


def test_the_other_hosts_machine_is_checked_and_a_mismatch_ends_both(tmp_path):
    url = make_study(tmp_path, [{"count": 1, "devices_per_node": 1, "device": "CPU"},
                                {"count": 1, "devices_per_node": 1, "device": "H100-SXM"}])
    before = snapshot(url)
    env = node_env()
    procs = [autotune(tmp_path, env, "validate", "--study", "s", "--storage", url, "--node-rank", "0",
                      "--device", "cpu"),
             autotune(tmp_path, env, "validate", "--study", "s", "--node-rank", "1")]
    lines = []
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 2, err
        lines.append(one_line(err))
    assert "node 1 has 1 x H100-SXM (cuda)" in lines[0] and "CPU" in lines[0], lines[0]
    assert lines[1] == lines[0]
    assert snapshot(url) == before


def test_a_host_that_dies_during_validate_ends_it_with_its_name_and_nothing_stored(tmp_path):
    """``--hosts``: node 0 starts node 1 through the (fake) remote shell; node 1's host then dies."""
    url = make_study(tmp_path, CPU2)
    shell = fake_ssh(tmp_path)
    before = snapshot(url)
    env = node_env()
    lead = autotune(tmp_path, env, "validate", "--study", "s", "--storage", url, "--hosts", "hosts",
                    "--remote-shell", str(shell), "--top", "1", "--steps", "100000", "--timeout", "60", "--json")

    def rank_of(node_rank: int) -> bool:
        return any(" -m autotune.runtime.launcher " in cmdline(q) and "torchrun" not in cmdline(q)
                   and f"--node-rank {node_rank} " in cmdline(q) for q in descendants(lead.pid))

    end = time.monotonic() + 300
    while time.monotonic() < end and not (rank_of(0) and rank_of(1)):
        assert lead.poll() is None, lead.communicate()[1][-2000:]
        time.sleep(0.5)
    assert rank_of(0) and rank_of(1)
    time.sleep(3)  # into the training steps
    tree = descendants(lead.pid)
    # node 1's line: what node 0 started through the remote shell (it runs node 1's autotune)
    (top,) = [q for q in tree if parent(q) == lead.pid and "--node-rank 1" in cmdline(q)]
    host1 = [top, *descendants(top)]
    for pid in host1:  # node 1's host is gone: its remote shell, autotune, torchrun, rank, all at once
        os.kill(pid, signal.SIGKILL)
    _, err = lead.communicate(timeout=120)
    assert lead.returncode == 1, err
    line = one_line(err)
    assert "node-rank 1 (127.0.0.1)" in line, line
    assert snapshot(url) == before  # the trial in flight is not recorded, no calibration
    deadline = time.monotonic() + 30
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(tree), f"processes left: {[cmdline(q) for q in alive(tree)]}"
    assert "autotune validate --study s --node-rank 1" in (tmp_path / "remote.log").read_text()


def test_apply_launch_with_a_hosts_file_runs_what_the_dry_run_printed(tmp_path):
    import shlex

    shell = fake_ssh(tmp_path)
    (tmp_path / "cluster.json").write_text(json.dumps({"name": "2x1", "nodes": CPU2}))
    (tmp_path / "plan.json").write_text(json.dumps({"degrees": {"dp": 2}, "dtype": "fp32"}))
    env = {**node_env(), "AUTOTUNE_REMOTE_SHELL": str(shell)}
    env.pop("MASTER_ADDR")  # with --hosts: the first host
    args = ["apply", "-p", "plan.json", "-m", "tiny", "-s", str(SEQ), "-b", str(BATCH), "-c", "cluster.json",
            "--launch", "--hosts", "hosts", "--steps", "2", "--json"]
    dry = subprocess.run([sys.executable, "-m", "autotune", *args, "--dry-run"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    printed = json.loads(dry.stdout)["commands"]
    assert not (tmp_path / "remote.log").exists() and not (tmp_path / "results").exists()
    p = autotune(tmp_path, env, *args)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    ran = json.loads(out)
    assert ran["commands"] == printed
    # node 1's line is the remote shell, the host, and the command it ran over there: that very text
    words = shlex.split(printed[1])
    assert words[:2] == [str(shell), "127.0.0.1"] and len(words) == 3
    assert (tmp_path / "remote.log").read_text() == words[2] + "\n"
    assert printed[0].startswith("export MASTER_ADDR=localhost ")
    from autotune.runtime.worker import reference_run
    from autotune.specs.model import load_model

    assert ran["measured"]["ranks"] == [0]
    assert_matches(ran["measured"]["losses"], reference_run(load_model("tiny"), SEQ, BATCH, steps=4, seed=0)["losses"])


def test_a_profile_from_a_hosts_file_spans_both_hosts_and_this_host_stores_it(tmp_path):
    from profilers import store

    shell = fake_ssh(tmp_path)
    url = f"sqlite:///{tmp_path}/p.db"
    env = node_env()
    env.pop("MASTER_ADDR")  # with --hosts: the first host
    p = autotune(tmp_path, env, "profile", "--hosts", "hosts", "--remote-shell", str(shell), "--quick", "--device",
                 "cpu", "--storage", url, "--json")
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    assert json.loads(out).get("stored") is not False  # node-rank 0 (here) holds rank 0 and stores
    assert "autotune profile --nnodes 2 --node-rank 1 --nproc 1 --device cpu" in (tmp_path / "remote.log").read_text()
    (prof,) = store.list_profiles(url)
    links = store.load_profile(prof["id"], url)["fits"]["links"]
    bw = links["p2p_bandwidth"]  # measured both ways between rank 0 (here) and rank 1 (the other host)
    assert prof["nproc"] == 2 and len(bw) == 2 and bw[0][1] > 0 and bw[1][0] > 0


def test_tune_with_a_hosts_file_searches_the_hosts_and_validates_across_them(tmp_path):
    """``tune --hosts``: the search is over a cluster of the file's hosts (each like this machine),
    the best plans are validated across both hosts (node-rank 1 started through the remote shell),
    and the plan file written is the best measured plan, whose losses are one process's."""
    from autotune.plan import Plan
    from autotune.runtime.worker import reference_run
    from autotune.specs.model import load_model
    from autotune.study import open_study

    shell = fake_ssh(tmp_path)
    url = f"sqlite:///{tmp_path}/t.db"
    env = node_env()
    env.pop("MASTER_ADDR")  # with --hosts: the first host
    p = autotune(tmp_path, env, "tune", "--hosts", "hosts", "--remote-shell", str(shell), "--no-profile", "-m", "tiny",
                 "-s", str(SEQ), "-b", str(BATCH), "-n", "12", "-k", "1", "--steps", "2", "--dtype", "fp32",
                 "--storage", url, "--json")
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]
    got = json.loads(out)
    st = open_study(got["study"], url)
    assert st.user_attrs["cluster_spec"]["nodes"][0]["count"] == 2  # two hosts of one rank each
    assert "validate" in (tmp_path / "remote.log").read_text() and "--node-rank 1" in (
        tmp_path / "remote.log").read_text()
    (row,) = got["validate"]["validated"]
    assert row["failure"] is None
    trial = next(t for t in st.get_trials() if t.number == row["trial"])
    assert len(trial.user_attrs["measured_on"]["hosts"]) == 2
    written = json.loads((tmp_path / got["plan_file"]).read_text())  # relative to where tune ran
    assert Plan.from_dict(written) == Plan.from_dict(row["plan"]) and written["measured"] == row["measured"]
    one = reference_run(load_model("tiny"), SEQ, BATCH, steps=3, seed=0)["losses"]
    assert_matches(trial.user_attrs["losses"], one)
