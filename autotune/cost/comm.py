"""Communication times: alpha-beta (Hockney) collectives over a group's slowest link.

A message of n bytes over a link costs ``latency + n / bandwidth``. Collective costs follow Thakur,
Rabenseifner & Gropp 2005 ("Optimization of Collective Communication Operations in MPICH") for ring
algorithms over a group of N ranks, with n the full (unsharded) buffer size:

* all-reduce (ring, bandwidth-optimal, Patarasuk & Yuan 2009): ``2(N-1) alpha + 2(N-1)/N * n / beta``
* all-gather and reduce-scatter: ``(N-1) alpha + (N-1)/N * n / beta``
* all-to-all (pairwise exchange): ``(N-1) alpha + max_bytes_sent_or_received_by_one_rank / beta``
* point-to-point: ``alpha + n / beta``

A ring or an all-to-all runs at the pace of its slowest pair, so each group uses the slowest link
among its members (``Topology.group_link``). Bandwidths are per device and per direction (the
catalogue's convention).

Measured collectives: a profiled CPU's gloo table replaces the formulas where it covers the op and
group size (``cpu.GlooTable``, CPU trial physics); accelerators keep the formulas.
"""

from __future__ import annotations

from typing import Any

from autotune.specs.cluster import Link

_SELF = Link(bandwidth=float("inf"), latency=0.0, kind="self")


def p2p(link: Link, nbytes: float) -> float:
    return link.latency + nbytes / link.bandwidth if nbytes > 0 else 0.0


def all_reduce(link: Link, n: int, nbytes: float) -> float:
    if n < 2 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * link.latency + 2.0 * (n - 1) / n * nbytes / link.bandwidth


def all_gather(link: Link, n: int, nbytes: float) -> float:
    """Also the cost of a reduce-scatter of the same full buffer."""
    if n < 2 or nbytes <= 0:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


reduce_scatter = all_gather


def all_to_all(link: Link, n: int, max_bytes: float) -> float:
    """``max_bytes``: the most any one rank sends or receives (uneven splits pace the exchange)."""
    if n < 2 or max_bytes <= 0:
        return 0.0
    return (n - 1) * link.latency + max_bytes / link.bandwidth


class AlphaBeta:
    """The formulas above behind the interface every collective model offers (``cpu.GlooTable``
    has the same methods): ``op(link, group size, bytes)``, ``p2p(link, bytes)``."""

    all_reduce = staticmethod(all_reduce)
    all_gather = staticmethod(all_gather)
    reduce_scatter = staticmethod(reduce_scatter)
    all_to_all = staticmethod(all_to_all)
    p2p = staticmethod(p2p)


FORMULAS = AlphaBeta()
"""The alpha-beta formulas (every device without a measured table)."""


class Topology:
    """Per-cluster lookups the cost model makes thousands of times: the device index of a
    (node, local) placement, the link between two nodes, the slowest link of a set of devices."""

    def __init__(self, cluster: Any):
        self.cluster = cluster
        self.index = {(d.node, d.local): d.index for d in cluster.devices}
        self.node_of = [d.node for d in cluster.devices]
        self._node_links: dict[tuple[int, int], Link] = {}
        self._groups: dict[tuple, Link] = {}
        self.memo: dict[str, Any] = {}
        """What modules above keep per topology (``cost/mesh_links.py``: its link codes)."""

    def node_link(self, a: int, b: int) -> Link:
        """Link between a device of node ``a`` and one of node ``b`` (a == b: inside the node)."""
        key = (a, b) if a <= b else (b, a)
        lk = self._node_links.get(key)
        if lk is None:
            c = self.cluster
            lk = None
            for x, y, o in c.overrides:
                if {x, y} == {a, b}:
                    lk = o
                    break
            if lk is None:
                lk = c.node_group(a).intra_node if a == b else c.inter_node
            self._node_links[key] = lk
        return lk

    def link(self, dev_a: int, dev_b: int) -> Link:
        if dev_a == dev_b:
            return _SELF
        return self.node_link(self.node_of[dev_a], self.node_of[dev_b])

    def group_link(self, devices: list[int] | tuple[int, ...]) -> Link:
        """The slowest link between any two members (by bandwidth, then latency); same answer as
        ``ClusterSpec.slowest_link`` but over node pairs instead of device pairs."""
        if len(devices) < 2:
            return _SELF
        counts: dict[int, int] = {}
        for d in devices:
            n = self.node_of[d]
            counts[n] = counts.get(n, 0) + 1
        key = tuple(sorted((n, c > 1) for n, c in counts.items()))
        lk = self._groups.get(key)
        if lk is None:
            nodes = [n for n, _ in key]
            cands = [self.node_link(n, n) for n, multi in key if multi]
            cands += [self.node_link(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:]]
            lk = min(cands, key=lambda x: (x.bandwidth, -x.latency))
            self._groups[key] = lk
        return lk


    def ring_link(self, devices: list[int] | tuple[int, ...]) -> Link:
        """The link a ring collective (all-reduce, all-gather, reduce-scatter) over ``devices`` runs at.

        Inside one node: ``group_link``. Across nodes NCCL splits the buffer over several rings
        (channels), and the rings leave a node through different NICs ("multi-rail"): with g members
        of the group on every node, each with its own NIC (bandwidths are per device), the buffer
        crosses between nodes at g x the per-device rate, while every member still forwards the whole
        ring's traffic over the node's own links, which cap it (NCCL docs, "NCCL_CROSS_NIC" and the
        ring/tree algorithms; nccl-tests' bus bandwidth of a multi-node all-reduce on DGX A100 nodes
        with 8 x 200 Gb/s NICs is far above one NIC's 25 GB/s). So the ring runs at
        min(slowest inner link, g x slowest inter-node link), with the inter-node latency."""
        counts: dict[int, int] = {}
        for d in devices:
            counts[self.node_of[d]] = counts.get(self.node_of[d], 0) + 1
        if len(counts) < 2:
            return self.group_link(devices)
        key = ("ring", tuple(sorted(counts.items())))
        lk = self._groups.get(key)
        if lk is None:
            nodes = sorted(counts)
            inter = min((self.node_link(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:]),
                        key=lambda x: (x.bandwidth, -x.latency))
            g = min(counts.values())
            bw = g * inter.bandwidth
            inner = [self.node_link(n, n).bandwidth for n, c in counts.items() if c > 1]
            if inner:
                bw = min(bw, min(inner))
            lk = self._groups[key] = Link(bandwidth=max(bw, inter.bandwidth), latency=inter.latency, kind=inter.kind)
        return lk


_TOPOLOGIES: dict[int, Topology] = {}


def topology(cluster: Any) -> Topology:
    """Cached per cluster object (specs are frozen, so a cluster never changes under the cache)."""
    t = _TOPOLOGIES.get(id(cluster))
    if t is None or t.cluster is not cluster:
        if len(_TOPOLOGIES) > 64:
            _TOPOLOGIES.clear()
        t = _TOPOLOGIES[id(cluster)] = Topology(cluster)
    return t
