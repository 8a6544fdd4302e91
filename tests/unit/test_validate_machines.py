"""Validation runs only where the study's cluster is (autotune/machines.py, autotune/validate.py).

A study searched for 2 x H100 and validated on this CPU machine is refused with exit 2 and one line
naming what differs, and the study is left exactly as it was (trials, their attrs, study attrs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _search_helpers import toy_estimate, toy_runner

from autotune.machines import DeviceType, Machine, mismatch, study_nodes
from autotune.search import SearchOptions, search
from autotune.specs import load_cluster, load_model
from autotune.study import open_study
from autotune.validate import ValidateOptions, calibration_for, memory_errors, validate


def _h100_study(tmp_path):
    c = tmp_path / "h100x2.yaml"
    c.write_text("name: h100x2\nnodes:\n  - {count: 1, devices_per_node: 2, device: H100-SXM}\n")
    url = f"sqlite:///{tmp_path}/h.db"
    search(load_model("tiny"), load_cluster(str(c)), 256, 8, study_name="h", storage=url,
           options=SearchOptions(trials=12))
    return url


def _snapshot(url: str, name: str):
    st = open_study(name, url)
    return (json.dumps(st.user_attrs, sort_keys=True, default=str),
            [(t.number, t.state.name, t.value, json.dumps(t.user_attrs, sort_keys=True, default=str))
             for t in st.get_trials()])


def test_an_h100_study_validated_on_this_cpu_machine_exits_2_and_changes_nothing(tmp_path):
    url = _h100_study(tmp_path)
    before = _snapshot(url, "h")
    r = subprocess.run([sys.executable, "-m", "autotune", "validate", "--study", "h", "--storage", url,
                        "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    assert "2 x H100-SXM (cuda)" in lines[0] and "CPU" in lines[0]
    assert _snapshot(url, "h") == before


def test_the_match_rules():
    h100 = DeviceType("cuda", "H100-SXM")
    cpu = Machine("here", (DeviceType("cpu", "Xeon"),))
    two = Machine("g", (h100, h100))
    assert mismatch([(h100, 2)], [two]) is None
    assert "1 x H100" in mismatch([(h100, 2)], [Machine("g", (h100,))])  # count per node
    assert "A100" in mismatch([(h100, 2)], [Machine("g", (DeviceType("cuda", "A100-80GB"),) * 2)])  # type
    assert "2 node(s)" in mismatch([(h100, 2), (h100, 2)], [two])  # multi-node needs one Machine per host
    assert mismatch([(h100, 2), (h100, 2)], [two, two]) is None
    assert mismatch([(DeviceType("cpu"), 4)], [cpu]) is None  # local's derived CPU: any CPU, any worker count
    assert "Epyc" in mismatch([(DeviceType("cpu", "Epyc"), 2)], [cpu])  # a profiled CPU is that CPU
    assert "CPU" in mismatch([(DeviceType("cpu"), 2)], [two])  # a CPU study on a GPU launch


def test_study_nodes_read_what_the_study_recorded(tmp_path):
    """``local`` rebuilt on another machine describes that machine: the record is what counts."""
    cluster = load_cluster("local:2")
    ua = {"cluster": "local-H100-SXM:2", "cluster_spec": {"nodes": [
        {"count": 1, "devices_per_node": 2, "device": "H100-SXM"}]}}
    assert study_nodes(ua, cluster, None) == [(DeviceType("cuda", "H100-SXM"), 2)]


def test_memory_errors_per_rank():
    m = memory_errors({"memory_bytes": [100.0, 300.0]}, {"peak_memory_bytes": [200, 200]})
    assert m["error"] == [pytest.approx(-0.5), pytest.approx(0.5)]
    assert m["median_error"] == pytest.approx(0.5)
    assert memory_errors({"memory_bytes": [1.0]}, {"peak_memory_bytes": [1, 2]}) is None


def test_validate_reports_memory_and_keys_the_calibration(tmp_path):
    url = f"sqlite:///{tmp_path}/v.db"
    search(load_model("tiny"), load_cluster("local:4"), 256, 8, study_name="v", storage=url,
           options=SearchOptions(trials=30), estimator=toy_estimate)
    out = validate("v", url, options=ValidateOptions(top=3), runner=toy_runner(1.3), estimator=toy_estimate)
    for r in out["validated"]:
        mem = r["memory"]
        assert len(mem["predicted_bytes"]) == len(r["measured"]["peak_memory_bytes"]) == len(mem["error"])
        assert mem["median_error"] is not None
    assert out["median_memory_error"] is not None
    key = out["calibration_measured"]
    assert key["devices"] == ["CPU"] and key["precision"] and key["runtime"].startswith("autotune")
    ua = open_study("v", url).user_attrs
    plan = out["validated"][0]["plan"]
    from autotune.plan import Plan

    p = Plan.from_dict(plan)
    assert calibration_for(ua, p) == ua["calibration"]
    other = "fp32" if p.dtype != "fp32" else "bf16"
    assert calibration_for(ua, p.replace(dtype=other)) is None  # measured in another precision


def test_an_estimator_that_raises_is_an_error_not_a_dropped_plan(tmp_path):
    url = f"sqlite:///{tmp_path}/e.db"
    search(load_model("tiny"), load_cluster("local:4"), 256, 8, study_name="e", storage=url,
           options=SearchOptions(trials=20), estimator=toy_estimate)

    def broken(plan, *a, calibration=None, **k):
        if calibration is not None:
            raise RuntimeError("cost model bug")
        return toy_estimate(plan, *a, calibration=calibration, **k)

    with pytest.raises(RuntimeError, match="cost model bug"):
        validate("e", url, options=ValidateOptions(top=2), runner=toy_runner(1.3), estimator=broken)


def test_a_cpu_study_on_a_gpu_launch_points_at_device_cpu():
    from autotune.machines import ClusterMismatch, check_machines

    ua = {"cluster": "local:2", "cluster_spec": {"nodes": [{"count": 1, "devices_per_node": 2, "device": "CPU"}]}}
    gpu = Machine("g", (DeviceType("cuda", "H200"),))
    with pytest.raises(ClusterMismatch, match="--device cpu"):
        check_machines(ua, load_cluster("local:2"), None, [gpu], "s")
    check_machines(ua, load_cluster("local:2"), None, [Machine("c", (DeviceType("cpu", "any"),))], "s")
