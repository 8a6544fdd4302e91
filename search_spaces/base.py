"""What every search space shares: the context it is built for and the shape of a rejected point.

A space maps a dict of parameter values (one fixed Optuna distribution per name, the same for every
trial of a study, so TPE models each name consistently) to a Plan with ``build(params)``. Points
that cannot be a plan (degrees whose product does not divide the device count, a sequence the CP
and Ulysses ranks cannot split) come back as ``Infeasible`` with the limit that broke, so the
search can record them and say which limit rules each family out.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

from autotune import dims
from autotune.plan import DIMS, Plan


@dataclass(frozen=True, kw_only=True)
class SearchContext:
    """The workload a space is built for."""

    model: Any
    """ModelSpec."""
    cluster: Any
    """ClusterSpec."""
    seq_len: int
    global_batch: int
    dtype: str = "bf16"
    target: str = "runtime"
    """Who will run the plans (``autotune/targets.py``): the space has the recipe knobs it runs."""
    grad_reduce: str = "fp32"
    """The gradient reduction every plan takes (``Plan.grad_reduce``; the user's call: ``_recipe.py``)."""

    @cached_property
    def speeds(self) -> list[float]:
        """Per cluster device: the FLOP/s it reaches in ``dtype`` (peak x achievable fraction, or 0
        when it lacks the dtype). Only ratios matter: they weight the balanced shares."""
        out = []
        for d in self.cluster.devices:
            peak = d.spec.peak_flops.get(self.dtype, 0.0)
            out.append(peak * d.spec.achievable_fraction)
        return out

    @cached_property
    def memories(self) -> list[float]:
        return [d.spec.memory_bytes for d in self.cluster.devices]

    @cached_property
    def heterogeneous(self) -> bool:
        return len({(round(s), round(m)) for s, m in zip(self.speeds, self.memories, strict=True)}) > 1


@dataclass(frozen=True)
class Infeasible:
    """A point that is no plan: ``kind`` is the limit (divisibility, schedule, batch, memory)."""

    kind: str
    reason: str
    family: str = ""


_FAMILY_ORDER = (dims.MESH_ORDER[-1], *dims.MESH_ORDER[:-1], *(n for n in dims.NAMES if n not in dims.MESH_ORDER))
"""A family names its dimensions innermost (tp) first, then in mesh order: ``tp+pp+dp``."""


def family_of(plan_or_degrees: Any) -> str:
    """The family a plan belongs to: the dimensions it uses, e.g. ``tp+pp+dp`` (``single`` for none)."""
    deg = plan_or_degrees.degrees if isinstance(plan_or_degrees, Plan) else plan_or_degrees
    used = [d for d in _FAMILY_ORDER if getattr(deg, d, 1) > 1]
    return "+".join(used) or "single"


class Space(Protocol):
    name: str
    ctx: SearchContext

    def distributions(self) -> dict[str, Any]: ...
    def build(self, params: dict[str, Any]) -> Plan | Infeasible: ...
    def baselines(self) -> list[tuple[str, dict[str, Any]]]: ...
    def grid_size(self) -> int: ...
    def grid(self) -> list[dict[str, Any]]: ...
    def neighbours(self, params: dict[str, Any]) -> list[dict[str, Any]]: ...


__all__ = ["DIMS", "Infeasible", "SearchContext", "Space", "family_of"]
