"""The default search space explores HelixPipe: its fold count and its attention shares by device
speed are sampled parameters, and the grid holds both fold counts."""

from __future__ import annotations

from autotune.cost import estimate
from autotune.plan import Plan
from autotune.search import load_space
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model
from search_spaces.base import SearchContext

MIXED = cluster_from_dict({"name": "h100-a100", "nodes": [
    {"count": 2, "devices_per_node": 8, "device": "H100-SXM"},
    {"count": 2, "devices_per_node": 8, "device": "A100-80GB"}],
    "inter_node": {"bandwidth": "50GB/s", "latency": "10us"}})
MODEL = load_model("llama2-7b")


def space():
    return load_space("default").space(SearchContext(model=MODEL, cluster=MIXED, seq_len=131072, global_batch=16))


def test_helix_params_build_the_plan_they_name():
    sp = space()
    p = {**sp.params(tp=8, pp=4, schedule="helixpipe", recompute="full", sp=True, placement="pp", folds=2)}
    plan = sp.build(p)
    assert isinstance(plan, Plan), plan
    assert plan.schedule == "helixpipe" and plan.helix_folds == 2 and plan.helix_attention is None
    assert len(set(plan.shares.layers)) == 1
    fast = sp.build({**p, "attention_speed": 1.0})
    assert isinstance(fast, Plan), fast
    shares = fast.helix_attention
    assert shares is not None and sum(shares) == MODEL.layers
    # the pipeline ranks on H100s (placement "pp": fastest first) take more of the attention
    assert shares[0] > shares[-1]
    t_even = estimate(plan, MODEL, MIXED, 131072, 16).predicted["step_time_s"]
    t_fast = estimate(fast, MODEL, MIXED, 131072, 16).predicted["step_time_s"]
    assert t_fast < t_even


def test_the_grid_holds_both_fold_counts_of_helixpipe_only():
    sp = space()
    seen = {(p["schedule"], p["helix_folds"]) for p in sp.grid_points()}
    assert ("helixpipe", 1) in seen and ("helixpipe", 2) in seen
    assert all(f == 1 for s, f in seen if s != "helixpipe")
    assert "helix_folds" in sp.distributions() and "attention_speed" in sp.distributions()
