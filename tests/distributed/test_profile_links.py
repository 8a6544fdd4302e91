"""Real multi-process profiles (gloo): the p2p matrix over every pair, collectives checked against
hand-computed answers, hosts per rank, and the torchrun entry point. Two launches in all."""

import json
import os
import socket
import subprocess
import sys

import pytest

from profilers.launch import launch_local
from profilers.links import COLLECTIVES, bus_factor, group_sizes
from profilers.store import fits_of, list_profiles, load_profile

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def three_ranks():
    # Three ranks on two cores is more than `autotune profile` allows (check_request), but the links
    # are what this test is about and three is the smallest world with more than one pair.
    return launch_local("cpu", 3, quick=True, timeout_s=60)


def test_p2p_matrix_covers_every_pair_symmetrically(three_ranks):
    res = three_ranks
    assert res["world"] == 3 and res["hosts"] == [socket.gethostname()] * 3
    assert [r["rank"] for r in res["ranks"]] == [0, 1, 2]
    _, links = fits_of(res)
    bw, lat = links["p2p_bandwidth"], links["p2p_latency"]
    for i in range(3):
        for j in range(3):
            if i == j:
                assert bw[i][j] is None and lat[i][j] is None
            else:
                assert bw[i][j] == bw[j][i] > 0 and lat[i][j] == lat[j][i] > 0
    # Each pair was measured by its lower rank, at every message size of the plan.
    p2p = [s for r in res["ranks"] for s in r["links"] if s["kind"] == "p2p"]
    assert sorted({(s["params"]["src"], s["params"]["dst"]) for s in p2p}) == [(0, 1), (0, 2), (1, 2)]
    assert {r["rank"] for r in res["ranks"] if any(s["kind"] == "p2p" for s in r["links"])} == {0, 1}
    assert set(links["alpha_beta"]) == {"intra"} and len(links["alpha_beta"]["intra"]["pairs"]) == 3


def test_collectives_are_correct_and_reported_like_nccl_tests(three_ranks):
    _, links = fits_of(three_ranks)
    table = links["collective_table"]
    assert {(r["op"], r["group_size"]) for r in table} == {(op, g) for op in COLLECTIVES for g in group_sizes(3)}
    for r in table:
        assert r["verified"], r  # each collective gave the hand-computed answer once before timing
        assert r["algbw_bytes_per_s"] == pytest.approx(r["bytes"] / r["time_s"])
        assert r["busbw_bytes_per_s"] == pytest.approx(r["algbw_bytes_per_s"] * bus_factor(r["op"], r["group_size"]))
    # Members of a group all timed it; rank 2 is only in the group of 3.
    coll = {(s["params"]["op"], s["params"]["group_size"], r["rank"]) for r in three_ranks["ranks"]
            for s in r["links"] if s["kind"] == "collective"}
    assert ("all_reduce", 2, 2) not in coll and ("all_reduce", 3, 2) in coll and ("all_reduce", 2, 1) in coll
    assert set(links["collectives"]) == set(COLLECTIVES)


def test_under_torchrun_rank0_stores_the_profile(tmp_path):
    url = f"sqlite:///{tmp_path}/t.db"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "profilers.worker", "--out", str(tmp_path / "out"), "--quick", "--storage", url,
                        "--label", "torchrun", "--emulate-slowdown", "1=1.5"],
                       capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    pid = json.loads(r.stdout.strip().splitlines()[-1])["id"]
    (row,) = list_profiles(url)
    assert row["id"] == pid and row["label"] == "torchrun" and row["nproc"] == 2
    assert row["hosts"] == [socket.gethostname()] * 2 and row["emulated"] == {"1": 1.5}
    doc = load_profile(pid, url)
    assert doc["fits"]["links"]["p2p_bandwidth"][0][1] > 0
    assert json.loads((tmp_path / "out" / "result.json").read_text())["world"] == 2
