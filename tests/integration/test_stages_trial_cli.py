"""`autotune trial -p plan.json` of SAILOR-shaped per-stage plans made for 8 A100 + 8 V100, scaled down
to this machine (``--nproc 4``: ``stages.scaled``) and run to completion with an OPT-350M-shaped
small model (24 layers, LayerNorm, biases, learned positions, GELU, tied embeddings); the training
is the same whatever the plan, so every step's loss equals a one-process trial's."""

from __future__ import annotations

import json

import pytest
from helpers.cli import run_autotune

pytestmark = pytest.mark.slow

OPT_SHAPED = """\
name: opt-350m-shaped
layers: 24
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
# device indices of the 16-GPU cluster: A100s 0-7, V100s 8-15
A100, V100 = list(range(8)), list(range(8, 16))


def _plan(*stages) -> dict:
    """stages: (layers, [devices of each replica]); a replica's tp is its device count."""
    return {"dtype": "fp32", "schedule": "1f1b", "zero_stage": 1, "micro_batch_size": 1,
            "stages": [{"layers": n, "replicas": [{"tp": len(d), "devices": d} for d in reps]} for n, reps in stages]}


PLANS = {
    # SAILOR's mixed replicas: a first stage of 3 A100 tp=1 replicas beside 2 V100 tp=4 replicas, a
    # second of 5 A100 tp=1 replicas (the OPT plan, on 8+8)
    "sailor-mixed": _plan((11, [[A100[0]], [A100[1]], [A100[2]], V100[:4], V100[4:]]),
                          (13, [[d] for d in A100[3:]])),
    # SAILOR's published shape: the V100s as tp=4 replicas first, then A100 tp=1 stages (the tied
    # embedding at tp 2 on the first stage, its copy at tp 1 on the last once scaled)
    "sailor-style": _plan((4, [V100[:4], V100[4:]]), *[(5, [[A100[2 * i]], [A100[2 * i + 1]]]) for i in range(4)]),
}
ARGS = ("--model", "opt.yaml", "--seq-len", "32", "--global-batch", "4", "--steps", "2", "--warmup", "1",
        "--device", "cpu", "--json")


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory) -> list[float]:
    """The one-process trial's losses: the same run for every plan (same model, data, seed), so once."""
    tmp = tmp_path_factory.mktemp("ref")
    (tmp / "opt.yaml").write_text(OPT_SHAPED)
    ref = run_autotune("trial", "-p", "dp=1,dtype=fp32", *ARGS, cwd=tmp, timeout=600)
    assert ref.returncode == 0, ref.stderr
    return json.loads(ref.stdout)["losses"]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_sailor_shaped_plan_runs_scaled_to_four_processes(in_tmp, name, one_process_losses):
    (in_tmp / "opt.yaml").write_text(OPT_SHAPED)
    (in_tmp / "plan.json").write_text(json.dumps(PLANS[name]))
    r = run_autotune("trial", "-p", "plan.json", "--nproc", "4", *ARGS, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["failure"] is None and out["measured"]["step_time_s"] > 0
    stages = out["plan"]["stages"]
    assert sum(len(rep["devices"]) for st in stages for rep in st["replicas"]) == 4
    tps = {rep["tp"] for st in stages for rep in st["replicas"]}
    assert len(tps) > 1, stages  # the scaled plan keeps stages or replicas of different tp
    assert out["losses"] == pytest.approx(one_process_losses, rel=1e-5)
