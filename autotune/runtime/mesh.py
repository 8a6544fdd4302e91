"""Process groups for one Plan's mesh (``MESH_ORDER`` = pp, dp, cp, hp, tp; tp innermost).

The mesh is an explicit object handed to every layer (as torchtitan passes ``ParallelDims``): no
global group manager. ``new_group`` is collective, so every rank creates every group of every
dimension in the same order; a rank keeps only the groups it belongs to. Dimensions of size 1 get no
group (``None``) and the layers skip their communication.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autotune import dims
from autotune.plan import MESH_ORDER, Plan


def backend_for(device: torch.device) -> str:
    """gloo on CPU, NCCL on CUDA (the only two backends the runtime drives)."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class Axis:
    """This rank's view of one mesh dimension."""

    size: int
    index: int
    ranks: list[int]
    group: dist.ProcessGroup | None  # None when size == 1


@dataclass
class Mesh:
    """The groups of one plan seen from one rank."""

    plan: Plan
    rank: int
    device: torch.device
    axes: dict[str, Axis] = field(default_factory=dict)
    grad: Axis | None = None
    """Ranks holding the same parameter shard (same pp and tp coordinate): dp x cp x hp. Gradients
    are SUM-reduced over it because every one of them saw different tokens."""
    timeout_s: float | None = None
    """The groups' timeout (for groups made later with the same one, e.g. ``runtime/tied.py``)."""

    def __getitem__(self, dim: str) -> Axis:
        return self.axes[dim]

    @property
    def coords(self) -> dict[str, int]:
        return {d: a.index for d, a in self.axes.items()}


_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def _new_group(ranks: list[int], timeout_s: float | None) -> dist.ProcessGroup:
    """``dist.new_group``, once per rank set and timeout in this process: creating a gloo group costs
    tenths of a second per rank, and a launch that runs many plans (the tests) meets the same rank
    sets again. Every rank runs the same plans in the same order, so every rank hits or misses the
    cache together and the collective ``new_group`` calls still match."""
    key = (id(dist.group.WORLD), tuple(ranks), timeout_s)
    group = _GROUPS.get(key)
    if group is None:
        kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        group = _GROUPS[key] = dist.new_group(ranks, **kw)
    return group


def build_mesh(plan: Plan, rank: int, device: torch.device, timeout_s: float | None = None) -> Mesh:
    """Create every group of ``plan`` (collective over the default group: all ranks must call it)."""
    if plan.world != dist.get_world_size():
        raise RuntimeError(f"plan world {plan.world} != process group world {dist.get_world_size()}")
    mesh = Mesh(plan=plan, rank=rank, device=device, timeout_s=timeout_s)
    coords = plan.coords(rank)
    for dim in MESH_ORDER:
        size = getattr(plan.degrees, dim)
        mine = plan.group_ranks(dim, rank)
        group = None
        if size > 1:
            for ranks in plan.all_groups(dim):
                g = _new_group(ranks, timeout_s)
                if rank in ranks:
                    group = g
        mesh.axes[dim] = Axis(size=size, index=coords[dim], ranks=mine, group=group)
    # the gradient group: the dimensions dense gradients reduce over (dp, cp, hp), the others fixed
    grad_groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(plan.world):
        c = plan.coords(r)
        grad_groups.setdefault(tuple(c[d] for d in MESH_ORDER if d not in dims.DENSE_REDUCE), []).append(r)
    mine = grad_groups[tuple(coords[d] for d in MESH_ORDER if d not in dims.DENSE_REDUCE)]
    group = None
    if len(mine) > 1:
        for key in sorted(grad_groups):
            g = _new_group(grad_groups[key], timeout_s)
            if rank in grad_groups[key]:
                group = g
    mesh.grad = Axis(size=len(mine), index=mine.index(rank), ranks=mine, group=group)
    return mesh


def single_process_mesh(plan: Plan, device: torch.device) -> Mesh:
    """A mesh of one rank without any process group (the reference run, plan world 1)."""
    mesh = Mesh(plan=plan, rank=0, device=device)
    for dim in MESH_ORDER:
        mesh.axes[dim] = Axis(size=1, index=0, ranks=[0], group=None)
    mesh.grad = Axis(size=1, index=0, ranks=[0], group=None)
    return mesh
