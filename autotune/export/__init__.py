"""Exporters: a resolved plan as the configuration of the framework people train with.

``export(plan or PlanRecord, ctx, fmt)`` returns an ``Export`` (file text plus the same content as data) or raises
``ExportRefused`` naming everything the target cannot express and the nearest plan it can, priced by
the cost model. One module per target: json_plan, megatron, torchtitan, deepspeed, accelerate;
``launch`` builds the torchrun command of autotune's own runtime. Every target is asked through
``export.stages.Routed`` (``EXPORTERS``, ``exporter``), the one place a per-stage plan is told apart:
the target modules of frameworks that build one mesh see only plans of one mesh.
"""

from __future__ import annotations

from autotune.errors import InputError, suggest
from autotune.export import accelerate, deepspeed, json_plan, megatron, torchtitan
from autotune.export.common import Export, ExportContext, ExportRefused, refuse_or_pass, write_atomic
from autotune.export.stages import Routed
from autotune.plan import Plan
from autotune.plan_record import PlanRecord

EXPORTERS: dict[str, Routed] = {
    json_plan.NAME: Routed(json_plan, writes_stages=True),  # the plan file carries its stages
    # frameworks of one mesh: a per-stage plan is routed to autotune/export/stages.py (export.stages.Routed)
    **{m.NAME: Routed(m) for m in (megatron, torchtitan, deepspeed, accelerate)},
}
FORMATS = tuple(EXPORTERS)

__all__ = ["EXPORTERS", "FORMATS", "Export", "ExportContext", "ExportRefused", "export", "exporter",
           "write_atomic"]


def exporter(fmt: str) -> Routed:
    if fmt not in EXPORTERS:
        raise InputError(f"unknown format {fmt!r}" + suggest(fmt, EXPORTERS), field="--format")
    return EXPORTERS[fmt]


def export(plan: Plan | PlanRecord, ctx: ExportContext, fmt: str) -> Export:
    """The plan (resolved against ``ctx``; with what was predicted and measured for it when a
    PlanRecord) in format ``fmt``, or ExportRefused."""
    target = exporter(fmt)
    record = target.as_exported(plan if isinstance(plan, PlanRecord) else PlanRecord(plan), ctx)
    refuse_or_pass(target, record, ctx)  # type: ignore[arg-type]
    return target.render(record, ctx)
