"""DeepSpeed exporter: the config JSON checked with DeepSpeed's batch rule
(train_batch_size = micro * accumulation * world / (pp * tp * sp)) and its uniform partition
(deepspeed.runtime.utils.partition_uniform, written again here from its source)."""

import itertools
import json

import pytest

from autotune.export import ExportRefused, export
from autotune.export import deepspeed as D
from autotune.export.common import ExportContext
from autotune.plan import Degrees, Plan, Shares
from autotune.specs.cluster import load_cluster
from autotune.specs.model import PRESETS


def ctx_for(world=8, seq=256, batch=16):
    return ExportContext(model=PRESETS["small"], cluster=load_cluster(f"local:{world}"), seq_len=seq,
                         global_batch=batch)


def resolved(ctx, **kw):
    return Plan(**kw).resolve(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)


def partition_uniform(num_items, num_parts):
    """DeepSpeed's boundaries: arange in steps of n // p, then +1 for the first n % p parts."""
    chunk = num_items // num_parts
    parts = [i * chunk for i in range(num_parts + 1)]
    for i in range(num_items - chunk * num_parts):
        for j in range(i + 1, num_parts + 1):
            parts[j] += 1
    return parts


@pytest.mark.parametrize("deg", [dict(dp=8), dict(dp=4, tp=2), dict(dp=2, pp=4), dict(dp=4, hp=2),
                                 dict(dp=2, hp=2, pp=2), dict(tp=2, pp=2, dp=2)])
@pytest.mark.parametrize("mbs", [1, 2])
def test_batch_rule_and_keys(deg, mbs):
    ctx = ctx_for()
    plan = resolved(ctx, degrees=Degrees(**deg), micro_batch_size=mbs, zero_stage=1 if deg.get("pp") else 2)
    out = json.loads(export(plan, ctx, "deepspeed").text)
    dp = D.data_parallel_size(out, plan.world)
    assert dp == plan.degrees.dp
    assert out["train_batch_size"] == out["train_micro_batch_size_per_gpu"] * out["gradient_accumulation_steps"] * dp
    assert out["train_batch_size"] == ctx.global_batch
    assert out.get("sequence_parallel_size", 1) == plan.degrees.hp
    assert out.get("tensor_parallel", {}).get("autotp_size", 1) == plan.degrees.tp
    assert out["zero_optimization"]["stage"] == plan.zero_stage and out["bf16"]["enabled"]
    if plan.degrees.pp > 1:
        pm = out["autotune"]["pipeline_module"]
        assert pm["parts"] == partition_uniform(ctx.model.layers, plan.degrees.pp)
        assert pm["parts"][-1] == ctx.model.layers  # every layer in one part


def test_only_uniform_layer_splits_are_expressible():
    ctx = ctx_for()
    n = ctx.model.layers
    uniform = partition_uniform(n, 4)
    for cuts in itertools.combinations(range(1, n), 3):
        b = (0, *cuts, n)
        layers = tuple(b[i + 1] - b[i] for i in range(4))
        plan = resolved(ctx, degrees=Degrees(pp=4, dp=2), zero_stage=1, shares=Shares(layers=layers))
        if list(b) == uniform:
            export(plan, ctx, "deepspeed")
        else:
            with pytest.raises(ExportRefused) as e:
                export(plan, ctx, "deepspeed")
            assert e.value.nearest.plan.shares.layers == tuple(uniform[i + 1] - uniform[i] for i in range(4))


def test_ring_cp_is_refused_and_nearest_uses_ulysses():
    ctx = ctx_for()
    plan = resolved(ctx, degrees=Degrees(cp=2, dp=4))
    with pytest.raises(ExportRefused) as e:
        export(plan, ctx, "deepspeed")
    assert "ring" in e.value.reasons[0]
    assert e.value.nearest.plan.degrees.cp == 1 and e.value.nearest.plan.world == 8
    assert D.reasons(e.value.nearest.plan, ctx) == []


def test_pipeline_with_zero2_refused():
    ctx = ctx_for()
    plan = resolved(ctx, degrees=Degrees(pp=2, dp=4), zero_stage=2)
    with pytest.raises(ExportRefused) as e:
        export(plan, ctx, "deepspeed")
    assert e.value.nearest.plan.zero_stage == 1
