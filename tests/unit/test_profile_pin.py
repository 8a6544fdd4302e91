"""Core pinning of the profile's ranks (profilers.worker.pin_cores), each case in a child process so
the test process keeps its own affinity."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")

CHILD = """
import json, os, sys, threading, time
from profilers.worker import pin_cores
ev = threading.Event()
t = threading.Thread(target=ev.wait, daemon=True); t.start()  # a thread started before pinning
got = pin_cores(*map(int, sys.argv[1:4]))
tid = t.native_id
late = threading.Thread(target=ev.wait, daemon=True); late.start()  # and one after
print(json.dumps({"got": got, "main": sorted(os.sched_getaffinity(0)), "early": sorted(os.sched_getaffinity(tid)),
                  "late": sorted(os.sched_getaffinity(late.native_id))}))
ev.set()
"""


def child(local_rank, local_world, threads, **env):
    r = subprocess.run([sys.executable, "-c", CHILD, str(local_rank), str(local_world), str(threads)],
                       capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_each_rank_gets_its_own_cores_on_every_thread():
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two usable cores")
    for rank in (0, 1):
        out = child(rank, 2, 1)
        want = [allowed[rank]]
        assert out == {"got": want, "main": want, "early": want, "late": want}


def test_no_pinning_when_ranks_do_not_fit_or_when_turned_off():
    n = len(os.sched_getaffinity(0))
    allowed = sorted(os.sched_getaffinity(0))
    out = child(0, n + 1, 1)
    assert out["got"] is None and out["main"] == allowed
    out = child(0, 1, 1, AUTOTUNE_PROFILE_PIN="0")
    assert out["got"] is None and out["main"] == allowed
