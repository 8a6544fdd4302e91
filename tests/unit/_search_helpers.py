"""Test doubles for the search tests (plumbing only; the product prices plans with autotune.cost).

``toy_estimate`` follows the ``estimate`` contract (docs/contracts.md): step time is the slowest
rank's share of the work divided by its device speed, memory is weights split over tp x pp; it is a
double so the study plumbing can be tested whether or not the cost model is built, never a
reference for the cost model's figures. ``toy_runner`` follows ``run_trial``'s result shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.plan import Plan

CAPACITY_SCALE = 1.0


@dataclass
class ToyEstimate:
    plan: Plan
    predicted: dict[str, Any]
    breakdown: dict[str, Any]


def toy_estimate(plan, model, cluster, seq_len, global_batch, *, calibration=None):
    plan = plan.resolve(model, cluster, seq_len, global_batch)
    d = plan.degrees
    worst, ranks, mems, caps = 0.0, [], [], []
    for r in range(plan.world):
        c = plan.coords(r)
        dev = cluster.devices[plan.device_index(r, cluster)].spec
        cal = (calibration or {}).get(dev.name, {"compute": 1.0, "comm": 1.0})
        layers = sum(plan.layers_of_stage(c["pp"]))
        work = layers * plan.shares.tokens[c["cp"]] * plan.shares.samples[c["dp"]] / (d.tp * d.hp)
        compute = work * 1e9 / (dev.flops(plan.dtype) * dev.achievable_fraction) * cal["compute"]
        comm = (0.002 * (d.tp > 1) + 0.001 * (d.pp - 1) + 0.001 * (d.dp > 1)) * cal["comm"]
        worst = max(worst, compute + comm)
        ranks.append({"compute_s": compute, "comm_s": comm})
        mems.append(model.param_count() * 16.0 / (d.tp * d.pp) * (0.5 if plan.recompute == "full" else 1.0))
        caps.append(dev.memory_bytes * CAPACITY_SCALE)
    over = [i for i, (m, c) in enumerate(zip(mems, caps, strict=False)) if m > c]
    pred = {"step_time_s": worst, "tokens_per_s": global_batch * seq_len / worst, "mfu": 0.3,
            "memory_bytes": mems, "capacity_bytes": caps, "feasible": not over,
            "infeasible_reason": f"rank {over[0]} memory {mems[over[0]]:.3g} > {caps[over[0]]:.3g}" if over else None}
    return ToyEstimate(plan, pred, {"ranks": ranks, "timeline": []})


@dataclass
class ToyResult:
    plan: dict
    measured: dict | None
    losses: list
    failure: dict | None


def toy_runner(factor: float = 1.3, fail_degrees: tuple = ()):
    """A run_trial double: measured times are ``factor`` x the toy prediction."""
    from autotune.specs import load_cluster

    def run(plan, model, seq_len, global_batch, **kw):
        if plan.degrees.inline() in fail_degrees:
            return ToyResult(plan.to_dict(), None, [], {"kind": "error", "rank": 0, "message": "boom"})
        cluster = load_cluster(f"local:{plan.world}")
        est = toy_estimate(plan.replace(placement=None), model, cluster, seq_len, global_batch)
        split = [{"rank": i, "compute_s": r["compute_s"] * factor, "comm_s": r["comm_s"] * factor,
                  "idle_s": 0.0, "emulated_s": 0.0} for i, r in enumerate(est.breakdown["ranks"])]
        step = est.predicted["step_time_s"] * factor
        m = {"step_time_s": step, "tokens_per_s": global_batch * seq_len / step,
             "peak_memory_bytes": [1.0] * plan.world, "time_split": split}
        return ToyResult(plan.to_dict(), m, [5.0, 4.9], None)

    return run


def flaky_estimate(every: int, message: str):
    """``toy_estimate`` that raises ``RuntimeError(message)`` on every ``every``-th call: a cost model
    that fails on some plans, for the search's handling of a raising estimator."""
    calls = {"n": 0}

    def flaky(plan, *a, **kw):
        calls["n"] += 1
        if calls["n"] % every == 0:
            raise RuntimeError(message)
        return toy_estimate(plan, *a, **kw)

    return flaky
