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


# a per-stage plan whose 3 stages no uniform mesh of 8 devices has (8 % 3): 2 A100s | 2 A100s | 4 V100s
THREE_STAGES = staged((1, [[0, 1]]), (1, [[2, 3]]), (2, [[4, 5, 6, 7]]))


@pytest.mark.parametrize("fmt", ["megatron", "torchtitan", "deepspeed"])
def test_stages_no_mesh_has_still_get_the_nearest_uniform_plan(fmt):
    """3 stages on 8 devices: the nearest uniform depths are 2 and 4 (issue 39 item 5: the refusal
    said "(no candidate resolved)")."""
    with pytest.raises(ExportRefused) as e:
        export(THREE_STAGES, CTX, fmt)
    near = e.value.nearest
    assert near is not None and near.plan.stages is None and near.plan.degrees.pp in (2, 4)
    assert near.plan.world == C.num_devices


def test_a_studys_per_stage_plan_is_refused_with_the_studys_best_plan_the_target_runs(tmp_path):
    """apply --study S --trial N of a per-stage plan names, as the nearest plan Megatron runs, one at
    least as fast as the best Megatron plan the search found (the study's best_per_target)."""
    import optuna

    from autotune.export.source import from_study
    from autotune.search import SearchOptions, search
    from autotune.study import trial_record

    url = f"sqlite:///{tmp_path / 's.db'}"
    search(M, C, 128, 16, study_name="s", storage=url,
           options=SearchOptions(trials=20, polish=False, dtype="fp16"))
    study = optuna.load_study(study_name="s", storage=url)
    best = study.user_attrs["best_per_target"]["megatron"]
    assert best is not None
    study.add_trial(optuna.trial.create_trial(value=1.0, params={}, distributions={},
                                              user_attrs={"plan": THREE_STAGES.to_dict()}))
    record, ctx = from_study("s", url, None, trial=len(study.trials) - 1)
    with pytest.raises(ExportRefused) as e:
        export(record, ctx, "megatron")
    near = e.value.nearest
    # the study's plan, priced as Megatron runs it (apply's price), against what the refusal names
    found = trial_record(next(t for t in study.trials if t.number == best["trial"]))
    from autotune.export import megatron
    from autotune.export.common import predict

    theirs, _ = predict(found.plan, ctx, megatron.KERNELS)
    assert near is not None and near.tokens_per_s() >= theirs.tokens_per_s() / 1.01


def split(*st, cp=1, hp=1):
    """stages of (layers, tp, [devices of each replica]), every replica at ``cp`` and ``hp``."""
    return Plan(stages=tuple(ST.Stage(layers=n, replicas=tuple(ST.Replica(tp=t, cp=cp, hp=hp, devices=tuple(d))
                                                                for d in reps)) for n, t, reps in st),
                dtype="fp16").resolve(M, C, 128, 16)


@pytest.mark.parametrize("fmt", ["megatron", "torchtitan", "deepspeed"])
def test_a_uniform_cp_mesh_written_as_stages_exports_as_itself(fmt):
    u = parse_inline("dp=2,pp=2,cp=2,dtype=fp16,layers=1/3").resolve(M, C, 128, 16)
    s = Plan(stages=ST.as_stages(u, C), dtype="fp16").resolve(M, C, 128, 16)
    assert s.degrees.cp == 2 and refusals(fmt, s, CTX) == refusals(fmt, u, CTX)


@pytest.mark.parametrize("fmt", FRAMEWORKS)
def test_frameworks_refuse_mixed_tp_stages_with_cp_in_one_line(fmt):
    p = split((1, 2, [[4, 5, 6, 7]]), (3, 1, [[0, 1]]), cp=2)
    reasons = refusals(fmt, p, CTX)
    assert len(reasons) == 1 and "--target runtime" in reasons[0] and "\n" not in reasons[0]
