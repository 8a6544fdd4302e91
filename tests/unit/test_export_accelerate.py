"""Accelerate exporter: the fields checked by Accelerate's own ParallelismConfig when Accelerate is
installed (its __post_init__ validation and total_size), and by the same rules written out here."""

import json

import pytest

from autotune.export import ExportRefused, export
from autotune.export import accelerate as A
from autotune.export.common import ExportContext
from autotune.plan import Degrees, Plan
from autotune.specs.cluster import load_cluster
from autotune.specs.model import PRESETS

CASES = [(dict(dp=8), 0), (dict(dp=8), 3), (dict(dp=4, tp=2), 3), (dict(dp=4, cp=2), 2), (dict(dp=4, hp=2), 0),
         (dict(dp=2, tp=2, hp=2), 3)]


def ctx_for(world=8, seq=256, batch=16):
    return ExportContext(model=PRESETS["small"], cluster=load_cluster(f"local:{world}"), seq_len=seq,
                         global_batch=batch)


def resolved(ctx, **kw):
    return Plan(**kw).resolve(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)


@pytest.mark.parametrize("deg,zero", CASES)
def test_fields_and_world(deg, zero):
    ctx = ctx_for()
    plan = resolved(ctx, degrees=Degrees(**deg), zero_stage=zero, micro_batch_size=2)
    out = json.loads(export(plan, ctx, "accelerate").text)
    pc = out["parallelism_config"]
    assert A.total_size(pc) == plan.world
    assert not (pc["cp_size"] > 1 and pc["sp_size"] > 1)
    assert not ((pc["tp_size"] > 1 or pc["cp_size"] > 1) and pc["dp_replicate_size"] > 1 and pc["dp_shard_size"] == 1)
    dp = pc["dp_replicate_size"] * pc["dp_shard_size"]
    assert out["per_device_train_batch_size"] * out["accelerator"]["gradient_accumulation_steps"] * dp == 16


@pytest.mark.parametrize("deg,zero", CASES)
def test_accelerate_itself_accepts_the_fields(deg, zero):
    pcmod = pytest.importorskip("accelerate.parallelism_config", reason="accelerate not installed")
    ctx = ctx_for()
    plan = resolved(ctx, degrees=Degrees(**deg), zero_stage=zero)
    pc = dict(export(plan, ctx, "accelerate").data["parallelism_config"])
    if pc["tp_size"] > 1:
        pc["tp_handler"] = object()  # its default handler needs transformers; the size rules are what we test
    cfg = pcmod.ParallelismConfig(**pc)
    assert cfg.total_size == plan.world


def test_pipeline_and_cp_with_sp_refused():
    ctx = ctx_for()
    plan = resolved(ctx, degrees=Degrees(pp=2, cp=2, hp=2), zero_stage=3)
    with pytest.raises(ExportRefused) as e:
        export(plan, ctx, "accelerate")
    assert len(e.value.reasons) == 2
    near = e.value.nearest.plan
    assert near.degrees.pp == 1 and (near.degrees.cp == 1 or near.degrees.hp == 1) and near.world == 8
    assert A.reasons(near, ctx) == []
