"""The cost model prices measured layers first (autotune/cost/layers.py): a device's layer profile
sets the block, head and embedding times where the model and dtype match, interpolated over
micro-batch, sequence and shard, and every estimate says what priced each term."""

import dataclasses

import pytest
from _cost_helpers import device, one_node

from autotune.cost import estimate
from autotune.cost.layers import LayerTable
from autotune.errors import InputError
from autotune.plan import parse_inline
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model
from profilers import store
from profilers.layers import LAYER_DOC_KIND, LAYER_SCHEMA_VERSION, model_dict

SMALL = load_model("small")
C = {"block": 1e-6, "head": 3e-7, "embed": 2e-8}
"""Seconds per (sample x token^p) of each piece in the synthetic profile."""


def law(piece, b, s, t, p=1.0):
    # a power law in every variable: log-log interpolation must reproduce it exactly off the grid
    return C[piece] * b * s**p / (t if piece != "embed" else 1)


def _doc(model=SMALL, dtype="bf16", mbs=(1, 2, 8), seqs=(128, 512), tps=(1, 2, 8), lid=5, p=1.5):
    pts = [{"piece": pc, "tp": t, "micro_batch": b, "seq": s, "fwd_s": law(pc, b, s, t, p),
            "bwd_s": 2 * law(pc, b, s, t, p)}
           for pc in C for t in tps for b in mbs for s in seqs]
    return {"kind": LAYER_DOC_KIND, "schema_version": LAYER_SCHEMA_VERSION, "id": lid, "device_kind": "cuda",
            "device_name": "X", "model": model_dict(model), "dtype": dtype, "origin": "measured", "points": pts}


def test_power_laws_are_reproduced_between_and_beyond_the_grid():
    tab = LayerTable(_doc())
    for b, s, t in [(1, 128, 1), (4, 256, 4), (3, 200, 2), (8, 512, 8)]:
        hit = tab.lookup("block", b, s, t)
        assert hit.fwd == pytest.approx(law("block", b, s, t, 1.5), rel=1e-9)
        assert hit.bwd == pytest.approx(2 * hit.fwd)
    assert "measured" in tab.lookup("block", 2, 512, 2).source
    assert "interpolated" in tab.lookup("block", 4, 256, 4).source
    # beyond the largest micro-batch the time grows with the work (slope 1), beyond the shards 1/t
    hit = tab.lookup("block", 16, 512, 16)
    assert hit.fwd == pytest.approx(law("block", 16, 512, 16, 1.5)) and "extrapolated" in hit.source
    assert tab.lookup("embed", 2, 128, 16).fwd == pytest.approx(law("embed", 2, 128, 1, 1.5))


def test_a_measured_micro_batch_curve_makes_larger_batches_cheaper_per_sample():
    # per-sample time falling with the micro-batch (issue 18: A100 block 8.7 ms at mbs 1, 7.8 ms at 4)
    doc = _doc(mbs=(1, 4), seqs=(2048,), tps=(1,))
    for p in doc["points"]:
        if p["piece"] == "block":
            p["fwd_s"] = {1: 8.7e-3, 4: 4 * 7.8e-3}[p["micro_batch"]] / 3
            p["bwd_s"] = 2 * p["fwd_s"]
    tab = LayerTable(doc)
    per_sample = [tab.lookup("block", b, 2048, 1).fwd / b for b in (1, 2, 4)]
    assert per_sample[0] > per_sample[1] > per_sample[2]


def _small_cluster(doc):
    return one_node(1, dev=dataclasses.replace(device(), layer_profiles=(doc,)))


@pytest.mark.parametrize("b,g", [(1, 4), (2, 8)])
def test_estimate_prices_the_step_from_the_layer_profile(b, g):
    est = estimate(parse_inline(f"dp=1,mbs={b}"), SMALL, _small_cluster(_doc()), 512, g)
    m = g // b
    per_micro = (SMALL.layers * 3 * law("block", b, 512, 1, 1.5) + 3 * law("head", b, 512, 1, 1.5)
                 + 3 * law("embed", b, 512, 1, 1.5))
    assert est.breakdown["ranks"][0]["compute_s"] == pytest.approx(m * per_micro)
    src = est.breakdown["compute_source"]["X"]
    assert all(src[k].startswith("layers:5 (measured), measured") for k in ("embed", "block", "head"))


def test_fallbacks_when_the_profile_does_not_fit():
    doc = _doc()
    kernel = estimate(parse_inline("dp=1"), SMALL, one_node(1), 512, 4)
    # another dtype, another model shape, a context-parallel split: the kernel model prices it
    for cl, plan, model in [(_small_cluster(_doc(dtype="fp16")), "dp=1", SMALL),
                            (_small_cluster(_doc(model=load_model("tiny"))), "dp=1", SMALL)]:
        est = estimate(parse_inline(plan), model, cl, 512, 4)
        assert est.breakdown["ranks"][0]["compute_s"] == kernel.breakdown["ranks"][0]["compute_s"]
        assert est.breakdown["compute_source"]["X"]["block"] == "datasheet"
    cp = estimate(parse_inline("cp=2"), SMALL, one_node(2, dev=dataclasses.replace(device(), layer_profiles=(doc,))),
                  512, 4)
    assert cp.breakdown["compute_source"]["X"]["block"] == "datasheet"


def test_cluster_file_attaches_stored_layer_profiles(tmp_path):
    url = f"sqlite:///{tmp_path}/l.db"
    lid = store.save_layer_profile(_doc(), url)
    c = cluster_from_dict({"nodes": [{"devices_per_node": 1, "device": "A100-40GB",
                                      "layer_profile": f"layers:{lid}"}]}, storage=url)
    spec = c.devices[0].spec
    assert [d["id"] for d in spec.layer_profiles] == [lid]
    again = cluster_from_dict({k: v for k, v in c.to_dict().items() if k in ("name", "nodes", "inter_node")}
                              | {"nodes": [{k: v for k, v in n.items() if k != "provenance"}
                                           for n in c.to_dict()["nodes"]]}, storage=url)
    assert [d["id"] for d in again.devices[0].spec.layer_profiles] == [lid]
    for ref, msg in (("layers:99", "no layer profile 99"), ("profile:1", "expected layers:ID")):
        with pytest.raises(InputError) as e:
            cluster_from_dict({"nodes": [{"devices_per_node": 1, "device": "A100-40GB", "layer_profile": ref}]},
                              storage=url)
        assert e.value.field == "nodes[0].layer_profile" and msg in e.value.message


def test_a_profile_matches_only_the_architecture_it_measured():
    """A block with LayerNorm, biases and learned positions is another block: a profile that records
    them prices only that architecture; one that does not say (older documents) matches the shape."""
    from autotune.cost.layers import matches

    opt = dataclasses.replace(SMALL, norm="layernorm", bias=True, position="learned", max_positions=2048)
    assert matches(_doc(opt), opt, "bf16") and not matches(_doc(opt), SMALL, "bf16")
    assert matches(_doc(SMALL), SMALL, "bf16") and not matches(_doc(SMALL), opt, "bf16")
    older = _doc(SMALL)
    for k in ("norm", "bias", "position"):
        del older["model"][k]
    assert matches(older, SMALL, "bf16") and matches(older, opt, "bf16")
