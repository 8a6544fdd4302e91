"""benchmarks/bench_validate.py: repeats are summarised by their median, and the fresh set shares no
model, workload or seed with the set the CPU constants were chosen on (docs/cpu-constants.md)."""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

from autotune.plan import Plan
from autotune.specs import load_cluster, load_model

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_validate.py"
_spec = importlib.util.spec_from_file_location("bench_validate", _PATH)
bv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bv)


def _rec(name, t):
    return {"model": "tiny", "name": name, "measured": {"step_time_s": t}}


def test_repeats_are_summarised_by_their_median_not_their_minimum():
    times = {"a": [0.30, 0.10, 0.20], "b": [0.5, 0.4, 0.9, 0.6]}
    sets = [[_rec(n, ts[i]) for n, ts in times.items() if i < len(ts)] for i in range(4)]
    out = {r["name"]: r for r in bv.merge_runs(sets)}
    assert out["a"]["measured"]["step_time_s"] == statistics.median(times["a"])
    assert out["b"]["measured"]["step_time_s"] == statistics.median_low(times["b"])
    assert out["a"]["repeats"] == 3 and out["b"]["spread"] == 0.9 / 0.4


def test_the_fresh_set_never_met_the_fitting_set():
    assert bv.FRESH_MODEL.name not in bv.WORKLOADS
    assert all(bv.FRESH_MODEL != load_model(m) for m in bv.WORKLOADS)
    assert bv.FRESH_WORKLOAD not in bv.WORKLOADS.values() and 0 not in bv.FRESH_SEEDS
    fitting = [{**d, "dtype": d.get("dtype", "bf16")} for _, d in bv.PLANS]
    cluster = load_cluster("local:2")
    seq, gb = bv.FRESH_WORKLOAD
    for name, d in bv.FRESH_PLANS:
        assert {**d, "dtype": d.get("dtype", "bf16")} not in fitting, name
        assert Plan.from_dict({**d, "dtype": d.get("dtype", "bf16")}).resolve(bv.FRESH_MODEL, cluster, seq, gb)
