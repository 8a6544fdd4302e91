"""HelixPipe plans export to the Megatron variant that names its fork; every other target refuses
with its reason and offers the nearest plan it can run."""

from __future__ import annotations

import pytest

from autotune.export import ExportContext, ExportRefused, export
from autotune.export.megatron import HELIX_FORK, parse_script, world_of
from autotune.plan import Plan
from autotune.specs import ModelSpec, local_cluster

SPEC = ModelSpec(name="helix-export", layers=8, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, vocab=128)
SEQ, BATCH = 64, 16


def plan(**kw):
    d = {"degrees": {"pp": 4, "dp": 2}, "schedule": "helixpipe", "dtype": "bf16", **kw}
    return Plan.from_dict(d).resolve(SPEC, local_cluster(8), SEQ, BATCH)


def ctx():
    return ExportContext(model=SPEC, cluster=local_cluster(8), seq_len=SEQ, global_batch=BATCH)


@pytest.mark.parametrize("folds,recompute", [(1, "none"), (2, "full")])
def test_megatron_variant_carries_the_forks_switches(folds, recompute):
    p = plan(helix_folds=folds, recompute=recompute)
    e = export(p, ctx(), "megatron")
    args = parse_script(e.text)  # read back from the file the user gets
    assert args == e.data["args"]
    i = args.index("--num-fold")
    assert args[i + 1] == str(folds)
    for flag in ("--attention-pipeline", "--transfer-weight"):
        assert flag in args
    j = args.index("--num-layers-per-virtual-pipeline-stage")
    assert args[j + 1] == "1"
    assert ("--checkpoint-without-attn" in args) == (recompute == "full")
    assert "--recompute-granularity" not in args
    assert e.data["requires"] == HELIX_FORK and HELIX_FORK in e.text
    # Megatron's own arithmetic on the arguments gives back the plan's degrees and micro-batches
    w = world_of(args, p.world)
    assert (w["tp"], w["pp"], w["dp"], w["num_microbatches"], w["remainder"]) == (
        p.degrees.tp, p.degrees.pp, p.degrees.dp, p.num_microbatches, 0)


def test_plain_megatron_plans_do_not_name_the_fork():
    p = Plan.from_dict({"degrees": {"pp": 4, "dp": 2}, "dtype": "bf16"}).resolve(SPEC, local_cluster(8), SEQ, BATCH)
    e = export(p, ctx(), "megatron")
    assert "requires" not in e.data and "--attention-pipeline" not in e.data["args"]


@pytest.mark.parametrize("fmt,why", [("torchtitan", "schedule helixpipe"), ("deepspeed", "schedule helixpipe"),
                                     ("accelerate", "pp(4)")])
def test_other_targets_refuse_with_their_reason(fmt, why):
    with pytest.raises(ExportRefused) as info:
        export(plan(helix_folds=2), ctx(), fmt)
    assert any(why in r for r in info.value.reasons)
    near = info.value.nearest
    if near is not None:
        assert near.plan.schedule != "helixpipe" and near.plan.helix_folds == 1
