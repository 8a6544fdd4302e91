"""The planning side's layout rules, read from the source: each parallel dimension's cost in a module
named after it, no module of the device model reaching the CPU trial physics, functions that fit a
screen, and no import cycle between the profiler's compute sweeps and its per-call costs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COST = ROOT / "autotune" / "cost"
DIMENSIONS = ("compute", "tensor_parallel", "ulysses", "context_parallel", "data_parallel", "pipeline_parallel",
              "memory")


def _imports(path: Path) -> set[str]:
    """Every module a file imports (at any level, lazy imports included), as dotted names."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("name", DIMENSIONS)
def test_each_dimension_has_its_module_and_the_device_model_leaves_cpu_alone(name):
    path = COST / f"{name}.py"
    assert path.exists()
    imported = _imports(path)
    if name != "compute":  # compute.py hands a CPU device's rates to cpu.py, and only that
        assert not any(m == "autotune.cost.cpu" or m.startswith("autotune.cost.cpu.") for m in imported), name


PLANNING = [*sorted(COST.glob("*.py")), *sorted((ROOT / "autotune" / "search").glob("*.py")),
            *sorted((ROOT / "autotune" / "schedules").glob("*.py")), *sorted((ROOT / "search_spaces").glob("*.py")),
            *(ROOT / "autotune" / f for f in ("plan.py", "plan_record.py", "divisibility.py", "targets.py",
                                               "study.py"))]


def test_functions_fit_a_screen():
    """No function on the planning side (cost model, search, schedules, search spaces, the plan and
    its rules) longer than 50 lines unless its docstring says why it is longer than a screen."""
    long = []
    for path in PLANNING:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 50 and "longer than a screen" not in " ".join((ast.get_docstring(node) or "").lower().split()):
                    long.append(f"{path.relative_to(ROOT)}:{node.name} {n} lines")
    assert len(PLANNING) > 40 and not long, long


def test_profiler_compute_and_overheads_do_not_import_each_other():
    compute, overheads = ROOT / "profilers" / "compute.py", ROOT / "profilers" / "overheads.py"
    assert not any(m.startswith("profilers.compute") for m in _imports(overheads))
    assert any(m.startswith("profilers.overheads") for m in _imports(compute))  # one direction only
