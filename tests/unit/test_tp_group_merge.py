"""``context.tp_groups`` merges tp groups whose contexts would be equal before it builds them (same
pipeline rank, CP index, device, links and micro-batches; hp indexes of equal heads). The reference:
each group's own context, built from its own coordinates as before the merge, priced without the
memo, and a whole estimate whose every group has its own context."""

from __future__ import annotations

import json
import random
import sys

from test_cost_corpus import DATA, _generator  # the corpus and its generator, loaded one way

from autotune.cost import context as CX
from autotune.cost import rank as RK
from autotune.cost.steps import step_context, tp_groups
from autotune.plan import Plan, PlanError
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model


def _own_contexts(s):
    """Every tp group's own context (its coordinates, links, micro-batches), no two groups sharing."""
    cal = s.calibration
    return [(r0, c["dp"], CX._rank_context(s, c, spec, links, s.microbatches[c["dp"]], cal.get(spec.name) or {}))
            for (r0, c), (spec, _, links) in zip(CX._tp_group_coords(s.plan.degrees), s.group_links, strict=True)]


def _mixed_cases(n: int, seed: int):
    """(model, cluster, seq, batch, plan) drawn on a 64-device cluster of four device types with
    different node links, even and uneven shares, every dimension (the corpus generator's draws)."""
    gen = _generator()
    cluster = cluster_from_dict({"name": "four-64", "inter_node": {"bandwidth": "25GB/s", "latency": "10us"}, "nodes": [
        {"count": 2, "devices_per_node": 8, "device": "H100-SXM", "intra_node": {"bandwidth": "450GB/s"}},
        {"count": 2, "devices_per_node": 8, "device": "A100-80GB", "intra_node": {"bandwidth": "300GB/s"}},
        {"count": 2, "devices_per_node": 8, "device": "H20", "intra_node": {"bandwidth": "450GB/s"}},
        {"count": 2, "devices_per_node": 8, "device": "L40S", "intra_node": {"bandwidth": "32GB/s"}}]})
    rng = random.Random(seed)
    out, tries = [], 0
    while len(out) < n and tries < 4000:
        tries += 1
        model = load_model(rng.choice(["llama3-8b", "llama2-7b"]))
        seq = rng.choice([8192, 32768])
        plan_d, batch = gen._draw_plan(rng, cluster.num_devices, ["bf16"])
        try:
            resolved = Plan.from_dict(plan_d).resolve(model, cluster, seq, batch)
            uneven = gen._unevened(rng, resolved) if rng.random() < 0.5 else {}
            if uneven:
                plan_d = {**plan_d, "shares": uneven}
                Plan.from_dict(plan_d).resolve(model, cluster, seq, batch)
        except PlanError:
            continue
        out.append((model, cluster, seq, batch, Plan.from_dict(plan_d)))
    return out


def test_each_group_prices_as_its_own_context():
    """On random mixed 64-device plans, every tp group's (merged) context prices exactly as the
    context of its own coordinates, and reads the same pipeline rank, device and links; the merge
    happens (fewer contexts than groups keyed by coordinates) on some of them."""
    merged_somewhere = False
    for model, cluster, seq, batch, plan in _mixed_cases(40, seed=5):
        s = step_context(plan, model, cluster, seq, batch, None)
        got, own = tp_groups(s), _own_contexts(s)
        assert [(r0, dp) for r0, dp, _ in got] == [(r0, dp) for r0, dp, _ in own]
        costs: dict[int, RK.RankCost] = {}
        for (_, _, ctx), (_, _, ref) in zip(got, own, strict=True):
            assert (ctx.pp_index, ctx.spec, ctx.links) == (ref.pp_index, ref.spec, ref.links)
            mine = costs.get(id(ctx)) or costs.setdefault(id(ctx), RK.rank_cost(ctx))
            assert mine == RK.rank_cost(ref), plan.degrees.inline()
        by_coords = {(c["pp"], c["cp"], c["hp"], place, s.microbatches[c["dp"]])
                     for (_, c), (_, place, _) in zip(CX._tp_group_coords(s.plan.degrees), s.group_links, strict=True)}
        merged_somewhere |= len({id(c) for *_, c in got}) < len(by_coords)
    assert merged_somewhere


def _estimate_module():
    import autotune.cost.estimate  # noqa: F401 - the package re-exports the function under this name

    return sys.modules["autotune.cost.estimate"]


def test_merged_estimate_equals_one_context_per_group(monkeypatch):
    """A whole estimate (predicted and breakdown, timeline included) with the merge equals the one
    whose every tp group has its own context: random mixed plans and the cost corpus's CPU and
    mixed-cluster entries."""
    est_mod = _estimate_module()
    gen = _generator()
    entries = json.loads((DATA / "cost_corpus.json").read_text())["entries"][::7]
    cases = [(m, c, seq, b, p, None, True) for m, c, seq, b, p in _mixed_cases(15, seed=11)]
    clusters = {}
    for e in entries:
        c = clusters.get(e["cluster"]) or clusters.setdefault(e["cluster"], gen.build_cluster(e["cluster"]))
        cases.append((load_model(e["model"]), c, e["seq_len"], e["global_batch"], Plan.from_dict(e["plan"]),
                      e["calibration"], e["timeline"]))

    def figures(case):
        model, cluster, seq, batch, plan, cal, timeline = case
        RK._MEMO.clear()
        RK._FIXED.clear()
        e = est_mod.estimate(plan, model, cluster, seq, batch, calibration=cal, timeline=timeline)
        return json.dumps({"predicted": e.predicted, "breakdown": e.breakdown}, default=str)

    merged = [figures(c) for c in cases]
    monkeypatch.setattr(est_mod, "tp_groups", lambda s, replicas=None: _own_contexts(s))
    assert [figures(c) for c in cases] == merged
