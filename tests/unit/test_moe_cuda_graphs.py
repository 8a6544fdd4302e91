"""CUDA graphs over parts of each layer (``Plan.cuda_graph_scope``, Megatron's ``--cuda-graph-impl
transformer_engine --cuda-graph-scope attn moe_router moe_preprocess``): each captured kernel costs a
graph replay (``kernels.GRAPH_REPLAY_S``, measured) instead of the runtime's host time per kernel, for
one graph launch per scope and pass; the export read back by Megatron Core's TransformerConfig."""

from __future__ import annotations

import warnings

import pytest
from test_export_moe import ctx_for, megatron_config, resolved

from autotune.cost import kernels as K
from autotune.cost.estimate import estimate
from autotune.export import ExportRefused, export
from autotune.export import megatron as M
from autotune.plan import Degrees, PlanError, parse_inline
from autotune.specs.model import load_model

ALL = ("attn", "moe_router", "moe_preprocess")


def test_each_captured_kernel_replays_for_one_launch_per_scope():
    k, per = M.KERNELS, M.KERNELS.host_s - K.GRAPH_REPLAY_S
    f, b = K.graph_saving(k, ("moe_router",))
    assert f == pytest.approx(M.MOE_ROUTING[0] * per - k.host_s)
    assert b == pytest.approx(M.MOE_ROUTING[1] * per - k.host_s)
    f, b = K.graph_saving(k, ALL)
    fwd = M.ATTENTION_KERNELS[0] + M.MOE_ROUTING[0] + M.MOE_PREPROCESS[0]
    bwd = M.ATTENTION_KERNELS[1] + M.MOE_ROUTING[1]  # the preprocessing has no backward kernels
    assert f == pytest.approx(fwd * per - 3 * k.host_s) and b == pytest.approx(bwd * per - 2 * k.host_s)
    assert K.graph_saving(K.RUNTIME, ALL) == (0.0, 0.0)  # a runtime that captures nothing saves nothing
    plain = K.moe_layer_host(k, 4, None)
    graphed = K.moe_layer_host(k, 4, None, ALL)
    assert plain[0] - graphed[0] == pytest.approx(K.graph_saving(k, ALL)[0])


def test_the_step_falls_by_the_host_time_the_graphs_save():
    ctx = ctx_for("qwen3-30b-a3b", nodes=1, seq=4096, batch=64)
    text = "dp=8,ep=8,mbs=1,zero=1,dtype=bf16"
    a = estimate(parse_inline(text), ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch, kernels=M.KERNELS)
    g = estimate(parse_inline(text + ",cuda_graph_scope=moe_router/moe_preprocess"), ctx.model, ctx.cluster,
                 ctx.seq_len, ctx.global_batch, kernels=M.KERNELS)
    layers, mb = ctx.model.moe_layer_count, 64 // 8
    saved = sum(K.graph_saving(M.KERNELS, ("moe_router", "moe_preprocess"))) * layers * mb
    assert a.breakdown["moe"]["moe_host_s"] - g.breakdown["moe"]["moe_host_s"] == pytest.approx(saved, rel=1e-6)
    assert a.predicted["step_time_s"] - g.predicted["step_time_s"] == pytest.approx(saved, rel=0.02)


def test_refusals():
    ctx = ctx_for("qwen3-30b-a3b")
    with pytest.raises(PlanError, match="moe_preprocess is captured only with moe_router"):
        parse_inline("dp=16,ep=8,cuda_graph_scope=moe_preprocess").resolve(ctx.model, ctx.cluster, 4096, 512)
    with pytest.raises(PlanError, match="cuda_graph_scope"):
        parse_inline("dp=16,cuda_graph_scope=attn").resolve(load_model("small"), ctx.cluster, 256, 16)
    with pytest.raises(PlanError, match="unknown module 'mlpp'"):
        parse_inline("dp=16,cuda_graph_scope=mlpp")
    plan = resolved(ctx, degrees=Degrees(dp=16, ep=8), micro_batch_size=1, zero_stage=1, cuda_graph_scope=ALL)
    for target in ("torchtitan", "deepspeed"):
        with pytest.raises(ExportRefused, match="cuda_graph_scope"):
            export(plan, ctx, target)


def test_megatron_core_reads_the_exported_scopes():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core")
    ctx = ctx_for("qwen3-30b-a3b")
    plan = resolved(ctx, degrees=Degrees(dp=16, ep=8), micro_batch_size=1, zero_stage=1, cuda_graph_scope=ALL)
    cfg = megatron_config(M.parse_script(export(plan, ctx, "megatron").text))
    assert cfg.cuda_graph_impl == "transformer_engine"
    assert [s.name for s in cfg.cuda_graph_scope] == list(ALL)
