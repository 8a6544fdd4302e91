"""The links of every tensor-parallel group of a mesh, computed for all groups at once.

``context._mesh_links`` memoises this per (topology, devices, degrees, virtual stages, hop peers);
a search of 1,024 devices resolves ~350 distinct meshes, each of 128-1,024 tp groups, and walking
them group by group (a dict of links per group, a ``Topology.group_link`` per group and dimension,
a tuple of link identities to key it) was ~15% of the search's CPU. Here each column of links is
one numpy gather over the ranks' node numbers (which node each rank's device sits on), the
``Topology`` is asked once per distinct node set, and a ``Links`` is built once per distinct row of
link codes. The answer is the per-group walk's, value for value (tests/unit/test_mesh_links.py keeps
that walk as its reference).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from autotune import dims
from autotune.cost import comm as C
from autotune.cost.expert_layout import expert_links


def build(topo: C.Topology, devs: tuple[int, ...], d: Any, v: int, hop_peers: tuple, moe: bool,
          links_type: Callable[..., Any], coords: tuple) -> tuple[tuple, tuple]:
    """(dp link of each pipeline rank, (DeviceSpec, placement key, Links) of every tp group in rank
    order); ``coords``: ``context._tp_group_coords(d)``, ``links_type``: ``context.Links``. The
    placement key is the group's coordinates along pp, cp, hp, tp, its spec's and its Links' ids;
    groups of equal links share one Links object."""
    t = _table(topo)
    blk = dims.stride(d, "pp")
    dev = np.asarray(devs, dtype=np.int64)
    node = t.node_of[dev]
    dp_links = _dp_links(t, dev, node, d)
    r0 = np.arange(0, d.world, d.tp, dtype=np.int64)
    names = []
    cols = [r0 // blk]  # the pipeline index: a group's dp link and hop directions follow from it
    for name, n, st in _inner_dims(d):
        names.append(name)
        cols.append(_group_codes(t, devs, node, r0 - (r0 // st % n) * st, n, st))
    if d.pp > 1:
        cols.extend(_hop_codes(t, node, r0, d.pp, blk, hop_peers))
    rows = np.stack(cols, axis=1).tolist()
    made: dict[tuple, Any] = {}
    equal: dict[Any, Any] = {}
    specs = topo.cluster.devices
    place = operator.itemgetter(*_PLACE_DIMS)
    groups = []
    for row, (g0, c) in zip(rows, coords, strict=True):
        el = expert_links(topo, devs, d, g0) if moe else None
        key = (*row, el)
        lk = made.get(key)
        if lk is None:
            lk = made[key] = _links(d, v, hop_peers, dp_links, names, row, t.links, el, links_type, equal)
        spec = specs[devs[g0]].spec
        groups.append((spec, (*place(c), id(spec), id(lk)), lk))
    return dp_links, tuple(groups)


class _Table:
    """One topology's links as small integer codes, kept across meshes: the Link objects the
    Topology hands out (``links``, a code indexes it), the node of each device, each node's own link
    and each node pair's as codes, and the links of the node sets seen so far."""

    def __init__(self, topo: C.Topology):
        self.topo = topo
        self.links: list[Any] = []
        self._codes: dict[int, int] = {}
        self.node_of = np.asarray(topo.node_of, dtype=np.int64)
        self.nodes = int(self.node_of.max()) + 1 if len(self.node_of) else 1
        self._pairs: dict[int, int] = {}  # node a, node b as a * nodes + b: their link's code
        self.sets: dict[bytes, int] = {}  # a sorted node set's bytes: its group link's code
        self.rings: dict[bytes, Any] = {}  # devices per node (bincount bytes): the ring link

    def pair(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """The codes of the links between nodes ``a[i]`` and ``b[i]`` (``Topology.node_link``, asked
        once per pair this topology has seen)."""
        keys, inv = np.unique(a * self.nodes + b, return_inverse=True)
        pairs, nn = self._pairs, self.nodes
        lut = np.empty(len(keys), dtype=np.int64)
        for i, k in enumerate(keys.tolist()):
            c = pairs.get(k)
            if c is None:
                c = pairs[k] = self.code(self.topo.node_link(k // nn, k % nn))
            lut[i] = c
        return lut[inv.reshape(-1)]

    def code(self, lk: Any) -> int:
        c = self._codes.get(id(lk))
        if c is None:
            c = self._codes[id(lk)] = len(self.links)
            self.links.append(lk)  # held here, so the id is not reused while the code is
        return c


def _table(topo: C.Topology) -> _Table:
    """The topology's table, kept on it (one per cluster object, ``comm.topology``)."""
    t = topo.memo.get("mesh_links")
    if t is None:
        t = topo.memo["mesh_links"] = _Table(topo)
    return t


_PLACE_DIMS = tuple(n for n in dims.MESH_ORDER if n != "dp")
"""The coordinates that tell groups' contexts apart (their shares of layers, tokens, heads): not the
dp index, which ``context.ReplicaTemplates`` keys by the replica's micro-batches."""


def _dp_links(t: _Table, dev: np.ndarray, node: np.ndarray, d: Any) -> tuple:
    """Per pipeline rank, the ring link of its parameter-sharing group (``dims.SHARED_BY``: the ranks
    of its first tp index that differ from its first rank only along those dimensions), asked of the
    Topology once per count of the group's devices on each node (all a ring link depends on)."""
    shape = [getattr(d, n) for n in dims.MESH_ORDER]
    keep = tuple(slice(None) if n in dims.SHARED_BY else 0 for n in dims.MESH_ORDER[1:])
    ranks = np.arange(d.world, dtype=np.int64).reshape(shape)
    out = []
    for i in range(d.pp):
        members = ranks[(i, *keep)].ravel()
        k = np.bincount(node[members], minlength=t.nodes).tobytes()
        lk = t.rings.get(k)
        if lk is None:
            lk = t.rings[k] = t.topo.ring_link(dev[members].tolist())
        out.append(lk)
    return tuple(out)


def _inner_dims(d: Any) -> tuple[tuple[str, int, int], ...]:
    """(name, degree, stride) of every dimension of degree > 1 but pp and dp, in mesh order."""
    return tuple((name, getattr(d, name), dims.stride(d, name)) for name in dims.MESH_ORDER
                 if getattr(d, name) > 1 and name not in ("pp", "dp"))


def _group_codes(t: _Table, devs: tuple[int, ...], node: np.ndarray, base: np.ndarray, n: int, st: int) -> np.ndarray:
    """Per group (first ranks ``base`` of its groups along one dimension of degree ``n`` and stride
    ``st``), the code of the group's slowest link. A group inside one node: that node's own link
    (``Topology.group_link``'s answer for it); one across nodes: ``group_link`` asked once per
    distinct set of nodes (all it depends on), with the devices of the first group of that set."""
    members = base[:, None] + np.arange(n, dtype=np.int64) * st
    nodes = np.sort(node[members], axis=1)
    one = nodes[:, 0] == nodes[:, -1]
    out = t.pair(nodes[:, 0], nodes[:, 0])  # node a's own link
    if not one.all():
        sets = t.sets
        for g in np.flatnonzero(~one).tolist():
            k = nodes[g].tobytes()
            c = sets.get(k)
            if c is None:
                c = sets[k] = t.code(t.topo.group_link([devs[r] for r in members[g].tolist()]))
            out[g] = c
    return out


def _hop_codes(t: _Table, node: np.ndarray, r0: np.ndarray, pp: int, blk: int, hop_peers: tuple) -> list[np.ndarray]:
    """The pp link (to the next pipeline rank, the last's to the first) and each chunk's hop link
    (``hop_peers``: to pipeline rank q of the same place) of every group, as codes; -1 past a pipeline
    rank's own chunks (ranks of a V schedule may hold different numbers)."""
    pp_i = r0 // blk
    nxt = np.where(pp_i < pp - 1, r0 + blk, r0 - (pp - 1) * blk)
    src = node[r0]
    cols = [t.pair(src, node[nxt])]
    width = max(len(h) for h in hop_peers)
    q = np.full((pp, width), -1, dtype=np.int64)
    for i, h in enumerate(hop_peers):
        q[i, :len(h)] = [peer for peer, _, _ in h]
    base = r0 - pp_i * blk
    for j in range(width):
        qj = q[pp_i, j]
        has = qj >= 0
        col = np.full(len(r0), -1, dtype=np.int64)
        col[has] = t.pair(src[has], node[base[has] + qj[has] * blk])
        cols.append(col)
    return cols


def _links(d: Any, v: int, hop_peers: tuple, dp_links: tuple, names: list[str], row: list[int], links: list,
           el: Any, links_type: Callable[..., Any], equal: dict) -> Any:
    """The Links of one row of codes (pipeline index, inner dimensions' links, pp link, hop links),
    one object per value (``equal``)."""
    pp_i = row[0]
    own = {name: links[c] for name, c in zip(names, row[1:1 + len(names)], strict=True)}
    if d.pp > 1:
        rest = row[1 + len(names):]
        own["pp"] = links[rest[0]]
        hops = tuple((links[c], f, b) for c, (_, f, b) in zip(rest[1:], hop_peers[pp_i], strict=False))
    else:
        hops = ((C._SELF, False, False),) * v
    lk = links_type(**own, dp=dp_links[pp_i], pp_hops=hops, experts=el)
    return equal.setdefault(lk, lk)
