"""torchtitan exporter: the TOML read back with tomllib and checked with torchtitan's rules
(ParallelDims: replicate * shard * cp * tp * pp == world; every layer in exactly one model part, in
order; local_batch_size / pipeline_parallel_microbatch_size micro-batches; global = local * dp * accum)."""

import itertools

import pytest
import tomllib

from autotune.export import ExportRefused, export
from autotune.export import torchtitan as T
from autotune.export.common import ExportContext
from autotune.plan import Degrees, Plan, Shares
from autotune.specs.cluster import load_cluster
from autotune.specs.model import PRESETS

# Field names of torchtitan/config/job_config.py (Parallelism, Training, ActivationCheckpoint).
KNOWN = {
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                    "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size", "module_fqns_per_model_part"},
    "training": {"local_batch_size", "global_batch_size", "seq_len", "mixed_precision_param"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
    "compile": {"enable", "components"},
}
SCHEDULES = {"GPipe", "1F1B", "Interleaved1F1B"}  # torch.distributed.pipelining schedule names


def ctx_for(world=8, seq=256, batch=16):
    return ExportContext(model=PRESETS["small"], cluster=load_cluster(f"local:{world}"), seq_len=seq,
                         global_batch=batch)


def resolved(ctx, **kw):
    return Plan(**kw).resolve(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)


def compositions(total, parts):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        b = (0, *cuts, total)
        yield tuple(b[i + 1] - b[i] for i in range(parts))


def check_titan_rules(cfg, plan, ctx):
    for section, keys in cfg.items():
        assert set(keys) <= KNOWN[section], section
    p, t = cfg["parallelism"], cfg["training"]
    world = (p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"] * p["context_parallel_degree"]
             * p["tensor_parallel_degree"] * p["pipeline_parallel_degree"])
    assert world == plan.world
    dp = p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"]
    accum, rem = divmod(t["global_batch_size"], t["local_batch_size"] * dp)
    assert rem == 0 and t["global_batch_size"] == ctx.global_batch
    if p["pipeline_parallel_degree"] > 1:
        assert p["pipeline_parallel_schedule"] in SCHEDULES
        assert accum == 1
        assert t["local_batch_size"] // p["pipeline_parallel_microbatch_size"] == plan.num_microbatches
        parts = p["module_fqns_per_model_part"]
        layer_ids = [int(n.split(".")[1]) for part in parts for n in part if n.startswith("layers.")]
        assert layer_ids == list(range(ctx.model.layers))  # each layer once, in model order
        assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
        assert len(parts) % p["pipeline_parallel_degree"] == 0
        return [sum(n.startswith("layers.") for n in part) for part in parts]
    assert accum == plan.num_microbatches
    return None


@pytest.mark.parametrize("pp,v", [(2, 1), (4, 1), (2, 2)])
def test_every_layer_split_round_trips(pp, v):
    ctx = ctx_for()
    sched = "interleaved_1f1b" if v > 1 else "1f1b"
    for layers in compositions(ctx.model.layers, pp * v):
        plan = resolved(ctx, degrees=Degrees(pp=pp, dp=8 // pp), schedule=sched, virtual_stages=v, zero_stage=3,
                        shares=Shares(layers=layers))
        cfg = tomllib.loads(export(plan, ctx, "torchtitan").text)
        assert check_titan_rules(cfg, plan, ctx) == list(layers)


@pytest.mark.parametrize("deg,zero", [(dict(dp=8), 0), (dict(dp=8), 3), (dict(dp=4, tp=2), 2), (dict(dp=2, cp=4), 3),
                                      (dict(pp=2, tp=2, cp=2), 3), (dict(dp=2, pp=2, tp=2), 3)])
def test_degrees_batch_and_recompute(deg, zero):
    ctx = ctx_for()
    plan = resolved(ctx, degrees=Degrees(**deg), zero_stage=zero, micro_batch_size=2, recompute="selective",
                    sequence_parallel=deg.get("tp", 1) > 1)
    cfg = tomllib.loads(export(plan, ctx, "torchtitan").text)
    check_titan_rules(cfg, plan, ctx)
    assert cfg["activation_checkpoint"]["mode"] == "selective"
    assert cfg["training"]["seq_len"] == ctx.seq_len
    if zero == 2:
        assert cfg["parallelism"]["fsdp_reshard_after_forward"] == "never"


def test_ulysses_is_refused_and_folded_into_ring_cp():
    ctx = ctx_for()
    plan = resolved(ctx, degrees=Degrees(hp=2, dp=4), zero_stage=3)
    with pytest.raises(ExportRefused) as e:
        export(plan, ctx, "torchtitan")
    assert any("Ulysses" in r for r in e.value.reasons)
    near = e.value.nearest.plan
    assert near.degrees.hp == 1 and near.world == plan.world
    assert T.reasons(near, ctx) == []


def test_ddp_with_tp_and_zero1_are_refused():
    ctx = ctx_for()
    plan = resolved(ctx, degrees=Degrees(dp=4, tp=2), zero_stage=0, sequence_parallel=True)
    with pytest.raises(ExportRefused) as e:
        export(plan, ctx, "torchtitan")
    assert "DDP" in e.value.reasons[0] and e.value.nearest.plan.zero_stage == 3
    plan = resolved(ctx, degrees=Degrees(dp=8), zero_stage=1)
    with pytest.raises(ExportRefused) as e:
        export(plan, ctx, "torchtitan")
    assert e.value.nearest.plan.zero_stage == 2


def test_fp16_is_refused_nearest_bf16():
    ctx = ctx_for()
    plan = resolved(ctx, degrees=Degrees(dp=8), zero_stage=3, dtype="fp16")
    with pytest.raises(ExportRefused) as e:
        export(plan, ctx, "torchtitan")
    assert e.value.nearest.plan.dtype == "bf16"
