"""Megatron exporter: arguments checked with Megatron's own rules (argument names from
megatron/training/arguments.py, layout parsing as pipeline_parallel_layer_layout.py does it, dp and
micro-batch arithmetic as megatron/training computes them), exhaustively over layer splits."""

import itertools
import re

import pytest

from autotune.export import ExportRefused, export
from autotune.export import megatron as M
from autotune.export.common import ExportContext
from autotune.plan import Degrees, Plan, Shares
from autotune.specs.cluster import load_cluster
from autotune.specs.model import PRESETS

# Names as Megatron-LM defines them (megatron/training/arguments.py); anything else is a typo.
KNOWN = {
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--cp-comm-type", "--hierarchical-context-parallel-sizes", "--num-layers-per-virtual-pipeline-stage",
    "--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--micro-batch-size", "--global-batch-size",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-modules", "--use-distributed-optimizer",
    "--sequence-parallel", "--bf16", "--fp16", "--num-layers", "--hidden-size", "--ffn-hidden-size",
    "--num-attention-heads", "--seq-length", "--max-position-embeddings", "--vocab-size",
    "--group-query-attention", "--num-query-groups", "--swiglu", "--normalization",
    "--position-embedding-type", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
}


def ctx_for(model="small", world=8, seq=256, batch=16):
    return ExportContext(model=PRESETS[model], cluster=load_cluster(f"local:{world}"), seq_len=seq,
                         global_batch=batch)


def resolved(ctx, **kw):
    return Plan(**kw).resolve(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)


def flags(args):
    return {a: args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else True
            for i, a in enumerate(args) if a.startswith("--")}


def compositions(total, parts):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        b = (0, *cuts, total)
        yield tuple(b[i + 1] - b[i] for i in range(parts))


def split_plans(pp, v):
    """Every split of the layers over ``pp * v`` stages: ``(layers, plan, exported args)``."""
    ctx = ctx_for()
    sched = "interleaved_1f1b" if v > 1 else "1f1b"
    for layers in compositions(ctx.model.layers, pp * v):
        plan = resolved(ctx, degrees=Degrees(pp=pp, dp=8 // pp), schedule=sched, virtual_stages=v,
                        shares=Shares(layers=layers))
        yield layers, plan, M.parse_script(export(plan, ctx, "megatron").text)


def megatron_unroll(layout):
    """Megatron's parse_str_to_list, written again from its docstring: '(..)*n' then 'x*n'."""
    s = layout.replace(",", "")
    while "(" in s:
        s = re.sub(r"\(([^()]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    s = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    return s.split("|")


@pytest.mark.parametrize("pp,v", [(2, 1), (4, 1), (2, 2)])
def test_every_layer_split_is_assigned_exactly_once(pp, v):
    n = ctx_for().model.layers
    seen = 0
    for layers, plan, args in split_plans(pp, v):
        got = M.layers_per_stage(args, n, pp)
        assert got == list(layers) and sum(got) == n
        f = flags(args)
        if "--pipeline-model-parallel-layout" in f:
            stages = megatron_unroll(f["--pipeline-model-parallel-layout"])
            assert len(stages) == pp * v  # Megatron: len(layout) % pp == 0, vpp = len / pp
            flat = "".join(stages)
            assert flat.count("E") == 1 and flat.startswith("E") and flat.count("L") == 1 and flat.endswith("L")
            assert [s.count("t") for s in stages] == list(layers)
            # Megatron's 2-D view: stage j on pp rank j % pp, virtual stage j // pp
            for r in range(pp):
                assert [stages[vi * pp + r].count("t") for vi in range(v)] == plan.layers_of_stage(r)
        seen += 1
    assert seen == len(list(compositions(n, pp * v)))


@pytest.mark.parametrize("deg", [dict(dp=8), dict(tp=2, dp=4), dict(pp=2, tp=2, dp=2), dict(cp=2, dp=4),
                                 dict(hp=2, dp=4), dict(cp=2, hp=2, dp=2), dict(pp=2, cp=2, hp=2),
                                 dict(tp=2, cp=2, pp=2)])
def test_world_and_batch_follow_megatron_arithmetic(deg):
    ctx = ctx_for()
    plan = resolved(ctx, degrees=Degrees(**deg), micro_batch_size=2, recompute="full", zero_stage=1,
                    sequence_parallel=deg.get("tp", 1) > 1)
    args = M.parse_script(export(plan, ctx, "megatron").text)
    assert {a for a in args if a.startswith("--")} <= KNOWN
    w = M.world_of(args, plan.world)
    assert w["remainder"] == 0
    assert w["tp"] * w["pp"] * w["cp"] * w["dp"] == plan.world
    assert w["dp"] == plan.degrees.dp and w["num_microbatches"] == plan.num_microbatches
    f = flags(args)
    d = plan.degrees
    if d.cp > 1 and d.hp > 1:
        assert f["--cp-comm-type"] == "a2a+p2p"
        i = args.index("--hierarchical-context-parallel-sizes")
        inner, outer = int(args[i + 1]), int(args[i + 2])
        assert (inner, outer) == (d.hp, d.cp) and inner * outer == w["cp"]
    elif d.hp > 1:
        assert f["--cp-comm-type"] == "a2a"
    elif d.cp > 1:
        assert f["--cp-comm-type"] == "p2p"
    assert f["--recompute-granularity"] == "full" and "--use-distributed-optimizer" in f
    assert ("--sequence-parallel" in f) == (d.tp > 1)
    assert int(f["--num-query-groups"]) == ctx.model.kv_heads


def test_uneven_tokens_are_refused_with_an_even_nearest_plan():
    ctx = ctx_for()
    plan = resolved(ctx, degrees=Degrees(cp=2, dp=4), shares=Shares(tokens=(160, 96)))
    with pytest.raises(ExportRefused) as e:
        export(plan, ctx, "megatron")
    err = e.value
    assert any("shares.tokens [160, 96]" in r for r in err.reasons)
    near = err.nearest.plan
    assert near is not None and near.degrees == plan.degrees and near.shares.tokens == (128, 128)
    assert M.reasons(near, ctx) == []
    assert "Nearest plan megatron can express" in str(err)


def test_gpipe_contiguous_and_zero3_each_named():
    ctx = ctx_for()
    plan = resolved(ctx, degrees=Degrees(pp=2, cp=2, dp=2), schedule="gpipe", cp_layout="contiguous", zero_stage=3)
    with pytest.raises(ExportRefused) as e:
        export(plan, ctx, "megatron")
    text = " ".join(e.value.reasons)
    assert "gpipe" in text and "contiguous" in text and "zero_stage 3" in text
    near = e.value.nearest.plan
    assert near.schedule == "1f1b" and near.cp_layout == "zigzag" and near.zero_stage == 1


def test_first_last_flags_only_when_middle_stages_are_equal():
    ctx = ctx_for()
    plan = resolved(ctx, degrees=Degrees(pp=4, dp=2), shares=Shares(layers=(1, 3, 3, 1)))
    f = flags(M.arguments(plan, ctx))
    assert f["--decoder-first-pipeline-num-layers"] == "1" and f["--decoder-last-pipeline-num-layers"] == "1"
    assert "--pipeline-model-parallel-layout" not in f
    plan = resolved(ctx, degrees=Degrees(pp=4, dp=2), shares=Shares(layers=(2, 1, 3, 2)))
    assert "--pipeline-model-parallel-layout" in flags(M.arguments(plan, ctx))


def test_sequence_must_cut_into_two_chunks_per_cp_rank():
    ctx = ctx_for(seq=258)  # 258 = 2 * 129: hp=2 alone splits it, Megatron's 2*cp chunks do not
    plan = resolved(ctx, degrees=Degrees(hp=2, dp=4))
    with pytest.raises(ExportRefused) as e:
        export(plan, ctx, "megatron")
    assert any("2*context-parallel-size(2)" in r for r in e.value.reasons)
    near = e.value.nearest.plan
    assert near is None or ctx.seq_len % (2 * near.degrees.cp * near.degrees.hp) == 0 or \
        near.degrees.cp * near.degrees.hp == 1
