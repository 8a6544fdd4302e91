"""One plan form (issue 36 item 2), read from the source: a uniform plan and a per-stage plan are
asked alike, so no module outside the plan's own construction and (de)serialisation branches on
whether ``stages`` is set; where the work itself differs (the cost contexts, the runtime, the
exporters of frameworks that build one mesh), one dispatch point per layer asks ``Plan.per_stage``.
A reference test beside it: ``Plan``'s form accessors answer a per-stage plan and the uniform plan
it is written as (``stages.as_stages``) alike.
"""

from __future__ import annotations

import ast
from pathlib import Path

from autotune import stages as ST
from autotune.plan import Degrees, Plan
from autotune.specs.cluster import load_cluster
from autotune.specs.model import load_model

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("autotune", "search_spaces", "profilers")

CONSTRUCTION = {
    "autotune/plan.py": "the Plan: its form's accessors (per_stage, tp_degrees, is_uniform, world, coords), "
                        "resolve, to_dict and from_dict",
    "autotune/plan_parts.py": "the parts a plan is built of and the stored plan's even-split rule",
    "autotune/stages.py": "the per-stage plan's rules, resolution, local placement (on_local_devices) and JSON",
}
"""Where ``stages`` may be tested for presence: the plan's construction and (de)serialisation."""

DISPATCH = {
    "autotune/cost/steps.py": "the step context and tp groups: cost/context.py or cost/stages.py",
    "autotune/runtime/worker.py": "_runtime: the mesh builder and trainer (runtime/stages.py for per-stage plans)",
    "autotune/export/stages.py": "Routed: a per-stage plan to the nearest uniform plan or a refusal, "
                                 "for every target that builds one mesh",
}
"""The one place per layer that asks a plan's form (``Plan.per_stage``), and what it sends where."""


def _is_stages(node: ast.AST) -> bool:
    """``x.stages`` or ``getattr(x, "stages", ...)``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "stages"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "stages")


def _truth_tests(tree: ast.AST):
    """Every expression Python reads as true or false: if/while/assert/ternary tests, the operands of
    and/or/not, comprehension filters."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            yield node.test
        elif isinstance(node, ast.BoolOp):
            yield from node.values
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield node.operand
        elif isinstance(node, ast.comprehension):
            yield from node.ifs


def form_branches(source: str) -> list[int]:
    """Lines that branch on whether a plan has ``stages``: ``x.stages is None`` / ``is not None`` /
    ``== None``, or ``x.stages`` read as a truth value."""
    tree = ast.parse(source)
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_stages(s) for s in sides) and any(
                    isinstance(s, ast.Constant) and s.value is None for s in sides):
                lines.add(node.lineno)
    lines |= {t.lineno for t in _truth_tests(tree) if _is_stages(t)}
    return sorted(lines)


def form_questions(source: str) -> list[int]:
    """Lines that read ``.per_stage``."""
    return sorted({n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)
                   and n.attr == "per_stage"})


def _sources():
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")


def test_the_scan_finds_each_way_of_asking():
    planted = ("if plan.stages is not None:\n    pass\n"
               "x = 1 if p.stages else 2\n"
               "ok = q.stages is None\n"
               "y = [a for a in b if not a.stages]\n"
               "z = getattr(plan, 'stages', None) and 3\n"
               "w = plan.stages == None\n"
               "n = len(plan.stages)\n")  # a read of the stages, not a branch on their presence
    assert form_branches(planted) == [1, 3, 4, 5, 6, 7]
    assert form_questions("if plan.per_stage:\n    pass\nv = plan.is_uniform\n") == [1]


def test_no_branch_on_the_plan_form_outside_its_construction():
    found = [f"{name}:{line}" for name, src in _sources() if name not in CONSTRUCTION
             for line in form_branches(src)]
    assert not found, "ask Plan.per_stage in a dispatch point (DISPATCH), or an accessor of both forms: " + ", ".join(found)


def test_the_form_is_asked_only_at_the_dispatch_points():
    asked = {name: form_questions(src) for name, src in _sources()}
    stray = [f"{name}:{line}" for name, lines in asked.items() if name not in CONSTRUCTION | DISPATCH for line in lines]
    assert not stray, stray
    assert all(asked[name] for name in DISPATCH), {n: asked[n] for n in DISPATCH}  # the table names real ones


def test_the_uniform_context_is_reached_only_through_the_dispatch():
    """``cost/context.py``'s step context and tp groups price one mesh and no longer refuse a per-stage
    plan themselves: only ``cost/steps.py`` (which tells the forms apart) may call them."""
    users = []
    for name, src in _sources():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and node.module == "autotune.cost.context":
                users += [f"{name}:{a.name}" for a in node.names if a.name in ("step_context", "tp_groups")]
            if (isinstance(node, ast.Attribute) and node.attr in ("step_context", "tp_groups")
                    and isinstance(node.value, ast.Name) and node.value.id == "CX" and name != "autotune/cost/steps.py"):
                users.append(f"{name}:CX.{node.attr}")
    assert not users, users


def test_the_accessors_answer_both_forms_alike():
    """A uniform plan and the same plan written stage by stage (``as_stages``): the same world,
    coordinates, tp degrees and uniformity; a per-stage plan of two tps is neither uniform nor even."""
    model, cluster = load_model("tiny"), load_cluster("local:8")
    mesh = Plan(degrees=Degrees(pp=2, dp=2, tp=2)).resolve(model, cluster, 128, 8)
    staged = Plan(stages=ST.as_stages(mesh, cluster), schema_version=3).resolve(model, cluster, 128, 8)
    assert (mesh.per_stage, staged.per_stage) == (False, True)
    assert staged.world == mesh.world == 8 and staged.tp_degrees() == mesh.tp_degrees() == (2,)
    assert staged.is_uniform and mesh.is_uniform
    assert [staged.coords(r) for r in range(8)] == [mesh.coords(r) for r in range(8)]
    assert staged.layout() == mesh.layout()
    mixed = ST.Stage(layers=model.layers // 2, replicas=(ST.Replica(tp=2, devices=(4, 5)), ST.Replica(tp=1, devices=(6,))))
    two = Plan(stages=(staged.stages[0], mixed), schema_version=3)
    assert two.tp_degrees() == (1, 2) and not two.is_uniform and not two.is_even()
