"""What a study was made for (model, cluster, sequence length, batch), rebuilt from its user attrs.

The dashboard needs it for two things only: device capacities when a stored prediction lacks
``capacity_bytes``, and recomputing a pipeline timeline through ``autotune.cost.estimate`` when a
trial's ``breakdown`` has none. Both are optional, so every failure here is remembered as a reason
(shown in the report) instead of raised.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from autotune.errors import AutotuneError


class StudyContext:
    def __init__(self, user_attrs: dict[str, Any], storage: str | None = None):
        self.ua = user_attrs
        self.storage = storage
        self.problem: str | None = None
        """Why the model or cluster could not be rebuilt (None when both were)."""
        self._estimates: dict[str, tuple[dict[str, Any] | None, str | None]] = {}

    @cached_property
    def model(self) -> Any:
        from autotune.specs.model import load_model, model_from_dict

        try:
            if isinstance(self.ua.get("model_spec"), dict):
                return model_from_dict(dict(self.ua["model_spec"]), source="study model_spec")
            if self.ua.get("model"):
                return load_model(str(self.ua["model"]))
        except AutotuneError as e:
            self.problem = f"the study's model cannot be rebuilt: {e}"
            return None
        self.problem = "the study records no model"
        return None

    @cached_property
    def cluster(self) -> Any:
        from autotune.specs.cluster import cluster_from_record

        name = str(self.ua.get("cluster") or "")
        spec = self.ua.get("cluster_spec")
        if not name.startswith("local") and not (isinstance(spec, dict) and spec.get("nodes")):
            self.problem = "the study records no cluster spec"
            return None
        try:
            return cluster_from_record(name, spec if isinstance(spec, dict) else None, self.storage,
                                       str(self.ua.get("cluster_digest") or ""))
        except AutotuneError as e:
            self.problem = f"the study's cluster cannot be rebuilt: {e}"
            return None

    def workload(self) -> tuple[int, int] | None:
        s, b = self.ua.get("seq_len"), self.ua.get("global_batch")
        return (s, b) if isinstance(s, int) and isinstance(b, int) else None

    def devices_of(self, plan: dict[str, Any]) -> list[Any] | None:
        """The cluster device under each rank (placement order; node order when there is none)."""
        cl = self.cluster
        if cl is None:
            return None
        if plan.get("uses") is not None:  # a plan on part of a pool: its placement names that subset's nodes
            from autotune.specs.pool import subset

            try:
                cl = subset(cl, tuple(plan["uses"]))
            except (AutotuneError, TypeError, ValueError):
                return None
        where = {(d.node, d.local): d for d in cl.devices}
        pl = plan.get("placement")
        if isinstance(pl, list) and pl:
            try:
                return [where[(int(p["node"]), int(p["device"]))] for p in sorted(pl, key=lambda p: p["rank"])]
            except (KeyError, TypeError, ValueError):
                return None
        world = 1
        for v in (plan.get("degrees") or {}).values():
            world *= int(v)
        return list(cl.devices[:world]) if world <= cl.num_devices else None

    def capacity_of(self, plan: dict[str, Any]) -> list[float] | None:
        """Memory capacity of the device under each rank, from the cluster spec."""
        devs = self.devices_of(plan)
        return [float(d.spec.memory_bytes) for d in devs] if devs else None

    def rank_labels(self, plan: dict[str, Any], n: int) -> list[str]:
        """``rank 3 · H100-SXM n0/3`` where the cluster is known, else ``rank 3``."""
        devs = self.devices_of(plan) or []
        if len(devs) != n:
            return [f"rank {i}" for i in range(n)]
        return [f"rank {i} · {d.spec.name} n{d.node}/{d.local}" for i, d in enumerate(devs)]

    def estimate_breakdown(self, plan: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
        """(breakdown, None) from ``autotune.cost.estimate`` (with its timeline), or (None, why not).
        Cached per plan: the Gantt chart and the time breakdown ask for the same plans."""
        import json

        key = json.dumps(plan, sort_keys=True, default=str)
        if key not in self._estimates:
            self._estimates[key] = self._estimate(plan)
        return self._estimates[key]

    def _estimate(self, plan: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
        try:
            from autotune.cost import estimate
        except ImportError:
            return None, "the cost model (autotune.cost) is not available to recompute it"
        wl = self.workload()
        if self.model is None or self.cluster is None or wl is None:
            return None, self.problem or "the study records no seq_len/global_batch"
        import inspect

        from autotune.plan import Plan
        from autotune.validate import calibration_for

        # the study's calibration only where it was measured (same precision and runtime)
        kw: dict[str, Any] = {"calibration": calibration_for(self.ua, Plan.from_dict(plan))}
        try:  # estimate fills the timeline only when asked (the search does not ask, to stay fast)
            params = inspect.signature(estimate).parameters
            if "timeline" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
                kw["timeline"] = True
        except (TypeError, ValueError):  # no introspectable signature: call as the contract says
            pass
        try:
            est = estimate(Plan.from_dict(plan), self.model, self.cluster, wl[0], wl[1], **kw)
        except AutotuneError as e:  # a plan the cost model refuses: said on the chart; a crash is an error
            return None, f"the cost model refused the plan: {e}"
        bd = getattr(est, "breakdown", None)
        return (bd, None) if isinstance(bd, dict) else (None, "the cost model returned no breakdown")
