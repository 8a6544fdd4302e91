"""Cluster files as a user writes them: a device the catalogue lacks described inline, units required
on every figure, suggestions that rank by family, and a study's record that rebuilds the same cluster."""

import copy

import pytest

from autotune.errors import InputError, nearest
from autotune.specs.catalogue import CATALOGUE
from autotune.specs.cluster import cluster_from_dict

B200 = {"name": "B200", "peak_flops": {"bf16": "2250TFLOP/s", "fp16": "2250TFLOP/s", "fp32": "75TFLOP/s"},
        "memory": "192GB", "memory_bandwidth": "8TB/s", "intra_node_bandwidth": "900GB/s",
        "nic_bandwidth": "400Gbit/s", "source": "NVIDIA B200 datasheet"}
MIXED = {"name": "b200-h100",
         "nodes": [{"count": 2, "devices_per_node": 8, "device": B200},
                   {"count": 1, "devices_per_node": 8, "device": "H100-SXM"}],
         "inter_node": {"bandwidth": "400Gbit/s", "latency": "5us"}}


def test_inline_device_carries_its_figures_and_says_user():
    c = cluster_from_dict(copy.deepcopy(MIXED))
    spec = c.devices[0].spec
    assert spec.provenance == "user" and spec.name == "B200"
    assert spec.flops("bf16") == 2250e12 and spec.memory_bytes == 192e9 and spec.memory_bandwidth == 8e12
    assert c.link(0, 1).bandwidth == 900e9          # intra-node from the device's NVLink figure
    assert spec.nic_bandwidth == 400e9 / 8          # per device, per direction
    assert c.devices[16].spec is CATALOGUE["H100-SXM"]


def test_a_study_record_rebuilds_the_same_cluster_inline_devices_included():
    from autotune.study import cluster_from_record

    c = cluster_from_dict(copy.deepcopy(MIXED))
    again = cluster_from_record(c.name, c.to_dict())
    assert again.groups == c.groups and again.inter_node == c.inter_node


@pytest.mark.parametrize("mutate,field,units", [
    (lambda d: d.update(memory=192e9), "nodes[0].device.memory", "GiB"),
    (lambda d: d["peak_flops"].update(bf16=2.25e15), "nodes[0].device.peak_flops.bf16", "TFLOP/s"),
    (lambda d: d.update(memory_bandwidth="8"), "nodes[0].device.memory_bandwidth", "GB/s"),
])
def test_inline_figures_need_units(mutate, field, units):
    d = copy.deepcopy(MIXED)
    mutate(d["nodes"][0]["device"])
    with pytest.raises(InputError) as e:
        cluster_from_dict(d, source="c.yaml")
    assert e.value.field == field and units in e.value.message and "\n" not in str(e.value)


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d.pop("memory"), "nodes[0].device.memory"),
    (lambda d: d.update(peak_flops={}), "nodes[0].device.peak_flops"),
    (lambda d: d.update(peak_flops={"tf33": "1TFLOP/s"}), "nodes[0].device.peak_flops"),
    (lambda d: d.update(memroy="1GB"), "nodes[0].device"),
    (lambda d: d.update(achievable_fraction=3), "nodes[0].device.achievable_fraction"),
])
def test_bad_inline_device_names_the_field(mutate, field):
    d = copy.deepcopy(MIXED)
    mutate(d["nodes"][0]["device"])
    with pytest.raises(InputError) as e:
        cluster_from_dict(d)
    assert e.value.field == field


def test_a_unitless_latency_in_a_cluster_file_is_refused():
    d = copy.deepcopy(MIXED)
    d["inter_node"]["latency"] = 3  # once silently 3 seconds: an 86,690 s step
    with pytest.raises(InputError, match="no unit") as e:
        cluster_from_dict(d)
    assert e.value.field == "inter_node.latency"


def test_suggestions_rank_the_family_the_user_named():
    names = [*CATALOGUE, "CPU"]
    h100 = nearest("H100", names)
    assert h100 and all(n.startswith("H100") for n in h100)
    assert set(h100) == {n for n in names if n.startswith("H100")}
    assert set(nearest("A100", names)) == {n for n in names if n.startswith("A100")}
    assert nearest("V10", names)[0].startswith("V100")


def test_node_group_overrides_survive_the_study_record():
    from autotune.specs.cluster import cluster_from_record

    d = copy.deepcopy(MIXED)
    d["nodes"][1].update(framework_reserve="3GiB", attention="materialized")
    c = cluster_from_dict(d)
    again = cluster_from_record(c.name, c.to_dict())
    assert again.groups == c.groups
    assert again.groups[1].device.framework_reserve_bytes == 3 * 2**30
