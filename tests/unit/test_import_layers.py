"""The direction of imports: every package of autotune sits in one layer and imports only from its own
layer or the layers below it, and no modules import one another in a circle (docs/architecture.md,
"Layers").

Every import statement counts, those inside functions too (an import moved into a function is still
an arrow); only imports under ``if TYPE_CHECKING:`` do not (annotations, never executed). A module's
layer is that of the longest prefix ``LAYERS`` names.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("autotune", "profilers", "search_spaces")

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # bottom first
    ("base", ("autotune", "autotune.errors", "autotune.units", "autotune.defaults", "autotune.consoles", "autotune.hostfile",
              "autotune.progress", "autotune.machine_load", "autotune.specs.fields")),
    ("specs", ("autotune.specs", "autotune.divisibility", "autotune.documents", "autotune.token_files")),
    ("schedules", ("autotune.schedules",)),
    ("plan", ("autotune.dims", "autotune.plan_parts", "autotune.plan_checks", "autotune.plan", "autotune.stages",
              "autotune.plan_record")),
    ("cost", ("autotune.cost", "autotune.advice", "autotune.objective")),
    ("runtime", ("autotune.runtime",)),
    ("export", ("autotune.export",)),
    ("profilers", ("profilers", "autotune.machines")),
    ("search", ("autotune.study", "autotune.study_sqlite", "autotune.study_known", "autotune.study_direct", "autotune.targets", "search_spaces", "autotune.search")),
    ("validate", ("autotune.validate", "autotune.runtime.control", "autotune.export.source",
                  "autotune.export.apply")),
    ("dashboard", ("autotune.dashboard",)),
    ("commands", ("autotune.commands", "autotune.cli", "autotune.__main__")),
)

ALLOWED: dict[tuple[str, str], str] = {}
"""(importer, imported) -> why this arrow may point up or close a circle. Expected: none."""


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's ``__init__``)."""
    out = {}
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _known(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from a.b import c`` is ``a.b.c`` when that is a
    module, else ``a.b``)."""
    mods = modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [_known(a.name, mods) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[:len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else _known(base, mods)
                           for a in node.names]
            edges[name].update(t for t in targets if t and t != name)
    return edges


def layer_of(module: str) -> int:
    best, layer = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), i
    assert layer is not None, f"{module} is in no layer: add it to LAYERS (and docs/architecture.md)"
    return layer


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if (v, w) in ALLOWED:
                    continue
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_every_module_is_in_a_layer():
    for name in modules():
        layer_of(name)


def test_no_import_points_up():
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
              for a, targets in sorted(import_graph().items()) for b in sorted(targets)
              if layer_of(b) > layer_of(a) and (a, b) not in ALLOWED]
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "modules that import one another in a circle:\n" + "\n".join(map(str, found))


def test_the_checks_see_what_they_must():
    """The reader finds an import made inside a function, skips one under TYPE_CHECKING, resolves a
    relative import, and the two checks fail on an upward arrow and on a circle."""
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from autotune.cli import app\n"
           "def f():\n    from autotune.cost import estimate\n")
    tree = ast.parse(src)
    skip = _type_checking_nodes(tree)
    seen = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and id(n) not in skip]
    assert seen == ["typing", "autotune.cost"]
    edges = import_graph()
    assert "autotune.cost.estimate" in edges["autotune.cost"]  # ``from autotune.cost.estimate import``
    assert "autotune.schedules.base" in edges["autotune.schedules.helixpipe"]
    assert layer_of("autotune.commands.apply") > layer_of("autotune.cost.rank") > layer_of("autotune.plan")
    assert layer_of("autotune.export.source") > layer_of("autotune.export.common")  # longest prefix wins
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
