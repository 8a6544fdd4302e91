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
from typing import Any, NamedTuple

from autotune.cost import disaggregation, helixpipe, report
from autotune.cost import windows as WIN
from autotune.cost.data_parallel import ADAM_BYTES_PER_PARAM, exposure  # noqa: F401  (ADAM_*: its old home)
from autotune.cost.memory import TERM_NAMES  # noqa: F401  (its old home)
from autotune.cost.pipeline_parallel import replica_stages, simulate_replicas
from autotune.cost.rank import rank_cost_memo
from autotune.cost.steps import step_context, tp_groups
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
             documents: Any = None, kernels: Any = None, balances: tuple[str, ...] = (),
             beat: float | None = None, rows_up_to: int | None = None) -> Estimate | None:
    """Predict one training step of ``plan`` (resolved here; PlanError when it does not fit).

    ``timeline=True`` also fills ``breakdown["timeline"]`` with the simulated events (None
    otherwise); ``calibration`` is ``{device type: {"compute": f, "comm": f}}`` from ``validate``;
    ``documents``: the length distribution (``autotune.documents.LengthDistribution``) packed into
    the windows, priced by ``cost/documents.py`` when the plan masks documents (``doc_mask``).
    A plan with ``uses`` runs on that subset of ``cluster`` (autotune/specs/pool.py). ``kernels``: the
    per-kernel costs of the runtime that will run the plan (``cost/kernels.py``,
    ``targets.kernel_costs``; None: autotune's own runtime). ``balances``: with documents, price the
    plan with each of these ways of dealing windows to replicas (``Plan.balance``) and return the
    fastest (the first among equals): they share the priced steps, so each costs little more.
    ``beat`` (a step time > 0; with a length distribution only): None instead of the ``Estimate``
    when the plan's step time is no shorter (``_documents``: a plan that cannot win is not reported).
    ``rows_up_to``: the per-rank rows (``breakdown["ranks"]``) only up to this many ranks; above it
    ``breakdown["ranks"]`` is None and ``breakdown["ranks_dropped"]`` the world, as a search stores a
    trial (``search.pricing.trim_breakdown``), and the rows are never built (None: always built)."""
    if plan.uses is not None:
        from autotune.specs.pool import subset

        cluster = subset(cluster, plan.uses)
    s = step_context(plan, model, cluster, seq_len, global_batch, calibration, kernels)
    rows = rows_up_to is None or s.plan.world <= rows_up_to
    if documents is not None and s.plan.doc_mask:
        WIN.check(s.plan, model)
        return _documents(s, cluster, documents, timeline, balances or (s.plan.balance,), beat, rows)
    predicted, breakdown = _price(s, timeline, rows)
    return Estimate(plan=s.plan, predicted=predicted, breakdown=breakdown)


def _price(s: Any, timeline: bool, rows: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """(predicted, breakdown) of one step context (``rows``: with its per-rank rows)."""
    return _report(_step(s), timeline, rows)


def _documents(s: Any, cluster: Any, documents: Any, timeline: bool, balances: tuple[str, ...],
               beat: float | None = None, rows: bool = True) -> Estimate | None:
    """The ``Estimate`` of a plan with document masks, the fastest of ``balances``. Drawn from a
    distribution: the two works of its CP layout (``documents_summary.works``: the mean window's and
    each step's heaviest window's, each given to every replica) priced as steps (``_step``), their
    replicas' ends read, and per balance the expected step over the dealt steps from them
    (``documents_summary.expected_step``: how windows are dealt moves only which replica gets which
    work); a plan over its devices' memory at the typical work is priced at that work alone (memory
    is every work's: each window is S tokens); given windows: every step priced as it is (``_given``). Then the report of the one priced
    step ``documents.combine`` keeps (the nearest the expected step), not of every step. ``beat``:
    None when the expected step cannot be below it (``documents_summary.step_floor`` reaches it
    after the typical step: the heavy one is not priced), or is not (nothing reported)."""
    from dataclasses import replace

    from autotune.cost import documents as DOC
    from autotune.cost import documents_summary as SUM
    from autotune.cost.context import ReplicaTemplates

    on_cpu = any(g.device.kind == "cpu" for g in cluster.groups)
    plans = [s.plan if b == s.plan.balance else s.plan.replace(balance=b) for b in balances]
    if isinstance(documents, DOC.GivenWindows):
        given = [_given(replace(s, plan=p), documents, on_cpu, timeline, rows) for p in plans]
        return max(given, key=lambda e: e.predicted["tokens_per_s"])  # max keeps the first of equals
    wk = SUM.works(s.plan, documents, s.seq_len, s.global_batch, on_cpu)
    replicas = ReplicaTemplates()  # the two works' contexts: copies of one template per place
    sims = [_step(replace(s, doc_work=wk.typical), replicas)]
    # memory does not move with the documents (every window is S tokens): a plan that does not fit is
    # ruled out at its typical work, whatever its expected step
    fits = all(c.memory_total <= c.spec.memory_bytes for *_, c in sims[0].groups)
    varies = wk.varies and fits
    xs = [SUM.replica_pairs(p, documents, s.seq_len, s.global_batch, wk) for p in plans] if varies else []
    ends = [_replica_ends(sims[0])] if varies else []
    if beat is not None and varies and min(SUM.step_floor(wk, x, ends[0]) for x in xs) >= beat:
        return None
    if varies:
        sims.append(_step(replace(s, doc_work=wk.heavy), replicas))
        ends.append(_replica_ends(sims[1]))
    steps = [sim.step for sim in sims]
    means = [SUM.expected_step(wk, x, ends, steps) for x in xs] if varies else [steps[0]] * len(plans)
    i = means.index(min(means))
    if beat is not None and means[i] >= beat:
        return None
    predicted, breakdown = DOC.combine(steps, lambda k: _report(sims[k], timeline, rows), documents, plans[i], s.model,
                                       s.seq_len, s.global_batch, means[i])
    return Estimate(plan=plans[i], predicted=predicted, breakdown=breakdown)


def _given(s: Any, documents: Any, on_cpu: bool, timeline: bool, rows: bool = True) -> Estimate:
    """(predicted, breakdown) of given windows (``documents.GivenWindows``): every step's time
    (``_step``; the replicas' contexts copied from one template per place, ``context.ReplicaTemplates``),
    their mean, the report of the step nearest it."""
    import statistics
    from dataclasses import replace

    from autotune.cost import documents as DOC
    from autotune.cost.context import ReplicaTemplates

    replicas = ReplicaTemplates()  # shared by the steps: they differ only in their work
    steps = [replace(s, doc_work=w) for w in DOC.drawn_work(s.plan, documents, s.seq_len, s.global_batch, on_cpu)]
    sims = [_step(st, replicas) for st in steps]
    times = [sim.step for sim in sims]
    predicted, breakdown = DOC.combine(times, lambda i: _report(sims[i], timeline, rows), documents, s.plan, s.model,
                                       s.seq_len, s.global_batch, statistics.fmean(times))
    return Estimate(plan=s.plan, predicted=predicted, breakdown=breakdown)


def _replica_ends(sim: Any) -> Any:
    """Each DP replica's end of step in ``sim``: over the pipeline stages, its last rank's finish plus
    its own DP exposure and optimizer step (``data_parallel.exposure``, which ends a stage at the
    latest finish plus the largest of these)."""
    import numpy as np

    ends = []
    for d, rep in enumerate(sim.sims):
        end = 0.0
        for st, finish in enumerate(rep.rank_finish):
            costs = sim.per_rep_stage.get((d, st), {})
            tail = max((sim.exposed_of[(d, cid)] + c.optimizer for cid, c in costs.items()), default=0.0)
            end = max(end, finish + tail)
        ends.append(end)
    return np.asarray(ends, dtype=float)


class _Simulated(NamedTuple):
    """One step context simulated: its tp groups with their costs, the replicas' pipelines, the step."""

    context: Any
    """The step context the report reads (a disaggregated plan's own, ``disaggregation.overlapped``)."""
    groups: list
    per_rep_stage: dict
    sims: list
    step: float
    stage_end: list
    exposed_of: dict
    disaggregation: Any = None
    """HeterMoE's expert-only ranks' figures (``breakdown["disaggregation"]``); None without them."""


def _step(s: Any, replicas: Any = None) -> _Simulated:
    """The tp groups of ``s`` priced, each replica's schedule simulated, the DP exposure: the step time
    and what the report reads. ``replicas``: the drawn steps' ``context.ReplicaTemplates``."""
    own = None if s.schedule.chain else helixpipe  # a data flow that is no chain of stages: its own cost module
    costs: dict[int, Any] = {}
    groups = []
    for r0, dp_i, ctx in tp_groups(s, replicas):
        c = costs.get(id(ctx))
        if c is None:
            c = costs[id(ctx)] = own.rank_cost(ctx, rank_cost_memo(ctx)) if own else rank_cost_memo(ctx)
        groups.append((r0, dp_i, ctx, c))
    disagg = None
    if s.plan.disaggregate:  # HeterMoE's expert-only ranks, overlapped: its own cost module
        s, groups, disagg = disaggregation.overlapped(s, groups)
    per_rep_stage = replica_stages(groups)
    sims = own.simulate_replicas(s, per_rep_stage) if own else simulate_replicas(s, per_rep_stage)
    step, stage_end, exposed_of = exposure(s.pp, s.dp, sims, per_rep_stage)
    return _Simulated(s, groups, per_rep_stage, sims, step, stage_end, exposed_of, disagg)


def _report(sim: _Simulated, timeline: bool, per_rank: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """(predicted, breakdown) of one simulated step context; ``per_rank`` False: without its per-rank
    rows (``breakdown["ranks"]`` None, ``"ranks_dropped"`` the world, as ``trim_breakdown`` leaves it)."""
    s, groups, sims, step = sim.context, sim.groups, sim.sims, sim.step
    memory, capacity, rows, stage_mem, infeasible = report.rank_rows(s, groups, sim.exposed_of, step, per_rank)
    predicted, model_flops, peak = report.predicted_figures(s, groups, sims, step, memory, capacity, infeasible)
    stages = report.stage_rows(s, groups, sims, sim.per_rep_stage, rows, sim.stage_end, stage_mem)
    breakdown = report.breakdown(s, groups, sims, stages, rows, sim.stage_end, step, model_flops, peak)
    if sim.disaggregation is not None:
        breakdown["disaggregation"] = sim.disaggregation
    if timeline:
        breakdown["timeline"] = report.timeline(s, groups, sims, sim.per_rep_stage, sim.exposed_of)
    if not per_rank:
        breakdown["ranks"], breakdown["ranks_dropped"] = None, len(rows)
    return predicted, breakdown
