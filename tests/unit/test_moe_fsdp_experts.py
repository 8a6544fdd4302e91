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


def test_torchtitan_selective_keeps_no_grouped_gemm_output_and_runs_the_experts_forward_again(monkeypatch):
    """torchtitan's per-op selective checkpointing (what the exporter writes for ``recompute=selective``)
    saves the outputs of the ops on its list: PyTorch's compute-intensive ops, linear, attention, topk,
    max and the all-to-all, and ``_grouped_mm`` (the routed experts' GEMMs) is not among PyTorch's (the
    list torchtitan starts from). So, against the same plan with the routed experts kept as Megatron's
    selective keeps them, a MoE layer keeps per routed token copy exactly the grouped GEMMs' outputs
    less (gate and up 2 x width, the activation's width, at 2 bytes: the hand count of torchtitan's
    GroupedExperts forward; the dispatched input stays, an all-to-all output), and its backward runs the
    experts' forward (a third of their forward + backward seconds) and the router's gate once more per
    micro-batch."""
    import torch
    from torch._functorch.partitioners import get_default_op_list

    from autotune.cost import moe_memory as MM
    from autotune.cost import moe_router as MR
    from autotune.cost import rank

    saved = {op.default for op in get_default_op_list().compute_intensive_ops}
    assert torch.ops.aten.mm.default in saved and torch.ops.aten._grouped_mm.default not in saved

    ctx = ctx_for("qwen3-30b-a3b", nodes=1, seq=4096, batch=64)
    text = "dp=8,ep=2,mbs=1,zero=3,recompute=selective,dtype=bf16"
    rank._MEMO.clear()
    op_sac = _est(ctx, text)
    monkeypatch.setattr(MM, "recomputes_routed_gemms", lambda framework, recompute: False)
    rank._MEMO.clear()
    kept_all = _est(ctx, text)
    rank._MEMO.clear()
    x = op_sac.breakdown["moe"]
    received = x["tokens_per_expert"] * x["experts_per_rank"][0]
    mem_o, mem_k = (e.breakdown["ranks"][0]["memory"] for e in (op_sac, kept_all))
    dropped = mem_k["activation_per_layer_microbatch"] - mem_o["activation_per_layer_microbatch"]
    # and of the router the top-k's fp32 scores and int64 indices instead of the gate's fp32 scores (the
    # gate is forced to recompute: ``force_recompute_mm_shapes_by_fqns = ["moe.router.gate"]``)
    m, n = ctx.model, ctx.seq_len
    router = n * (m.moe.experts * 4.0 - m.moe.top_k * MM.TOPK_BYTES)
    assert dropped == pytest.approx(received * 3 * m.moe.expert_ffn_hidden * 2.0 + router, rel=1e-9)
    rc = tp_groups(step_context(parse_inline(text), m, ctx.cluster, ctx.seq_len, ctx.global_batch, None,
                                kernel_costs("torchtitan")))[0][2]
    gate = rc.cf * MR.router_time(rc.rates, m, n, 2)[0] * m.moe_layer_count * rc.microbatches
    again = op_sac.breakdown["compute_s"] - kept_all.breakdown["compute_s"]
    assert again == pytest.approx(x["experts_s"] / 3.0 + gate, rel=1e-6)  # experts_s: the step's, every micro-batch
