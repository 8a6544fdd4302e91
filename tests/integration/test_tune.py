"""`autotune tune`: the whole loop on this machine (profile, search, validate the top 3, export)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_tune_prints_best_with_predicted_and_measured(in_tmp):
    r = subprocess.run([sys.executable, "-m", "autotune", "tune", "--model", "tiny", "--seq-len", "64",
                        "--global-batch", "4", "--trials", "30", "--steps", "2", "--json"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    best = out["best"]
    # the search ran on this machine's measured profile, not on a fallback to the catalogue figures
    assert out["profile"] is not None and not any("not usable" in n for n in out["notes"]), out["notes"]
    assert best["predicted"]["tokens_per_s"] > 0 and best["measured"]["tokens_per_s"] > 0
    from autotune.plan import load_plan

    plan = load_plan(out["plan_file"])  # the exported file is a plan `apply --plan` accepts
    assert plan.degrees.to_dict() == best["degrees"]
