"""Per-stage plans run like one process (issue 26): a stage at tp=2 next to stages at tp=1, a stage
whose replicas run tp=1 and tp=2 (ZeRO-1 over them too), with 1F1B, GPipe and interleaved 1F1B; losses
(rtol 1e-5, fp32) and every rank's weights after AdamW against ``reference_run``. One launch of four
workers runs them all; an OPT-style model (LayerNorm, biases split with their weights into the
replicas' pieces, learned positions on the first stage, GELU, tied embeddings) runs those with more
than one stage in others: its first stage's embedding and its last stage's copy of it split the
vocabulary over different tp (tp=2 beside tp=1 and the other way round, replicas of tp 1 and 2 beside
replicas of tp 1), and their gradients are summed row by row (runtime/tied.py)."""

from __future__ import annotations

import functools

import pytest
from helpers.parity import assert_matches_reference, reference, run_plans

from autotune.specs import ModelSpec

pytestmark = pytest.mark.slow

SPEC = ModelSpec(name="equiv", layers=8, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, vocab=128)
OPT = ModelSpec(name="equiv-opt-tied", layers=8, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, vocab=128,
                activation="gelu", norm="layernorm", position="learned", max_positions=16, bias=True,
                tied_embeddings=True)
SPECS = {SPEC.name: SPEC, OPT.name: OPT}
SEQ, BATCH, STEPS, SEED = 16, 4, 2, 1234


def stages(*st):
    """st: (layers, [devices of each replica]); a replica's tp is its device count."""
    return [{"layers": n, "replicas": [{"tp": len(d), "devices": list(d)} for d in reps]} for n, reps in st]


def split(cp, hp, *st):
    """st: (layers, [(tp, devices) of each replica]); every replica at ``cp`` x ``hp`` (cp*hp*tp devices)."""
    return [{"layers": n, "replicas": [{"tp": t, "cp": cp, "hp": hp, "devices": list(d)} for t, d in reps]}
            for n, reps in st]


CASES = {
    "tp2-then-tp1-then-tp1": {"stages": stages((2, [[0, 1]]), (3, [[2]]), (3, [[3]]))},
    "tp1-then-tp2-gpipe": {"stages": stages((5, [[0]]), (3, [[1, 2]])), "schedule": "gpipe"},
    "tp2-tp1-interleaved": {"stages": stages((4, [[0, 1]]), (4, [[2]])), "schedule": "interleaved_1f1b",
                            "virtual_stages": 2},
    "replicas-tp1-tp1-tp2": {"stages": stages((8, [[0], [1], [2, 3]])), "shares": {"samples": [2, 1, 1]}},
    "replicas-tp1-tp2-zero1": {"stages": stages((8, [[0], [1, 2]])), "zero_stage": 1},
    "replicas-tp1-tp2-then-tp1": {"stages": stages((3, [[0], [1, 2]]), (5, [[3], [4]])), "zero_stage": 1,
                                  "schedule": "gpipe"},
    # the sequence split inside the stages (issue 40 item 4): ring attention over cp, Ulysses over hp,
    # each CP shard's hop to the same shard of the next stage, gradients summed over dp x cp x hp
    "cp2-then-cp2": {"stages": split(2, 1, (3, [(1, [0, 1])]), (5, [(1, [2, 3])]))},
    "hp2-replicas-zero1": {"stages": split(1, 2, (8, [(1, [0, 1]), (1, [2, 3])])), "zero_stage": 1},
    "cp2-tp2-then-tp1-gpipe": {"stages": split(2, 1, (3, [(2, [0, 1, 2, 3])]), (5, [(1, [4, 5])])),
                               "schedule": "gpipe"},
}
WORLD = {name: sum(len(r["devices"]) for s in item["stages"] for r in s["replicas"]) for name, item in CASES.items()}
OPT_CASES = ("tp2-then-tp1-then-tp1", "replicas-tp1-tp1-tp2", "tp1-then-tp2-gpipe", "tp2-tp1-interleaved",
             "replicas-tp1-tp2-then-tp1", "cp2-tp2-then-tp1-gpipe")  # launches of 4, 3, 5 and 6


@functools.cache
def all_runs() -> dict[tuple[int, str], dict[str, list[dict]]]:
    """Every case of both models, one world size after the other: the jobs of one world run back to
    back in the session's workers of that world (helpers.pool keeps two worlds' workers; in test order,
    worlds 4, 6, 4, 5, 3, ... restarted them, ~5 s of CPU a rank each time: the 6-rank cases took 13-15 s)."""
    out = {}
    for world in sorted(set(WORLD.values())):
        for spec_name, names in ((SPEC.name, CASES), (OPT.name, OPT_CASES)):
            items = [(n, {"dtype": "fp32", **CASES[n]}) for n in names if WORLD[n] == world]
            if items:
                out[world, spec_name] = run_plans("autotune.runtime.worker:plans_job", SPECS[spec_name], items,
                                                  world, SEQ, BATCH, STEPS, SEED)
    return out


def run_world(world: int, spec_name: str = SPEC.name) -> dict[str, list[dict]]:
    return all_runs()[world, spec_name]


@pytest.mark.parametrize("name", sorted(CASES))
def test_per_stage_plan_matches_single_process(name):
    per_rank = run_world(WORLD[name])[name]
    assert_matches_reference(per_rank, reference(SPEC, SEQ, BATCH, STEPS, SEED))


@pytest.mark.parametrize("name", OPT_CASES)
def test_opt_style_per_stage_plan_matches_single_process(name):
    per_rank = run_world(WORLD[name], OPT.name)[name]
    assert_matches_reference(per_rank, reference(OPT, SEQ, BATCH, STEPS, SEED))
