"""A plan with what was said and seen about it: the cost model's ``predicted`` figures, a trial's
``measured`` ones and the ``provenance`` an export writes (study, trial, cluster, profiles).

The Plan itself is configuration (``autotune.plan``): two plans with the same degrees, shares and
schedule are equal and hash alike whatever was predicted or measured for them. The plan JSON users
read and write keeps its ``predicted``, ``measured`` and ``provenance`` keys (``RECORD_KEYS``, after
the configuration, as they always were); this record is what reads and writes them, and a study's
trials store the same dict.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.plan import RECORD_KEYS, Plan, read_plan


@dataclass(frozen=True)
class PlanRecord:
    plan: Plan
    predicted: dict[str, Any] | None = None
    """The cost model's figures (``Estimate.predicted``) for ``plan`` on the cluster it was priced on."""
    measured: dict[str, Any] | None = None
    """A real trial's figures (``TrialResult.measured``), once validated or run."""
    provenance: dict[str, Any] | None = None
    """Where an exported plan came from (``export.common.provenance``)."""

    @classmethod
    def from_dict(cls, d: Any, source: str | None = None) -> PlanRecord:
        """A plan JSON (a file, a study trial's ``plan`` attribute): the Plan and its record keys,
        each checked to be a mapping or null (``Plan.from_dict`` raises PlanError otherwise)."""
        plan = Plan.from_dict(d, source=source)
        return cls(plan, **{k: d.get(k) for k in RECORD_KEYS})

    def to_dict(self) -> dict[str, Any]:
        return {**self.plan.to_dict(), **{k: getattr(self, k) for k in RECORD_KEYS}}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def replace(self, **kw: Any) -> PlanRecord:
        return dataclasses.replace(self, **kw)

    def tokens_per_s(self) -> float | None:
        """Predicted tokens/s, None when not priced (or priced without a throughput)."""
        v = (self.predicted or {}).get("tokens_per_s")
        return None if v is None else float(v)


def load_record(path_or_inline: str | Path) -> PlanRecord:
    """A plan file (or an inline ``dp=2,pp=2`` string, which records nothing) with its record."""
    plan, record, _ = read_plan(path_or_inline)
    return PlanRecord(plan, **record)
