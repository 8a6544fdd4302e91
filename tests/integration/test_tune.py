"""`autotune tune`: the whole loop on this machine (profile, search, validate the top 3, export)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def assert_priced_on_this_machines_profile(out: dict) -> None:
    """The search ran on this machine's measured profile, not on a fallback to the catalogue figures."""
    assert out["profile"] is not None and not any("not usable" in n for n in out["notes"]), out["notes"]


@pytest.mark.slow
def test_tune_prints_best_with_predicted_and_measured(in_tmp):
    """The loop on a dense model. Without its layer-timing step (``--no-layers``, about half of this
    test's time): the loop with every step, the layer profile included, is the MoE test below, and
    tests/unit/test_tune_layers.py covers a dense model's layer grid and the search priced from its
    measured layers. Two plans validated, not three: the best measured is still chosen among several."""
    r = subprocess.run([sys.executable, "-m", "autotune", "tune", "--model", "tiny", "--seq-len", "64",
                        "--global-batch", "4", "--trials", "30", "--top", "2", "--steps", "2", "--no-layers",
                        "--json"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    best = out["best"]
    assert_priced_on_this_machines_profile(out)
    assert len(out["validate"]["validated"]) == 2  # --top 2: both run for real
    assert best["predicted"]["tokens_per_s"] > 0 and best["measured"]["tokens_per_s"] > 0
    from autotune.plan import load_plan

    plan = load_plan(out["plan_file"])  # the exported file is a plan `apply --plan` accepts
    assert plan.degrees.to_dict() == best["degrees"]


@pytest.mark.slow
def test_tune_of_an_moe_model_measures_its_moe_block_and_prices_from_it(in_tmp):
    """`tune -m tiny-moe` runs the whole loop (the README's first command, every step); its layer profile times the MoE block and its FFN's
    steps at every (ep, etp) the search on this machine's ranks can choose, and every validated plan's
    MoE layers were priced from those steps (cp and etp plans too)."""
    r = subprocess.run([sys.executable, "-m", "autotune", "tune", "--model", "tiny-moe", "--seq-len", "64",
                        "--global-batch", "4", "--trials", "12", "--top", "2", "--steps", "2", "--json"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert_priced_on_this_machines_profile(out)  # every step of the loop: profile, layers, search, validate
    from autotune.commands.tune_layers import etp_grid, layer_grid
    from autotune.cost import estimate
    from autotune.plan_record import PlanRecord
    from autotune.specs import load_model
    from autotune.specs.profiles import load_layer_profile
    from autotune.study import open_study, study_workload

    doc = load_layer_profile(out["layers"], out["storage"])
    model, cluster, seq, gb = study_workload(open_study(out["study"], out["storage"]), out["storage"])
    world = cluster.groups[0].devices_per_node
    moe = [p for p in doc["points"] if p["piece"] == "moe"]
    assert {p["ep"] for p in moe} == set(layer_grid(load_model("tiny-moe"), 4, world)[2])
    assert {p.get("etp", 1) for p in moe} == set(etp_grid(load_model("tiny-moe"), world))
    assert all(set(p["parts"]) >= {"router", "dispatch", "experts", "combine", "ffn"} for p in moe)
    validated = [v for v in out["validate"]["validated"] if v["failure"] is None]
    assert validated and out["errors"]["before"] is not None
    for v in validated:
        plan = PlanRecord.from_dict(v["plan"]).plan
        est = estimate(plan, model, cluster, seq, gb)
        assert est.predicted["step_time_s"] == pytest.approx(v["predicted"]["step_time_s"], rel=1e-9)
        source = next(iter(est.breakdown["compute_source"].values()))["moe"]
        assert source.startswith(f"{out['layers']} steps"), source
