"""ZeRO-3 (torchtitan's FSDP) of a MoE model shards the routed experts' weights over the ranks that
hold the same experts (edp) and gathers them per layer, as it does the dense blocks: the expert
weights a rank keeps are its 1/edp shard plus two gathered layers, and the gathers are priced behind
the layer's compute."""

from __future__ import annotations

import pytest
from test_export_moe import ctx_for

from autotune.cost import expert_data_parallel as EDP
from autotune.cost.context import step_context, tp_groups
from autotune.cost.estimate import estimate
from autotune.plan import parse_inline
from autotune.targets import kernel_costs


def _est(ctx, text):
    return estimate(parse_inline(text), ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch,
                    kernels=kernel_costs("torchtitan"))


def test_expert_weights_are_sharded_over_edp_with_two_layers_gathered():
    ctx = ctx_for("qwen3-30b-a3b", nodes=1, seq=4096, batch=64)
    m = ctx.model
    mem = _est(ctx, "dp=8,mbs=1,zero=3,recompute=full,dtype=bf16").breakdown["ranks"][0]["memory"]
    per_layer = m.moe.experts * m.expert_params()  # ep 1: every expert on every rank
    n = m.moe_layer_count
    # the sharded copy is the fp32 master the optimizer states count (memory.state_bytes): what is left
    # are the two gathered layers in bf16
    assert mem["expert_weights"] == pytest.approx(2 * per_layer * 2.0)
    z2 = _est(ctx, "dp=8,mbs=1,zero=2,recompute=full,dtype=bf16").breakdown["ranks"][0]["memory"]
    assert z2["expert_weights"] == pytest.approx(n * per_layer * 2.0)  # ZeRO-2 keeps whole weights


def test_the_expert_gathers_are_priced_over_edp():
    ctx = ctx_for("qwen3-30b-a3b", nodes=2, seq=4096, batch=64)
    s = step_context(parse_inline("dp=16,ep=2,mbs=1,zero=3,recompute=full,dtype=bf16"), ctx.model, ctx.cluster,
                     ctx.seq_len, ctx.global_batch, None, kernel_costs("torchtitan"))
    rc = tp_groups(s)[0][2]
    x, m = s.experts, s.model
    nbytes = x.shares[0] * m.expert_params() * 2
    assert EDP.zero3_gather(rc) == pytest.approx(rc.mf * rc.collectives.all_gather(rc.expert_links.edp, x.edp, nbytes))
    s1 = step_context(parse_inline("dp=16,ep=2,mbs=1,zero=1,dtype=bf16"), ctx.model, ctx.cluster,
                      ctx.seq_len, ctx.global_batch, None, kernel_costs("torchtitan"))
    assert EDP.zero3_gather(tp_groups(s1)[0][2]) == 0.0
