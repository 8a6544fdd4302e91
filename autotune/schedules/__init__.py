"""Pipeline schedules, one module each; ``get_schedule(name)`` is the one registry everybody asks.

Every module of this package (except ``base`` and names starting with ``_``) is imported here, and
each ``Schedule`` subclass with a ``name`` registers itself: adding a schedule is adding a module.
See ``base.py`` for what a schedule says about itself.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from typing import Any

from autotune.errors import InputError, suggest
from autotune.schedules.base import EXPORT_TARGETS, KIND_LETTERS, B, F, I, Op, Schedule, W, registry

__all__ = ["B", "EXPORT_TARGETS", "F", "I", "KIND_LETTERS", "W", "Op", "Schedule", "UnknownSchedule",
           "as_schedule", "get_schedule", "names", "schedule_of"]

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name != "base" and not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")

# the order plans, help texts and the search list them in: the built-ins first, then by name
_FIRST = ("gpipe", "1f1b", "interleaved_1f1b")


class UnknownSchedule(InputError):
    """A schedule name no module registers."""


def names() -> tuple[str, ...]:
    """Every registered schedule name."""
    reg = registry()
    return tuple(n for n in _FIRST if n in reg) + tuple(sorted(n for n in reg if n not in _FIRST))


def get_schedule(name: str) -> Schedule:
    """The schedule registered as ``name`` (one shared instance); UnknownSchedule otherwise."""
    if not isinstance(name, str) or name not in registry():
        raise UnknownSchedule(f"unknown schedule {name!r}" + suggest(str(name), names()), field="schedule")
    return _instance(name)


@cache
def _instance(name: str) -> Schedule:
    return registry()[name]()


def schedule_of(plan: Any) -> Schedule:
    """The plan's schedule, configured by the plan's own fields (``Schedule.for_plan``)."""
    return get_schedule(plan.schedule).for_plan(plan)


def as_schedule(schedule: Schedule | str) -> Schedule:
    """A schedule instance from an instance or a registered name."""
    return schedule if isinstance(schedule, Schedule) else get_schedule(schedule)
