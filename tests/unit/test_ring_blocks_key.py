"""The rank-cost memo keys by a CP rank's ring blocks only where a block's price reads them
(``Rates.reads_ring_blocks``). The reference: each rank's cost priced again with other ring blocks
(its own twice over): the same cost where the flag says they are not read, and on the devices that
read them (CPU, a memory-efficient or materialised attention) the cost moves, so the flag is not
true everywhere by accident."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from autotune.cost import rank as RK
from autotune.cost.steps import step_context, tp_groups
from autotune.plan import Plan
from autotune.specs.model import load_model

DATA = Path(__file__).resolve().parents[1] / "data"


def test_ring_blocks_move_a_rank_cost_only_where_they_are_read():
    spec = importlib.util.spec_from_file_location("make_cost_corpus", DATA / "make_cost_corpus.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    entries = json.loads((DATA / "cost_corpus.json").read_text())["entries"]
    clusters: dict = {}
    unread = read_moved = 0
    for e in entries:
        if e["plan"]["degrees"].get("cp", 1) < 2:
            continue
        c = clusters.get(e["cluster"]) or clusters.setdefault(e["cluster"], gen.build_cluster(e["cluster"]))
        s = step_context(Plan.from_dict(e["plan"]), load_model(e["model"]), c, e["seq_len"], e["global_batch"],
                         e["calibration"])
        seen = set()
        for _, _, ctx in tp_groups(s):
            if id(ctx) in seen or ctx.ring is None:
                continue
            seen.add(id(ctx))
            other = ctx.with_work(ctx.step, ctx.coords, ctx.keysum, ctx.ring + ctx.ring, ctx.attn_seq)
            same = RK.rank_cost(other) == RK.rank_cost(ctx)
            if ctx.rates.reads_ring_blocks:
                read_moved += not same
            else:
                assert same, (e["cluster"], e["plan"])
                unread += 1
    assert unread > 0 and read_moved > 0, (unread, read_moved)
