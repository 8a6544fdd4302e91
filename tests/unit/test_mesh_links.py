"""``cost/mesh_links.build`` computes every tp group's links with numpy gathers over the ranks' node
numbers; the reference is the per-group walk it replaced (``_walk`` below: each group's own links
asked of the Topology dimension by dimension, its hops to the next and to each chunk's peer). On
random plans of mixed clusters (with node-pair overrides, several node groups), interleaved and V
schedules (whose ranks hop to other peers) and a MoE model, every group gets the same spec, equal
links (the same Link objects inside) and the same grouping (two groups share a placement key in one
exactly when they do in the other)."""

from __future__ import annotations

import operator
import random

from test_tp_group_merge import _mixed_cases

from autotune import dims
from autotune.cost import comm as C
from autotune.cost import context as CX
from autotune.cost import mesh_links
from autotune.cost.expert_layout import expert_links
from autotune.plan import Plan, PlanError, parse_inline
from autotune.specs.cluster import Link, cluster_from_dict
from autotune.specs.model import load_model


def _walk(topo, devs, d, v, hop_peers, moe):
    """The links of every tp group, group by group (``context._mesh_links`` before numpy)."""
    blk = dims.stride(d, "pp")
    dp_links = tuple(topo.ring_link([devs[r] for r in dims.ranks_along(d, dims.SHARED_BY, i * blk)])
                     for i in range(d.pp))
    node_of, specs = topo.node_of, topo.cluster.devices
    inner = [(n, getattr(d, n), dims.stride(d, n)) for n in dims.MESH_ORDER if getattr(d, n) > 1 and n not in ("pp", "dp")]
    place = operator.itemgetter(*(n for n in dims.MESH_ORDER if n != "dp"))
    links_of, equal, groups = {}, {}, []
    for r0, c in CX._tp_group_coords(d):
        own = {}
        for name, n, st in inner:
            base = r0 - c[name] * st
            own[name] = topo.group_link([devs[base + k * st] for k in range(n)])
        if d.pp > 1:
            nxt = r0 + blk if c["pp"] < d.pp - 1 else r0 - (d.pp - 1) * blk
            own["pp"] = topo.node_link(node_of[devs[r0]], node_of[devs[nxt]])
            base = r0 - c["pp"] * blk
            hops = tuple((topo.node_link(node_of[devs[r0]], node_of[devs[base + q * blk]]), f, b)
                         for q, f, b in hop_peers[c["pp"]])
        else:
            hops = ((C._SELF, False, False),) * v
        el = expert_links(topo, devs, d, r0) if moe else None
        ids = (c["pp"], *map(id, own.values()), *[id(h) for h, _, _ in hops], el)
        links = links_of.get(ids)
        if links is None:
            links = CX.Links(**own, dp=dp_links[c["pp"]], pp_hops=hops, experts=el)
            links = links_of[ids] = equal.setdefault(links, links)
        spec = specs[devs[r0]].spec
        groups.append((spec, (*place(c), id(spec), id(links)), links))
    return dp_links, tuple(groups)


def _same(s) -> int:
    """Compare ``build`` with ``_walk`` on one step context's mesh; the number of groups compared."""
    d, v = s.degrees, s.v
    moe = getattr(s.model, "moe", None) is not None
    got_dp, got = mesh_links.build(s.topo, s.devs, d, v, s.hop_peers, moe, CX.Links, CX._tp_group_coords(d))
    want_dp, want = _walk(s.topo, s.devs, d, v, s.hop_peers, moe)
    assert all(a is b for a, b in zip(got_dp, want_dp, strict=True))
    assert len(got) == len(want)
    for (gs, gk, gl), (ws, wk, wl) in zip(got, want, strict=True):
        assert gs is ws and gk[:-1] == wk[:-1] and gl == wl
        assert all(a is b for a, b in zip(dict(gl.__dict__).values(), dict(wl.__dict__).values(), strict=True)
                   if isinstance(a, Link))
        assert [h is k for (h, *_), (k, *_) in zip(gl.pp_hops, wl.pp_hops, strict=True)] == [True] * len(gl.pp_hops)
    # the same partition into placement keys
    for i in range(0, len(got), max(1, len(got) // 16)):
        assert [g[1] == got[i][1] for g in got] == [w[1] == want[i][1] for w in want]
    return len(got)


def test_random_mixed_plans_match_the_walk():
    from autotune.cost.steps import step_context

    seen = 0
    for model, cluster, seq, batch, plan in _mixed_cases(40, seed=11):
        seen += _same(step_context(plan, model, cluster, seq, batch, None))
    assert seen > 400


def _overrides_cluster():
    return cluster_from_dict({"name": "ov-48", "inter_node": {"bandwidth": "25GB/s", "latency": "10us"},
                              # every node pair its own link: a hop priced on the wrong pair shows
                              "overrides": [{"nodes": [a, b], "bandwidth": f"{5 + 3 * a + b}GB/s", "latency": "10us"}
                                            for a in range(6) for b in range(a + 1, 6)],
                              "nodes": [{"count": 3, "devices_per_node": 8, "device": "H100-SXM"},
                                        {"count": 3, "devices_per_node": 8, "device": "A100-80GB",
                                         "intra_node": {"bandwidth": "150GB/s"}}]})


def test_schedules_overrides_and_moe_match_the_walk():
    """Interleaved and V schedules (chunks hop to other ranks than the next), node-pair overrides,
    shuffled placements, and a MoE model's expert links."""
    from autotune.cost.steps import step_context

    cluster = _overrides_cluster()
    rng = random.Random(3)
    cases = [("llama2-7b", "dp=2,pp=4,tp=2,cp=3", "interleaved_1f1b", 2),
             ("llama2-7b", "dp=3,pp=2,tp=8", "zbv", 2),
             ("llama2-7b", "dp=3,pp=4,tp=4", "zbv", 2),
             ("llama2-7b", "dp=3,pp=8,tp=2", "1f1b", 1),
             ("llama2-7b", "dp=3,pp=2,hp=2,tp=4", "interleaved_1f1b", 4),
             ("tiny-moe", "dp=12,pp=2,tp=2,ep=4", "1f1b", 1),
             ("tiny-moe", "dp=12,pp=2,tp=2,ep=4,etp=2", "interleaved_1f1b", 2)]
    seen = 0
    for name, inline, sched, vpp in cases:
        model = load_model(name)
        for _ in range(4):
            # nodes in a random order, each node's devices shuffled (a tp group stays in its node)
            nodes = list(range(cluster.num_devices // 8))
            rng.shuffle(nodes)
            order = [n * 8 + k for n in nodes for k in rng.sample(range(8), 8)]
            d = {**parse_inline(inline).to_dict(), "schedule": sched, "virtual_stages": vpp,
                 "placement": [{"rank": r, "node": cluster.devices[i].node, "device": cluster.devices[i].local}
                                                 for r, i in enumerate(order)]}
            try:
                plan = Plan.from_dict(d)
                s = step_context(plan, model, cluster, 4096, 96, None)
            except PlanError as e:  # a case this suite's authors meant to run: say which
                raise AssertionError(f"{name} {inline} {sched}: {e}") from e
            seen += _same(s)
    assert seen >= 7 * 4 * 2
