"""Mixture-of-Experts exports read back by the frameworks' own code where it installs on CPU.

* Megatron: the arguments become a Megatron Core ``TransformerConfig`` / ``MLATransformerConfig``
  the way megatron/training turns flags into config fields (field = the flag's name, with its
  ``num_experts`` / ``fp8_format`` renames; ``--moe-layer-freq`` evaluated as its ``moe_freq_type``
  does); Megatron Core builds each layer's spec from it (MoE or dense MLP, MLA or not), and its own
  ``RankGenerator`` lays out the expert groups, which must be the plan's (``plan_parts.expert_groups``).
* DeepSpeed: its own ``_get_expert_parallel_ranks`` gives the expert groups of every plan the exporter
  accepts, and ``deepspeed.moe.layer.MoE`` takes the exported layer arguments.
* torchtitan and Accelerate: the rules each states (its job config's expert-parallel constraints; no
  expert parallelism in Accelerate's ParallelismConfig), with the nearest plan each can run.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest
import tomllib

from autotune.export import ExportRefused, export, exporter
from autotune.export import megatron as M
from autotune.export.common import ExportContext
from autotune.plan import Degrees, Plan, PlanError, Shares, expert_groups
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model

MOE_PRESETS = ("tiny-moe", "tiny-moe-shared", "mixtral-8x7b", "mixtral-8x22b", "qwen2-57b-a14b", "qwen3-30b-a3b",
               "qwen3-235b-a22b", "deepseek-v3", "gpt-oss-120b", "gpt-oss-20b", "grok-1")


def ctx_for(model: str, nodes: int = 2, seq: int = 4096, batch: int = 512) -> ExportContext:
    cluster = cluster_from_dict({"name": f"h100x{8 * nodes}", "nodes": [{"count": nodes, "devices_per_node": 8,
                                                                         "device": "H100-SXM"}],
                                 "inter_node": {"bandwidth": "50GB/s"}})
    return ExportContext(model=load_model(model), cluster=cluster, seq_len=seq, global_batch=batch)


def resolved(ctx: ExportContext, **kw) -> Plan:
    return Plan(**kw).resolve(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)


def layouts(ctx: ExportContext, world: int):
    """Every (tp, pp, cp, ep, etp) over ``world`` ranks that resolves for the model."""
    experts = ctx.model.moe.experts
    for tp, pp, cp in itertools.product((1, 2), (1, 2), (1, 2)):
        if world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        for ep, etp in itertools.product((1, 2, 4, 8), (1, 2)):
            if (dp * cp * tp) % (ep * etp) or experts % ep:
                continue
            try:
                yield resolved(ctx, degrees=Degrees(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp), micro_batch_size=1,
                               zero_stage=1, sequence_parallel=tp > 1)
            except PlanError:
                continue


# ---- Megatron --------------------------------------------------------------------------------------
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mcore = pytest.importorskip("megatron.core", reason="megatron-core not installed")
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.parallel_state import RankGenerator
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

RENAMES = {"num_experts": "num_moe_experts", "fp8_format": "fp8", "tensor_model_parallel_size": "tensor_model_parallel_size"}
"""megatron/training/arguments.py's flags whose TransformerConfig field has another name."""
SHAPE_FLAGS = ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads")
MOE_PREFIXES = ("--moe-", "--num-experts", "--expert-", "--q-lora-rank", "--kv-lora-rank", "--qk-", "--v-head-dim",
                "--multi-latent-attention", "--tensor-model-parallel-size", "--sequence-parallel",
                "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute", "--cuda-graph-")


def megatron_config(args: list[str], pp: int = 1, vpp: int | None = None):
    """What megatron/training makes of the flags: each MoE/MLA flag sets the config field of its name
    (converted by the field's default's type); ``--moe-layer-freq`` evaluated as a Python list, as
    arguments.py's moe_freq_type does. ``pp`` 1: the whole model on one stage (every layer's spec)."""
    f: dict[str, list[str]] = {}
    key = None
    for a in args:
        if a.startswith("--"):
            key = a
            f[key] = []
        elif key is not None:
            f[key].append(a)
    cls = MLATransformerConfig if "--multi-latent-attention" in f else TransformerConfig
    fields = {x.name: x for x in dataclasses.fields(cls)}
    kw = {"pipeline_model_parallel_size": pp, "virtual_pipeline_model_parallel_size": vpp, "bf16": True,
          "params_dtype": torch.bfloat16, "pipeline_dtype": torch.bfloat16}
    for flag in SHAPE_FLAGS:
        kw[flag[2:].replace("-", "_")] = int(f[flag][0])
    for flag, vals in f.items():
        if not flag.startswith(MOE_PREFIXES):
            continue
        name = RENAMES.get(flag[2:].replace("-", "_"), flag[2:].replace("-", "_"))
        assert name in fields, f"{flag}: no {cls.__name__} field {name}"  # a typo Megatron would reject
        default = fields[name].default
        if not vals:
            kw[name] = True
        elif name == "cuda_graph_scope":  # nargs='+' (arguments.py)
            kw[name] = list(vals)
        elif name == "moe_layer_freq":
            kw[name] = eval(vals[0], {"__builtins__": {}})  # noqa: S307  (Megatron evaluates it this way)
        elif isinstance(default, bool):
            kw[name] = vals[0].lower() == "true"
        elif isinstance(default, int):
            kw[name] = int(vals[0])
        elif isinstance(default, float):
            kw[name] = float(vals[0])
        else:  # an optional field: the number arguments.py's type= parses, else the string
            kw[name] = _number(vals[0])
    return cls(**kw)  # __post_init__: Megatron Core's own checks


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


@pytest.mark.parametrize("model", MOE_PRESETS)
def test_megatron_builds_every_moe_preset_as_the_spec_says(model):
    ctx = ctx_for(model, nodes=4)
    moe, mla, m = ctx.model.moe, ctx.model.mla, ctx.model
    ep = max(e for e in (1, 2, 4, 8) if moe.experts % e == 0)
    plan = resolved(ctx, degrees=Degrees(dp=16, tp=2, ep=ep), micro_batch_size=1, zero_stage=1,
                    sequence_parallel=True)
    args = M.parse_script(export(plan, ctx, "megatron").text)
    cfg = megatron_config(args)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == \
        (moe.experts, moe.top_k, moe.expert_ffn_hidden)
    assert (cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size) == (ep, 1)
    assert cfg.moe_shared_expert_intermediate_size == (moe.shared_width or None)
    assert cfg.ffn_hidden_size == m.dense_ffn_width
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, pp_rank=0)
    built = [ls.submodules.mlp.module.__name__ for ls in spec.layer_specs]
    assert built == ["MoELayer" if m.is_moe_layer(i) else "MLP" for i in range(m.layers)]
    attention = spec.layer_specs[0].submodules.self_attention.module.__name__
    assert attention == ("MLASelfAttention" if mla is not None else "SelfAttention")
    if mla is not None:
        assert (cfg.q_lora_rank or 0, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == \
            (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim)


def test_megatron_router_options_read_back():
    """Token dropping with a capacity factor and forced balance reach Megatron Core's router fields."""
    from autotune.specs.moe import RouterSpec

    ctx = ctx_for("tiny-moe", nodes=1, seq=256, batch=16)
    router = RouterSpec(dropless=False, capacity_factor=1.25, force_balance=True, aux_loss_coeff=0.01)
    model = dataclasses.replace(ctx.model, moe=dataclasses.replace(ctx.model.moe, router=router))
    ctx = dataclasses.replace(ctx, model=model)
    plan = resolved(ctx, degrees=Degrees(dp=8, ep=4), micro_batch_size=1, zero_stage=1)
    cfg = megatron_config(M.parse_script(export(plan, ctx, "megatron").text))
    assert cfg.moe_expert_capacity_factor == 1.25 and cfg.moe_pad_expert_input_to_capacity
    assert cfg.moe_router_force_load_balancing and cfg.moe_aux_loss_coeff == 0.01


def test_megatron_lays_out_the_expert_groups_as_the_plan_does():
    """Megatron Core's expert RankGenerator (tp=etp, ep, dp=edp, pp; order tp-cp-ep-dp-pp) gives
    exactly the plan's expert groups for every layout of 16 ranks."""
    ctx = ctx_for("tiny-moe", nodes=2, seq=256, batch=64)
    seen = 0
    for plan in layouts(ctx, 16):
        d = plan.degrees
        gen = RankGenerator(tp=d.etp, ep=d.ep, dp=d.edp, pp=d.pp, cp=1, order="tp-cp-ep-dp-pp")
        for ours, theirs in (("ep", "ep"), ("etp", "tp"), ("edp", "dp")):
            assert sorted(expert_groups(d, ours)) == sorted(gen.get_ranks(theirs)), (d, ours)
        seen += 1
    assert seen >= 20


def test_megatron_refuses_uneven_experts_and_tp_without_sp_with_the_nearest_plan():
    ctx = ctx_for("tiny-moe", nodes=1, seq=256, batch=16)
    uneven = resolved(ctx, degrees=Degrees(dp=8, ep=2), micro_batch_size=1, zero_stage=1,
                      shares=Shares(experts=(5, 3)))
    with pytest.raises(ExportRefused) as e:
        export(uneven, ctx, "megatron")
    assert any("shares.experts" in r for r in e.value.reasons)
    near = e.value.nearest.plan  # the fastest candidate the cost model finds: even shares, any ep
    assert len(set(near.shares.experts)) == 1
    export(near, ctx, "megatron")
    no_sp = resolved(ctx, degrees=Degrees(dp=4, tp=2, ep=4), micro_batch_size=1, zero_stage=1, sequence_parallel=False)
    with pytest.raises(ExportRefused) as e:
        export(no_sp, ctx, "megatron")
    near = e.value.nearest.plan
    assert near.sequence_parallel or near.degrees.tp == 1 or near.degrees.ep == 1
    export(near, ctx, "megatron")


# ---- DeepSpeed ---------------------------------------------------------------------------------------
def test_deepspeed_expert_groups_are_its_own_for_every_accepted_plan():
    ds_groups = pytest.importorskip("deepspeed.utils.groups", reason="deepspeed not installed")
    ctx = ctx_for("tiny-moe", nodes=2, seq=256, batch=64)
    accepted = refused = 0
    for plan in layouts(ctx, 16):
        d = plan.degrees
        if d.cp > 1:
            continue  # DeepSpeed has no ring attention (refused for that, MoE or not)
        try:
            out = export(plan, ctx, "deepspeed")
        except ExportRefused as e:
            refused += 1
            near = e.nearest.plan.degrees
            assert near.etp == near.tp and near.dp % near.ep == 0
            continue
        ep_groups, _ = ds_groups._get_expert_parallel_ranks(plan.world, d.tp, d.ep, d.pp)
        assert sorted(expert_groups(d, "ep")) == sorted(ep_groups), d
        assert out.data["moe_layer"]["ep_size"] == d.ep
        accepted += 1
    assert accepted >= 6 and refused >= 6


@pytest.mark.parametrize("model", ["tiny-moe", "qwen3-30b-a3b"])
def test_deepspeed_moe_layer_takes_the_exported_arguments(model):
    layer = pytest.importorskip("deepspeed.moe.layer", reason="deepspeed not installed")
    ctx = ctx_for(model, nodes=2, batch=64)
    plan = resolved(ctx, degrees=Degrees(dp=16, ep=8), micro_batch_size=1, zero_stage=1)
    kw = export(plan, ctx, "deepspeed").data["moe_layer"]
    moe = layer.MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), **kw)  # its own checks (experts % ep_size)
    assert moe.num_local_experts == ctx.model.moe.experts // 8 and moe.ep_size == 8


def test_deepspeed_refuses_zero3_with_experts():
    ctx = ctx_for("tiny-moe", nodes=1, seq=256, batch=16)
    plan = resolved(ctx, degrees=Degrees(dp=8, ep=2), micro_batch_size=1, zero_stage=3)
    with pytest.raises(ExportRefused) as e:
        export(plan, ctx, "deepspeed")
    assert e.value.nearest.plan.zero_stage <= 2
    export(e.value.nearest.plan, ctx, "deepspeed")


# ---- torchtitan and Accelerate ------------------------------------------------------------------------
def titan_ep_groups(plan: Plan) -> list[list[int]]:
    """torchtitan's EP groups (torchtitan/distributed/parallel_dims.py): the mesh
    [pp, dp_replicate, dp_shard_mod_ep, dp_shard_in_ep, cp, tp] with ep = dp_shard_in_ep x cp (x tp at
    etp 1), flattened in that order."""
    d = plan.degrees
    shard = d.dp if plan.zero_stage >= 2 else 1
    inner = d.cp * (d.tp if d.etp == 1 else 1)
    in_ep = d.ep // inner
    mesh = torch.arange(plan.world).reshape(d.pp, d.dp // shard, shard // in_ep, in_ep, d.cp, d.tp)
    if d.etp == 1:
        groups = mesh.reshape(-1, in_ep * d.cp * d.tp)
    else:  # ep over (dp_shard_in_ep, cp), one group per tp rank
        groups = mesh.reshape(-1, in_ep * d.cp, d.tp).transpose(1, 2).reshape(-1, in_ep * d.cp)
    return [g.tolist() for g in groups]


def test_torchtitan_writes_expert_degrees_and_its_groups_are_the_plans():
    ctx = ctx_for("tiny-moe", nodes=2, seq=256, batch=64)
    accepted = 0
    for plan in layouts(ctx, 16):
        if plan.degrees.pp > 1:
            continue
        plan = plan.replace(zero_stage=3)
        try:
            cfg = tomllib.loads(export(plan, ctx, "torchtitan").text)
        except ExportRefused as e:
            near = e.nearest.plan.degrees if e.nearest else None
            assert near is None or near.etp in (1, near.tp)
            continue
        d = plan.degrees
        assert (cfg["parallelism"]["expert_parallel_degree"], cfg["parallelism"]["expert_tensor_parallel_degree"]) == \
            (d.ep, d.etp)
        if d.ep > 1:
            assert sorted(titan_ep_groups(plan)) == sorted(expert_groups(d, "ep")), d
        accepted += 1
    assert accepted >= 6


def test_torchtitan_refuses_an_etp_it_has_not():
    ctx = ctx_for("tiny-moe", nodes=2, seq=256, batch=64)
    plan = resolved(ctx, degrees=Degrees(dp=4, tp=4, ep=2, etp=2), micro_batch_size=1, zero_stage=3,
                    sequence_parallel=True)
    with pytest.raises(ExportRefused) as e:
        export(plan, ctx, "torchtitan")
    assert any("etp(2)" in r for r in e.value.reasons)
    assert e.value.nearest.plan.degrees.etp in (1, 4)


def test_accelerate_refuses_expert_parallelism_with_the_replicated_plan_as_nearest():
    ctx = ctx_for("tiny-moe", nodes=1, seq=256, batch=16)
    plan = resolved(ctx, degrees=Degrees(dp=8, ep=4), micro_batch_size=1, zero_stage=3)
    with pytest.raises(ExportRefused) as e:
        export(plan, ctx, "accelerate")
    near = e.value.nearest.plan.degrees
    assert (near.ep, near.etp, near.dp) == (1, 1, 8)
    export(e.value.nearest.plan, ctx, "accelerate")  # and that plan exports


def test_the_search_target_rules_are_the_exporters():
    """``--target`` asks the exporters (targets.refusals): a plan torchtitan refuses is refused there."""
    from autotune.targets import refusals

    ctx = ctx_for("tiny-moe", nodes=2, seq=256, batch=64)
    plan = resolved(ctx, degrees=Degrees(dp=4, tp=4, ep=2, etp=2), micro_batch_size=1, zero_stage=3,
                    sequence_parallel=True)
    assert refusals("torchtitan", plan, ctx) == exporter("torchtitan").reasons(plan, ctx) != []
    assert refusals("megatron", plan.replace(zero_stage=1), ctx) == []


def test_megatron_fp8_moe_flags_name_megatron_core_fields():
    """FP8 with experts adds the router's padding to the FP8 GEMM alignment; every flag names a Megatron
    Core config field (building the config needs Transformer Engine's version under FP8, absent on CPU)."""
    ctx = ctx_for("deepseek-v3", nodes=4)
    plan = resolved(ctx, degrees=Degrees(dp=16, pp=2, ep=8), micro_batch_size=1, zero_stage=1, dtype="fp8-blockwise")
    args = M.parse_script(export(plan, ctx, "megatron").text)
    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    names = {RENAMES.get(a[2:].replace("-", "_"), a[2:].replace("-", "_")) for a in args if a.startswith(MOE_PREFIXES)}
    assert "moe_router_padding_for_quantization" in names and names <= fields


def test_apply_and_the_nearest_plan_are_priced_as_the_target_runs():
    """``apply --format megatron`` prices the plan with Megatron's kernel costs, the figure
    ``estimate --target megatron`` (and ``search --target megatron``) gives, not autotune's runtime's."""
    from autotune.cost.estimate import estimate
    from autotune.cost.kernels import RUNTIME
    from autotune.export.apply import price

    ctx = ctx_for("qwen3-30b-a3b", nodes=2)
    plan = resolved(ctx, degrees=Degrees(dp=8, pp=2, ep=8), micro_batch_size=1, zero_stage=1)
    got = price(plan, ctx, True, M.KERNELS).predicted["tokens_per_s"]
    want = estimate(plan, ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch, kernels=M.KERNELS)
    runtime = estimate(plan, ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch, kernels=RUNTIME)
    assert got == want.predicted["tokens_per_s"] != runtime.predicted["tokens_per_s"]
    uneven = resolved(ctx, degrees=Degrees(dp=8, pp=2, ep=8), micro_batch_size=1, zero_stage=3)
    with pytest.raises(ExportRefused) as e:  # the nearest plan's figure: Megatron's too
        export(uneven, ctx, "megatron")
    near = e.value.nearest
    again = estimate(near.plan, ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch, kernels=M.KERNELS)
    assert near.predicted["tokens_per_s"] == again.predicted["tokens_per_s"]
