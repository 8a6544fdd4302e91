"""Exporters: a resolved plan as the configuration of the framework people train with.

``export(plan or PlanRecord, ctx, fmt)`` returns an ``Export`` (file text plus the same content as data) or raises
``ExportRefused`` naming everything the target cannot express and the nearest plan it can, priced by
the cost model. One module per target: json_plan, megatron, torchtitan, deepspeed, accelerate;
``launch`` builds the torchrun command of autotune's own runtime.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

from autotune.errors import InputError, suggest
from autotune.export import accelerate, deepspeed, json_plan, megatron, torchtitan
from autotune.export.common import Export, ExportContext, ExportRefused, refuse_or_pass, write_atomic
from autotune.plan import Plan
from autotune.plan_record import PlanRecord

EXPORTERS: dict[str, ModuleType] = {m.NAME: m for m in (json_plan, megatron, torchtitan, deepspeed, accelerate)}
FORMATS = tuple(EXPORTERS)

__all__ = ["EXPORTERS", "FORMATS", "Export", "ExportContext", "ExportRefused", "export", "exporter",
           "write_atomic"]


def exporter(fmt: str) -> ModuleType:
    if fmt not in EXPORTERS:
        raise InputError(f"unknown format {fmt!r}" + suggest(fmt, EXPORTERS), field="--format")
    return EXPORTERS[fmt]


def export(plan: Plan | PlanRecord, ctx: ExportContext, fmt: str) -> Export:
    """The plan (resolved against ``ctx``; with what was predicted and measured for it when a
    PlanRecord) in format ``fmt``, or ExportRefused."""
    mod = exporter(fmt)
    record = plan if isinstance(plan, PlanRecord) else PlanRecord(plan)
    if record.plan.stages is not None and fmt != "json":  # a uniform mesh in disguise is that mesh
        from autotune.export.stages import as_uniform

        u = as_uniform(record.plan, ctx)
        if u is not None:
            record = dataclasses.replace(record, plan=u)
    refuse_or_pass(mod, record, ctx)  # type: ignore[arg-type]
    return mod.render(record, ctx)
