"""The plan itself as JSON: resolved shares, ``predicted`` and (when validated) ``measured``, and
provenance. Checked against the shipped schema (autotune/schema/plan.schema.json) before it is
written and read back through ``load_plan`` (which checks it again) before the file is renamed into
place, so a file that exists is a file ``autotune apply --plan`` accepts."""

from __future__ import annotations

import json
from pathlib import Path

from autotune.export.common import Export, ExportContext, provenance
from autotune.plan import Plan, check_schema, load_plan
from autotune.plan_record import PlanRecord

NAME = "json"
SUFFIX = ".json"


def reasons(plan: Plan, ctx: ExportContext) -> list[str]:
    return []  # every plan is expressible as itself


def candidates(plan: Plan, ctx: ExportContext) -> list[Plan]:
    return [plan]


def render(record: PlanRecord, ctx: ExportContext) -> Export:
    d = record.replace(provenance=provenance(record, ctx)).to_dict()
    check_schema(d, source="exported plan")
    return Export(format=NAME, text=json.dumps(d, indent=2) + "\n", data=d, suffix=SUFFIX)


def check_file(path: Path) -> None:
    """Read the written file back as ``--plan`` would (schema included)."""
    load_plan(path)
