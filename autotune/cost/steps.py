"""The step context and the tensor-parallel groups of any plan: a uniform mesh's from
``cost/context.py``, a per-stage plan's (``Plan.stages``: each stage its own degrees) from
``cost/stages.py``, which builds on the first. The cost model's one dispatch on the plan's form
(``Plan.per_stage``): the estimate and the memory checks ask here, so the two context modules never
import each other and neither asks which form it was given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autotune.cost import context as CX
from autotune.cost import stages as STG


def step_context(plan: Any, model: Any, cluster: Any, seq_len: int, global_batch: int,
                 calibration: Mapping[str, Mapping[str, float]] | None, kernels: Any = None) -> Any:
    """Resolve ``plan`` (PlanError when it does not fit) and gather what every rank shares;
    ``kernels``: the runtime's per-kernel costs (``cost/kernels.py``; None: autotune's own)."""
    if plan.per_stage:
        rp = plan.resolve(model, cluster, seq_len, global_batch)
        return STG.staged_step_context(rp, model, cluster, seq_len, global_batch, calibration, kernels)
    return CX.step_context(plan, model, cluster, seq_len, global_batch, calibration, kernels)


def tp_groups(s: Any, replicas: CX.ReplicaTemplates | None = None) -> list[tuple[int, int, Any]]:
    """(first rank, DP index, context) of every tensor-parallel group in rank order; ``replicas``:
    the DP replicas' templates of an estimate's drawn steps of documents (``context.tp_groups``)."""
    return STG.staged_tp_groups(s) if s.plan.per_stage else CX.tp_groups(s, replicas)
