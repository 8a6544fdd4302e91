"""Export of per-stage plans (autotune/export/stages.py): the frameworks refuse per-stage degrees with
the reason and the nearest uniform plan they can run (read back by their own exporters); a per-stage
plan that is a uniform mesh exports exactly as that uniform plan does; JSON and the runtime take all."""

from __future__ import annotations

import json

import pytest

from autotune import stages as ST
from autotune.export import ExportContext, ExportRefused, export
from autotune.plan import Plan, parse_inline
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model
from autotune.targets import refusals

M = load_model("tiny")
C = cluster_from_dict({"name": "mixed", "nodes": [
    {"count": 1, "devices_per_node": 4, "device": "A100-40GB"},
    {"count": 1, "devices_per_node": 4, "device": "V100-16GB"}], "inter_node": {"bandwidth": "25GB/s"}})
CTX = ExportContext(model=M, cluster=C, seq_len=128, global_batch=16)
FRAMEWORKS = ("megatron", "torchtitan", "deepspeed", "accelerate")


def staged(*st, **kw):
    return Plan(stages=tuple(ST.Stage(layers=n, replicas=tuple(ST.Replica(tp=len(d), devices=tuple(d)) for d in reps))
                             for n, reps in st), dtype="fp16", **kw).resolve(M, C, 128, 16)


MIXED_TP = staged((1, [[4, 5, 6, 7]]), (3, [[0], [1], [2], [3]][:1]))


@pytest.mark.parametrize("fmt", FRAMEWORKS)
def test_frameworks_refuse_per_stage_degrees_with_the_nearest_uniform_plan(fmt):
    with pytest.raises(ExportRefused) as e:
        export(MIXED_TP, CTX, fmt)
    assert any("stages" in r and "--target runtime" in r for r in e.value.reasons)
    near = e.value.nearest
    if fmt != "accelerate":  # Accelerate has no pipeline: no pp=2 plan is expressible there
        assert near is not None and near.plan.stages is None
        assert near.predicted or fmt == "torchtitan"  # torchtitan's bf16 the V100s lack: the price says so
        export(near.plan, CTX, fmt)  # the nearest plan is one the target really takes
    assert refusals(fmt, MIXED_TP, CTX)


def test_runtime_and_json_take_every_per_stage_plan():
    assert refusals("runtime", MIXED_TP, CTX) == []
    data = json.loads(export(MIXED_TP, CTX, "json").text)
    assert data["stages"][0]["replicas"][0]["tp"] == 4 and Plan.from_dict(data) == MIXED_TP


@pytest.mark.parametrize("fmt", ["megatron", "torchtitan", "deepspeed"])
def test_a_uniform_mesh_written_as_stages_exports_as_itself(fmt):
    u = parse_inline("dp=2,pp=2,tp=2,dtype=fp16,layers=1/3").resolve(M, C, 128, 16)
    s = Plan(stages=ST.as_stages(u, C), dtype="fp16").resolve(M, C, 128, 16)
    assert refusals(fmt, s, CTX) == refusals(fmt, u, CTX)

    def outcome(p):
        try:
            return export(p, CTX, fmt).data
        except ExportRefused as e:
            return e.reasons, e.nearest.plan if e.nearest else None

    assert outcome(s) == outcome(u)
