"""The recipe options as knobs of the default space (search_spaces/_recipe.py): a MoE study has the
all-to-all overlap and the CUDA graph scopes exactly where its target runs them (asked of the target's
own refusals: the reference here), the built plans carry them, a dense study is as before, and bf16
gradient reduction is the user's choice, refused in one line where it cannot apply."""

import pytest

from autotune.errors import InputError
from autotune.search.options import SearchOptions
from autotune.search.run import search
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model
from autotune.targets import TARGETS, context, refusals
from search_spaces import _recipe
from search_spaces.base import Infeasible, SearchContext
from search_spaces.default import DefaultSpace

CLUSTER = {"name": "h100-1n", "inter_node": {"bandwidth": "400Gbit/s", "latency": "10us"},
           "nodes": [{"count": 1, "devices_per_node": 8, "device": "H100-SXM",
                      "intra_node": {"bandwidth": "450GB/s", "latency": "3us"}}]}
KNOBS = ("moe_a2a_overlap", "moe_dispatcher", "cuda_graph_scope")


def _space(model: str = "tiny-moe", target: str = "megatron", grad_reduce: str = "fp32") -> DefaultSpace:
    return DefaultSpace(SearchContext(model=load_model(model), cluster=cluster_from_dict(CLUSTER), seq_len=512,
                                      global_batch=64, target=target, grad_reduce=grad_reduce))


def _on(sp: DefaultSpace, name: str):
    """A plan of ``sp`` with ``name`` on (ep 8, selective recomputation: what the overlap needs)."""
    value = {"moe_a2a_overlap": True, "moe_dispatcher": "flex", "cuda_graph_scope": _recipe.GRAPH_SCOPES[-1]}[name]
    return sp.build({**sp.params(ep=8, recompute="selective", zero=1), name: value})


@pytest.mark.parametrize("target", TARGETS)
def test_a_study_has_each_recipe_knob_exactly_where_its_target_runs_it(target):
    sp = _space(target=target)
    megatron = _space(target="megatron")
    ctx = context(sp.ctx.model, sp.ctx.cluster, 512, 64)
    for name in KNOBS:
        plan = _on(megatron, name)
        assert not isinstance(plan, Infeasible), plan
        assert getattr(plan, name)
        named = [r for r in refusals(target, plan, ctx) if r.startswith(name + ":")]
        assert (name in sp.distributions()) == (not named), (target, name, named)


def test_built_plans_carry_the_knobs_and_ep1_leaves_the_overlap_off():
    sp = _space()
    assert set(KNOBS) <= set(sp.distributions())
    plan = sp.build({**sp.params(ep=8, recompute="selective"), "moe_a2a_overlap": True,
                     "cuda_graph_scope": "moe_router/moe_preprocess"})
    assert plan.moe_a2a_overlap and plan.cuda_graph_scope == ("moe_router", "moe_preprocess")
    p1 = {**sp.params(ep=1, recompute="selective"), "moe_a2a_overlap": True}
    assert not sp.build(p1).moe_a2a_overlap and "moe_a2a_overlap" in sp._idle_knobs(p1)
    assert not sp.build(sp.params(ep=8)).cuda_graph_scope  # off by default
    # the baselines try the recipe as the Megatron-Bridge recipes run it, beside the bare layouts
    recipes = {(p.get("moe_a2a_overlap"), p.get("cuda_graph_scope")) for n, p in sp.baselines() if n == "megatron-moe"}
    assert {(False, "none"), (True, _recipe.GRAPH_SCOPES[-1])} <= recipes


def test_the_grid_enumerates_every_recipe_combination():
    sp = _space()
    seen = {(p["moe_a2a_overlap"], p["cuda_graph_scope"]) for p in sp.grid_points() if sp.ep_divs[p["ep_exp"]] > 1}
    assert seen == {(a, g) for a in (False, True) for g in _recipe.GRAPH_SCOPES}


def test_a_dense_study_has_no_recipe_knobs():
    dense, moe = _space("tiny"), _space("tiny-moe")
    assert not set(KNOBS) & set(dense.distributions())
    assert set(KNOBS) <= set(moe.distributions())


def test_bf16_gradient_reduction_is_the_users_choice():
    sp = _space(grad_reduce="bf16")
    assert sp.build(sp.params(ep=8)).grad_reduce == "bf16"
    assert "grad_reduce" not in sp.distributions()
    assert _space().build(sp.params(ep=8)).grad_reduce == "fp32"
    m, c = load_model("tiny-moe"), cluster_from_dict(CLUSTER)
    for opts, says in ((SearchOptions(target="runtime", grad_reduce="bf16"), "--target runtime"),
                       (SearchOptions(target="megatron", grad_reduce="bf16", dtype="fp32"), "needs bf16 weights"),
                       (SearchOptions(target="megatron", grad_reduce="fp16"), "unknown gradient reduction")):
        with pytest.raises(InputError, match=says) as e:
            search(m, c, 512, 64, study_name="gr", storage=":memory:", options=opts)
        assert e.value.field == "--grad-reduce"


def test_a_pool_search_refuses_bf16_reduction_where_a_device_has_no_bf16():
    from autotune.search.pool import pool_search

    pool = cluster_from_dict({"name": "p", "inter_node": {"bandwidth": "100Gbit/s", "latency": "5us"}, "nodes": [
        {"devices_per_node": 2, "device": "H100-SXM", "available": 1},
        {"devices_per_node": 2, "device": "V100-16GB", "available": 1}]})
    with pytest.raises(InputError, match="needs bf16 weights") as e:
        pool_search(load_model("tiny-moe"), pool, 512, 64, study_name="gp", storage=":memory:",
                    options=SearchOptions(target="megatron", grad_reduce="bf16"))
    assert e.value.field == "--grad-reduce"
