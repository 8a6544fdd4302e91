"""The default search against exhaustive enumeration under the real cost model (issue 6: >= 99% of
the grid optimum's predicted tokens/s). The reference prices every grid point with
``autotune.cost.estimate`` directly, not through the search, on instances small enough to be fast."""

from __future__ import annotations

import pytest

from autotune.cost import estimate  # noqa: E402
from autotune.errors import InputError
from autotune.plan import Plan  # noqa: E402
from autotune.search import SearchOptions, load_space, search  # noqa: E402
from autotune.specs import load_model  # noqa: E402
from autotune.specs.cluster import cluster_from_dict  # noqa: E402
from search_spaces.base import SearchContext  # noqa: E402

INSTANCES = [  # (name, node groups, devices per node, model, seq, batch)
    ("4 mixed", [("H100-SXM", 1), ("A100-80GB", 1)], 2, "llama3-8b", 8192, 4),
    ("4 A100 nodes of 2", [("A100-80GB", 2)], 2, "llama3-8b", 8192, 8),
]


def exhaustive_best(model, cluster, seq, batch) -> float:
    sp = load_space("default").space(SearchContext(model=model, cluster=cluster, seq_len=seq, global_batch=batch))
    best, seen = 0.0, set()
    for p in sp.grid_points():
        plan = sp.build(p)
        if not isinstance(plan, Plan) or plan in seen:
            continue
        seen.add(plan)
        try:
            pred = estimate(plan, model, cluster, seq, batch).predicted
        except InputError:  # a plan the cost model refuses is no candidate (a crash fails the test)
            continue
        if pred["feasible"]:
            best = max(best, float(pred["tokens_per_s"]))
    assert seen, "the grid built no plan"
    return best


@pytest.mark.parametrize("name,groups,dpn,model,seq,batch", INSTANCES, ids=[i[0] for i in INSTANCES])
def test_default_search_finds_99_percent_of_the_exhaustive_optimum(name, groups, dpn, model, seq, batch):
    m = load_model(model)
    c = cluster_from_dict({"name": name.replace(" ", "-"), "inter_node": {"bandwidth": "25GB/s"},
                           "nodes": [{"count": n, "devices_per_node": dpn, "device": t} for t, n in groups]})
    ref = exhaustive_best(m, c, seq, batch)
    assert ref > 0
    res = search(m, c, seq, batch, study_name=f"quality-{name}", storage=":memory:", options=SearchOptions())
    got = float(res.best.predicted["tokens_per_s"])
    assert got >= 0.99 * ref, f"{name}: default {got:,.0f} tok/s < 99% of exhaustive {ref:,.0f}"
    g = search(m, c, seq, batch, study_name=f"quality-grid-{name}", storage=":memory:",
               options=SearchOptions(sampler="grid"))
    assert float(g.best.predicted["tokens_per_s"]) == pytest.approx(ref, rel=1e-9)  # the grid is exhaustive
