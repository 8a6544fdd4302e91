"""``estimate(plan, model, cluster, seq_len, global_batch)``: step time, tokens/s, MFU, memory per
rank and the reasons, composed from one module per parallel dimension.

How the pieces fit (``docs/architecture.md`` draws the layout):

1. ``context.step_context`` resolves the plan once (PlanError when it does not fit the model or the
   cluster) and gathers what every rank shares; ``context.tp_groups`` gives each tensor-parallel
   group (its ranks share a node, hence a device type, and do identical work) a ``RankContext``:
   its coordinates (``Plan.coords``), device, links and shares.
2. ``rank.rank_cost`` prices one block per micro-batch from ``compute`` (GEMMs, causal attention on
   its CP shard and heads, elementwise traffic), ``tensor_parallel``, ``ulysses``,
   ``context_parallel`` (ring passes beyond the attention they hide behind) and ``data_parallel``
   (ZeRO-3 gathers beyond the block they prefetch for), with recomputation; then the chunks of its
   pipeline rank (``pipeline_parallel``), its step-level DP terms and its ``memory``. On a CPU the
   trial physics of ``cpu.py`` joins in; accelerators never read it.
3. A pipeline stage of one DP replica runs at the pace of its slowest rank; the schedule is
   simulated per replica (``pipeline.py``) over these stage times and the sends between stages.
4. DP gradient synchronisation starts when every replica has finished; the reduce part overlaps
   with the last micro-batch's backward, the rest is exposed; then the optimizer step
   (``data_parallel.exposure``).
5. ``report`` turns it into per-rank rows, ``predicted`` and the ``breakdown``; memory over a
   device's capacity is infeasible and the reason names the largest term.

Speed: everything is computed once per distinct TP group context, stage times and simulations are
shared between identical replicas, and the cluster lookups are cached (comm.Topology). The Gantt
``timeline`` costs a few hundred small dicts; pass ``timeline=False`` (the default) to skip it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.cost import report
from autotune.cost.context import step_context, tp_groups
from autotune.cost.data_parallel import ADAM_BYTES_PER_PARAM, exposure  # noqa: F401  (ADAM_*: its old home)
from autotune.cost.memory import TERM_NAMES  # noqa: F401  (its old home)
from autotune.cost.pipeline_parallel import replica_stages, simulate_replicas
from autotune.cost.rank import rank_cost_memo
from autotune.plan import Plan
from autotune.plan_record import PlanRecord


@dataclass
class Estimate:
    """What the cost model says about one plan."""

    plan: Plan
    """The resolved plan (configuration; the figures are ``predicted`` beside it)."""
    predicted: dict[str, Any]
    breakdown: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.record().to_dict(), "predicted": self.predicted, "breakdown": self.breakdown}

    def record(self) -> PlanRecord:
        """The resolved plan with its prediction, as plan JSON carries it."""
        return PlanRecord(self.plan, predicted=self.predicted)


def estimate(plan: Plan, model: Any, cluster: Any, seq_len: int, global_batch: int, *,
             calibration: dict[str, dict[str, float]] | None = None, timeline: bool = False,
             kernels: Any = None) -> Estimate:
    """Predict one training step of ``plan`` (resolved here; PlanError when it does not fit).

    ``timeline=True`` also fills ``breakdown["timeline"]`` with the simulated events (None
    otherwise); ``calibration`` is ``{device type: {"compute": f, "comm": f}}`` from ``validate``;
    ``kernels`` the per-kernel costs of the runtime that will run the plan (``cost/kernels.py``,
    ``targets.kernel_costs``; None: autotune's own runtime)."""
    s = step_context(plan, model, cluster, seq_len, global_batch, calibration, kernels)
    own = None if s.schedule.chain else s.schedule  # a data flow that is no chain of stages prices itself
    costs: dict[int, Any] = {}
    groups = []
    for r0, dp_i, ctx in tp_groups(s):
        c = costs.get(id(ctx))
        if c is None:
            c = costs[id(ctx)] = own.price_rank(ctx, rank_cost_memo(ctx)) if own else rank_cost_memo(ctx)
        groups.append((r0, dp_i, ctx, c))
    per_rep_stage = replica_stages(groups)
    sims = own.simulate_replicas(s, per_rep_stage) if own else simulate_replicas(s, per_rep_stage)
    step, stage_end, exposed_of = exposure(s.pp, s.dp, sims, per_rep_stage)
    memory, capacity, rows, stage_mem, infeasible = report.rank_rows(s, groups, exposed_of, step)
    predicted, model_flops, peak = report.predicted_figures(s, groups, sims, step, memory, capacity, infeasible)
    stages = report.stage_rows(s, groups, sims, per_rep_stage, rows, stage_end, stage_mem)
    breakdown = report.breakdown(s, groups, sims, stages, rows, stage_end, step, model_flops, peak)
    if timeline:
        breakdown["timeline"] = report.timeline(s, groups, sims, per_rep_stage, exposed_of)
    return Estimate(plan=s.plan, predicted=predicted, breakdown=breakdown)
