"""Divisibility rules: which degrees and even splits a model and a batch allow.

Written once here and asked by the plan (``Plan.resolve`` names every broken rule), the search space
(search_spaces/default.py rejects a point before it builds a plan) and the exporters (a framework
that splits heads evenly needs the heads of a tp rank to divide by the Ulysses degree). Each rule
returns ``(field, text)`` pairs: the plan prefixes the field, the space records the text. The
micro-batch rules belong to each pipeline schedule (autotune/schedules: ``min_microbatches``,
``microbatch_multiple``), which the plan and the space ask the same way.
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


def even_heads_problem(model: Any, tp: int, hp: int, name: str = "hp") -> str | None:
    """A framework that splits the heads of a tp rank evenly over ``hp`` Ulysses ranks needs them to divide."""
    per = model.heads // tp
    if hp > 1 and per % hp:
        return f"heads per tp rank ({per}) not divisible by {name}({hp})"
    return None
