"""A pool search against exhaustive enumeration: every subset of the pool (built from a cluster file
written with those counts, not by ``subset``), every grid point of the space on it, priced directly.
The search's best plan per objective and its Pareto front must match what the enumeration finds
(the search may find better: its shares are continuous, the grid's even or speed-balanced)."""

from __future__ import annotations

import itertools
import math

import pytest

from autotune.cost import estimate
from autotune.objective import make_objective
from autotune.search import SearchOptions
from autotune.search.pool import pool_search
from autotune.specs import load_model
from autotune.specs.cluster import cluster_from_dict
from search_spaces.base import Infeasible, SearchContext
from search_spaces.default import DefaultSpace

TOL = 0.01

POOLS = {
    # two H100 nodes and an A100 node: using every device is fastest
    "all-best": ([("H100-SXM", 2, 2, 2.1), ("A100-80GB", 1, 2, 1.3)], "llama3-8b", 8192, 8),
    # H100s and a V100-16GB node: the time objective leaves the V100s out
    "leave-out": ([("H100-SXM", 2, 2, 2.1), ("V100-16GB", 1, 2, 0.4)], "llama2-7b", 16384, 4),
    # the same at 32k tokens
    "leave-out-32k": ([("H100-SXM", 2, 2, 2.1), ("V100-16GB", 1, 2, 0.4)], "llama2-7b", 32768, 4),
    # three device types
    "three": ([("H100-SXM", 1, 2, 2.1), ("A100-80GB", 1, 2, 1.3), ("L40S", 1, 2, 0.9)], "llama2-7b", 16384, 4),
}


def _file(groups, counts=None, available=True):
    nodes = []
    for (dev, avail, dpn, price), n in zip(groups, counts or [g[1] for g in groups], strict=True):
        nd = {"devices_per_node": dpn, "device": dev, "price": f"{price}USD/h"}
        nd.update({"available": avail} if available else {"count": n})
        nodes.append(nd)
    return {"name": "p", "nodes": nodes, "inter_node": {"bandwidth": "100Gbit/s", "latency": "5us"}}


def _exhaustive(groups, model, seq, batch, dtype):
    """Per subset (node counts): the fastest feasible grid plan's step time, and its price per hour."""
    out = {}
    for counts in itertools.product(*[range(g[1] + 1) for g in groups]):
        if not any(counts):
            continue
        kept = [(g, n) for g, n in zip(groups, counts, strict=True) if n]
        sub = cluster_from_dict(_file([g for g, _ in kept], [n for _, n in kept], available=False))
        space = DefaultSpace(SearchContext(model=model, cluster=sub, seq_len=seq, global_batch=batch, dtype=dtype))
        best = math.inf
        for p in space.grid_points():
            plan = space.build(p)
            if isinstance(plan, Infeasible):
                continue
            pr = estimate(plan, model, sub, seq, batch).predicted
            if pr["feasible"]:
                best = min(best, pr["step_time_s"])
        if best < math.inf:
            hourly = sum(n * g[2] * g[3] for g, n in zip(groups, counts, strict=True))
            out[counts] = (best, hourly * best / 3600 / (seq * batch) * 1e6)
    return out


def _front(points):
    return {k for k, (s, c) in points.items()
            if not any(s2 <= s and c2 <= c and (s2 < s or c2 < c) for k2, (s2, c2) in points.items() if k2 != k)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(POOLS))
def test_pool_search_matches_exhaustive_enumeration(name):
    groups, model_name, seq, batch = POOLS[name]
    model = load_model(model_name)
    pool = cluster_from_dict(_file(groups))
    dtype = "fp16" if any(g[0].startswith(("V100", "T4")) for g in groups) else "bf16"
    exh = _exhaustive(groups, model, seq, batch, dtype)
    assert exh, "the enumeration found no feasible plan"
    for kind in ("time", "cost"):
        res = pool_search(model, pool, seq, batch, study_name=f"{name}-{kind}", storage=":memory:",
                          options=SearchOptions(dtype=dtype, trials=30), objective=make_objective(kind, None, None, pool))
        got_uses = tuple(res.best.plan.uses) if res.best.plan.uses else tuple(g[1] for g in groups)
        axis = 0 if kind == "time" else 1
        want = min(exh, key=lambda k: exh[k][axis])
        got = res.front_point = next(p for p in res.front if p["chosen"])
        value = got["step_time_s"] if kind == "time" else got["cost"]["per_mtok"]
        assert value <= exh[want][axis] * (1 + TOL), (kind, got_uses, value, want, exh[want])
        # the subset chosen is the enumeration's, unless another is within the tolerance of it
        assert got_uses == want or exh[got_uses][axis] <= exh[want][axis] * (1 + TOL), (kind, got_uses, want, exh)
        # every point of the enumerated front is matched (or beaten) by a point of the search's front
        front = [(p["step_time_s"], p["cost"]["per_mtok"]) for p in res.front]
        for k in _front(exh):
            s, c = exh[k]
            assert any(s2 <= s * (1 + TOL) and c2 <= c * (1 + TOL) for s2, c2 in front), (k, exh[k], front)
    if name == "all-best":
        assert want_time(exh) == tuple(g[1] for g in groups)
    if name.startswith("leave-out"):
        assert want_time(exh)[1] == 0 and res.left_out


def want_time(exh):
    return min(exh, key=lambda k: exh[k][0])
