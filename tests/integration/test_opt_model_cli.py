"""An OPT-shaped model file (LayerNorm, linear biases, learned positions, GELU, tied embeddings) end
to end through the CLI: its pieces profiled (`profile --layers`), the profile pricing it, a search
whose plans `validate` runs for real on local processes."""

from __future__ import annotations

import json

import pytest
from helpers.cli import cli, run_autotune

OPT_FILE = """\
name: opt-mini
layers: 4
hidden: 64
heads: 4
ffn_hidden: 256
vocab: 256
activation: gelu
norm: layernorm
position: learned
max_positions: 64
bias: true
tied_embeddings: true
"""

CLUSTER_FILE = """\
name: two-a100
nodes:
  - devices_per_node: 2
    device: A100-40GB
    layer_profile: {ref}
"""


@pytest.mark.slow
def test_opt_shaped_model_is_profiled_priced_and_validated(in_tmp, capsys):
    (in_tmp / "opt.yaml").write_text(OPT_FILE)
    code, out, err = cli(capsys, "profile", "--layers", "opt.yaml", "--device", "cpu", "--mbs", "1", "--seq", "16,32",
                         "--tp", "1,2", "--dtype", "fp32", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert {p["piece"] for p in doc["points"]} == {"embed", "block", "head"}
    assert {k: doc["model"][k] for k in ("norm", "bias", "position")} == {
        "norm": "layernorm", "bias": True, "position": "learned"}
    # a sequence longer than the position table is refused, not measured
    code, _, err = cli(capsys, "profile", "--layers", "opt.yaml", "--device", "cpu", "--seq", "128", "--tp", "1")
    assert code == 2 and "--seq" in err and "max_positions(64)" in err

    # the measured pieces price the model on a cluster that names the profile
    (in_tmp / "cl.yaml").write_text(CLUSTER_FILE.format(ref=doc["id"]))
    code, out, err = cli(capsys, "estimate", "--plan", "tp=2,dtype=fp32", "--model", "opt.yaml", "--cluster", "cl.yaml",
                         "--seq-len", "32", "--global-batch", "4", "--json")
    assert code == 0, err
    sources = json.loads(out)["breakdown"]["compute_source"]["A100-40GB"]
    assert all(sources[p].startswith(doc["id"]) for p in ("embed", "block", "head")), sources

    # search on this machine, then validate runs the best plan for real: no refusal of the model
    code, out, err = cli(capsys, "search", "--model", "opt.yaml", "--cluster", "local:4", "--seq-len", "32",
                         "--global-batch", "4", "--trials", "6", "--study", "opt", "--json")
    assert code == 0, err
    assert not any("cannot build" in n for n in json.loads(out).get("notes", [])), out
    r = run_autotune("validate", "--study", "opt", "--top", "1", "--steps", "1", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    assert not v["skipped"] and v["validated"][0]["measured"]["step_time_s"] > 0
