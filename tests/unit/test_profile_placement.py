"""gloo's socket loop thread follows the message size (profilers.placement.CommThreads), checked
on a real two-rank gloo group in a child process (so the test process keeps its own affinity): both
ranks live in the child on two threads, since gloo starts its loop thread only once a pair connects."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")

CHILD = """
import datetime, json, os, sys, tempfile, threading
import torch, torch.distributed as dist
from profilers.placement import CommThreads, SMALL_BYTES, pin_cores, _comm_tids
allowed = sorted(os.sched_getaffinity(0))[:2]
pin_cores(0, 2, 1)
path = os.path.join(tempfile.mkdtemp(), "store")
groups = {}
def join(rank):
    store = dist.FileStore(path, 2)
    groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=30))
ts = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
[t.start() for t in ts]; [t.join() for t in ts]
assert len(groups) == 2, "gloo pair did not connect"
comm = CommThreads(allowed, 0, 2, 1)
where = lambda: sorted({c for t in _comm_tids() for c in os.sched_getaffinity(t)})
out = {"allowed": allowed, "threads": len(comm.tids), "start": where()}
comm.for_size(SMALL_BYTES + 1); out["large"] = where(); out["main_large"] = sorted(os.sched_getaffinity(0))
comm.for_size(8); out["small"] = where()
out["describe"] = comm.describe()
print(json.dumps(out))
sys.stdout.flush()
os._exit(0)
"""


def child(**env):
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_loop_thread_moves_to_the_next_ranks_core_for_large_messages_only():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two usable cores")
    out = child()
    own, nxt = [out["allowed"][0]], [out["allowed"][1]]
    assert out["threads"] >= 1  # gloo started its loop thread under the name we look for
    assert out["start"] == own
    assert out["large"] == nxt and out["main_large"] == own  # only the loop thread moved
    assert out["small"] == own
    assert out["describe"]["active"] and out["describe"]["large_cores"] == nxt


def test_own_mode_keeps_the_loop_thread_home():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two usable cores")
    out = child(AUTOTUNE_PROFILE_PIN="own")
    own = [out["allowed"][0]]
    assert out["threads"] == 0 and not out["describe"]["active"]
    assert out["start"] == out["large"] == own  # the loop thread exists and stays on its own core
