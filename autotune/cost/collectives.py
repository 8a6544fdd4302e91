"""Which collective model a device's links are priced with: the alpha-beta formulas of
``cost/comm.py`` (every GPU, a CPU without a profile), or a profiled CPU's measured gloo table
(``cost/cpu.py``). Above both, so neither imports the other to decide.
"""

from __future__ import annotations

from typing import Any

from autotune.cost.comm import FORMULAS
from autotune.cost.cpu import measured_collectives


def collectives_for(spec: Any) -> Any:
    """The collective model of a DeviceSpec: a profiled CPU's measured gloo table
    (``cpu.measured_collectives``), else the formulas."""
    if spec.kind != "cpu":
        return FORMULAS
    return measured_collectives(spec)
