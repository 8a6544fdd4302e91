"""The Megatron export fed to Megatron Core itself (megatron-core from PyPI, when installed).

Megatron-LM's pretrain_gpt.py turns its arguments into a ``TransformerConfig`` (its
``__post_init__`` checks the parallel sizes, CP communication types, uneven pipeline stages and
recomputation) and builds ``get_num_layers_to_build(config, vp_stage, pp_rank)`` decoder layers on
each pipeline rank and virtual stage. Here our arguments go through the same path: every uneven layer
split must build exactly the plan's layers on every (pp rank, virtual stage), and every degree mix
must pass Megatron's own validation.
"""

from __future__ import annotations

import warnings

import pytest
from test_export_megatron import compositions, ctx_for, resolved, split_plans  # the rule tests' workloads

from autotune.export import export
from autotune.export import megatron as M
from autotune.plan import Degrees

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": expected on CPU
    warnings.simplefilter("ignore")
    mcore = pytest.importorskip("megatron.core", reason="megatron-core not installed")
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.transformer_block import get_num_layers_to_build


def config_from_args(args: list[str]) -> TransformerConfig:
    """What megatron/training/arguments.py + core_transformer_config_from_args make of our flags."""
    f: dict[str, list[str]] = {}
    key = None
    for a in args:
        if a.startswith("--"):
            key = a
            f[key] = []
        elif key is not None:
            f[key].append(a)
    one = {k: v[0] for k, v in f.items() if v}
    pp = int(one.get("--pipeline-model-parallel-size", 1))
    layers = int(one["--num-layers"])
    kw = dict(
        num_layers=layers, hidden_size=int(one["--hidden-size"]), ffn_hidden_size=int(one["--ffn-hidden-size"]),
        num_attention_heads=int(one["--num-attention-heads"]),
        num_query_groups=int(one["--num-query-groups"]) if "--group-query-attention" in f else None,
        tensor_model_parallel_size=int(one.get("--tensor-model-parallel-size", 1)),
        pipeline_model_parallel_size=pp, context_parallel_size=int(one.get("--context-parallel-size", 1)),
        sequence_parallel="--sequence-parallel" in f, bf16="--bf16" in f,
        params_dtype=torch.bfloat16 if "--bf16" in f else torch.float32,
        pipeline_dtype=torch.bfloat16 if "--bf16" in f else torch.float32,
    )
    if "--cp-comm-type" in one:
        kw["cp_comm_type"] = one["--cp-comm-type"]
    if "--hierarchical-context-parallel-sizes" in f:
        kw["hierarchical_context_parallel_sizes"] = [int(x) for x in f["--hierarchical-context-parallel-sizes"]]
    if "--num-layers-per-virtual-pipeline-stage" in one:  # arguments.py: vpp = layers / pp / per-stage
        kw["virtual_pipeline_model_parallel_size"] = layers // pp // int(one["--num-layers-per-virtual-pipeline-stage"])
    if "--pipeline-model-parallel-layout" in one:
        lay = PipelineParallelLayerLayout(one["--pipeline-model-parallel-layout"], pp)
        kw["pipeline_model_parallel_layout"] = lay
        vpp = lay.virtual_pipeline_model_parallel_size
        kw["virtual_pipeline_model_parallel_size"] = vpp if vpp > 1 else None
    if "--decoder-first-pipeline-num-layers" in one:
        kw["num_layers_in_first_pipeline_stage"] = int(one["--decoder-first-pipeline-num-layers"])
    if "--decoder-last-pipeline-num-layers" in one:
        kw["num_layers_in_last_pipeline_stage"] = int(one["--decoder-last-pipeline-num-layers"])
    if "--recompute-granularity" in one:
        kw["recompute_granularity"] = one["--recompute-granularity"]
        if "--recompute-method" in one:
            kw["recompute_method"] = one["--recompute-method"]
            kw["recompute_num_layers"] = int(one["--recompute-num-layers"])
        if "--recompute-modules" in f:
            kw["recompute_modules"] = f["--recompute-modules"]
    return TransformerConfig(**kw)  # __post_init__: Megatron's own checks


def built_layers(cfg: TransformerConfig, pp: int, vpp: int) -> list[list[int]]:
    """Decoder layers Megatron builds on each pp rank, per virtual stage."""
    out = []
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    parallel_state.set_pipeline_model_parallel_world_size(pp)
    try:
        for r in range(pp):
            parallel_state.set_pipeline_model_parallel_rank(r)
            out.append([get_num_layers_to_build(cfg, vp_stage=v if vpp > 1 else None, pp_rank=r) for v in range(vpp)])
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_rank(None)
    return out


@pytest.mark.parametrize("pp,v", [(2, 1), (4, 1), (2, 2)])
def test_megatron_builds_the_plans_layers_for_every_split(pp, v):
    n = ctx_for().model.layers
    seen = 0
    for layers, plan, args in split_plans(pp, v):
        cfg = config_from_args(args)
        assert built_layers(cfg, pp, v) == [plan.layers_of_stage(r) for r in range(pp)], layers
        seen += 1
    assert seen == len(list(compositions(n, pp * v)))


@pytest.mark.parametrize("deg", [dict(dp=8), dict(tp=2, dp=4), dict(pp=2, tp=2, dp=2), dict(cp=2, dp=4),
                                 dict(hp=2, dp=4), dict(cp=2, hp=2, dp=2), dict(pp=2, cp=2, hp=2),
                                 dict(tp=2, cp=2, pp=2)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_megatron_accepts_every_degree_mix(deg, recompute):
    ctx = ctx_for()
    plan = resolved(ctx, degrees=Degrees(**deg), micro_batch_size=2, recompute=recompute, zero_stage=1,
                    sequence_parallel=deg.get("tp", 1) > 1)
    cfg = config_from_args(M.parse_script(export(plan, ctx, "megatron").text))
    d = plan.degrees
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size) == \
        (d.tp, d.pp, d.cp * d.hp)
    if d.cp > 1 and d.hp > 1:  # Megatron's hierarchical CP: sizes multiply to the CP size, a2a inside
        assert cfg.cp_comm_type == "a2a+p2p" and cfg.hierarchical_context_parallel_sizes == [d.hp, d.cp]
    assert cfg.recompute_granularity == (None if recompute == "none" else recompute)


def test_megatron_reads_the_plans_recompute_modules():
    """A plan's per-module recomputation reaches Megatron-Core's TransformerConfig as it names it
    (its own __post_init__ checks the names)."""
    ctx = ctx_for()
    plan = resolved(ctx, degrees=Degrees(dp=8), recompute="selective", recompute_modules=("layernorm", "mlp"))
    cfg = config_from_args(M.parse_script(export(plan, ctx, "megatron").text))
    assert cfg.recompute_granularity == "selective" and cfg.recompute_modules == ["layernorm", "mlp"]
