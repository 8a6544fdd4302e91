"""Divisibility rules: which degrees, micro-batches and even splits a model and a batch allow.

Written once here and asked by the plan (``Plan.resolve`` names every broken rule), the search space
(search_spaces/default.py rejects a point before it builds a plan) and the exporters (a framework
that splits heads evenly needs the heads of a tp rank to divide by the Ulysses degree). Each rule
returns ``(field, text)`` pairs: the plan prefixes the field, the space records the text.
"""

from __future__ import annotations

from typing import Any


def degree_problems(deg: Any, model: Any, devices: int, virtual_stages: int = 1) -> list[tuple[str, str]]:
    """The degrees against the device count and the model's heads and layers."""
    p = []
    if deg.world != devices:
        p.append(("degrees", f"{deg.product_text()} = {deg.world} != devices({devices})"))
    if model.heads % deg.tp:
        p.append(("degrees.tp", f"heads({model.heads}) not divisible by tp({deg.tp})"))
    if model.kv_heads % deg.tp:
        p.append(("degrees.tp", f"kv_heads({model.kv_heads}) not divisible by tp({deg.tp})"))
    if deg.hp > model.heads // max(deg.tp, 1):
        p.append(("degrees.hp", f"hp({deg.hp}) > heads per tp rank({model.heads // max(deg.tp, 1)})"))
    if deg.pp * virtual_stages > model.layers:
        p.append(("degrees.pp", f"pp({deg.pp})*virtual_stages({virtual_stages}) > layers({model.layers}): "
                                "a stage would have no layers"))
    return p


def min_microbatches(schedule: str, pp: int) -> int:
    """Micro-batches a replica needs at least: 1F1B (plain or interleaved) fills the pipeline first."""
    return pp if schedule in ("1f1b", "interleaved_1f1b") and pp > 1 else 1


def microbatch_multiple(schedule: str, pp: int) -> int:
    """Interleaved 1F1B runs micro-batches in groups of pp: a replica's count must divide by it."""
    return pp if schedule == "interleaved_1f1b" else 1


def microbatch_problems(schedule: str, pp: int, counts: list[int]) -> list[tuple[str, str]]:
    """The micro-batch count of every data-parallel replica against the schedule."""
    p = []
    if counts and min(counts) < min_microbatches(schedule, pp):
        p.append(("num_microbatches", f"{schedule} needs at least pp({pp}) micro-batches per replica, "
                                      f"a replica has {min(counts)}"))
    if microbatch_multiple(schedule, pp) > 1 and any(c % pp for c in counts):
        p.append(("num_microbatches", f"interleaved_1f1b needs micro-batches per replica divisible by "
                                      f"pp({pp}), got {counts}"))
    return p


def even_heads_problem(model: Any, tp: int, hp: int, name: str = "hp") -> str | None:
    """A framework that splits the heads of a tp rank evenly over ``hp`` Ulysses ranks needs them to divide."""
    per = model.heads // tp
    if hp > 1 and per % hp:
        return f"heads per tp rank ({per}) not divisible by {name}({hp})"
    return None
