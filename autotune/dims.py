"""The one list of parallel dimensions: each declared once, with what the rest of autotune asks of it.

``Degrees`` takes its fields from ``DIMENSIONS`` (``autotune/plan_parts.py``); its world, inline
form, JSON and product text, the mesh's groups and strides, ``Plan.coords``, the step context's link
strides and ZeRO shard sizes (``cost/context.py``), the plan checks' shares, the default space's
degree knobs, the runtime's process groups (``runtime/mesh.py``) and the exporters' "can express"
rules (``export/common.unexpressed``) iterate this tuple instead of naming dimensions. What adding a
dimension takes is written in docs/architecture.md ("The parallel dimensions").

The model is torchtitan's ``ParallelDims`` (degrees declared once, validated once, asked by
everyone); the mesh order (pp outermost, tp innermost) is its order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Dimension:
    """One parallel dimension: what every other module asks of it."""

    name: str
    """``dp``, ``pp``, ``cp``, ``hp``, ``tp``: the ``Degrees`` field and the mesh axis."""
    doc: str
    """One line for users and docs."""
    inline_key: str
    """Its key in an inline plan (``-p dp=8,tp=2``)."""
    share: str | None
    """The ``Shares`` field it may carry uneven (``samples``, ``layers``, ``tokens``, ``heads``)."""
    folds: bool
    """False: its degree multiplies the world; True: it regroups ranks the other dimensions already
    count (expert parallelism folds onto the attention ranks of one pipeline stage)."""
    mesh: str
    """The mesh it orders in: ``attention`` (pp, dp, cp, hp, tp) or ``expert``."""
    zero_shards: bool
    """ZeRO shards optimizer state, gradients and weights over its groups (the ranks that hold the
    same parameters: dp, and cp and hp, whose ranks hold whole weights as DP replicas do)."""
    reduces: str | None
    """Which gradients are reduced over its groups: ``dense`` (dp, cp, hp), ``expert``, or None."""


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension(name="pp", doc="pipeline stages (physical; virtual stages are the plan's virtual_stages)",
              inline_key="pp", share="layers", folds=False, mesh="attention", zero_shards=False, reduces=None),
    Dimension(name="dp", doc="data-parallel replicas", inline_key="dp", share="samples", folds=False,
              mesh="attention", zero_shards=True, reduces="dense"),
    Dimension(name="cp", doc="context-parallel (ring attention) shards of the sequence", inline_key="cp",
              share="tokens", folds=False, mesh="attention", zero_shards=True, reduces="dense"),
    Dimension(name="hp", doc="head-parallel (Ulysses all-to-all) ranks", inline_key="hp", share="heads",
              folds=False, mesh="attention", zero_shards=True, reduces="dense"),
    Dimension(name="tp", doc="tensor-parallel (Megatron) ranks", inline_key="tp", share=None, folds=False,
              mesh="attention", zero_shards=False, reduces=None),
    Dimension(name="ep", doc="expert-parallel ranks, each holding its share of every MoE layer's routed experts "
              "(folded onto each stage's dp*cp*hp*tp ranks; absent: 1)", inline_key="ep", share="experts",
              folds=True, mesh="expert", zero_shards=False, reduces=None),
    Dimension(name="etp", doc="expert tensor-parallel ranks, each expert's FFN split over them (absent: 1)",
              inline_key="etp", share=None, folds=True, mesh="expert", zero_shards=False, reduces=None),
)
"""Every parallel dimension, in mesh order, outermost first (rank = ((pp_i*dp + dp_i)*cp + ...)*tp + tp_i);
the expert mesh's (ep, etp: folded onto each stage's ranks as edp, ep, etp, etp innermost; edp is
derived, ``Degrees.edp``, and its groups are ``plan_parts.expert_groups``)."""

WRITTEN_FIRST = "dp"
"""Users write the replicas first (``dp=8,pp=2,tp=2``): the written order (``written``) is this
dimension, then the rest in mesh order, so plan JSON, inline plans and messages read as before."""

_BY_NAME = {d.name: d for d in DIMENSIONS}
NAMES: tuple[str, ...] = tuple(d.name for d in DIMENSIONS)
"""Every dimension's name, in mesh order."""
WRITTEN: tuple[str, ...] = tuple(sorted(NAMES, key=lambda n: n != WRITTEN_FIRST))
"""Every dimension's name in the order plans write them (JSON ``degrees``, inline, product text)."""


def dimension(name: str) -> Dimension:
    """The declaration of ``name`` (KeyError for a name that is not declared)."""
    return _BY_NAME[name]


@cache
def mesh_names(mesh: str = "attention") -> tuple[str, ...]:
    """The dimensions ordered in ``mesh``, outermost first (memoised: the declarations are constant,
    and ``stride`` asks for every tp group of every plan a search prices)."""
    return tuple(d.name for d in DIMENSIONS if d.mesh == mesh)


MESH_ORDER = mesh_names("attention")
"""The attention mesh's order (pp, dp, cp, hp, tp): ranks are its linearised coordinates."""
SHARED_BY = tuple(d.name for d in DIMENSIONS if d.zero_shards and d.mesh == "attention")
"""The dimensions whose ranks hold the same dense parameters: the ZeRO shard group (``shard_size``)."""
DENSE_REDUCE = tuple(d.name for d in DIMENSIONS if d.reduces == "dense")
"""The dimensions dense gradients are reduced over (the runtime's gradient group, ``runtime/mesh.py``)."""
SHARES: tuple[tuple[str, str], ...] = tuple((d.name, d.share) for d in DIMENSIONS if d.share)
"""(dimension, share field) of every dimension that carries a share, in mesh order."""


def world(degrees: Any) -> int:
    """Devices the degrees span: the product of the degrees that do not fold onto other ranks."""
    return math.prod(getattr(degrees, d.name) for d in DIMENSIONS if not d.folds)


def shard_size(degrees: Any) -> int:
    """Ranks holding the same dense parameters, over which ZeRO shards (dp * cp * hp today)."""
    return math.prod(getattr(degrees, n) for n in SHARED_BY)


def stride(degrees: Any, name: str) -> int:
    """Rank stride of ``name``'s groups in its mesh: the product of the degrees inside it."""
    return math.prod(getattr(degrees, n) for n in _inside(name))


@cache
def _inside(name: str) -> tuple[str, ...]:
    """The dimensions inside ``name`` in its mesh (whose degrees make its stride)."""
    mesh = mesh_names(dimension(name).mesh)
    return mesh[mesh.index(name) + 1:]


def groups(degrees: Any, name: str, world_size: int | None = None) -> list[list[int]]:
    """Every ``name`` group of the mesh ``degrees`` spans over ranks ``0 .. world - 1`` (default:
    ``world(degrees)``), ordered by first rank. Stride arithmetic (the same result as collecting each
    rank's group, which cost ~2 ms at 128 ranks inside every ``resolve``)."""
    n, s = getattr(degrees, name), stride(degrees, name)
    w = world(degrees) if world_size is None else world_size
    return [[r + i * s for i in range(n)] for r in range(w) if (r // s) % n == 0]


def ranks_along(degrees: Any, names: tuple[str, ...], rank: int) -> list[int]:
    """The ranks that differ from ``rank`` only along the dimensions ``names`` (of its mesh),
    ascending: e.g. ``SHARED_BY``, the ranks that hold the same dense parameters as ``rank``."""
    c = coords(degrees, rank)
    out = [rank - sum(c[n] * stride(degrees, n) for n in names)]
    for n in names:
        s = stride(degrees, n)
        out = [r + i * s for r in out for i in range(getattr(degrees, n))]
    return sorted(out)


def coords(degrees: Any, rank: int) -> dict[str, int]:
    """Attention-mesh coordinate of ``rank`` as {dimension: index}, in mesh order."""
    out: dict[str, int] = {}
    for name in reversed(MESH_ORDER):
        n = getattr(degrees, name)
        out[name] = rank % n
        rank //= n
    return {name: out[name] for name in MESH_ORDER}


def origin(**known: int) -> dict[str, int]:
    """A mesh coordinate with the ``known`` indices and 0 along every other dimension (a per-stage
    plan's cell names its stage, replica, cp, hp and tp index)."""
    unknown = set(known) - set(MESH_ORDER)
    if unknown:
        raise KeyError(f"not a dimension of the mesh: {sorted(unknown)}")
    return {name: known.get(name, 0) for name in MESH_ORDER}
