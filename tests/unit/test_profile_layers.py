"""Per-layer profiles: the runtime's own pieces timed (profilers/layers.py), stored beside the kernel
profiles with a schema version, exported and imported back, and the CLI around them."""

import json

import pytest
import torch
from helpers.cli import cli

from autotune.errors import InputError
from autotune.runtime.model import Block, StageModel, unsharded_layout
from autotune.specs.model import load_model
from profilers import store
from profilers.layers import LayerSweep, _Piece, profile_layers, shard_sizes

TINY = load_model("tiny")




@pytest.fixture(scope="module")
def doc():
    sweep = LayerSweep(micro_batches=(1, 2), seq_lens=(16, 128), tp=(1, 2), rounds=2, round_s=0.005)
    return profile_layers(TINY, "cpu", sweep)


def _pt(doc, piece, tp, b, s):
    return next(p for p in doc["points"] if (p["piece"], p["tp"], p["micro_batch"], p["seq"]) == (piece, tp, b, s))


def test_every_piece_shard_and_shape_is_measured(doc):
    keys = {(p["piece"], p["tp"], p["micro_batch"], p["seq"]) for p in doc["points"]}
    assert keys == {(pc, t, b, s) for pc in ("embed", "block", "head") for t in (1, 2) for b in (1, 2) for s in (16, 128)}
    for p in doc["points"]:
        assert p["fwd_s"] > 0 and p["fwd_bwd_s"] > 0 and p["bwd_s"] == pytest.approx(max(0.0, p["fwd_bwd_s"] - p["fwd_s"]))
    # 8x the tokens through a block costs more (thread CPU time: another process's load is not counted)
    for t in (1, 2):
        assert _pt(doc, "block", t, 2, 128)["fwd_bwd_s"] > _pt(doc, "block", t, 1, 16)["fwd_bwd_s"]


def test_a_shard_holds_its_share_of_the_runtime_blocks_weights(doc):
    # reference: the runtime's unsharded Block; norms are replicated, every matrix split over tp
    full = Block(TINY, unsharded_layout())
    norms = sum(p.numel() for n, p in full.named_parameters() if "norm" in n) * 4
    whole = sum(p.numel() for p in full.parameters()) * 4
    assert _pt(doc, "block", 1, 1, 16)["param_bytes"] == whole
    assert _pt(doc, "block", 2, 1, 16)["param_bytes"] == (whole - norms) / 2 + norms
    head = StageModel(TINY, unsharded_layout(), [], False, True, 16)
    assert _pt(doc, "head", 2, 1, 16)["param_bytes"] == (TINY.vocab * TINY.hidden) / 2 * 4 + TINY.hidden * 4
    assert sum(p.numel() for p in head.parameters()) * 4 == _pt(doc, "head", 1, 1, 16)["param_bytes"]


def test_activation_bytes_are_what_autograd_saves_and_scale_with_the_batch(doc):
    # weights and the rotary tables are state, not activations: what is left doubles with the batch
    for t in (1, 2):
        one, two = _pt(doc, "block", t, 1, 128)["activation_bytes"], _pt(doc, "block", t, 2, 128)["activation_bytes"]
        assert two == 2 * one
    p = _Piece("block", TINY, 1, 1, 16, "cpu", torch.float32)
    assert p.activation_bytes() >= 16 * TINY.hidden * 4 * 4  # at least the block input, both norms' inputs, ...
    assert p.activation_bytes() == _pt(doc, "block", 1, 1, 16)["activation_bytes"]


def test_shard_sizes_keep_only_even_splits():
    ok, notes = shard_sizes(TINY, (1, 2, 3, 4, 8))
    assert ok == (1, 2, 4) and len(notes) == 2 and "kv_heads" in notes[1]


def test_store_round_trip_and_schema(doc, tmp_path):
    url = f"sqlite:///{tmp_path}/p.db"
    lid = store.save_layer_profile(doc, url, label="t")
    back = store.load_layer_profile(f"layers:{lid}", url)
    assert back["points"] == json.loads(json.dumps(doc["points"]))
    assert back["model"] == doc["model"] and back["schema_version"] == doc["schema_version"]
    path = tmp_path / "l.json"
    path.write_text(json.dumps(back))
    kind, lid2 = store.import_any(path, url)
    assert kind == "layers" and lid2 != lid
    again = store.load_layer_profile(lid2, url)
    assert again["points"] == back["points"] and again["origin"] == "imported"
    assert [r["id"] for r in store.list_layer_profiles(url)] == [lid, lid2]


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d.update(schema_version=99), "schema_version"),
    (lambda d: d.update(kind="nope"), "kind"),
    (lambda d: d["points"][0].update(piece="mlp"), "points[0].piece"),
    (lambda d: d["points"][1].update(fwd_s=-1.0), "points[1].fwd_s"),
    (lambda d: d["points"][2].update(tp=0), "points[2].tp"),
    (lambda d: d.update(points=[]), "points"),
    (lambda d: d.pop("model"), "model"),
])
def test_bad_layer_documents_are_one_input_error(doc, tmp_path, mutate, field):
    bad = json.loads(json.dumps(doc))
    mutate(bad)
    url = f"sqlite:///{tmp_path}/p.db"
    with pytest.raises(InputError) as e:
        store.import_layer_doc(bad, url, source="bad.json")
    assert e.value.field == field and e.value.source == "bad.json"
    assert store.list_layer_profiles(url) == []  # nothing stored


def test_cli_layers_profile_export_import(capsys, tmp_path):
    url = f"sqlite:///{tmp_path}/c.db"
    code, out, err = cli(capsys, "profile", "--layers", "tiny", "--mbs", "1", "--seq", "16", "--tp", "1,3",
                         "--storage", url, "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["id"] == "layers:1" and len(res["points"]) == 3  # tp 3 does not divide tiny's heads: skipped
    assert any("tp 3 skipped" in n for n in res["meta"]["notes"])
    code, out, err = cli(capsys, "profile", "export", "layers:1", "-o", str(tmp_path / "x.json"), "--storage", url)
    assert code == 0, err
    code, out, err = cli(capsys, "profile", "import", str(tmp_path / "x.json"), "--storage", url, "--json")
    assert code == 0 and json.loads(out)["id"] == "layers:2"
    code, out, err = cli(capsys, "profile", "show", "layers:7", "--storage", url)
    assert code == 2 and "no layer profile 7" in err
    code, out, err = cli(capsys, "profile", "--layers", "tiny", "--mbs", "0", "--storage", url)
    assert code == 2 and "--mbs" in err


@pytest.mark.gpu
def test_the_same_code_times_the_pieces_on_cuda_with_events():
    sweep = LayerSweep(micro_batches=(1, 2), seq_lens=(128,), tp=(1, 2), dtype="bf16", rounds=2)
    d = profile_layers(TINY, "cuda", sweep)
    assert d["device_kind"] == "cuda" and len(d["points"]) == 3 * 2 * 2
    assert all(p["clock"] == "cuda" and p["fwd_s"] > 0 and p["activation_bytes"] > 0 for p in d["points"])
