"""Per-stage plans through the CLI (issue 26): `autotune search` on a mixed A100 + V100 cluster
answers with a per-stage plan exactly when the study's best per-stage plan beats its best uniform
one (the search's own tie rule aside), the table shows the stages with their own degrees, and the
dashboard's rows carry them."""

from __future__ import annotations

import json

import optuna
import pytest
from helpers.cli import run_autotune

pytestmark = pytest.mark.slow

MODEL = {"name": "m6", "layers": 6, "hidden": 2048, "heads": 16, "kv_heads": 16, "ffn_hidden": 8192,
         "vocab": 32000}
CLUSTER = {"name": "a100-v100", "inter_node": {"bandwidth": "25Gbit/s"},
           "nodes": [{"count": 1, "devices_per_node": 2, "device": "A100-40GB"},
                     {"count": 1, "devices_per_node": 2, "device": "V100-16GB"}]}


def test_search_answers_with_a_per_stage_plan_when_it_is_faster(in_tmp):
    (in_tmp / "m.json").write_text(json.dumps(MODEL))
    (in_tmp / "c.json").write_text(json.dumps(CLUSTER))
    args = ("search", "-m", "m.json", "-c", "c.json", "-s", "2048", "-b", "16", "--dtype", "fp16", "--study", "st")
    r = run_autotune(*args, "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    best = json.loads(r.stdout)["best"]
    study = optuna.load_study(study_name="st", storage="sqlite:///results/autotune.db")
    ok = [t for t in study.trials if t.value and "plan" in t.user_attrs and not t.user_attrs.get("infeasible_reason")
          and all(c <= 0 for c in t.system_attrs.get("constraints", []) or [])]
    uniform = max((t.value for t in ok if not t.user_attrs["plan"].get("stages")), default=0.0)
    staged = max((t.value for t in ok if t.user_attrs["plan"].get("stages")), default=0.0)
    assert staged > 0 and uniform > 0
    tps = best["predicted"]["tokens_per_s"]
    if staged > 1.01 * uniform:  # beyond the search's 1% tie: the per-stage plan must win
        assert "stages" in best and tps >= staged / 1.01
    elif uniform > 1.01 * staged:
        assert "stages" not in best
    # the table shows stages with their own degrees; the dashboard's rows carry them
    t = run_autotune(*args, "--trials", "1", timeout=600)
    # (a per-stage plan whose stages share one tp is its mesh, shown by its degrees: stages.degrees_text)
    from autotune.stages import degrees_text

    assert t.returncode == 0 and ("stages " in t.stdout) == degrees_text(best).startswith("stages ")
    d = run_autotune("dashboard", "--study", "st", "--json", timeout=300)
    rows = json.loads(d.stdout)["rows"]
    assert any(row.get("stages") for row in rows)
