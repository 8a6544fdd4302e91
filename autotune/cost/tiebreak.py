"""The tie-break rule: when predictions tie within a tolerance, the simpler plan ranks first.

A cost model's figures carry its error (``docs/validation.md``: several percent on real trials), so
two plans within ``TIE_TOLERANCE`` of each other are not told apart by their tokens/s; ranking them
by a difference the model cannot see would put a ZeRO-2 plan above the identical ZeRO-1 plan for
nothing. Among tied plans the simpler one wins, by ``simplicity`` in this order:

1. the lower ZeRO stage (fewer collectives, less that can go wrong, more targets that run it);
2. fewer parallel dimensions in use (degrees above 1: each adds process groups and failure modes);
3. even shares before uneven ones (the Megatron/torchtitan shape every exporter can express).

Then the faster prediction, then the order the plans came in (so the rule is deterministic).

``rank(items, tokens_per_s=...)`` orders whole lists (the search's top plans); ``prefer(a, b)``
compares two. Ties are not transitive (a ~ b and b ~ c while a is faster than c beyond the
tolerance), so ``rank`` walks down the list: each place goes to the simplest plan within the
tolerance of the fastest plan not yet placed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from autotune.plan import DIMS, Plan

TIE_TOLERANCE = 0.01
"""Relative difference in predicted tokens/s below which two plans tie (1%)."""

T = TypeVar("T")


def simplicity(plan: Plan) -> tuple[int, int, int]:
    """(ZeRO stage, dimensions in use, 1 when any share is uneven): smaller is simpler."""
    d = plan.degrees
    used = sum(getattr(d, k) > 1 for k in DIMS)
    return plan.zero_stage, used, 0 if plan.is_even() else 1


def ties(a: float, b: float, tolerance: float = TIE_TOLERANCE) -> bool:
    """True when two throughputs differ by at most ``tolerance`` of the larger."""
    hi = max(a, b)
    return hi <= 0 or abs(a - b) <= tolerance * hi


def prefer(a: Plan, a_tps: float, b: Plan, b_tps: float, tolerance: float = TIE_TOLERANCE) -> bool:
    """True when plan ``a`` (``a_tps`` tokens/s predicted) ranks before ``b``."""
    if not ties(a_tps, b_tps, tolerance):
        return a_tps > b_tps
    if simplicity(a) != simplicity(b):
        return simplicity(a) < simplicity(b)
    return a_tps >= b_tps


def rank(items: Sequence[T], *, plan: Callable[[T], Plan], tokens_per_s: Callable[[T], float],
         tolerance: float = TIE_TOLERANCE, top: int | None = None) -> list[T]:
    """``items`` best first under the rule (the first ``top`` only, when given): each place goes to
    the simplest item whose tokens/s is within ``tolerance`` of the fastest item not yet placed."""
    left = sorted(range(len(items)), key=lambda i: -tokens_per_s(items[i]))
    out: list[T] = []
    want = len(items) if top is None else min(top, len(items))
    while len(out) < want:
        best_tps = tokens_per_s(items[left[0]])
        window = []
        for i in left:  # sorted fastest first: the tied ones lead
            if not ties(tokens_per_s(items[i]), best_tps, tolerance):
                break
            window.append(i)
        pick = min(window, key=lambda i: (simplicity(plan(items[i])), -tokens_per_s(items[i]), i))
        out.append(items[pick])
        left = [i for i in left if i != pick]
    return out


def best(items: Sequence[T], *, plan: Callable[[T], Plan], tokens_per_s: Callable[[T], float],
         tolerance: float = TIE_TOLERANCE) -> Any:
    """The item ``rank`` puts first (None for no items)."""
    r = rank(items, plan=plan, tokens_per_s=tokens_per_s, tolerance=tolerance, top=1)
    return r[0] if r else None
