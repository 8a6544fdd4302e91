"""Other planners' per-layer profiles read into layer profiles (profilers/foreign/): files written
here in each format with the structure (and figures) of the repositories' own examples, checked
against what each format's numbers mean, plus broken files -> one InputError naming the file."""

import json

import pytest
import yaml
from helpers.cli import cli

from autotune.errors import InputError
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model
from profilers import store
from profilers.foreign import ImportContext, read_foreign

# OPT-350M (Sailor's and the model): 24 layers, hidden 1024, 16 heads, vocab 50272
OPT350 = {"name": "opt-350m", "layers": 24, "hidden": 1024, "heads": 16, "ffn_hidden": 4096, "vocab": 50272,
          "activation": "gelu", "norm": "layernorm", "position": "learned", "max_positions": 2048, "bias": True}
# Metis' example GPT-3 (profile_data_samples/): 8 blocks of hidden 2048 (202383360 parameter bytes each)
GPT_METIS = {"name": "gpt3-1.5b", "layers": 8, "hidden": 2048, "heads": 16, "ffn_hidden": 8192, "vocab": 48000,
             "activation": "gelu", "norm": "layernorm", "position": "learned", "max_positions": 2048, "bias": True}
LLAMA2 = load_model("llama2-7b")


def _model(tmp_path, spec):
    p = tmp_path / f"{spec['name']}.yaml"
    p.write_text(yaml.safe_dump(spec))
    return load_model(str(p))




# ---- Sailor ------------------------------------------------------------------------------------
def _sailor_table(mbs, tp):
    # sailor/Planner/sailor_planner/profiles/OPT-350/V100-16/profile.json, mbs 1 tp 1 (seconds):
    # "0": [0.000445, 3e-06, 0.004854], "1".."24": [0.00779, 0.017197, ...], "25": [0.018638, 0.030124, ...]
    f = mbs / tp
    t = {"0": [0.000445 * f, 3e-06, 0.004854 / tp]}
    for i in range(1, 25):
        t[str(i)] = [0.00779 * f * (1.02 if i == 1 else 1.0), 0.017197 * f, 0.004854 / tp]
    t["25"] = [0.018638 * f, 0.030124 * f, 0.004854 / tp]
    return t


def _sailor_file(tmp_path, gpu="V100-16"):
    d = tmp_path / "profiles" / "OPT-350" / gpu
    d.mkdir(parents=True)
    p = d / "profile.json"
    p.write_text(json.dumps({str(m): {str(t): _sailor_table(m, t) for t in (1, 2, 4)} for m in (1, 2, 4)}))
    return p


def test_sailor_gathered_profile(tmp_path):
    model = _model(tmp_path, OPT350)
    doc = read_foreign("sailor", [_sailor_file(tmp_path)], ImportContext(model=model, seq=2048, dtype="fp16"))
    assert doc["device_name"] == "V100-16GB" and doc["origin"] == "sailor" and doc["dtype"] == "fp16"
    assert len(doc["points"]) == 3 * 3 * 3
    pts = {(p["piece"], p["tp"], p["micro_batch"]): p for p in doc["points"]}
    for m in (1, 2, 4):
        for t in (1, 2, 4):
            table = _sailor_table(m, t)
            # the block is the transformer layers' typical entry, not the first layer's warm-up-skewed one
            assert pts["block", t, m]["fwd_s"] == pytest.approx(table["2"][0])
            assert pts["block", t, m]["bwd_s"] == pytest.approx(table["2"][1])
            assert pts["embed", t, m]["fwd_s"] == pytest.approx(table["0"][0])
            assert pts["head", t, m]["fwd_s"] + pts["head", t, m]["bwd_s"] == pytest.approx(sum(table["25"][:2]))
            assert pts["head", t, m]["seq"] == 2048
    stored = store.load_layer_profile(store.save_layer_profile(doc, f"sqlite:///{tmp_path}/s.db"),
                                      f"sqlite:///{tmp_path}/s.db")
    assert stored["points"] == json.loads(json.dumps(doc["points"]))


def test_sailor_per_run_file_with_memory(tmp_path):
    model = _model(tmp_path, OPT350)
    mem = {str(i): {"params_bytes": 50384896, "act_mem_bytes": 360726528} for i in range(26)}
    mem["0"] = {"params_bytes": 214433792, "act_mem_bytes": 8388608}
    p = tmp_path / "profile_OPT-350_A100-40_1_1.json"
    p.write_text(json.dumps({"timing": _sailor_table(1, 1), "memory": mem}))
    doc = read_foreign("sailor", [p], ImportContext(model=model, seq=2048, dtype="fp16"))
    block = next(x for x in doc["points"] if x["piece"] == "block")
    assert doc["device_name"] == "A100-40GB" and block["activation_bytes"] == 360726528
    # Sailor's runs are fp32: the profile labelled fp16 says its activation bytes are fp32's (issue 39 item 10)
    said = [a for a in doc["meta"]["assumed"] if a.startswith("activation bytes measured in fp32")]
    assert len(said) == 1 and "labelled" in said[0] and "fp16" in said[0], doc["meta"]["assumed"]
    fp32 = read_foreign("sailor", [p], ImportContext(model=model, seq=2048, dtype="fp32"))
    assert not any("measured in" in a for a in fp32["meta"]["assumed"])  # labelled as measured: nothing to say


def test_sailor_llama_final_norm_joins_the_head(tmp_path):
    t = _sailor_table(1, 1)
    t["25"], t["26"] = [0.0001, 0.0002, 0.0], t["25"]  # LLaMA: the RMSNorm gets its own key before the head
    p = tmp_path / "profiles" / "x" / "A100-80"
    p.mkdir(parents=True)
    (p / "profile.json").write_text(json.dumps({"1": {"1": t}}))
    doc = read_foreign("sailor", [p / "profile.json"], ImportContext(model=_model(tmp_path, OPT350), seq=2048,
                                                                     dtype="bf16"))
    head = next(x for x in doc["points"] if x["piece"] == "head")
    assert head["fwd_s"] == pytest.approx(0.018638 + 0.0001)


# ---- Metis -------------------------------------------------------------------------------------
METIS_BLOCK_MS = {(1, 1): 29.507994651794434, (2, 1): 16.83783531188965, (1, 2): 58.86340141296387}
"""layer_compute_total_ms of a block in profile_data_samples/DeviceType.A100_tp{T}_bs{B}.json."""


def _metis_file(tmp_path, tp, bs, device="A100"):
    ms = METIS_BLOCK_MS[tp, bs]
    doc = {"model": {"model_name": "GPT3", "num_layers": 10, "parameters": {
        "total_parameters_bytes": 2405502976,
        "parameters_per_layer_bytes": [393216000] + [202383360] * 8 + [393220096]}},
        "execution_time": {"total_time_ms": 336.2, "forward_backward_time_ms": 292.8, "batch_generator_time_ms": 0.9,
                           "layernorm_grads_all_reduce_time_ms": 0.02, "embedding_grads_all_reduce_time_ms": 0.04,
                           "optimizer_time_ms": 39.3, "layer_compute_total_ms": [0.2892] + [ms] * 8 + [0.4101]},
        "execution_memory": {"total_memory": 53120, "layer_memory_total_mb": [7820] + [4146] * 8 + [12132]}}
    p = tmp_path / f"DeviceType.{device}_tp{tp}_bs{bs}.json"
    p.write_text(json.dumps(doc))
    return p


def test_metis_profiles(tmp_path):
    model = _model(tmp_path, GPT_METIS)
    files = [_metis_file(tmp_path, t, b) for t, b in METIS_BLOCK_MS]
    doc = read_foreign("metis", files, ImportContext(model=model, seq=1024, dtype="fp16", device="A100-40GB"))
    for (t, b), ms in METIS_BLOCK_MS.items():
        blk = next(p for p in doc["points"] if (p["piece"], p["tp"], p["micro_batch"]) == ("block", t, b))
        assert blk["fwd_s"] + blk["bwd_s"] == pytest.approx(ms / 1e3)  # Metis: forward + backward, ms
        assert blk["bwd_s"] == pytest.approx(2 * blk["fwd_s"])
        assert blk["memory_total_bytes"] == 4146 * 2**20 and blk["param_bytes"] == 202383360
    assert any("1/3" in a for a in doc["meta"]["assumed"])


def test_metis_needs_a_catalogue_device(tmp_path):
    model = _model(tmp_path, GPT_METIS)
    with pytest.raises(InputError) as e:  # "A100" alone: 40 or 80 GB?
        read_foreign("metis", [_metis_file(tmp_path, 1, 1)], ImportContext(model=model, seq=1024, dtype="fp16"))
    assert e.value.field == "--device"
    doc = read_foreign("metis", [_metis_file(tmp_path, 1, 2, device="A100-80GB")],
                       ImportContext(model=model, seq=1024, dtype="fp16"))
    assert doc["device_name"] == "A100-80GB"


# ---- Galvatron ---------------------------------------------------------------------------------
# galvatron/models/gpt/configs/computation_profiling_bf16_llama2-7b_all.json (ms)
GALV_RAW = {2: {1: 15.0786208152771, 2: 24.93551368713379, 4: 45.43589096069336},
            4: {1: 23.87112617492676, 2: 42.117263793945305, 4: 78.43060150146484}}


def _galvatron_files(tmp_path):
    comp = {}
    for n, by_b in GALV_RAW.items():
        for b, ms in by_b.items():
            comp[f"layernum[{n}]_bsz{b}_seq2048"] = ms
    for b in (1, 2, 4):  # what Galvatron's _process_computation_data writes from the raw runs
        per_layer = (GALV_RAW[4][b] - GALV_RAW[2][b]) / b / (4 - 2)
        comp[f"layertype_0_bsz{b}_seq2048"] = per_layer
        comp[f"layertype_other_bsz{b}_seq2048"] = max((GALV_RAW[2][b] - 2 * per_layer * b) / b, 0)
    c = tmp_path / "computation_profiling_bf16_llama2-7b_all.json"
    c.write_text(json.dumps(comp, indent=4))
    mem = {"1_1_8_sp": {"layernum[1]_bsz8_seq2048_rank0_ms": 904.33, "layernum[1]_bsz8_seq2048_rank0_act": 828.6},
           "layertype_0_sp": {"2048": {"parameter_size": 778.2236328125, "tp_activation_per_bsz_dict": {
               "1": 514.5634765625, "2": 273.28173828125, "4": 136.885498046875, "8": 68.3204345703125,
               "checkpoint": 32.0}}},
           "other_memory_pp_off_sp": {"2048": {"model_states": {"1": 4130.3}, "activation": {"1": 841.6}}}}
    m = tmp_path / "memory_profiling_bf16_llama2-7b_all.json"
    m.write_text(json.dumps(mem, indent=4))
    return c, m


def test_galvatron_profiles_against_the_raw_runs(tmp_path):
    c, m = _galvatron_files(tmp_path)
    doc = read_foreign("galvatron", [c, m], ImportContext(model=LLAMA2, device="A100-80GB"))
    assert doc["dtype"] == "bf16" and doc["device_name"] == "A100-80GB"
    for b in (1, 2, 4):
        blk = next(p for p in doc["points"] if (p["piece"], p["micro_batch"]) == ("block", b))
        # a layer's forward per micro-batch = the time two more layers added to the raw run, halved
        assert blk["fwd_s"] == pytest.approx((GALV_RAW[4][b] - GALV_RAW[2][b]) / 2 / 1e3)
        assert blk["bwd_s"] == pytest.approx(2 * blk["fwd_s"]) and blk["seq"] == 2048 and blk["tp"] == 1
        assert blk["activation_bytes"] == pytest.approx(514.5634765625 * 2**20 * b)
        head = next(p for p in doc["points"] if (p["piece"], p["micro_batch"]) == ("head", b))
        assert head["fwd_s"] + 2 * blk["fwd_s"] == pytest.approx(GALV_RAW[2][b] / 1e3)
    assert not any(p["piece"] == "embed" for p in doc["points"])
    assert doc["meta"]["memory"]["2048"]["block_activation_bytes_per_sample"]["8"] == pytest.approx(68.3204345703125 * 2**20)
    assert not any("measured in" in a for a in doc["meta"]["assumed"])
    relabelled = read_foreign("galvatron", [c, m], ImportContext(model=LLAMA2, device="A100-80GB", dtype="fp32"))
    assert any(a.startswith("activation bytes measured in bf16") and "labelled" in a
               for a in relabelled["meta"]["assumed"]), relabelled["meta"]["assumed"]


# ---- broken files and the CLI ------------------------------------------------------------------
def test_bad_foreign_files_are_one_input_error(tmp_path):
    model = _model(tmp_path, OPT350)
    ctx = ImportContext(model=model, seq=2048, dtype="fp16")
    notjson = tmp_path / "profile.json"
    notjson.write_text("{not json")
    cases = [("sailor", notjson, None)]
    short = tmp_path / "short" / "A100-40"
    short.mkdir(parents=True)
    (short / "profile.json").write_text(json.dumps({"1": {"1": {"0": [0.1, 0.1, 0], "1": [0.2, 0.2, 0]}}}))
    cases.append(("sailor", short / "profile.json", None))
    badnum = tmp_path / "n" / "A100-40"
    badnum.mkdir(parents=True)
    t = _sailor_table(1, 1)
    t["3"] = ["fast", 0.1, 0.0]
    (badnum / "profile.json").write_text(json.dumps({"1": {"1": t}}))
    cases.append(("sailor", badnum / "profile.json", "1.1.3[0]"))
    misnamed = tmp_path / "A100_tp1.json"
    misnamed.write_text("{}")
    cases.append(("metis", misnamed, None))
    galv = tmp_path / "computation_profiling_fp16_x_all.json"
    galv.write_text(json.dumps({"layertype_0_bsz1_seq2048": "slow"}))
    cases.append(("galvatron", galv, "layertype_0_bsz1_seq2048"))
    for fmt, path, field in cases:
        with pytest.raises(InputError) as e:
            read_foreign(fmt, [path], ImportContext(model=model, seq=2048, dtype="fp16", device="A100-40GB")
                         if fmt != "sailor" else ctx)
        assert e.value.source == str(path) and "\n" not in e.value.message, (fmt, e.value.message)
        if field:
            assert e.value.field == field
    with pytest.raises(InputError) as e:
        read_foreign("sailor", [_sailor_file(tmp_path)], ImportContext(model=model, dtype="fp16"))
    assert e.value.field == "--seq"


def test_cli_imports_each_format_and_refuses_bad_input(capsys, tmp_path):
    url = f"sqlite:///{tmp_path}/f.db"
    mfile = tmp_path / "opt.yaml"
    mfile.write_text(yaml.safe_dump(OPT350))
    code, out, err = cli(capsys, "profile", "import", "--format", "sailor", str(_sailor_file(tmp_path)),
                         "--model", str(mfile), "--seq", "2048", "--dtype", "fp16", "--storage", url, "--json")
    assert code == 0, err
    assert json.loads(out)["id"] == "layers:1" and json.loads(out)["device"] == "V100-16GB"
    c, m = _galvatron_files(tmp_path)
    code, out, err = cli(capsys, "profile", "import", "--format", "galvatron", str(c), str(m), "--model", "llama2-7b",
                         "--device", "A100-80GB", "--storage", url)
    assert code == 0, err
    gm = tmp_path / "g.yaml"
    gm.write_text(yaml.safe_dump(GPT_METIS))
    code, out, err = cli(capsys, "profile", "import", "--format", "metis", str(_metis_file(tmp_path, 1, 1)),
                         "--model", str(gm), "--seq", "1024", "--dtype", "fp16", "--device", "A100-40GB",
                         "--storage", url)
    assert code == 0, err
    assert [r["origin"] for r in store.list_layer_profiles(url)] == ["sailor", "galvatron", "metis"]
    for args in (["--format", "amp", str(c)], ["--format", "sailor", str(c), "--seq", "2048", "--dtype", "fp16"],
                 ["--format", "galvatron", str(c), "--model", "llama2-7b"],
                 ["--format", "metis", str(tmp_path / "missing.json"), "--model", "llama2-7b", "--seq", "1"]):
        code, out, err = cli(capsys, "profile", "import", *args, "--storage", url)
        assert code == 2 and err.strip().count("\n") == 0, (args, err)
    assert len(store.list_layer_profiles(url)) == 3  # nothing half-stored


def test_sailors_published_profiles_price_the_estimate(tmp_path):
    # Sailor's own OPT-350 measurements (benchmarks/data/sailor, MIT) imported, attached to the
    # cluster file, and read back by the cost model at a measured point
    from pathlib import Path

    from autotune.cost.layers import predicted_pieces
    from autotune.plan import parse_inline

    data = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "sailor" / "OPT-350"
    url = f"sqlite:///{tmp_path}/s.db"
    model = _model(tmp_path, OPT350)
    ids = {}
    for gpu in ("A100-40", "V100-16"):
        doc = read_foreign("sailor", [data / gpu / "profile.json"], ImportContext(model=model, seq=2048, dtype="fp32"))
        ids[doc["device_name"]] = store.save_layer_profile(doc, url)
    assert set(ids) == {"A100-40GB", "V100-16GB"}
    for dev, gpu in (("A100-40GB", "A100-40"), ("V100-16GB", "V100-16")):
        c = cluster_from_dict({"nodes": [{"devices_per_node": 2, "device": dev, "layer_profile": f"layers:{ids[dev]}"}]},
                              storage=url)
        raw = json.loads((data / gpu / "profile.json").read_text())["4"]["2"]
        got = predicted_pieces(parse_inline("tp=2,mbs=4,dtype=fp32"), model, c, 2048, 4)
        assert got["block"].fwd == pytest.approx(raw["2"][0]) and got["block"].bwd == pytest.approx(raw["2"][1])
        assert got["head"].fwd == pytest.approx(raw["25"][0])
        assert got["block"].source == f"layers:{ids[dev]} (sailor), measured"
        # between measured micro-batches: between the neighbours' times
        mid = predicted_pieces(parse_inline("tp=2,mbs=3,dtype=fp32"), model, c, 2048, 3)["block"]
        lo, hi = (json.loads((data / gpu / "profile.json").read_text())[b]["2"]["2"][0] for b in ("2", "4"))
        assert lo < mid.fwd < hi and "interpolated" in mid.source


@pytest.mark.parametrize("key,yaml_name,gpu,tp,mbs", [("OPT-350", "opt-350m.yaml", "A100-40", 1, 2),
                                                     ("OPT-350", "opt-350m.yaml", "V100-16", 2, 4),
                                                     ("GPT-Neo-2.7", "gpt-neo-2.7b.yaml", "A100-40", 1, 1)])
def test_sailors_model_description_carries_activation_memory_to_the_estimate(tmp_path, key, yaml_name, gpu, tp, mbs):
    """Sailor's llm_info.json (benchmarks/data/sailor, the repository's file for these two models):
    imported with the timing profile, every block point carries act_mem_bytes x micro-batch, and the
    memory model prices one block's activations per micro-batch at that figure (issue 25: within 15%
    of what a foreign profile carries), where the formula alone says more."""
    from pathlib import Path

    from autotune.cost import estimate
    from autotune.plan import parse_inline

    data = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
    info = json.loads((data / "sailor" / "llm_info.json").read_text())[key]
    model = load_model(str(data / yaml_name))
    doc = read_foreign("sailor", [data / "sailor" / key / gpu / "profile.json", data / "sailor" / "llm_info.json"],
                       ImportContext(model=model, seq=2048, dtype="fp32"))
    for p in doc["points"]:
        want = {"embed": "0", "block": "2", "head": str(model.layers + 1)}[p["piece"]]
        assert p["activation_bytes"] == info[str(p["tp"])][want]["act_mem_bytes"] * p["micro_batch"]
    assert any("x micro-batch" in a for a in doc["meta"]["assumed"])
    url = f"sqlite:///{tmp_path}/s.db"
    lid = store.save_layer_profile(doc, url)
    nodes = {"devices_per_node": tp, "device": doc["device_name"], "attention": "materialized"}
    plain = cluster_from_dict({"nodes": [nodes]})
    measured = cluster_from_dict({"nodes": [{**nodes, "layer_profile": f"layers:{lid}"}]}, storage=url)
    plan = parse_inline(f"tp={tp},mbs={mbs},dtype=fp32")
    figure = info[str(tp)]["2"]["act_mem_bytes"] * mbs
    got = estimate(plan, model, measured, 2048, 4 * mbs).breakdown["ranks"][0]
    formula = estimate(plan, model, plain, 2048, 4 * mbs).breakdown["ranks"][0]
    assert got["memory"]["activation_per_layer_microbatch"] == pytest.approx(figure, rel=0.15)
    # the formula alone (every saved tensor, dropout masks, scores and softmax: docs/validation.md)
    # is not within 15% of it: what the import changes
    assert formula["memory"]["activation_per_layer_microbatch"] > 1.15 * figure
    src = estimate(plan, model, measured, 2048, 4 * mbs).breakdown["activation_source"][doc["device_name"]]
    assert src.startswith(f"layers:{lid} (sailor)")


def test_sailors_model_description_alone_is_refused(tmp_path):
    from pathlib import Path

    data = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
    with pytest.raises(InputError) as e:
        read_foreign("sailor", [data / "sailor" / "llm_info.json"],
                     ImportContext(model=load_model(str(data / "opt-350m.yaml")), seq=2048, dtype="fp32"))
    assert "memory only" in e.value.message


def test_metis_memory_per_layer_reaches_the_estimate(tmp_path):
    """Metis' per-layer memory (activations + gradients + optimizer states, its example files'
    4146 MiB a block at tp 1, bs 1): the activation part left after the layer's model states as this
    cost model counts them, so the memory model's layer adds up to Metis' figure (within 15%)."""
    from autotune.cost import estimate
    from autotune.cost.memory import state_bytes_per_param
    from autotune.plan import parse_inline

    model = _model(tmp_path, GPT_METIS)
    doc = read_foreign("metis", [_metis_file(tmp_path, 1, 1)], ImportContext(model=model, seq=1024, dtype="fp16",
                                                                               device="A100-40GB"))
    blk = next(p for p in doc["points"] if p["piece"] == "block")
    per_param = sum(state_bytes_per_param("fp16"))
    # Metis' parameter bytes are 4 a parameter (202383360: the 50.6M of a hidden-2048 block)
    assert blk["activation_bytes"] == pytest.approx(4146 * 2**20 - 202383360 / 4 * per_param)
    url = f"sqlite:///{tmp_path}/m.db"
    lid = store.save_layer_profile(doc, url)
    c = cluster_from_dict({"nodes": [{"devices_per_node": 1, "device": "A100-40GB", "layer_profile": f"layers:{lid}"}]},
                          storage=url)
    mem = estimate(parse_inline("dp=1,dtype=fp16,zero=0"), model, c, 1024, 4).breakdown["ranks"][0]["memory"]
    layer = mem["activation_per_layer_microbatch"] + model.layer_params() * per_param
    assert layer == pytest.approx(4146 * 2**20, rel=0.15)
