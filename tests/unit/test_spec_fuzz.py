"""Random and mangled spec files: the loaders raise InputError or succeed, never anything else."""

import json

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotune.errors import InputError
from autotune.plan import Plan
from autotune.specs.cluster import cluster_from_dict, load_cluster
from autotune.specs.model import PRESETS, load_model, model_from_dict

scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12))
values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                   st.dictionaries(st.text(max_size=10), c, max_size=4)),
                      max_leaves=12)


def _mangle(base: dict, data) -> dict:
    d = json.loads(json.dumps(base))
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(sorted(d) + ["extra"]))
        if data.draw(st.booleans()):
            d[key] = data.draw(values)
        else:
            d.pop(key, None)
    return d


# no deadline on any of these: they are about error kinds, not speed (a mangled count can build tens of
# thousands of devices, and a loaded CI machine took 285 ms on a plan Hypothesis' 200 ms default refused)
GOOD_CLUSTER = {"name": "c", "nodes": [{"count": 2, "devices_per_node": 8, "device": "H100-SXM",
                                        "intra_node": {"bandwidth": "450GB/s", "latency": "3us"}}],
                "inter_node": {"bandwidth": "25GB/s", "latency": "10us"}}


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.data())
def test_mangled_model_dicts(data):
    d = _mangle(PRESETS["llama3-8b"].to_dict(), data)
    try:
        model_from_dict(d)
    except InputError:
        pass


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.data())
def test_mangled_cluster_dicts(data):
    d = _mangle(GOOD_CLUSTER, data)
    if "nodes" in d and isinstance(d["nodes"], list) and d["nodes"] and isinstance(d["nodes"][0], dict):
        d["nodes"][0] = _mangle(d["nodes"][0], data)
    try:
        cluster_from_dict(d)
    except InputError:
        pass


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.data())
def test_mangled_plans(data):
    d = _mangle({"schema_version": 1, "degrees": {"dp": 2, "tp": 2}, "shares": {"layers": [4]},
                 "schedule": "1f1b", "placement": None}, data)
    try:
        Plan.from_dict(d)
    except InputError:
        pass


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture], deadline=None)
@given(text=st.text(max_size=200), suffix=st.sampled_from([".yaml", ".json"]))
def test_random_files(tmp_path, text, suffix):
    p = tmp_path / f"f{suffix}"
    p.write_text(text)
    for loader in (load_model, load_cluster):
        try:
            loader(p)
        except InputError:
            pass


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture], deadline=None)
@given(doc=values)
def test_random_yaml_documents(tmp_path, doc):
    p = tmp_path / "f.yaml"
    try:
        p.write_text(yaml.safe_dump(doc))
    except Exception:  # noqa: BLE001 - unrepresentable doc, nothing to test
        return
    for loader in (load_model, load_cluster):
        try:
            loader(p)
        except InputError:
            pass
