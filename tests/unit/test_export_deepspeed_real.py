"""The DeepSpeed export read by DeepSpeed itself (``DeepSpeedConfig``, ``partition_uniform``), when
deepspeed is installed (CI installs it): every exported config is accepted, DeepSpeed derives the
plan's batch, micro-batch, accumulation, data-parallel size and ZeRO stage from it, and its own uniform
partition is the layer split we wrote. A config broken on purpose is refused (the check bites)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_export_deepspeed import ctx_for, resolved  # the same workloads as the rule tests

from autotune.export import export
from autotune.plan import Degrees

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")

CASES = [(deg, mbs, rc) for deg in (dict(dp=8), dict(dp=4, tp=2), dict(dp=2, pp=4), dict(dp=4, hp=2),
                                    dict(dp=2, hp=2, pp=2), dict(tp=2, pp=2, dp=2), dict(hp=8))
         for mbs in (1, 2) for rc in ("none", "full")]


def deepspeed_reads(items: list[dict]) -> list[dict]:
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("_deepspeed_check.py"))],
                       input=json.dumps(items), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_deepspeed_accepts_and_reads_back_every_export():
    ctx = ctx_for()
    plans, items = [], []
    for deg, mbs, rc in CASES:
        plan = resolved(ctx, degrees=Degrees(**deg), micro_batch_size=mbs, recompute=rc,
                        zero_stage=1 if deg.get("pp") else 2)
        cfg = json.loads(export(plan, ctx, "deepspeed").text)
        plans.append((plan, cfg))
        items.append({"config": cfg, "world": plan.world, "layers": ctx.model.layers})
    broken = dict(items[0]["config"], train_batch_size=items[0]["config"]["train_batch_size"] + 1)
    got = deepspeed_reads([*items, {"config": broken, "world": 8, "layers": ctx.model.layers}])
    assert "error" in got[-1] and "train_batch_size" in got[-1]["error"]
    for (plan, cfg), g in zip(plans, got[:-1], strict=True):
        assert "error" not in g, (plan.degrees.inline(), g)
        assert g["train_batch_size"] == ctx.global_batch and g["micro"] == plan.micro_batch_size
        assert g["dp"] == plan.degrees.dp and g["gas"] == plan.num_microbatches
        assert g["zero"] == plan.zero_stage and g["bf16"]
        if plan.degrees.pp > 1:
            assert cfg["autotune"]["pipeline_module"]["parts"] == g["parts"]
