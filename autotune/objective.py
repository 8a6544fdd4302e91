"""What a search optimises on a pool, and what each plan costs: the one place that ranks plans by
the objective (``search --objective time|cost``, ``--budget``, ``--max-step-time``), so the search,
``apply``, ``validate`` and the dashboard name the same best plan.

Cost. A plan on the devices ``uses`` names costs their price per hour (``price`` per device and
hour in the cluster file, autotune/specs/pool.py) for as long as it trains: per trained step
``hourly x step_time / 3600``, per token that over the tokens of a step (reported per million
tokens). Without prices the comparable figure is the devices used (device-hours per token when
multiplied by the step time), which is what the front is drawn against then.

The study records its objective (``Objective.attrs``); each trial of a pool search records its
``uses`` and ``cost`` (``figures``). A plain search (a cluster without ``available``, objective
time, no limits) records neither and ranks by predicted tokens/s as it always has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.errors import InputError

OBJECTIVES = ("time", "cost")
STUDY_KEY = "objective"


@dataclass(frozen=True)
class Objective:
    kind: str = "time"
    """time: the fastest plan; cost: the cheapest per token (needs a price on every node group)."""
    budget: float | None = None
    """At most this much per hour for the devices a plan uses (``--budget "40USD/h"``)."""
    max_step_time: float | None = None
    """At most this step time in seconds (``--max-step-time 2s``)."""
    currency: str = ""
    pool: bool = False
    """Read back from a pool search's study (``of_study``): its plans differ in the devices they use,
    so even the time objective ranks equal speeds by cost (``sort_key``), never by tokens/s alone."""

    @property
    def plain(self) -> bool:
        """Ranks by tokens/s with no limit: today's search (not a pool search's study)."""
        return self.kind == "time" and self.budget is None and self.max_step_time is None and not self.pool

    def attrs(self) -> dict[str, Any]:
        return {"kind": self.kind, "budget": self.budget, "max_step_time": self.max_step_time,
                "currency": self.currency}

    @classmethod
    def from_attrs(cls, d: Any) -> Objective:
        if not isinstance(d, dict):
            return cls()
        return cls(kind=str(d.get("kind") or "time"), budget=d.get("budget"), max_step_time=d.get("max_step_time"),
                   currency=str(d.get("currency") or ""), pool=True)

    def text(self) -> str:
        what = "fastest" if self.kind == "time" else "cheapest per token"
        limits = []
        if self.budget is not None:
            limits.append(f"within {self.budget:g}{self.currency}/h")
        if self.max_step_time is not None:
            limits.append(f"within {self.max_step_time:g} s a step")
        return " ".join([what, *limits])


def make_objective(kind: str, budget: str | None, max_step_time: str | None, cluster: Any) -> Objective:
    """The options checked against the pool: cost and a budget need a price on every node group
    (refused in one line naming the first group without one)."""
    from autotune.specs.pool import currency, missing_price, parse_price
    from autotune.units import parse_time

    if kind not in OBJECTIVES:
        raise InputError(f"must be one of {', '.join(OBJECTIVES)}, got {kind!r}", field="--objective")
    cur = currency(cluster)
    b = None
    if budget is not None:
        b, bcur = parse_price(budget, "--budget")
        if cur and bcur != cur:
            raise InputError(f"the pool's prices are in {cur}, the budget in {bcur}", field="--budget")
    t = parse_time(max_step_time, field="--max-step-time", allow_zero=False) if max_step_time is not None else None
    need = [opt for opt, on in (("--objective cost", kind == "cost"), ("--budget", b is not None)) if on]
    missing = missing_price(cluster)
    if need and missing:
        raise InputError(f"{' and '.join(need)} need a price per device-hour on every node group of "
                         f"{getattr(cluster, 'name', 'the cluster')}; {missing} is missing (e.g. price: \"2.10USD/h\")",
                         field=missing)
    return Objective(kind=kind, budget=b, max_step_time=t, currency=cur)


def figures(cluster: Any, uses: tuple[int, ...] | None, predicted: dict[str, Any], seq_len: int,
            global_batch: int) -> dict[str, Any]:
    """A plan's ``cost`` attrs: devices used, price per hour, per step and per million tokens (None
    without prices)."""
    from autotune.specs.pool import currency, devices_of, hourly

    n = devices_of(cluster, uses)
    per_h = hourly(cluster, uses)
    step = predicted.get("step_time_s")
    out: dict[str, Any] = {"devices": n, "per_hour": per_h, "per_step": None, "per_mtok": None,
                           "device_hours_per_mtok": None, "currency": currency(cluster) or None}
    if isinstance(step, (int, float)) and step > 0:
        tokens = seq_len * global_batch
        out["device_hours_per_mtok"] = n * step / 3600 / tokens * 1e6
        if per_h is not None:
            out["per_step"] = per_h * step / 3600
            out["per_mtok"] = out["per_step"] / tokens * 1e6
    return out


def cost_text(c: dict[str, Any] | None) -> str | None:
    """``20USD/h: 0.1556USD/Mtok, 0.0815USD a step`` (a plan's ``cost`` attrs for people; with
    prices only, else None)."""
    if not c or c.get("per_hour") is None:
        return None
    cur = c.get("currency") or ""
    out = f"{c['per_hour']:.4g}{cur}/h"
    if c.get("per_mtok") is not None:
        out += f": {c['per_mtok']:.4g}{cur}/Mtok, {c['per_step']:.4g}{cur} a step"
    return out


def step_of(attrs: dict[str, Any]) -> float | None:
    v = ((attrs.get("plan") or {}).get("predicted") or {}).get("step_time_s")
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def cost_of(attrs: dict[str, Any]) -> float | None:
    """The cost the front and ``--objective cost`` compare: per million tokens when priced, else
    device-hours per million tokens."""
    c = attrs.get("cost") or {}
    v = c.get("per_mtok")
    if v is None:
        v = c.get("device_hours_per_mtok")
    return float(v) if isinstance(v, (int, float)) else None


def admissible(obj: Objective, attrs: dict[str, Any]) -> bool:
    """Within the objective's limits (a trial with no cost figures passes a budget it cannot be held to)."""
    if obj.max_step_time is not None:
        s = step_of(attrs)
        if s is None or s > obj.max_step_time:
            return False
    if obj.budget is not None:
        per_h = (attrs.get("cost") or {}).get("per_hour")
        if per_h is not None and per_h > obj.budget * (1 + 1e-12):
            return False
    return True


def figure_key(obj: Objective, slowness: float, cost: float | None) -> tuple[float, float]:
    """The objective's one ordering, smaller first: its figure, then the other one. ``slowness`` is
    anything that grows as the step slows (the step time, minus the tokens/s); ``cost`` as
    ``cost_of`` reads it (None: unknown, last under the cost objective)."""
    if obj.kind == "cost":
        return (cost if cost is not None else float("inf"), slowness)
    return (slowness, cost or 0.0)


def sort_key(obj: Objective, value: float | None, attrs: dict[str, Any]) -> tuple[float, float]:
    """Smaller first: the objective's figure, then the other one (``value``: tokens/s)."""
    return figure_key(obj, -(value or 0.0), cost_of(attrs))


def cost_at(attrs: dict[str, Any], step_s: float) -> dict[str, Any]:
    """``attrs`` with its cost figures (``figures``) at another step time of the same plan (measured
    or calibrated): those per step and per token scale with the step, the hourly price and the
    devices do not. Unchanged without a predicted step or cost figures."""
    pred, c = step_of(attrs), attrs.get("cost")
    if not pred or not isinstance(c, dict):
        return attrs
    r = step_s / pred
    return {**attrs, "cost": {k: (v * r if k in _PER_STEP and isinstance(v, (int, float)) else v) for k, v in c.items()}}


_PER_STEP = ("per_step", "per_mtok", "device_hours_per_mtok")
"""The cost figures that scale with the step time (``figures``)."""


def of_study(study: Any) -> Objective:
    """The objective a study was searched for (plain for studies before pools)."""
    try:
        attrs = study.user_attrs
    except AttributeError:
        return Objective()
    return Objective.from_attrs(attrs.get(STUDY_KEY))
