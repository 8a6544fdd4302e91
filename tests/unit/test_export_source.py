"""Picking a study's trial and rebuilding its cluster from the study's record."""

import optuna
import pytest
import yaml

from autotune.errors import InputError
from autotune.export.source import _cluster_from_record, best_trial
from autotune.specs.cluster import load_cluster


def test_cluster_rebuilt_from_the_study_record(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"name": "mixed", "nodes": [
        {"count": 1, "devices_per_node": 4, "device": "H100-SXM", "intra_node": {"bandwidth": "450GB/s"}},
        {"count": 2, "devices_per_node": 2, "device": "A100-80GB"}],
        "inter_node": {"bandwidth": "25GB/s", "latency": "10us"},
        "overrides": [{"nodes": [0, 2], "bandwidth": "5GB/s"}]}))
    cl = load_cluster(str(f))
    back = _cluster_from_record(cl.name, cl.to_dict(), cl.digest, "sqlite://")
    assert [(d.node, d.local, d.spec.name) for d in back.devices] == [(d.node, d.local, d.spec.name) for d in cl.devices]
    for a in range(cl.num_devices):
        for b in range(cl.num_devices):
            assert back.link(a, b).bandwidth == cl.link(a, b).bandwidth
    assert back.digest == cl.digest
    with pytest.raises(InputError, match="--cluster"):
        _cluster_from_record("mixed", None, "", "sqlite://")


def test_best_trial_order():
    s = optuna.create_study(direction="maximize")
    mk = optuna.trial.create_trial
    s.add_trial(mk(value=5.0, user_attrs={"plan": {}}, constraints={"m": -1.0}))
    s.add_trial(mk(value=9.0, user_attrs={"plan": {}}, constraints={"m": 3.0}))  # infeasible
    s.add_trial(mk(value=7.0, user_attrs={"plan": {}, "infeasible_reason": "oom"}))
    s.add_trial(mk(value=6.0, user_attrs={"plan": {}}))
    assert best_trial(s).number == 3
    s.set_user_attr("best_measured_trial", 0)
    assert best_trial(s).number == 0
