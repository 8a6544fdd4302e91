"""`autotune estimate` end to end: tables for people, one JSON object with --json, exit 2 on bad
input with one line and no traceback. The JSON figures are compared with the library call."""

import json

import pytest
from helpers.cli import run_autotune

from autotune.cost import estimate
from autotune.plan import load_plan
from autotune.specs import load_cluster, load_model


def run(*args):
    return run_autotune("estimate", *args, timeout=120)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    p = tmp_path_factory.mktemp("c") / "mixed.yaml"
    p.write_text("name: mixed\nnodes:\n  - {count: 1, devices_per_node: 4, device: H100-SXM}\n"
                 "  - {count: 1, devices_per_node: 4, device: A100-80GB}\ninter_node: {bandwidth: 25GB/s}\n")
    return str(p)


def test_json_inline_plan_matches_the_library(mixed):
    r = run("-m", "llama3-8b", "-c", mixed, "-p", "dp=2,pp=2,tp=2", "-s", "4096", "-b", "16", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"plan", "predicted", "breakdown"}
    ref = estimate(load_plan("dp=2,pp=2,tp=2"), load_model("llama3-8b"), load_cluster(mixed), 4096, 16)
    assert out["predicted"]["step_time_s"] == pytest.approx(ref.predicted["step_time_s"])
    assert out["predicted"]["memory_bytes"] == pytest.approx(ref.predicted["memory_bytes"])
    assert out["plan"]["predicted"]["tokens_per_s"] == pytest.approx(ref.predicted["tokens_per_s"])
    assert len(out["breakdown"]["ranks"]) == 8 and len(out["breakdown"]["stages"]) == 2
    assert out["breakdown"]["timeline"] is None


def test_plan_file_and_timeline(tmp_path, mixed):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"schema_version": 1, "degrees": {"pp": 2, "dp": 4},
                                "shares": {"layers": [18, 14]}, "schedule": "gpipe"}))
    r = run("-m", "llama3-8b", "-c", mixed, "-p", str(plan), "-s", "2048", "-b", "16", "--json", "--timeline")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["plan"]["shares"]["layers"] == [18, 14]
    assert {e["kind"] for e in out["breakdown"]["timeline"]} >= {"fwd", "bwd"}


def test_table_for_people(mixed):
    r = run("-m", "llama3-8b", "-c", mixed, "-p", "dp=2,pp=2,tp=2", "-s", "4096", "-b", "16")
    assert r.returncode == 0, r.stderr
    for word in ("step time", "tokens/s", "MFU", "Per pipeline stage", "Per rank", "H100-SXM", "A100-80GB"):
        assert word in r.stdout


def test_infeasible_plan_says_why(mixed):
    r = run("-m", "llama3-70b", "-c", mixed, "-p", "dp=8", "-s", "4096", "-b", "8", "--json")
    assert r.returncode == 0, r.stderr
    pr = json.loads(r.stdout)["predicted"]
    assert pr["feasible"] is False and "memory" in pr["infeasible_reason"]


@pytest.mark.parametrize("args,needle", [
    (("-m", "tiny", "-c", "local:4", "-p", "dp=3", "-s", "64", "-b", "8"), "devices(4)"),
    (("-m", "tiny", "-c", "local:4", "-p", "pp=8,dp=1", "-s", "64", "-b", "8"), "pp"),
    (("-m", "tiny", "-c", "local:2", "-p", "dp=2,bogus=1", "-s", "64", "-b", "8"), "bogus"),
    (("-m", "tiny9", "-c", "local:2", "-p", "dp=2", "-s", "64", "-b", "8"), "did you mean"),
    (("-m", "tiny", "-c", "nope.yaml", "-p", "dp=2", "-s", "64", "-b", "8"), "not found"),
    (("-m", "tiny", "-c", "local:2", "-p", "missing.json", "-s", "64", "-b", "8"), "not found"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    r = run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert needle in r.stderr


def test_unknown_device_type_is_a_clear_error(tmp_path):
    c = tmp_path / "c.yaml"
    c.write_text("nodes:\n  - {count: 1, devices_per_node: 2, device: H10}\n")
    r = run("-m", "tiny", "-c", str(c), "-p", "dp=2", "-s", "64", "-b", "8", "--json")
    assert r.returncode == 2
    assert json.loads(r.stdout)["error"]["kind"] == "input" and "H10" in r.stderr
