"""`autotune search` through the CLI with stderr on a pipe: no progress display, only the lines a
log keeps; --timeout's note says where the search stopped."""

from __future__ import annotations

import json
import subprocess
import sys

BASE = ("search", "--model", "tiny", "--cluster", "local:4", "--seq-len", "128", "--global-batch", "8",
        "--storage", ":memory:")


def test_a_pipe_gets_no_progress_display_and_timeout_is_said(in_tmp):
    r = subprocess.run([sys.executable, "-m", "autotune", *BASE, "--trials", "100000", "--timeout", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "elapsed" not in r.stderr and "\x1b[" not in r.stderr and "searching tiny" in r.stderr
    assert "--timeout 2 s stopped the search during the" in r.stdout
    j = subprocess.run([sys.executable, "-m", "autotune", *BASE, "--trials", "5", "--json"], capture_output=True,
                       text=True, timeout=300)
    assert j.returncode == 0 and j.stderr == "" and json.loads(j.stdout)["stopped"] is None
