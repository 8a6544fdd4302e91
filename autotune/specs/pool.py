"""Pools: what a user could use (how many nodes of each group at most, at what price per device and
hour) and the subsets a plan may run on.

A node group of a cluster file may say ``available: 4`` (at most 4 nodes of it may be used; with
``count`` beside it, ``count`` is how many a plan must use at least, else 0) and ``price:
"2.10USD/h"`` (per device and hour, the unit written like every other figure). The ClusterSpec of
such a file holds every available node (``NodeGroup.count`` = ``available``): a plan without
``uses`` runs on all of them, as on any cluster. A plain cluster file (no ``available``) is a pool
whose every device is used: its groups offer one choice, all nodes (``choices``).

A plan on a subset says ``uses``: nodes per node group, the first ``uses[g]`` nodes of group ``g``
(the shape agreed with per-stage plans). ``subset(pool, uses)`` is the ClusterSpec of those nodes
(groups with 0 dropped, node indices renumbered in node order, overrides kept between kept nodes);
its plan's placement names nodes of that sub-cluster, ``pool_nodes`` maps them back.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from autotune.errors import InputError

_PRICE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]{3})\s*/\s*(h|hr|hour)\s*$")
PRICE_EXAMPLE = '"2.10USD/h"'


def parse_price(value: Any, field: str) -> tuple[float, str]:
    """``"2.10USD/h"`` -> (2.1, "USD"): a price per device and hour with its currency (three letters)."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise InputError(f"expected a price per device and hour with its currency, e.g. {PRICE_EXAMPLE}, "
                         f"got {value!r}", field=field)
    m = _PRICE_RE.match(value)
    if m is None:
        raise InputError(f"expected a price per device and hour with its currency, e.g. {PRICE_EXAMPLE} "
                         f"(units: CUR/h, CUR/hr, CUR/hour), got {value!r}", field=field)
    return float(m.group(1)), m.group(2).upper()


def pool_terms(nd: dict[str, Any], where: str, count: int | None) -> tuple[int, int | None, float | None, str]:
    """A node group's pool keys: (nodes in the pool, the least a plan must use or None for a plain
    group, price per device-hour or None, currency). ``count``: the group's ``count`` if written."""
    from autotune.specs import fields as F

    price, currency = (None, "")
    if nd.get("price") is not None:
        price, currency = parse_price(nd["price"], f"{where}.price")
    if nd.get("available") is None:
        return (1 if count is None else count), None, price, currency
    avail = F.get_int(nd, "available", f"{where}.available")
    least = 0 if count is None else count
    if least > avail:
        raise InputError(f"count({least}) is the least a plan must use and cannot exceed available({avail})",
                         field=f"{where}.count")
    return avail, least, price, currency


def choices(cluster: Any) -> list[range]:
    """Per node group, the node counts a plan may use (a plain group: all of them, one choice)."""
    out = []
    for g in cluster.groups:
        least = g.count if getattr(g, "minimum", None) is None else g.minimum
        out.append(range(least, g.count + 1))
    return out


def is_pool(cluster: Any) -> bool:
    """Whether any group lets a plan use fewer nodes than it has."""
    return any(len(r) > 1 for r in choices(cluster))


def full_uses(cluster: Any) -> tuple[int, ...]:
    return tuple(g.count for g in cluster.groups)


def check_uses(cluster: Any, uses: tuple[int, ...], field: str = "uses") -> None:
    if len(uses) != len(cluster.groups):
        raise InputError(f"{len(uses)} entries, but cluster {cluster.name!r} has {len(cluster.groups)} node groups "
                         "(one node count per group)", field=field)
    for g, (n, r) in enumerate(zip(uses, choices(cluster), strict=True)):
        if n not in r:
            raise InputError(f"uses[{g}] = {n}, but node group {g} ({cluster.groups[g].device.name}) offers "
                             f"{r.start}..{r.stop - 1} nodes", field=field)
    if not any(uses):
        raise InputError("uses no node at all", field=field)


_SUBSETS: dict[tuple[int, tuple[int, ...]], tuple[Any, Any]] = {}
_SUBSET_OF: dict[int, tuple[Any, tuple[int, ...]]] = {}


def subset(cluster: Any, uses: tuple[int, ...] | None) -> Any:
    """The ClusterSpec of the first ``uses[g]`` nodes of each node group ``g`` of ``cluster``.

    ``None`` or every node: ``cluster`` itself (so a plain cluster prices bit for bit as before).
    Memoised per (cluster object, uses): caches downstream key on the cluster's id, and a search
    prices thousands of plans on one subset. Idempotent: the subset of a subset made with the same
    ``uses`` is itself."""
    if uses is None:
        return cluster
    uses = tuple(uses)
    made = _SUBSET_OF.get(id(cluster))
    if made is not None and made[0] is cluster and made[1] == uses:
        return cluster
    if uses == full_uses(cluster):
        return cluster
    hit = _SUBSETS.get((id(cluster), uses))
    if hit is not None and hit[0] is cluster:
        return hit[1]
    check_uses(cluster, uses)
    old_to_new: dict[int, int] = {}
    node = 0
    groups = []
    for g, n in zip(cluster.groups, uses, strict=True):
        for k in range(g.count):
            if k < n:
                old_to_new[node] = len(old_to_new)
            node += 1
        if n:
            groups.append(dataclasses.replace(g, count=n, minimum=None))
    overrides = tuple((old_to_new[a], old_to_new[b], lk) for a, b, lk in cluster.overrides
                      if a in old_to_new and b in old_to_new)
    sub = type(cluster)(name=f"{cluster.name}[{uses_text(uses)}]", groups=tuple(groups), inter_node=cluster.inter_node,
                      overrides=overrides, source=cluster.source, digest=cluster.digest)
    if len(_SUBSETS) > 512:
        _SUBSETS.clear()
        _SUBSET_OF.clear()
    _SUBSETS[(id(cluster), uses)] = (cluster, sub)
    _SUBSET_OF[id(sub)] = (sub, uses)
    return sub


def plan_cluster(plan: Any, cluster: Any) -> Any:
    """The cluster a plan runs on: the subset its ``uses`` names, else ``cluster``."""
    return subset(cluster, getattr(plan, "uses", None))


def uses_text(uses: tuple[int, ...]) -> str:
    return ",".join(map(str, uses))


def pool_nodes(cluster: Any, uses: tuple[int, ...] | None) -> list[int]:
    """Node ``k`` of ``subset(cluster, uses)`` is pool node ``pool_nodes(...)[k]``."""
    if uses is None:
        return list(range(cluster.num_nodes))
    out, start = [], 0
    for g, n in zip(cluster.groups, uses, strict=True):
        out += list(range(start, start + n))
        start += g.count
    return out


# ---- prices ------------------------------------------------------------------------------------
def currency(cluster: Any) -> str:
    """The one currency of the pool's prices ('' when no group has a price); mixed currencies refused."""
    groups = [(i, g) for i, g in enumerate(cluster.groups) if getattr(g, "price", None) is not None]
    cur = {g.currency for _, g in groups}
    if len(cur) > 1:  # every group's currency, so the user sees which to rewrite
        each = ", ".join(f"nodes[{i}] ({g.device.name}) {g.currency}" for i, g in groups)
        raise InputError(f"prices in several currencies: {each}; write every price in one currency",
                         source=getattr(cluster, "source", None) or None, field="nodes[].price")
    return cur.pop() if cur else ""


def missing_price(cluster: Any) -> str | None:
    """The field a cost needs and the pool lacks (the first group without a price), or None."""
    for i, g in enumerate(cluster.groups):
        if getattr(g, "price", None) is None:
            return f"nodes[{i}].price"
    return None


def priced(cluster: Any) -> bool:
    return missing_price(cluster) is None


def hourly(cluster: Any, uses: tuple[int, ...] | None) -> float | None:
    """What the devices of ``uses`` cost per hour (None: a group in use has no price)."""
    uses = uses if uses is not None else full_uses(cluster)
    total = 0.0
    for g, n in zip(cluster.groups, uses, strict=True):
        if n == 0:
            continue
        if getattr(g, "price", None) is None:
            return None
        total += n * g.devices_per_node * g.price
    return total


def devices_of(cluster: Any, uses: tuple[int, ...] | None) -> int:
    uses = uses if uses is not None else full_uses(cluster)
    return sum(n * g.devices_per_node for g, n in zip(cluster.groups, uses, strict=True))


def left_out(cluster: Any, uses: tuple[int, ...] | None) -> list[tuple[int, int, str]]:
    """Per node group with nodes left out: (group, devices left out, device name)."""
    if uses is None:
        return []
    return [(i, (g.count - n) * g.devices_per_node, g.device.name)
            for i, (g, n) in enumerate(zip(cluster.groups, uses, strict=True)) if n < g.count]


def describe_uses(cluster: Any, uses: tuple[int, ...] | None) -> str:
    """``8 H100-SXM + 4 A100-80GB`` (the devices a plan uses)."""
    uses = uses if uses is not None else full_uses(cluster)
    parts = [f"{n * g.devices_per_node} {g.device.name}" for g, n in zip(cluster.groups, uses, strict=True) if n]
    return " + ".join(parts) or "nothing"


def subset_text(cluster: Any, uses: tuple[int, ...] | None) -> str | None:
    """``uses 8 H100-SXM of pool lab; left out 8 V100-16GB (node group 1: 1 of 1 nodes)``, or None
    for a plan on every device."""
    gone = left_out(cluster, uses)
    if not gone:
        return None
    assert uses is not None
    parts = [f"{n} {name} (node group {g}: {cluster.groups[g].count - uses[g]} of {cluster.groups[g].count} nodes)"
             for g, n, name in gone]
    return f"uses {describe_uses(cluster, uses)} of pool {cluster.name}; left out " + ", ".join(parts)
