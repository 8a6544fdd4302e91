"""The CPU constants are frozen: their values in the code are the ones docs/cpu-constants.md records
(with the data that chose each), so none can be re-tuned after the held-out figures were taken
without the record saying so."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "cpu-constants.md"


def _table() -> list[tuple[str, str, object]]:
    rows = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| `([A-Z_]+)` \| `([a-z_.]+)` \| `([^`]+)` \|", line)
        if m:
            rows.append((m.group(1), m.group(2), ast.literal_eval(m.group(3).replace("1 / 50", "0.02"))))
    return rows


def test_every_constant_in_the_record_has_its_recorded_value():
    rows = _table()
    assert len(rows) >= 10
    for name, module, value in rows:
        actual = getattr(importlib.import_module(module), name)
        if isinstance(value, tuple):
            actual = tuple(actual)
        assert actual == value, f"{module}.{name} = {actual!r}, docs/cpu-constants.md records {value!r}"


def test_every_cpu_constant_is_in_the_record():
    cpu = importlib.import_module("autotune.cost.cpu")
    recorded = {name for name, module, _ in _table() if module == "autotune.cost.cpu"}
    constants = {n for n, v in vars(cpu).items() if re.fullmatch(r"[A-Z][A-Z0-9_]+", n)
                 and isinstance(v, (int, float, dict, tuple)) and not isinstance(v, bool)}
    assert constants <= recorded, f"not in docs/cpu-constants.md: {sorted(constants - recorded)}"
