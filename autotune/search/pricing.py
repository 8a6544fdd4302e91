"""Pricing one point of a space: params -> Plan (the space) -> prediction (the cost model) -> Outcome.

Equal plans are priced once (``Evaluator.cache``, keyed by the frozen resolved Plan). A point the
space cannot build, or a plan the cost model refuses as an input (InputError), is a recorded limit;
a cost model that raises anything else is a failed trial carrying the exception's message (the
search goes on and says so in its notes and in its error when nothing could be priced:
autotune/search/report.py).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autotune.errors import InputError, WorkError
from autotune.plan import Placement, Plan
from autotune.plan_record import PlanRecord
from autotune.search.bulk import EncodedList

TIMELINE_LIMIT = 4000  # events kept per trial; larger timelines are stored for the best plans only
RANKS_LIMIT = 64  # per-rank rows kept up to this world (what validate calibrates from); stages always
# attrs that belong to one trial, not to the plan it priced (not copied from a cached plan)
_PER_TRIAL_ATTRS = ("origin", "baseline", "baseline_key", "polish", "measured", "losses", "failure",
                    "prediction_error", "validated_from")


@dataclass
class Row:
    """One finished trial as this process knows it: what the phases rank and skip by."""

    params: dict[str, Any]
    value: float | None
    feasible: bool
    attrs: dict[str, Any]
    constraints: dict[str, float]
    mine: bool = False  # recorded by this process (its plan is in this process's cache already)


def default_estimator() -> Callable[..., Any]:
    try:
        from autotune.cost import estimate
    except ImportError as exc:
        raise WorkError(f"the cost model (autotune.cost) is not available in this build: {exc}") from None
    return estimate


class Shared(dict):
    """A user-attr value that the trials pricing one plan share instead of copying.

    Optuna's in-memory storage deep-copies every trial it adds (and ``tell`` returns a deep copy);
    a plan with its breakdown is thousands of nested objects, so those copies, not the cost model,
    were half of a search's time at 128 devices (measured: 13 s of 33 s). The values are never
    mutated once priced; RDB and journal storages serialise them to JSON like any dict."""

    def __deepcopy__(self, memo: dict) -> Shared:
        return self


@dataclass
class Outcome:
    """What one point of the space became: the trial value, user attrs and constraints."""

    value: float
    attrs: dict[str, Any]
    constraints: dict[str, float]
    failed: bool = False

    @property
    def feasible(self) -> bool:
        return not self.failed and "plan" in self.attrs and not self.attrs.get("infeasible_reason") and \
            all(c <= 0 for c in self.constraints.values())


_PLACEMENT_FIELDS = tuple(f.name for f in dataclasses.fields(Placement))


class PlanDict(Shared):
    """A trial's ``plan`` attribute that remembers the Plan it was written from (``plan``), so this
    process reads it back without parsing it (``study.iter_trial_plans``: the post-search report
    reads hundreds; at 128 devices each parse checks 128 placement entries)."""

    plan: Plan


def plan_dict(plan: Plan, predicted: dict[str, Any] | None = None) -> PlanDict:
    """A trial's ``plan`` attribute: ``PlanRecord(plan, predicted).to_dict()`` (the plan JSON users
    read), shared (see Shared), without ``dataclasses.asdict`` on every placement entry (3 ms of a
    5 ms estimate at 128 devices; tests/unit/test_search_study.py checks equality)."""
    if plan.placement is None:
        d = PlanDict(PlanRecord(plan, predicted=predicted).to_dict())
    else:
        d = PlanDict(PlanRecord(plan.replace(placement=None), predicted=predicted).to_dict())
        d["placement"] = _placement_dicts(plan.placement)
    d.plan = plan
    return d


_PLACEMENT_DICTS: dict[int, tuple[Any, EncodedList]] = {}


def _placement_dicts(pl: tuple[Placement, ...]) -> EncodedList:
    """A placement's entries as dicts, one list per placement tuple: the search space hands every
    plan of a layout the same (frozen) tuple, and a trial's plan dict is never mutated (Shared), so
    its trials share the list, and its JSON is encoded once (bulk.EncodedList). The entry holds
    the tuple, so its id is not reused while cached."""
    hit = _PLACEMENT_DICTS.get(id(pl))
    if hit is None or hit[0] is not pl:
        if len(_PLACEMENT_DICTS) > 4096:
            _PLACEMENT_DICTS.clear()
        hit = _PLACEMENT_DICTS[id(pl)] = (pl, EncodedList({f: getattr(e, f) for f in _PLACEMENT_FIELDS} for e in pl))
    return hit[1]


def trim_breakdown(bd: Any) -> Any:
    """Keep stored trials small: the copies Optuna makes of every trial's attrs dominate the search
    time at scale (measured: deepcopy was half of a grid search's time at 8 devices)."""
    if not isinstance(bd, dict):
        return bd
    if isinstance(bd.get("timeline"), list) and len(bd["timeline"]) > TIMELINE_LIMIT:
        bd = {**bd, "timeline": None, "timeline_events": len(bd["timeline"])}
    if isinstance(bd.get("ranks"), list) and len(bd["ranks"]) > RANKS_LIMIT:
        bd = {**bd, "ranks": None, "ranks_dropped": len(bd["ranks"])}
    return bd


def _no_plan(kind: str, reason: str, family: str | None, plan: Plan | None = None) -> Outcome:
    attrs: dict[str, Any] = {"infeasible_reason": f"{kind}: {reason}", "infeasible_kind": kind,
                             "family": family or None, "baseline": None}
    if plan is not None:
        attrs = {"plan": plan_dict(plan), **attrs}
    return Outcome(0.0, attrs, {"memory": 0.0, "divisibility": 1.0})


def outcome_of(built: Plan, est: Any) -> Outcome:
    """The Outcome of a priced plan: its tokens/s when feasible, else the limit that rules it out
    (memory when a rank is over capacity or the reason says so, else the model's own reason)."""
    from search_spaces.base import family_of

    pred = dict(est.predicted)
    plan = est.plan if est.plan is not None else built
    bd = trim_breakdown(getattr(est, "breakdown", None))
    attrs = {"plan": plan_dict(plan, pred), "breakdown": Shared(bd) if isinstance(bd, dict) else bd,
             "infeasible_reason": None, "family": family_of(plan), "baseline": None}
    mem, cap = pred.get("memory_bytes") or [], pred.get("capacity_bytes") or []
    over = max((m - c) / c for m, c in zip(mem, cap, strict=False)) if mem and cap else -1.0
    if pred.get("feasible", True):
        return Outcome(float(pred["tokens_per_s"]), attrs, {"memory": min(over, 0.0), "divisibility": 0.0})
    reason = str(pred.get("infeasible_reason") or "infeasible")
    kind = "memory" if "memory" in reason.lower() or over > 0 else "model"
    attrs["infeasible_reason"] = f"{kind}: {reason}"
    attrs["infeasible_kind"] = kind
    return Outcome(0.0, attrs, {"memory": max(over, 1e-9) if kind == "memory" else 0.0,
                                "divisibility": 0.0 if kind == "memory" else 1.0})


class PricingFailed(Exception):
    """The cost model raised (not a PlanError) on a plan a space priced through ``Evaluator.price``
    while building a point: the point is recorded as a failed trial with this message."""


class Evaluator:
    """Prices points of a space, once per distinct plan."""

    def __init__(self, space: Any, estimator: Callable[..., Any], calibration: dict | None = None,
                 target: str | None = None):
        self.space, self.estimator, self.calibration = space, estimator, calibration
        self.target = target  # autotune/targets.py: plans it cannot run are limits, never priced
        self._target_ctx: Any = None
        self.cache: dict[Any, Outcome] = {}  # by the (frozen, hashable) resolved Plan
        self.calls = 0
        self.failures = 0  # plans the cost model raised on (recorded as failed trials)
        self.best = 0.0
        self._primed: set[int] = set()
        self._priced: dict[Plan, Any] = {}  # Estimates ``price`` made for a space (the stage program's)
        # The Gantt timeline costs a third of an estimate at scale: price without it, and draw it
        # again only for a plan that beats every plan so far (so the best plan always has one).
        try:
            params = inspect.signature(estimator).parameters
        except (TypeError, ValueError):
            params = {}
        self.has_timeline = "timeline" in params
        # rows a trial would drop (trim_breakdown) are not built: 1,024 per estimate at 1,024 devices
        self.rows_up_to = RANKS_LIMIT if "rows_up_to" in params else None
        # a search aimed at a target prices plans as that framework runs them (targets.kernel_costs)
        self.kernels = None
        if target is not None and "kernels" in params:
            from autotune.targets import kernel_costs

            self.kernels = kernel_costs(target)
        # a space whose points are chosen by pricing plans of its own (the default space's stage
        # program) prices them as this evaluator will: its estimator, calibration and kernels
        if hasattr(space, "price_with"):
            space.price_with(self.price)

    def price(self, plan: Plan) -> Any:
        """``plan``'s Estimate as this evaluator prices it (its estimator, calibration and kernels;
        no timeline): PlanError where it is not a plan. Kept by the resolved plan until the search
        prices that plan as a point (``_price`` takes it instead of estimating it again)."""
        try:
            est = self._estimate(plan, False)
        except InputError:
            raise
        except Exception as e:  # a crash is not a limit: the point that asked is recorded as failed
            raise PricingFailed(f"{type(e).__name__}: {e}") from e
        if len(self._priced) >= 4096:
            self._priced.clear()
        self._priced[est.plan] = est
        return est

    def _estimate(self, plan: Plan, timeline: bool) -> Any:
        ctx = self.space.ctx
        kw: dict[str, Any] = {"calibration": self.calibration}
        if self.has_timeline:
            kw["timeline"] = timeline
        if self.kernels is not None:
            kw["kernels"] = self.kernels
        if self.rows_up_to is not None:
            kw["rows_up_to"] = self.rows_up_to
        return self.estimator(plan, ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch, **kw)

    def evaluate(self, params: dict[str, Any]) -> Outcome:
        return self.evaluate_new(params)[0]

    def evaluate_new(self, params: dict[str, Any]) -> tuple[Outcome, bool]:
        """The outcome and whether it was priced now (False: no plan, or a plan priced before)."""
        from search_spaces.base import Infeasible

        try:
            built = self.space.build(params)
        except PricingFailed as e:  # the space's own pricing (``price``) raised: as ``_price`` records it
            self.failures += 1
            return Outcome(0.0, {"failure": {"kind": "error", "rank": None, "message": str(e)},
                                 "family": "per-stage", "baseline": None}, {}, failed=True), True
        if isinstance(built, Infeasible):
            return _no_plan(built.kind, built.reason, built.family), False
        hit = self.cache.get(built)
        if hit is not None:
            return hit, False
        out = self.cache[built] = self._price(built)
        return out, True

    def _price(self, built: Plan) -> Outcome:
        from search_spaces.base import family_of

        refused = self._refused(built)
        if refused:
            return _no_plan("target", refused, family_of(built), built)
        self.calls += 1
        try:
            est = self._priced.pop(built, None) or self._estimate(built, timeline=not self.has_timeline)
            if self.has_timeline and est.predicted.get("feasible", True) and \
                    float(est.predicted.get("tokens_per_s") or 0) > self.best:
                self.best = float(est.predicted["tokens_per_s"])
                est = self._estimate(built, timeline=True)
        except InputError as e:  # the cost model refused the plan: a limit, recorded
            return _no_plan("divisibility", e.message, family_of(built), built)
        except Exception as e:  # noqa: BLE001 - recorded as a failed trial with its message, counted,
            # and reported by the search (notes; the error when no plan could be priced)
            self.failures += 1
            return Outcome(0.0, {"plan": plan_dict(built), "failure": {"kind": "error", "rank": None,
                                                                       "message": f"{type(e).__name__}: {e}"},
                                 "family": family_of(built), "baseline": None}, {}, failed=True)
        return outcome_of(built, est)

    def _refused(self, built: Plan) -> str | None:
        """Why the search's target cannot run ``built`` (its own rules: autotune/targets.py), or None."""
        if self.target is None:
            return None
        from autotune.targets import context, refusals

        if self._target_ctx is None:
            from autotune.targets import model_problems

            c = self.space.ctx
            if model_problems(self.target, c.model):  # nothing would run: price for the model as it is
                self.target = None
                return None
            self._target_ctx = context(c.model, c.cluster, c.seq_len, c.global_batch)
        why = refusals(self.target, built, self._target_ctx)
        return f"{self.target} cannot run it: " + "; ".join(why) if why else None

    def prime(self, rows: list[Row]) -> None:
        """Seed the cache from trials already in the study (resume costs no re-pricing)."""
        for r in rows:
            if r.mine or id(r) in self._primed:
                continue
            self._primed.add(id(r))
            if "plan" in r.attrs and r.value is not None:
                try:
                    key = Plan.from_dict(r.attrs["plan"])
                except InputError:
                    continue
                if key in self.cache:
                    continue
                self.cache[key] = Outcome(float(r.value), {k: v for k, v in r.attrs.items()
                                                           if k not in _PER_TRIAL_ATTRS}, dict(r.constraints))
                if r.feasible:
                    self.best = max(self.best, float(r.value))
