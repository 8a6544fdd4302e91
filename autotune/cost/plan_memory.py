"""A whole plan's memory per rank, for checks that need no timing: the runtime's pre-launch check
(``runtime/trial.py``: ``peak_rank_memory``) and the advice when nothing fits (``advice.py``:
``rank_memory_terms``). Each tp group's terms come from ``cost/memory.py`` (the formulas), scaled
to a layer profile's measured activations where the device has one (``cost/layers.py``), on the
step contexts ``cost/steps.py`` builds: the same memory model the estimate prices.
"""

from __future__ import annotations

from typing import Any

from autotune.cost.layers import measured_activations
from autotune.cost.memory import block_activations, rank_memory
from autotune.cost.steps import step_context, tp_groups


def peak_rank_memory(plan: Any, model: Any, cluster: Any, seq_len: int, global_batch: int
                     ) -> tuple[float, int, dict[str, float]]:
    """(bytes, rank, terms) of the rank that needs the most memory under ``plan`` (resolved here):
    the cost model's memory, for checks that need no timing (the runtime's pre-launch check)."""
    best: tuple[float, int, dict[str, float]] | None = None
    for r0, _, total, terms in _group_memory(plan, model, cluster, seq_len, global_batch):
        if best is None or total > best[0]:
            best = (total, r0, terms)
    assert best is not None
    return best


def rank_memory_terms(plan: Any, model: Any, cluster: Any, seq_len: int, global_batch: int, rank: int
                      ) -> tuple[float, dict[str, float]]:
    """(bytes, terms) of rank ``rank`` under ``plan``: what a search's stored trial no longer holds
    when it dropped its per-rank rows (more than 64 ranks), for the advice when nothing fits."""
    for r0, tp, total, terms in _group_memory(plan, model, cluster, seq_len, global_batch):
        if r0 <= rank < r0 + tp:
            return total, terms
    raise ValueError(f"rank {rank} is not in the plan's {plan.world} ranks")


def _group_memory(plan: Any, model: Any, cluster: Any, seq_len: int, global_batch: int) -> Any:
    """(first rank, tp, bytes, terms) of every tp group (a per-stage plan's cell at its own tp), each
    distinct context priced once."""
    step = step_context(plan, model, cluster, seq_len, global_batch, None)
    seen: dict[int, tuple[float, dict[str, float]]] = {}
    for r0, _, ctx in tp_groups(step):
        hit = seen.get(id(ctx))
        if hit is None and ctx.step.experts is not None:  # a MoE rank: its mix of dense and MoE layers
            from autotune.cost.rank import rank_cost_memo

            c = rank_cost_memo(ctx)
            hit = seen[id(ctx)] = (c.memory_total, c.memory_terms)
        if hit is None:
            kept, full, scores = block_activations(ctx)
            kept, full = measured_activations(ctx, kept, full, scores)
            hit = seen[id(ctx)] = rank_memory(ctx, kept, full)
        yield r0, ctx.step.tp, hit[0], hit[1]
