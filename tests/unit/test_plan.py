import itertools
import json

import pytest

from autotune.errors import InputError
from autotune.plan import (
    CP_LAYOUTS,
    DIMS,
    DTYPES,
    EXPERT_DIMS,
    MESH_ORDER,
    RECOMPUTE,
    SCHEDULES,
    SCHEMA_PATH,
    SCHEMA_VERSION,
    ZERO_STAGES,
    Degrees,
    Plan,
    PlanError,
    check_schema,
    choose_dtype,
    even_split,
    load_plan,
    parse_inline,
    plan_schema,
)
from autotune.plan_record import PlanRecord
from autotune.specs import load_model
from autotune.specs.cluster import cluster_from_dict, local_cluster

TINY = load_model("tiny")


def two_nodes(dpn=4):
    return cluster_from_dict({"nodes": [{"count": 2, "devices_per_node": dpn, "device": "A100-80GB"}]})


def test_hand_written_degrees_only_gets_design_defaults():
    c = local_cluster(8)
    p = Plan.from_dict({"degrees": {"dp": 2, "pp": 2, "cp": 2}}).resolve(TINY, c, seq_len=64, global_batch=8)
    assert p.shares.layers == (2, 2)
    assert p.shares.tokens == (32, 32)
    assert p.shares.heads == (8,)
    assert p.shares.samples == (4, 4)
    assert p.num_microbatches == 4 and p.micro_batch_size == 1 and p.schedule == "1f1b"
    assert [(x.node, x.device) for x in p.placement] == [(0, i) for i in range(8)]
    assert p.workload.model == "tiny"


def test_json_round_trip_and_schema():
    c = local_cluster(4)
    p = parse_inline("pp=2,hp=2").resolve(TINY, c, 64, 4)
    rec = PlanRecord(p, predicted={"step_time_s": 1.0, "tokens_per_s": 256.0, "mfu": 0.1,
                                   "memory_bytes": [1, 2, 3, 4], "feasible": True})
    assert Plan.from_json(p.to_json()) == p
    assert PlanRecord.from_dict(json.loads(rec.to_json())) == rec
    check_schema(json.loads(rec.to_json()))
    assert list(rec.to_dict())[-3:] == ["predicted", "measured", "provenance"]  # the file's layout


def test_mesh_coordinates_are_a_bijection_with_tp_innermost():
    p = parse_inline("dp=2,pp=2,cp=2,hp=1,tp=2")
    ranks = [p.rank_of(**p.coords(r)) for r in range(p.world)]
    assert ranks == list(range(16))
    assert p.group_ranks("tp", 5) == [4, 5]
    assert p.group_ranks("pp", 1) == [1, 9]
    assert MESH_ORDER[0] == "pp"
    for dim in ("dp", "pp", "cp", "hp", "tp"):
        groups = p.all_groups(dim)
        assert sorted(itertools.chain(*groups)) == list(range(16))


def test_world_mismatch_names_every_factor():
    with pytest.raises(PlanError, match=r"dp\(2\)\*pp\(2\)\*cp\(2\)\*hp\(1\)\*tp\(2\) = 16 != devices\(8\)"):
        parse_inline("dp=2,pp=2,cp=2,tp=2").resolve(TINY, local_cluster(8), 64, 8)


@pytest.mark.parametrize("plan,match", [
    ({"degrees": {"tp": 3}}, "heads"),
    ({"degrees": {"pp": 2}, "shares": {"layers": [4, 0]}}, "layers"),
    ({"degrees": {"pp": 2}, "shares": {"layers": [2, 1]}}, "adds up"),
    ({"degrees": {"cp": 3}, "shares": {"tokens": [21, 21, 22]}}, "multiple of 2"),
    ({"degrees": {"hp": 3}, "shares": {"heads": [4, 2, 1]}}, "heads"),
    ({"degrees": {"dp": 3}, "shares": {"samples": [1, 1, 1]}}, "samples"),
])
def test_bad_shares_are_refused(plan, match):
    n = 1
    for v in plan["degrees"].values():
        n *= v
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(plan).resolve(TINY, local_cluster(n), 64, 4)


def test_tp_crossing_a_node_is_refused():
    c = two_nodes(dpn=2)
    bad = [{"rank": r, "node": n, "device": d} for r, (n, d) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1)])]
    with pytest.raises(PlanError, match="crosses nodes"):
        Plan.from_dict({"degrees": {"dp": 2, "tp": 2}, "placement": bad}).resolve(TINY, c, 64, 4)
    Plan.from_dict({"degrees": {"dp": 2, "tp": 2}}).resolve(TINY, c, 64, 4)  # node order is fine


def test_uneven_shares_accepted():
    c = local_cluster(4)
    p = Plan.from_dict({"degrees": {"pp": 2, "cp": 2}, "shares": {"layers": [1, 3], "tokens": [40, 24]}})
    r = p.resolve(TINY, c, 64, 4)
    assert r.shares.layers == (1, 3) and not r.is_even()


def test_1f1b_needs_enough_microbatches():
    with pytest.raises(PlanError, match="micro-batches"):
        parse_inline("pp=4").resolve(TINY, local_cluster(4), 64, 2)
    parse_inline("pp=4,schedule=gpipe").resolve(TINY, local_cluster(4), 64, 2)


def test_inline_and_file_loading(tmp_path):
    assert parse_inline("dp=2,tp=4,mbs=2,schedule=gpipe").micro_batch_size == 2
    with pytest.raises(InputError, match="unknown inline plan key"):
        parse_inline("dq=2")
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"schema_version": SCHEMA_VERSION + 1, "degrees": {"dp": 1}}))
    with pytest.raises(PlanError, match="schema_version"):
        load_plan(f)
    f.write_text("{not json")
    with pytest.raises(PlanError, match="does not parse"):
        load_plan(f)


def test_even_split():
    assert even_split(10, 3) == [4, 3, 3] and sum(even_split(127, 8)) == 127


@pytest.mark.parametrize("kw,match", [
    ({"schedule": "zero_bubble"}, r"schedule: unknown schedule 'zero_bubble'"),
    ({"schedule": "1F1B"}, r"did you mean 1f1b"),
    ({"recompute": "ful"}, r"recompute: .*did you mean full"),
    ({"cp_layout": "zig-zag"}, r"cp_layout: .*did you mean zigzag"),
    ({"dtype": "bfloat16"}, r"dtype: unknown dtype 'bfloat16'"),
    ({"zero_stage": 4}, r"zero_stage: must be 0, 1, 2 or 3"),
    ({"zero_stage": True}, r"zero_stage"),
])
def test_plan_constructor_checks_enumerated_fields(kw, match):
    """A Plan built in code is checked like one read from JSON (issue 13 point 5)."""
    with pytest.raises(PlanError, match=match):
        Plan(**kw)
    with pytest.raises(PlanError, match=match.split(":")[0]):  # replace() goes through the constructor
        Plan().replace(**kw)


def test_plan_constructor_accepts_every_registered_value():
    for sched in SCHEDULES:
        for rc in RECOMPUTE:
            for z in ZERO_STAGES:
                for dt in DTYPES:
                    for lay in CP_LAYOUTS:
                        Plan(schedule=sched, recompute=rc, zero_stage=z, dtype=dt, cp_layout=lay)


def test_degrees_must_be_positive():
    with pytest.raises(PlanError, match=r"degrees.tp: must be a positive integer"):
        Degrees(tp=0)


def test_schema_file_enumerations_follow_the_registries():
    """The JSON Schema lists exactly the values the Plan constructor accepts (the schedules come
    from their registry, the file leaves them out)."""
    props = json.loads(SCHEMA_PATH.read_text())["properties"]
    assert "enum" not in props["schedule"]
    assert plan_schema()["properties"]["schedule"]["enum"] == list(SCHEDULES)
    assert props["degrees"]["properties"] == {}  # filled from autotune/dims.py
    assert list(plan_schema()["properties"]["degrees"]["properties"]) == [*DIMS, *EXPERT_DIMS]
    assert props["recompute"]["enum"] == list(RECOMPUTE)
    assert props["cp_layout"]["enum"] == list(CP_LAYOUTS)
    assert "enum" not in props["dtype"]  # filled from plan_parts.DTYPES, the one list of dtypes
    assert plan_schema()["properties"]["dtype"]["enum"] == list(DTYPES)
    assert SCHEMA_VERSION in props["schema_version"]["enum"]
    assert [props["zero_stage"]["minimum"], props["zero_stage"]["maximum"]] == [min(ZERO_STAGES), max(ZERO_STAGES)]


def test_version_1_plans_still_load(tmp_path):
    f = tmp_path / "v1.json"
    f.write_text(json.dumps({"schema_version": 1, "degrees": {"dp": 2}, "dtype": "fp16", "zero_stage": 1}))
    p = load_plan(f)
    assert p.dtype == "fp16" and p.zero_stage == 1 and p.schema_version == SCHEMA_VERSION
    check_schema(p.to_dict())


def _mixed_v100():
    return cluster_from_dict({"name": "mixed", "nodes": [{"count": 1, "devices_per_node": 8, "device": "A100-40GB"},
                                                          {"count": 1, "devices_per_node": 8, "device": "V100"}]})


def test_auto_dtype_is_bf16_only_where_every_device_has_it():
    assert choose_dtype("auto", two_nodes()) == "bf16"
    mixed = _mixed_v100()
    assert choose_dtype("auto", mixed) == "fp16"
    assert choose_dtype("fp32", mixed) == "fp32"
    with pytest.raises(PlanError, match=r"--dtype: bf16 is not supported by V100.*use --dtype fp16"):
        choose_dtype("bf16", mixed)
    # auto keeps what a plan states, and refuses it where the cluster cannot
    assert choose_dtype("auto", two_nodes(), plan_dtype="fp16") == "fp16"
    with pytest.raises(PlanError, match=r"dtype: bf16 is not supported"):
        choose_dtype("auto", mixed, plan_dtype="bf16")
    with pytest.raises(PlanError, match=r"did you mean bf16"):
        choose_dtype("bf61", mixed)


def test_a_plan_is_configuration_and_its_record_travels_beside_it():
    """Issue 17, point 5: what was predicted or measured never changes what a plan is."""
    import dataclasses

    from autotune.cost import estimate
    from autotune.plan import RECORD_KEYS

    c = local_cluster(4)
    p = parse_inline("pp=2,dp=2").resolve(TINY, c, 64, 4)
    est = estimate(p, TINY, c, 64, 4)
    assert est.plan == p and hash(est.plan) == hash(p) and len({est.plan, p}) == 1
    rec = est.record()
    assert rec.plan is est.plan and rec.predicted == est.predicted
    stored = rec.replace(measured={"step_time_s": 1.0}, provenance={"study": "s"}).to_dict()
    assert Plan.from_dict(stored) == p  # a record's JSON reads back as the same configuration
    assert PlanRecord.from_dict(stored).measured == {"step_time_s": 1.0}
    assert not set(RECORD_KEYS) & set(p.to_dict())
    assert not set(RECORD_KEYS) & {f.name for f in dataclasses.fields(Plan)}
    with pytest.raises(InputError, match="expected a mapping"):
        PlanRecord.from_dict({**stored, "measured": [1]})
