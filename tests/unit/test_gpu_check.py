"""The CPU-testable parts of benchmarks/gpu_check.py: which plans it runs for a GPU count, that each
is a valid plan of its model, and the report's figures (the GPU run itself needs a GPU)."""

from __future__ import annotations

import importlib.util
import math
import statistics
from pathlib import Path

import pytest

from autotune.plan import Plan
from autotune.specs.cluster import cluster_from_dict

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", _PATH)
gc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gc)


def test_one_gpu_runs_the_single_device_plans_and_says_why_not_the_rest():
    plans, skipped = gc.select_plans(1)
    assert [Plan.from_dict(d).world for _, d in plans] == [1] * len(plans) and len(plans) >= 2
    assert sorted(k for k, _ in skipped) == sorted(set(gc.KINDS) - {"dp"})
    assert all("2 or more GPUs" in why for _, why in skipped)
    with pytest.raises(ValueError):
        gc.select_plans(0)


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_several_gpus_run_one_plan_per_parallelism_over_all_of_them(gpus):
    plans, skipped = gc.select_plans(gpus)
    assert [n for n, _ in plans] == list(gc.KINDS) and not skipped
    cluster = cluster_from_dict({"name": "h", "nodes": [{"count": 1, "devices_per_node": gpus,
                                                         "device": "H100-SXM"}]})
    for name, d in plans:
        plan = Plan.from_dict({**d, "dtype": "bf16"})
        assert plan.world == gpus
        dim = "dp" if name == "zero3" else name
        assert getattr(plan.degrees, dim) == gpus
        from autotune.cost import estimate

        est = estimate(plan, gc.CHECK_MODEL, cluster, gc.CHECK_SEQ, gc.CHECK_BATCH)
        assert est.predicted["feasible"], (name, est.predicted["infeasible_reason"])


def _row(name, pred_s, meas_s, pred_mem, meas_mem):
    return {"name": name, "predicted": {"step_time_s": pred_s, "memory_bytes": pred_mem},
            "measured": {"step_time_s": meas_s, "peak_memory_bytes": meas_mem}, "failure": None}


def test_the_report_prints_both_figures_and_their_errors():
    rows = [_row("dp", 0.12, 0.10, [2e9, 2e9], [2.5e9, 1.0e9]),
            _row("tp", 0.30, 0.40, [1e9, 1e9], [1e9, 1e9]),
            {"name": "pp", "predicted": {"step_time_s": 0.2, "memory_bytes": [1.0, 1.0]}, "measured": None,
             "failure": {"kind": "oom", "message": "CUDA out of memory"}}]
    text = gc.report(rows, [("zero3", "the runtime refuses zero_stage 3")])
    lines = {ln.split()[0]: ln for ln in text.splitlines()}
    assert "+20.0%" in lines["dp"] and "-25.0%" in lines["tp"]
    # the busiest rank's memory: dp's rank 0 (2.5 GB measured, 2 GB predicted: -20%)
    assert "-20.0%" in lines["dp"]
    assert "CUDA out of memory" in lines["pp"] and "refuses" in lines["zero3"]
    median_t = statistics.median([0.2, 0.25])
    # per plan the median over ranks of |memory error|: dp (0.2, 1.0) -> 0.6, tp 0 -> median 0.3
    median_m = statistics.median([statistics.median([0.2, 1.0]), 0.0])
    assert f"step time {median_t:.1%}" in text and f"memory {median_m:.1%}" in text
    assert not math.isnan(median_m)


def test_the_datasheet_column_prices_the_same_plans_on_the_catalogue_entry():
    """The GPU's catalogue entry is found by its name, each plan is priced on it, and the report
    gives its error against the measurement."""
    assert gc.catalogue_name("NVIDIA H200") == "H200" and gc.catalogue_name("NVIDIA H100 80GB HBM3") == "H100-SXM"
    assert gc.catalogue_name("NVIDIA A100-SXM4-40GB") == "A100-40GB" and gc.catalogue_name("Quadro") is None
    plans, _ = gc.select_plans(1)
    rows = [{"name": n, "plan": Plan.from_dict({**d, "dtype": "bf16"})} for n, d in plans]
    gc.add_sheet_predictions(rows, gc.CHECK_MODEL, "H200", 1, gc.CHECK_SEQ, gc.CHECK_BATCH)
    from autotune.cost import estimate

    c = cluster_from_dict({"name": "x", "nodes": [{"count": 1, "devices_per_node": 1, "device": "H200"}]})
    for r in rows:
        assert r["sheet"]["step_time_s"] == estimate(r["plan"], gc.CHECK_MODEL, c, gc.CHECK_SEQ,
                                                     gc.CHECK_BATCH).predicted["step_time_s"]
        r.update(measured={"step_time_s": r["sheet"]["step_time_s"] * 1.25}, failure=None)
    text = gc.sheet_report(rows, "H200")
    assert text.count("-20.0%") == len(rows) and "median |error| over" in text


def _synthetic_profile_cluster():
    """One H200 priced from a synthetic measured profile (a GEMM fit and a memory bandwidth, as
    ``profile`` stores them) through the profile path, not the datasheet."""
    import dataclasses

    from autotune.specs.catalogue import device_from_catalogue

    sheet = device_from_catalogue("H200")
    dev = dataclasses.replace(sheet, name="profile:1", provenance="measured", achievable_fraction=1.0,
                              peak_flops={"bf16": 6.8e14}, profile={"id": 1, "gemm": {"bf16": {
                                  "peak_flops_per_s": 6.8e14, "overhead_s": 8e-6}}})
    return cluster_from_dict({"name": "synthetic", "nodes": [{"count": 1, "devices_per_node": 1, "device": "profile:1"}]},
                             source="test", resolve_profile=lambda ref, storage: dev)


def test_profile_path_pays_the_runtime_host_time(monkeypatch):
    """--predict-only's profile path: the check's plans on a profiled GPU cost exactly the runtime's
    kernels x host time more than with no host time (8 blocks, the head, per micro-batch; full
    recomputation issues each block's forward again), as the datasheet path charges."""
    import dataclasses

    from autotune.cost import compute
    from autotune.cost.kernels import RUNTIME

    with_host = dict(gc.predict_rows(_synthetic_profile_cluster(), 1))
    compute._RATES.clear()
    monkeypatch.setattr(compute, "RUNTIME", dataclasses.replace(RUNTIME, host_s=0.0))
    bare = dict(gc.predict_rows(_synthetic_profile_cluster(), 1))
    compute._RATES.clear()
    layers, k = gc.CHECK_MODEL.layers, RUNTIME
    per_mb = (layers * (k.block_fwd + k.block_bwd) + k.head_fwd + k.head_bwd) * k.host_s
    assert with_host["single"] - bare["single"] == pytest.approx(8 * per_mb, rel=1e-6)
    assert with_host["single-mbs4"] - bare["single-mbs4"] == pytest.approx(2 * per_mb, rel=1e-6)
    assert with_host["single-recompute"] - bare["single-recompute"] == pytest.approx(
        2 * (per_mb + layers * k.block_fwd * k.host_s), rel=1e-6)


def test_predict_only_prints_every_plan_on_the_catalogue_entry(capsys):
    assert gc.main(["--predict-only", "--entry", "H200"]) == 0
    out = capsys.readouterr().out
    names = [n for n, _ in gc.select_plans(1)[0]]
    rows = {line.split()[0]: float(line.split()[1]) for line in out.splitlines() if line.split()[:1]
            and line.split()[0] in names}
    assert sorted(rows) == sorted(names) and all(t > 0 for t in rows.values())
    assert gc.main(["--predict-only", "--entry", "no-such-gpu"]) == 2
