"""The hop between pipeline stages is priced as the runtime sends it (issue 36, "price what runs").

- Bytes: per-stage plans of four ranks (tp 2 -> 1 -> 1, tp 1 -> 2 -> 1 with GPipe, tp 2 -> 2, and
  interleaved chunks over tp 2 -> 1 -> 1) train one step with every ``isend`` counted on every rank;
  the busiest rank of each stage sends, forward and backward, exactly the bytes the cost model
  prices for that stage (``pipeline_parallel.hop_bytes``, counted from ``stages.hop_copies``), no
  rank sends more, and the gradients the simulation waits for over each hop
  (``hop_bytes``' second term, priced by the sending side of the forward) add up to the gradients
  the stages send.
- Time: on the same four gloo processes the hop as the runtime runs it (the whole tensor to each
  receiver) against 1/tp slices gathered by the receivers (the scatter/gather the price used to
  assume), alternating round by round: the whole send is the faster one here, which is why the
  runtime keeps it and the price follows; and a hop priced dearer (more copies from one sender)
  is measured slower.
"""

from __future__ import annotations

import functools

import pytest
from helpers.parity import run_plans
from helpers.pool import run_in_pool

from autotune import stages as ST
from autotune.cost import pipeline_parallel as PP
from autotune.cost.steps import step_context, tp_groups
from autotune.plan import Plan
from autotune.specs import ModelSpec, local_cluster

pytestmark = pytest.mark.slow

SPEC = ModelSpec(name="hop", layers=8, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, vocab=128)
SEQ, BATCH, WORLD = 16, 6, 4


def stages(*st):
    """st: (layers, [devices of each replica]); a replica's tp is its device count."""
    return [{"layers": n, "replicas": [{"tp": len(d), "devices": list(d)} for d in reps]} for n, reps in st]


PLANS = {
    "tp2-tp1-tp1": {"stages": stages((2, [[0, 1]]), (3, [[2]]), (3, [[3]]))},
    "tp1-tp2-tp1-gpipe": {"stages": stages((3, [[0]]), (3, [[1, 2]]), (2, [[3]])), "schedule": "gpipe"},
    "tp2-tp2": {"stages": stages((4, [[0, 1]]), (4, [[2, 3]]))},
    "tp2-tp1-tp1-interleaved": {"stages": stages((2, [[0, 1]]), (3, [[2]]), (3, [[3]])),
                                "schedule": "interleaved_1f1b", "virtual_stages": 2},
}


def _resolved(item: dict) -> Plan:
    return Plan.from_dict({"dtype": "fp32", **item}).resolve(SPEC, local_cluster(WORLD), SEQ, BATCH)


@functools.cache
def _counted() -> dict[str, list[dict[str, int]]]:
    items = [(n, {"dtype": "fp32", **p}) for n, p in PLANS.items()]
    return run_plans("_hop_targets:sent_bytes", SPEC, items, WORLD, SEQ, BATCH, 1, 1)


def _priced(plan: Plan) -> list[tuple[list[int], float, float, float]]:
    """Per cell: (its ranks, bytes its busiest rank sends forward and backward in one step, bytes of
    the gradients priced back over its forward hops)."""
    s = step_context(plan, SPEC, local_cluster(WORLD), SEQ, BATCH, None)
    lay = ST.layout_of(plan.stages)
    out = []
    for _, r, ctx in tp_groups(s):
        fwd = bwd = back = 0.0
        for (_, fwd_out, bwd_out), (f, k, g) in zip(ctx.links.pp_hops, PP.hop_bytes(ctx), strict=True):
            fwd, bwd, back = fwd + f * fwd_out, bwd + g * bwd_out, back + k * fwd_out
        m = ctx.microbatches
        out.append((lay.cell_ranks(ctx.pp_index, r), m * fwd, m * bwd, m * back))
    return out


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_busiest_rank_of_each_stage_sends_the_priced_bytes(name):
    sent = [rank_counts for rank_counts in _counted()[name]]
    priced = _priced(_resolved(PLANS[name]))
    assert len({r for ranks, *_ in priced for r in ranks}) == WORLD
    for ranks, fwd, bwd, _ in priced:
        for key, want in (("fwd", fwd), ("bwd", bwd)):
            got = [sent[r][key] for r in ranks]
            assert max(got) == want, (name, ranks, key, got, want)
    # the gradients the pipeline simulation waits for are the ones the stages send
    assert sum(back for *_, back in priced) == sum(max(sent[r]["bwd"] for r in ranks) for ranks, *_ in priced)


def test_the_whole_send_is_the_faster_hop_here_and_dearer_hops_are_slower():
    pairs = [(1, 1), (1, 2), (2, 2), (1, 3)]
    res = run_in_pool("_hop_targets:hop_times", {"pairs": pairs, "bytes": 1 << 20, "rounds": 8}, WORLD, timeout_s=300)
    assert res.failure is None, f"{res.failure}\n{res.extra.get('traceback', '')}"
    rows = {(r["a"], r["b"]): r for r in res.results[0]}
    # receivers at tp > 1: slices need the receivers' all-gather, which costs more than it saves
    ratios = sorted(rows[p]["ratio"] for p in pairs if p[1] > 1)
    assert ratios[len(ratios) // 2] < 1.0, rows
    # the price: one sender serving three receivers sends three copies, serving one sends one
    assert ST.hop_copies(1, 3) == 3 * ST.hop_copies(1, 1)
    assert rows[(1, 3)]["whole_s"] > rows[(1, 1)]["whole_s"], rows
