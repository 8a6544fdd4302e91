"""JSON export: schema-valid on write and on read, round-trips through load_plan, carries provenance;
write_atomic leaves no partial file."""

import json
import os

import jsonschema
import pytest

from autotune import __version__
from autotune.errors import InputError
from autotune.export import export, write_atomic
from autotune.export import json_plan as J
from autotune.export.common import ExportContext
from autotune.plan import Degrees, Plan, PlanError, Shares, load_plan, plan_schema
from autotune.plan_record import PlanRecord, load_record
from autotune.specs.cluster import load_cluster
from autotune.specs.model import PRESETS


def ctx_for(**kw):
    base = dict(model=PRESETS["small"], cluster=load_cluster("local:8"), seq_len=256, global_batch=16)
    base.update(kw)
    return ExportContext(**base)


def test_written_plan_matches_schema_and_round_trips(tmp_path):
    ctx = ctx_for(study="s1", trial=7, source="study s1")
    plan = Plan(degrees=Degrees(pp=2, dp=2, cp=2), shares=Shares(layers=(3, 5), tokens=(160, 96))).resolve(
        ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)
    measured = {"step_time_s": 1.5, "tokens_per_s": 100.0, "peak_memory_bytes": [1.0] * 8}
    out = export(PlanRecord(plan, measured=measured), ctx, "json")
    path = write_atomic(tmp_path / "plan.json", out.text, check=J.check_file)
    data = json.loads(path.read_text())
    jsonschema.Draft202012Validator(plan_schema()).validate(data)
    back = load_record(path)
    assert back.plan == plan and back.measured == measured
    prov = data["provenance"]
    assert prov["version"] == __version__ and prov["model"] == "small" and prov["study"] == "s1"
    assert prov["trial"] == 7 and "cluster_digest" in prov and prov["profile_ids"] == []
    assert data["measured"]["step_time_s"] == 1.5


def test_other_schema_version_is_refused(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"schema_version": 99, "degrees": {"dp": 2}}))
    with pytest.raises(PlanError, match="schema_version 99"):
        load_plan(p)


def test_write_atomic_failures_leave_nothing(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        write_atomic(tmp_path / "missing" / "x.json", "{}")
    target = tmp_path / "x.json"
    target.write_text("old")

    def bad(_):
        raise InputError("check failed")

    with pytest.raises(InputError, match="check failed"):
        write_atomic(target, "new", check=bad)
    assert target.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["x.json"]  # no temp file left


def test_unwritable_place():
    with pytest.raises(InputError, match="cannot write"):
        write_atomic("/proc/autotune-plan.json", "{}")  # unwritable even for root


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into read-only folders")
def test_unwritable_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(InputError, match="cannot write"):
            write_atomic(ro / "x.json", "{}")
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o700)


def test_provenance_names_profiles_and_the_cluster_file_digest(tmp_path):
    import dataclasses
    import hashlib

    import yaml

    from autotune.specs.catalogue import CATALOGUE

    data = {"name": "measured", "nodes": [{"count": 1, "devices_per_node": 4, "device": "profile:7"},
                                          {"count": 1, "devices_per_node": 4, "device": "H100-SXM"}]}
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(data))

    def resolver(ref, storage):
        return dataclasses.replace(CATALOGUE["A100-80GB"], name=ref, provenance="measured")

    cl = load_cluster(str(f), resolve_profile=resolver)
    ctx = ExportContext(model=PRESETS["small"], cluster=cl, seq_len=256, global_batch=16, cluster_digest=cl.digest)
    plan = Plan(degrees=Degrees(dp=8)).resolve(ctx.model, cl, 256, 16)
    prov = json.loads(export(plan, ctx, "json").text)["provenance"]
    assert prov["profile_ids"] == ["7"]
    assert prov["cluster_digest"] == hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
