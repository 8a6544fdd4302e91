"""Exporting per-stage plans (``autotune/stages.py``): who runs them, who refuses and what is nearest.

The exporters' one dispatch on a plan's form: every exporter is asked through ``Routed``
(``export.EXPORTERS``), which sends a plan of one mesh to the target module's own rules and a
per-stage plan here, so no target module asks which form it was given.

autotune's runtime runs every per-stage plan (``--target runtime``; the JSON export carries its
stages). Megatron-LM, torchtitan, DeepSpeed and Accelerate build one device mesh with one tp and one
dp for the whole model, so a plan whose stages or replicas differ in tp, or that leaves devices out,
is refused with that reason, and the nearest plan they can express is a uniform one: the study's own
best plan for each target (when the plan came from a study), and each tp the plan uses over the
whole cluster at the nearest pipeline depth the cluster divides into, with the plan's layers per
stage and with even layers (priced as the target runs them, the fastest kept:
``export.common.nearest_expressible``). A per-stage plan that is a uniform mesh in
disguise (one tp, every device, ranks in mesh order) is that uniform plan (``as_uniform``): the
framework runs it exactly, so it is exported, not refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from autotune import stages as ST
from autotune.errors import InputError
from autotune.plan import Degrees, Plan, Shares
from autotune.plan_record import PlanRecord

FRAMEWORK_MESH = {
    "megatron": "Megatron-LM builds one tensor-, pipeline- and data-parallel mesh for the whole model",
    "torchtitan": "torchtitan's ParallelDims gives the whole model one tp and one dp",
    "deepspeed": "DeepSpeed's PipelineModule runs one tp and one dp for every stage",
    "accelerate": "Accelerate runs one data-parallel (or FSDP) layout for the whole model",
}


@dataclass(frozen=True)
class Routed:
    """An exporter as every caller asks it (``export.exporter``): ``module``'s own rules
    (``reasons``, ``candidates``, ``render``) for a plan of one mesh; for a per-stage plan, unless
    the module writes stages as they are, the uniform plan it is (``as_uniform``), else the one
    reason that it is not and the nearest uniform plans as candidates (``staged_reasons``,
    ``staged_candidates``)."""

    module: ModuleType
    writes_stages: bool = False
    """True: the module writes a per-stage plan as it is (``json``: the plan file carries its stages)."""

    @property
    def NAME(self) -> str:  # noqa: N802  (the exporter modules' own attribute names)
        return self.module.NAME

    @property
    def SUFFIX(self) -> str:  # noqa: N802
        return self.module.SUFFIX

    @property
    def KERNELS(self) -> Any:  # noqa: N802  (None: the target prices as autotune's runtime)
        return getattr(self.module, "KERNELS", None)

    @property
    def check_file(self) -> Callable[..., None] | None:
        return getattr(self.module, "check_file", None)

    def _routes(self, plan: Plan) -> bool:
        return plan.per_stage and not self.writes_stages

    def as_exported(self, record: PlanRecord, ctx: Any) -> PlanRecord:
        """``record`` as this target checks and writes it: a per-stage plan that is a uniform mesh in
        disguise is that mesh (the framework runs it exactly)."""
        u = as_uniform(record.plan, ctx) if self._routes(record.plan) else None
        return record if u is None else dataclasses.replace(record, plan=u)

    def reasons(self, plan: Plan, ctx: Any) -> list[str]:
        if self._routes(plan):
            return staged_reasons(plan, ctx, self.NAME, self.module.reasons)
        return self.module.reasons(plan, ctx)

    def candidates(self, plan: Plan, ctx: Any) -> list[Plan]:
        if self._routes(plan):  # each nearest uniform plan, then what the target would try from it
            return [q for c in staged_candidates(plan, ctx) for q in (c, *self.module.candidates(c, ctx))]
        return self.module.candidates(plan, ctx)

    def render(self, record: PlanRecord, ctx: Any) -> Any:
        return self.module.render(record, ctx)


def as_uniform(plan: Plan, ctx: Any) -> Plan | None:
    """The uniform plan a resolved per-stage ``plan`` is, when it is one: every replica at one tp,
    every device of ``ctx.cluster`` used; ranks are numbered alike (stage, replica, cp, hp, tp rank),
    so the placement carries over, and the cp/hp split with its token shards. None otherwise."""
    if not plan.is_uniform or plan.world != ctx.cluster.num_devices:
        return None
    d = plan.degrees
    u = Plan(degrees=Degrees(pp=d.pp, dp=d.dp, cp=d.cp, hp=d.hp, tp=d.tp), micro_batch_size=plan.micro_batch_size,
             schedule=plan.schedule, virtual_stages=plan.virtual_stages, recompute=plan.recompute,
             zero_stage=plan.zero_stage, dtype=plan.dtype, cp_layout=plan.cp_layout,
             shares=Shares(layers=plan.shares.layers, tokens=plan.shares.tokens, samples=plan.shares.samples),
             placement=plan.placement)
    try:
        return u.resolve(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)
    except InputError:
        return None


def staged_reasons(plan: Plan, ctx: Any, target: str, reasons: Callable[[Plan, Any], list[str]]) -> list[str]:
    """Why ``target`` cannot run per-stage ``plan``: its own reasons for the uniform plan it is, or
    the one reason that it is not uniform."""
    u = as_uniform(plan, ctx)
    if u is not None:
        return reasons(u, ctx)
    used = f"{plan.world} of {ctx.cluster.num_devices} devices"
    return [f"{ST.degrees_text(plan.to_dict())} ({used}): {FRAMEWORK_MESH.get(target, target + ' runs one mesh')}; "
            "per-stage device groups and degrees run on autotune's runtime (--target runtime)"]


def staged_candidates(plan: Plan, ctx: Any) -> list[Plan]:
    """Uniform plans near a per-stage one: first the plans its study found best for each target
    (``ctx.study_plans``: the search's own best plan a framework runs, priced beside the others), then
    each tp it uses (and 1) over the whole cluster at the pipeline depth nearest its stage count that
    divides the cluster (its own when it does, with its layers per stage too), with even layers."""
    n, p = ctx.cluster.num_devices, len(plan.stages)
    out = [q for q in getattr(ctx, "study_plans", ()) if not q.per_stage]
    for pp in nearest_depths(n, p, ctx.model.layers):
        for tp in sorted({*plan.tp_degrees(), 1}, reverse=True):
            if n % (pp * tp):
                continue
            deg = Degrees(pp=pp, dp=n // (pp * tp), tp=tp)
            base = Plan(degrees=deg, micro_batch_size=plan.micro_batch_size,
                        schedule=plan.schedule if pp > 1 else "1f1b",
                        virtual_stages=plan.virtual_stages if pp == p else 1, recompute=plan.recompute,
                        zero_stage=plan.zero_stage if deg.dp > 1 else 0, dtype=plan.dtype)
            out += [base.replace(shares=Shares(layers=plan.shares.layers)), base] if pp == p else [base]
    return out


def nearest_depths(devices: int, stages: int, layers: int) -> list[int]:
    """Pipeline depths a uniform mesh of ``devices`` can take (divisors, at most ``layers``) nearest
    ``stages``: the stage count itself when it divides, else the nearest one on each side (3 stages
    on 16 devices: 2 and 4)."""
    ok = [d for d in range(1, min(devices, layers) + 1) if devices % d == 0]
    if stages in ok:
        return [stages]
    below = [d for d in ok if d < stages]
    above = [d for d in ok if d > stages]
    return above[:1] + below[-1:]
