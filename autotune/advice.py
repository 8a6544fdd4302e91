"""What to tell a user when no plan fits: one short line instead of every family's reasons.

The line names the plan that came closest to fitting (the smallest peak memory against its device's
capacity), what it needs against what the device has, what that memory is made of, and the levers
that plan does not pull yet and that shrink the part that dominates:

* activations (and logits) dominate: full recomputation, more pipeline stages or context-parallel
  shards, a shorter sequence;
* model states (weights, gradients, optimizer) dominate: ZeRO-3, more tensor or pipeline parallelism.
"""

from __future__ import annotations

from typing import Any

from autotune.stages import degrees_text
from autotune.units import fmt_bytes


def _tightest(trial: Any) -> tuple[float, int, dict[str, Any]] | None:
    """(memory / capacity, rank, plan dict) of the trial's fullest device, when it was priced."""
    plan = trial.user_attrs.get("plan") or {}
    pred = plan.get("predicted") or {}
    mem, cap = pred.get("memory_bytes") or [], pred.get("capacity_bytes") or []
    if not mem or len(cap) != len(mem):
        return None
    r = max(range(len(mem)), key=lambda i: mem[i] / cap[i])
    return mem[r] / cap[r], r, plan


def _levers(plan: dict[str, Any], activations: float, states: float, parts: dict[str, Any]) -> list[str]:
    from autotune.cost.data_parallel import grads_accumulate_unsharded

    deg = plan.get("degrees") or {}
    out = []
    if activations >= states:
        if plan.get("recompute") != "full":
            out.append("recompute=full")
        out += ["more pipeline stages (pp)", "more context parallelism (cp)", "a shorter sequence"]
    else:
        zero, nmb = plan.get("zero_stage") or 0, plan.get("num_microbatches") or 1
        grads = float(parts.get("gradients", 0.0))
        if (grads_accumulate_unsharded(zero, deg.get("pp", 1), nmb) and deg.get("pp", 1) == 1
                and grads >= max(float(parts.get("weights", 0.0)), float(parts.get("optimizer", 0.0)))):
            # ZeRO-2/3 accumulate several micro-batches' gradients whole (the cost model's and the
            # runtime's rule, data_parallel.grads_accumulate_unsharded); one micro-batch shards them
            out.append("one micro-batch per replica (a larger micro_batch_size: gradients stay sharded)")
        if zero < 3:
            out.append("ZeRO-3")
        out.append("more tensor or pipeline parallelism" if deg.get("tp", 1) * deg.get("pp", 1) > 1 else
                   "tensor or pipeline parallelism")
    return out


def nothing_fits(trials: list[Any], workload: tuple[Any, Any, int, int] | None = None) -> str | None:
    """The one-line advice, or None when no trial was priced (then there is no memory to speak of).
    ``workload`` (model, cluster, seq_len, global_batch): to price the closest plan's memory terms
    again where its trial dropped its per-rank rows (a search keeps them up to 64 ranks)."""
    priced = [(t, x) for t in trials if (x := _tightest(t)) is not None]
    if not priced:
        return None
    trial, (frac, rank, plan) = min(priced, key=lambda tx: tx[1][0])
    pred = plan["predicted"]
    need, have = pred["memory_bytes"][rank], pred["capacity_bytes"][rank]
    ranks = (trial.user_attrs.get("breakdown") or {}).get("ranks") or []
    row = ranks[rank] if rank < len(ranks) else {}
    parts = row.get("memory") or {}
    if not parts and workload is not None:
        parts, row = _terms_again(plan, rank, workload)
    states = sum(float(parts.get(k, 0.0)) for k in ("weights", "gradients", "optimizer"))
    activations = float(parts.get("activations", 0.0)) + float(parts.get("logits", 0.0))
    deg = degrees_text(plan)  # the one description of a plan (autotune/stages.py)
    device = f" on {row['device']}" if row.get("device") else ""
    what = ""
    if states + activations > 0:
        what = (f" (activations {fmt_bytes(activations)}, weights+gradients+optimizer {fmt_bytes(states)})")
    return (f"nothing fits: the smallest plan ({deg}, zero {plan.get('zero_stage', 0)}, recompute "
            f"{plan.get('recompute', 'none')}) needs {fmt_bytes(need)} per device{device}{what}, the device has "
            f"{fmt_bytes(have)}; try " + ", ".join(_levers(plan, activations, states, parts)))


def _terms_again(plan: dict[str, Any], rank: int, workload: tuple[Any, Any, int, int]
                 ) -> tuple[dict[str, float], dict[str, Any]]:
    """The memory terms of ``rank`` under the stored ``plan``, priced again, and its device."""
    from autotune.cost.plan_memory import rank_memory_terms
    from autotune.plan import Plan

    model, cluster, seq_len, global_batch = workload
    p = Plan.from_dict(plan).resolve(model, cluster, seq_len, global_batch)
    _, terms = rank_memory_terms(p, model, cluster, seq_len, global_batch, rank)
    e = p.placement[rank]
    device = next(d.spec.name for d in cluster.devices if (d.node, d.local) == (e.node, e.device))
    return terms, {"device": device}

