"""The flex (DeepEP) token dispatcher (``Plan.moe_dispatcher``): the plan field and its refusals, the
network copies per token against enumeration and Monte Carlo of top-k routing, the price equal to the
all-to-all's where the EP group fits in one node, the Megatron export read back by Megatron Core (whose
own checks refuse what the plan refuses), and the search knob only where the target runs it."""

from __future__ import annotations

import itertools
import json
import warnings
from math import comb

import numpy as np
import pytest
from test_export_moe import ctx_for, megatron_config, resolved

from autotune.cost import expert_ranks as ER
from autotune.cost import flex_dispatch as FD
from autotune.cost.estimate import estimate
from autotune.cost.expert_layout import expert_step
from autotune.export import export
from autotune.export import megatron as M
from autotune.plan import Degrees, Plan, PlanError, parse_inline
from autotune.specs.moe import RouterSpec
from autotune.targets import TARGETS, context, kernel_costs, refusals
from search_spaces.base import SearchContext
from search_spaces.default import DefaultSpace


# ---- the plan field ---------------------------------------------------------------------------------
def test_inline_json_round_trip_and_default():
    p = parse_inline("dp=16,ep=16,moe_dispatcher=flex")
    assert p.moe_dispatcher == "flex"
    d = json.loads(json.dumps(p.to_dict()))
    assert d["moe_dispatcher"] == "flex" and Plan.from_dict(d) == p
    assert "moe_dispatcher" not in Plan().to_dict()  # old plans read and write as before
    assert Plan.from_dict(Plan().to_dict()).moe_dispatcher == "alltoall"


@pytest.mark.parametrize("bad", ["moe_dispatcher=deepep", "moe_dispatcher=allgather", "moe_dispatch=flex"])
def test_bad_values_are_one_line_plan_errors(bad):
    with pytest.raises(PlanError) as e:
        parse_inline(f"dp=2,{bad}")
    assert "\n" not in str(e.value) and "moe_dispatch" in str(e.value)


def test_flex_needs_a_moe_model_and_dropless_routing():
    dense = ctx_for("tiny", nodes=1, seq=256, batch=16)
    with pytest.raises(PlanError, match="moe_dispatcher: flex needs a MoE model"):
        resolved(dense, degrees=Degrees(dp=8), moe_dispatcher="flex")
    ctx = _dropping(ctx_for("tiny-moe", nodes=1, seq=256, batch=16))
    with pytest.raises(PlanError, match="moe_dispatcher: flex needs dropless routing"):
        resolved(ctx, degrees=Degrees(dp=8, ep=4), moe_dispatcher="flex")


def _dropping(ctx):
    import dataclasses

    router = RouterSpec(dropless=False, capacity_factor=1.25)
    model = dataclasses.replace(ctx.model, moe=dataclasses.replace(ctx.model.moe, router=router))
    return dataclasses.replace(ctx, model=model)


def test_megatron_core_refuses_what_the_plan_refuses():
    """The reference for the refusals: TransformerConfig's own checks on the exported flags."""
    ctx = ctx_for("tiny-moe-shared", nodes=1, seq=256, batch=16)
    plan = resolved(ctx, degrees=Degrees(dp=8, ep=4), micro_batch_size=1, zero_stage=1, moe_dispatcher="flex")
    args = M.parse_script(export(plan, ctx, "megatron").text)
    megatron_config(args)  # accepted as exported
    with warnings.catch_warnings(), pytest.raises(ValueError, match="moe_shared_expert_overlap"):
        warnings.simplefilter("ignore")
        megatron_config([*args, "--moe-shared-expert-overlap"])
    with pytest.raises(ValueError, match="moe_pad_expert_input_to_capacity"):
        megatron_config([*args, "--moe-expert-capacity-factor", "1.25", "--moe-pad-expert-input-to-capacity"])


@pytest.mark.parametrize("target", [t for t in TARGETS if t != "megatron"])
def test_other_targets_refuse_flex_in_one_line(target):
    ctx = ctx_for("tiny-moe", nodes=1, seq=256, batch=16)
    plan = resolved(ctx, degrees=Degrees(dp=8, ep=4), micro_batch_size=1, moe_dispatcher="flex")
    named = [r for r in refusals(target, plan, ctx) if r.startswith("moe_dispatcher:")]
    assert len(named) == 1 and "\n" not in named[0]
    assert not [r for r in refusals("megatron", plan, ctx) if r.startswith("moe_dispatcher")]


# ---- the export ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "deepseek-v3"])
def test_megatron_export_reads_back_as_flex_with_deepep(model):
    ctx = ctx_for(model, nodes=4)
    for disp in ("alltoall", "flex"):
        plan = resolved(ctx, degrees=Degrees(dp=32, ep=8), micro_batch_size=1, zero_stage=1, moe_dispatcher=disp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = megatron_config(M.parse_script(export(plan, ctx, "megatron").text))
        assert cfg.moe_token_dispatcher_type == disp
        if disp == "flex":  # Megatron-Core's own default backend is deepep, so name it
            assert cfg.moe_flex_dispatcher_backend == "deepep" and not cfg.moe_shared_expert_overlap
        else:
            assert cfg.moe_shared_expert_overlap == bool(ctx.model.moe.shared_experts)


# ---- network copies per token -------------------------------------------------------------------------
def _enumerated_remote_nodes(experts: int, k: int, node_of_expert: list[int], home: int) -> float:
    """The mean over every k-subset of experts of the distinct nodes other than ``home`` it touches."""
    subsets = list(itertools.combinations(range(experts), k))
    return sum(len({node_of_expert[x] for x in s} - {home}) for s in subsets) / len(subsets)


@pytest.mark.parametrize("shares,k", [((2, 3, 3), 2), ((4, 4), 3), ((1, 2, 5), 4), ((3, 3, 3, 3), 2), ((6,), 2)])
def test_remote_node_copies_match_enumeration(shares, k):
    e = sum(shares)
    node_of = [n for n, s in enumerate(shares) for _ in range(s)]
    for home in range(len(shares)):
        remote = [s for n, s in enumerate(shares) if n != home]
        assert FD.remote_node_copies(e, k, remote) == pytest.approx(_enumerated_remote_nodes(e, k, node_of, home),
                                                                    abs=1e-12)


@pytest.mark.parametrize("nodes", [2, 4, 8])
def test_remote_node_copies_match_monte_carlo_at_qwen3_scale(nodes):
    """128 experts, top-8, over ``nodes`` nodes holding 128 / nodes each: 40000 sampled routings."""
    e, k, n = 128, 8, 40000
    rng = np.random.default_rng(7)
    picks = np.argsort(rng.random((n, e)), axis=1)[:, :k]  # uniform k-subsets
    node = picks // (e // nodes)
    touched = np.array([len(set(row) - {0}) for row in node])
    mean, sem = touched.mean(), touched.std() / np.sqrt(n)
    assert abs(FD.remote_node_copies(e, k, [e / nodes] * (nodes - 1)) - mean) < 5 * sem + 1e-9


def test_two_nodes_of_64_experts_send_about_one_copy_where_the_all_to_all_sends_four():
    """docs/figures.md's what-if for NVIDIA's EP 16 Qwen3-30B layout (2 nodes of 8 H100): the split the
    busiest rank sends across, 0.997 copies per token under flex against 4 under the all-to-all."""
    f = _split("qwen3-30b-a3b", (8,) * 16, (0,) * 8 + (1,) * 8, True)[0][1]
    a = _split("qwen3-30b-a3b", (8,) * 16, (0,) * 8 + (1,) * 8, False)[0][1]
    loads = _split("qwen3-30b-a3b", (8,) * 16, (0,) * 8 + (1,) * 8, False)[1]
    imb = max(ld.imbalance for ld in loads)  # the busiest receiver sets both
    assert f == pytest.approx(1000.0 * (1 - comb(64, 8) / comb(128, 8)) * imb, rel=1e-12)
    assert a == pytest.approx(1000.0 * 8 * 64 / 128 * imb, rel=1e-12)


# ---- the exchange split -------------------------------------------------------------------------------
def _split(model: str, shares: tuple[int, ...], nodes: tuple[int, ...], flex: bool, tokens: float = 1000.0):
    moe = ctx_for(model, nodes=1).model.moe
    loads = ER.loads(moe, len(shares), 1, tokens, shares)
    return ER.exchange_split(moe, (tokens,) * len(shares), loads, nodes, flex=flex), loads, moe


@pytest.mark.parametrize("shares", [(16,) * 8, (24, 8, 16, 16, 20, 12, 16, 16)])
def test_one_node_flex_is_the_all_to_all(shares):
    nodes = (0,) * len(shares)
    a, _, _ = _split("qwen3-30b-a3b", shares, nodes, False)
    f, _, _ = _split("qwen3-30b-a3b", shares, nodes, True)
    assert f == pytest.approx(a, rel=1e-12, abs=0.0) and f[1] == 0.0


def test_two_nodes_flex_network_volume_against_enumeration():
    """tiny-moe (8 experts, top-2) over 4 EP ranks on 2 nodes, uneven shares: every rank's network
    send is its tokens times the enumerated distinct remote nodes, its receive its peer's tokens times
    the enumerated chance of hitting its node (at its load), and the busiest sets the split."""
    shares, nodes, t = (3, 1, 2, 2), (0, 0, 1, 1), 1000.0
    (intra, inter), loads, moe = _split("tiny-moe", shares, nodes, True, t)
    node_of = [nodes[q] for q, s in enumerate(shares) for _ in range(s)]
    subsets = list(itertools.combinations(range(moe.experts), moe.top_k))
    expect = 0.0
    for q, ld in enumerate(loads):
        send = t * _enumerated_remote_nodes(moe.experts, moe.top_k, node_of, nodes[q])
        hit = sum(any(node_of[x] == nodes[q] for x in s) for s in subsets) / len(subsets)
        recv = (2 * t / 2) * hit * ld.imbalance  # the other node's 2 ranks' tokens over its 2 ranks
        expect = max(expect, send, recv)
    assert inter == pytest.approx(expect, rel=1e-12)
    a_intra, a_inter = _split("tiny-moe", shares, nodes, False, t)[0]
    assert inter < a_inter and intra > a_intra  # fewer network copies, forwarded over NVLink instead


# ---- priced end to end --------------------------------------------------------------------------------
def _step(ctx, plan, target="megatron"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate(plan, ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch, kernels=kernel_costs(target))
    return est.predicted["step_time_s"]


@pytest.mark.parametrize("model,target", [("qwen3-30b-a3b", "megatron"), ("tiny-moe-shared", "runtime")])
def test_ep_inside_one_node_prices_flex_as_the_all_to_all(model, target):
    ctx = ctx_for(model, nodes=2, seq=1024, batch=64)
    a, f = (resolved(ctx, degrees=Degrees(dp=16, ep=8), micro_batch_size=1, zero_stage=1, moe_dispatcher=d)
            for d in ("alltoall", "flex"))
    assert _step(ctx, f, target) == pytest.approx(_step(ctx, a, target), rel=1e-12, abs=0.0)


def test_across_nodes_flex_is_cheaper_and_megatron_loses_the_shared_expert_overlap():
    ctx = ctx_for("qwen3-30b-a3b", nodes=2, seq=4096, batch=256)
    a, f = (resolved(ctx, degrees=Degrees(dp=16, ep=16), micro_batch_size=1, zero_stage=1, moe_dispatcher=d)
            for d in ("alltoall", "flex"))
    assert _step(ctx, f) < _step(ctx, a)
    shared = ctx_for("tiny-moe-shared", nodes=1, seq=256, batch=16)
    for d, overlap in (("alltoall", "shared_experts"), ("flex", "none")):
        p = resolved(shared, degrees=Degrees(dp=8, ep=4), micro_batch_size=1, moe_dispatcher=d)
        assert expert_step(p, shared.model, ((0,),), M.KERNELS).overlap == overlap


# ---- the search ---------------------------------------------------------------------------------------
def _space(target: str, model: str = "qwen3-30b-a3b", dropping: bool = False) -> DefaultSpace:
    ctx = ctx_for(model, nodes=2)
    if dropping:
        ctx = _dropping(ctx)
    return DefaultSpace(SearchContext(model=ctx.model, cluster=ctx.cluster, seq_len=4096, global_batch=512,
                                      target=target))


@pytest.mark.parametrize("target", TARGETS)
def test_flex_is_a_knob_only_where_the_target_runs_it(target):
    sp = _space(target)
    ctx = context(sp.ctx.model, sp.ctx.cluster, 4096, 512)
    plan = _space("megatron").build({**_space("megatron").params(ep=16, zero=1), "moe_dispatcher": "flex"})
    assert plan.moe_dispatcher == "flex"
    named = [r for r in refusals(target, plan, ctx) if r.startswith("moe_dispatcher:")]
    assert ("moe_dispatcher" in sp.distributions()) == (not named) == (target == "megatron")


def test_flex_is_idle_at_ep1_and_absent_for_dropping_routers():
    sp = _space("megatron")
    p1 = {**sp.params(ep=1), "moe_dispatcher": "flex"}
    assert sp.build(p1).moe_dispatcher == "alltoall" and "moe_dispatcher" in sp._idle_knobs(p1)
    assert "moe_dispatcher" not in _space("megatron", dropping=True).distributions()
