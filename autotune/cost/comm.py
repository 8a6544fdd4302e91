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

Measured collectives (CPU): where a CPU device's profile holds a ``collective_table`` (nccl-tests
conventions, measured with gloo by ``profilers/links.py``), a collective inside the host over a
group size the table covers takes the measured time at that size, interpolated log-log in bytes
(below the smallest size its time: the latency floor; above the largest, that point's algorithm
bandwidth). gloo's loopback costs are far from alpha-beta with a datasheet figure (a 64 KiB
reduce-scatter takes ~0.5 ms, an all-reduce of the same ~0.2 ms), so the table replaces the
formulas there. A point-to-point exchange between two ranks (a CP ring pass, a pipeline send and
its matching receive) is priced as the two-rank all-to-all that moves the same bytes each way.
Accelerators keep the formulas (their tables, when profiled, cover group sizes the trials there
do not use alone).
"""

from __future__ import annotations

import bisect
import math
import statistics
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


_TABLE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


class Collectives:
    """The collective times one device type's ranks see: the formulas above, or the measured table
    (see the module docstring). ``all_to_all(link, n, max_bytes)`` and ``p2p(link, n)`` take the
    formulas' arguments."""

    def __init__(self, table: list[dict[str, Any]] | None = None):
        self.curves: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
        acc: dict[tuple[str, int], dict[float, list[float]]] = {}
        for row in table or []:
            try:
                op, n, b, t = row["op"], int(row["group_size"]), float(row["bytes"]), float(row["time_s"])
            except (KeyError, TypeError, ValueError):
                continue
            if op in _TABLE_OPS and n >= 2 and b > 0 and t > 0 and math.isfinite(t):
                acc.setdefault((op, n), {}).setdefault(b, []).append(t)
        for key, by_bytes in acc.items():
            xs = sorted(by_bytes)
            self.curves[key] = (xs, [statistics.median(by_bytes[x]) for x in xs])

    def _measured(self, op: str, link: Link, n: int, nbytes: float) -> float | None:
        if link.kind not in ("intra", "self"):
            return None
        c = self.curves.get((op, n))
        if c is None:
            return None
        xs, ys = c
        if nbytes <= xs[0]:
            return ys[0]
        if nbytes >= xs[-1]:
            return ys[-1] * nbytes / xs[-1]
        k = bisect.bisect_right(xs, nbytes)
        w = (math.log(nbytes) - math.log(xs[k - 1])) / (math.log(xs[k]) - math.log(xs[k - 1]))
        return math.exp(math.log(ys[k - 1]) + w * (math.log(ys[k]) - math.log(ys[k - 1])))

    def _priced(self, op: str, formula: Any, link: Link, n: int, nbytes: float,
                table_bytes: float | None = None) -> float:
        """The measured time where the table covers it, else the formula's."""
        if n < 2 or nbytes <= 0:
            return 0.0
        t = self._measured(op, link, n, nbytes if table_bytes is None else table_bytes) if self.curves else None
        return formula(link, n, nbytes) if t is None else t

    def all_reduce(self, link: Link, n: int, nbytes: float) -> float:
        return self._priced("all_reduce", all_reduce, link, n, nbytes)

    def all_gather(self, link: Link, n: int, nbytes: float) -> float:
        return self._priced("all_gather", all_gather, link, n, nbytes)

    def reduce_scatter(self, link: Link, n: int, nbytes: float) -> float:
        return self._priced("reduce_scatter", reduce_scatter, link, n, nbytes)

    def all_to_all(self, link: Link, n: int, max_bytes: float) -> float:
        # the table's bytes are each rank's whole input, its own part included
        return self._priced("all_to_all", all_to_all, link, n, max_bytes,
                            max_bytes * n / (n - 1) if n >= 2 else None)

    def p2p(self, link: Link, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        t = self._measured("all_to_all", link, 2, 2.0 * nbytes) if self.curves and link.kind != "self" else None
        return p2p(link, nbytes) if t is None else t


FORMULAS = Collectives()
"""The alpha-beta formulas (every device without a measured table)."""

_COLLECTIVES: dict[int, tuple[Any, Collectives]] = {}


def collectives_for(spec: Any) -> Collectives:
    """The collective model of a DeviceSpec: measured table for a profiled CPU, else the formulas."""
    if spec.kind != "cpu":
        return FORMULAS
    hit = _COLLECTIVES.get(id(spec))
    if hit is None or hit[0] is not spec:
        table = ((spec.profile or {}).get("links") or {}).get("collective_table")
        if len(_COLLECTIVES) > 64:
            _COLLECTIVES.clear()
        hit = _COLLECTIVES[id(spec)] = (spec, Collectives(table) if table else FORMULAS)
    return hit[1]


class Topology:
    """Per-cluster lookups the cost model makes thousands of times: the device index of a
    (node, local) placement, the link between two nodes, the slowest link of a set of devices."""

    def __init__(self, cluster: Any):
        self.cluster = cluster
        self.index = {(d.node, d.local): d.index for d in cluster.devices}
        self.node_of = [d.node for d in cluster.devices]
        self._node_links: dict[tuple[int, int], Link] = {}
        self._groups: dict[tuple, Link] = {}

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


_TOPOLOGIES: dict[int, Topology] = {}


def topology(cluster: Any) -> Topology:
    """Cached per cluster object (specs are frozen, so a cluster never changes under the cache)."""
    t = _TOPOLOGIES.get(id(cluster))
    if t is None or t.cluster is not cluster:
        if len(_TOPOLOGIES) > 64:
            _TOPOLOGIES.clear()
        t = _TOPOLOGIES[id(cluster)] = Topology(cluster)
    return t
