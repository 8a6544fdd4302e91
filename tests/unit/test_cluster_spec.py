import pytest
import yaml

from autotune.errors import InputError
from autotune.specs.catalogue import CATALOGUE
from autotune.specs.cluster import cluster_from_dict, load_cluster, local_cluster

MIXED = {
    "name": "mixed-h100-a100",
    "nodes": [
        {"count": 2, "devices_per_node": 8, "device": "H100-SXM",
         "intra_node": {"bandwidth": "450GB/s", "latency": "3us"}},
        {"count": 2, "devices_per_node": 8, "device": "A100-80GB", "intra_node": {"bandwidth": "300GB/s"}},
    ],
    "inter_node": {"bandwidth": "25GB/s", "latency": "10us"},
    "overrides": [{"nodes": [0, 3], "bandwidth": "5GB/s", "latency": "50us"}],
}

REQUIRED_DEVICES = ["H100-SXM", "H100-PCIe", "H200", "H20", "A100-40GB", "A100-80GB", "L40S", "L4", "A10",
                    "RTX-4090", "V100", "MI300X"]


def test_catalogue_has_required_devices_with_sources():
    for name in REQUIRED_DEVICES:
        d = CATALOGUE[name]
        assert d.provenance == "datasheet" and d.source and d.memory_bytes > 0 and d.peak_flops


def test_mixed_cluster_devices_and_links(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(MIXED))
    c = load_cluster(p)
    assert c.num_devices == 32 and c.num_nodes == 4
    assert c.devices[0].spec.name == "H100-SXM" and c.devices[31].spec.name == "A100-80GB"
    assert c.link(0, 1).bandwidth == 450e9 and c.link(0, 1).latency == 3e-6
    assert c.link(16, 17).bandwidth == 300e9
    assert c.link(0, 8).bandwidth == 25e9 and c.link(0, 8).kind == "inter"
    assert c.link(0, 24).bandwidth == 5e9  # override between node 0 and node 3
    assert c.slowest_link([0, 1, 8]).bandwidth == 25e9
    assert c.digest


def test_local_cluster_is_cpu_and_says_derived():
    c = local_cluster(2)
    assert c.num_devices == 2
    assert c.devices[0].spec.provenance in ("derived", "datasheet")
    assert load_cluster("local:3").num_devices == 3


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d.update(nodes=[]), "nodes"),
    (lambda d: d["nodes"][0].update(device="H10"), "nodes[0].device"),
    (lambda d: d["nodes"][0].update(devices_per_node=-1), "nodes[0].devices_per_node"),
    (lambda d: d["nodes"][1]["intra_node"].update(bandwidth="fast"), "nodes[1].intra_node.bandwidth"),
    (lambda d: d["inter_node"].update(latency="soon"), "inter_node.latency"),
    (lambda d: d["overrides"][0].update(nodes=[0, 9]), "overrides"),
])
def test_bad_cluster_fields(mutate, field):
    import copy

    d = copy.deepcopy(MIXED)
    mutate(d)
    with pytest.raises(InputError) as e:
        cluster_from_dict(d, source="c.yaml")
    assert e.value.field == field and e.value.source == "c.yaml"


def test_unknown_device_suggests():
    with pytest.raises(InputError, match="did you mean"):
        cluster_from_dict({"nodes": [{"devices_per_node": 1, "device": "H100"}]})


def test_profile_device_without_store_or_unknown_id_is_input_error(tmp_path):
    with pytest.raises(InputError):
        cluster_from_dict({"nodes": [{"devices_per_node": 1, "device": "profile:999999"}]},
                          storage=f"sqlite:///{tmp_path}/x.db")


def test_yaml_that_does_not_parse(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("nodes: [\n  - {count: 2,")
    with pytest.raises(InputError, match="does not parse"):
        load_cluster(p)
