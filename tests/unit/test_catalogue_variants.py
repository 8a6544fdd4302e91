"""Catalogue precisions (fp32 = TF32 where there are tensor cores, fp32-strict the CUDA-core peak),
memory variants, the framework reserve and the attention implementation as cluster-file terms."""


import pytest

from autotune.cost.memory import RESERVE_FRACTION, reserve
from autotune.errors import InputError
from autotune.specs.catalogue import ALIASES, CATALOGUE, FRAMEWORK_RESERVE, device_from_catalogue, local_cpu
from autotune.specs.cluster import cluster_from_dict

VARIANTS = [("V100-16GB", "V100"), ("A100-40GB", "A100-80GB"), ("A100-PCIe-40GB", "A100-PCIe-80GB")]


def test_every_entry_prices_both_fp32s_and_strict_never_exceeds_tf32():
    for d in CATALOGUE.values():
        assert {"fp32", "fp32-strict", "fp16"} <= set(d.peak_flops), d.name
        assert d.flops("fp32-strict") <= d.flops("fp32") <= d.flops("fp16"), d.name
        assert d.sm_count > 0 and d.name in d.source or d.source


def test_tf32_is_what_fp32_means_from_ampere_on():
    # Volta has no TF32: both fp32s are the CUDA-core peak; Ampere/Hopper fp32 is the TF32 tensor peak,
    # half of the 16-bit tensor peak on every such NVIDIA part (the datasheets' ratio)
    for name in ("V100", "V100-16GB"):
        d = CATALOGUE[name]
        assert d.flops("fp32") == d.flops("fp32-strict")
    for name in ("A100-40GB", "A100-80GB", "H100-SXM", "H100-NVL", "H200", "L40S", "A10"):
        d = CATALOGUE[name]
        assert d.flops("fp32") == pytest.approx(d.flops("bf16") / 2, rel=0.02)
        assert d.flops("fp32") > 1.9 * d.flops("fp32-strict")  # Ada parts: 2x, data-centre parts: 7-8x
    a100, v100 = CATALOGUE["A100-40GB"], CATALOGUE["V100-16GB"]
    # issue 18: the old fp32 ratio was 19.5/15.7 = 1.24 against ~3.4 measured end to end
    assert a100.flops("fp32") / v100.flops("fp32") > 3.4
    assert a100.flops("fp32-strict") / v100.flops("fp32-strict") == pytest.approx(19.5 / 15.7)


@pytest.mark.parametrize("small,large", VARIANTS)
def test_memory_variants_share_the_chip_and_differ_in_memory(small, large):
    a, b = CATALOGUE[small], CATALOGUE[large]
    assert a.memory_bytes < b.memory_bytes
    assert a.sm_count == b.sm_count and a.peak_flops == b.peak_flops
    for d in (a, b, CATALOGUE["H100-SXM"], CATALOGUE["H100-NVL"]):
        if d.memory_source:  # as the device reports it (nvidia-smi's MiB), near the product name's GB
            assert f"{d.memory_bytes / 2**20:.0f}MiB" in d.memory_source
            sheet = float(d.memory_source.split("datasheet's ")[1].rstrip("GB"))
            assert f"{sheet:g}GB" in d.source.replace(" ", "")
            assert abs(d.memory_bytes / 1e9 - sheet) < 0.1 * sheet
        else:
            assert f"{d.memory_bytes / 1e9:.0f}GB" in d.source.replace(" ", "")


def test_aliases_resolve_and_unknown_names_still_suggest():
    assert device_from_catalogue("V100-32GB") is CATALOGUE["V100"]
    assert device_from_catalogue("v100-16gb") is CATALOGUE["V100-16GB"]
    assert all(v in CATALOGUE for v in ALIASES.values())
    with pytest.raises(InputError, match="did you mean"):
        device_from_catalogue("V100-16G")


def test_local_cpu_has_no_tensor_cores():
    c = local_cpu(2)
    assert c.flops("fp32") == c.flops("fp32-strict")


def _group(**extra):
    return {"nodes": [{"devices_per_node": 2, "device": "A100-40GB", **extra}]}


def test_framework_reserve_is_a_named_term_overridable_in_the_cluster_file():
    default = cluster_from_dict(_group()).devices[0].spec
    assert default.framework_reserve() == FRAMEWORK_RESERVE["cuda"]
    three = cluster_from_dict(_group(framework_reserve="3GB")).devices[0].spec
    assert three.framework_reserve() == 3e9
    assert reserve(three, 1e9) == pytest.approx(3e9 + RESERVE_FRACTION * 1e9)
    assert cluster_from_dict(_group(framework_reserve=0)).devices[0].spec.framework_reserve() == 0.0
    with pytest.raises(InputError) as e:
        cluster_from_dict(_group(framework_reserve="lots"))
    assert e.value.field == "nodes[0].framework_reserve"


def test_attention_implementation_follows_the_cluster_file():
    assert cluster_from_dict(_group()).devices[0].spec.fused_attention()
    assert not cluster_from_dict(_group(attention="materialized")).devices[0].spec.fused_attention()
    assert not local_cpu(1).fused_attention()
    with pytest.raises(InputError) as e:
        cluster_from_dict(_group(attention="flash3"))
    assert e.value.field == "nodes[0].attention"


def test_attention_implementation_changes_the_estimated_memory():
    # materialised scores keep Korthikanti et al.'s 5*a*s^2*b bytes per block, fused kernels the fp32
    # log-sum-exp (4 bytes per query and head): the difference per block, times the layers
    from _cost_helpers import GELU

    from autotune.cost import estimate
    from autotune.plan import parse_inline

    s, b = 128, 2
    mem = {}
    for impl in ("fused", "materialized"):
        c = cluster_from_dict({"nodes": [{"devices_per_node": 1, "device": "A100-80GB", "attention": impl}]})
        est = estimate(parse_inline(f"dp=1,mbs={b}"), GELU, c, s, 4)
        mem[impl] = est.breakdown["ranks"][0]["memory"]["activations"]
    per_block = 5 * GELU.heads * s * s * b - 4 * GELU.heads * s * b
    assert mem["materialized"] - mem["fused"] == pytest.approx(GELU.layers * per_block)


def test_search_on_a_v100_cluster_takes_fp16_where_bf16_is_missing(tmp_path, capsys):
    # V100s have no bf16: --dtype auto (the default) searches fp16, an explicit bf16 is refused up front
    import json
    import sys

    from autotune.cli import main

    c = tmp_path / "v.yaml"
    c.write_text("nodes:\n  - {count: 1, devices_per_node: 2, device: V100-16GB}\n")

    def run(*extra):
        old, sys.argv = sys.argv, ["autotune", "search", "-m", "tiny", "-c", str(c), "-s", "128", "-b", "4", "-n", "3",
                                   "--storage", f"sqlite:///{tmp_path}/s.db", "--json", *extra]
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            sys.argv = old
        return code, capsys.readouterr().out

    code, out = run()
    assert code == 0 and json.loads(out)["best"]["dtype"] == "fp16"
    code, out = run("--dtype", "bf16")
    assert code == 2 and "bf16" in json.loads(out)["error"]["message"]
