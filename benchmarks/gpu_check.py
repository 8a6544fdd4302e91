"""One GPU check: profile this machine's GPUs, run a few plans for real, print predicted vs measured.

On any machine with CUDA GPUs (one is enough):

1. profiles the GPUs (``autotune profile --quick`` as a library call: GEMM, attention, memory and,
   with several GPUs, the links) and prices plans on that measured profile;
2. runs up to six plans, one per parallelism: dp, tp, pp, cp, hp and ZeRO-3, each over all the GPUs
   (``select_plans``): what the GPU count allows (one GPU runs the single-device plans: the whole
   model, a larger micro-batch, full recomputation) and what the runtime runs (a plan it refuses
   before launch is listed with its reason);
3. prints, per plan, predicted vs measured step time and memory (the busiest rank; on CUDA the
   measured figure is ``torch.cuda.max_memory_allocated``), their errors and the medians.

The model (``CHECK_MODEL``, ~160M parameters) and the short runs keep the whole check under 8 minutes
on one GPU. ``--device cpu`` runs the same steps on CPU worker processes (a smoke test of this
script, not a GPU figure).

    python benchmarks/gpu_check.py [--gpus N] [--steps 3] [--json FILE] [--storage URL]

``--predict-only`` runs nothing (no GPU needed): it prints what the check would predict for its
plans on the catalogue's entry (``--entry``, default H200) and, with ``--profile ID`` (and
``--storage``), on a stored profile, so a new price can be compared with a stored run quickly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.specs.model import ModelSpec  # noqa: E402

CHECK_MODEL = ModelSpec(name="gpu-check-160m", layers=8, hidden=1024, heads=16, kv_heads=8, ffn_hidden=2816,
                        vocab=32000, source="benchmarks/gpu_check.py: a Llama-style model sized for a short GPU run")
"""8 layers, 16 heads and 8 KV heads: tp, hp and pp of 2, 4 and 8 divide it."""
CHECK_SEQ, CHECK_BATCH = 2048, 8
SMOKE_MODEL, SMOKE_SEQ, SMOKE_BATCH = "tiny", 64, 4
"""``--device cpu``: the runtime's test model, small enough for CPU workers."""

KINDS = ("dp", "tp", "pp", "cp", "hp", "zero3")


def select_plans(gpus: int) -> tuple[list[tuple[str, dict[str, Any]]], list[tuple[str, str]]]:
    """(name, plan dict) of the plans to run on ``gpus`` devices, and (kind, why not) of the kinds
    the count does not allow. With one device the single-device plans stand in for the six."""
    if gpus < 1:
        raise ValueError(f"need at least one device, got {gpus}")
    if gpus == 1:
        plans = [("single", {"degrees": {}, "micro_batch_size": 1}),
                 ("single-mbs4", {"degrees": {}, "micro_batch_size": 4}),
                 ("single-recompute", {"degrees": {}, "micro_batch_size": 4, "recompute": "full"})]
        return plans, [(k, "needs 2 or more GPUs") for k in KINDS if k != "dp"]
    n = gpus
    plans = [("dp", {"degrees": {"dp": n}, "micro_batch_size": 1}),
             ("tp", {"degrees": {"tp": n}, "micro_batch_size": 2, "sequence_parallel": True}),
             ("pp", {"degrees": {"pp": n}, "micro_batch_size": 1, "schedule": "1f1b"}),
             ("cp", {"degrees": {"cp": n}, "micro_batch_size": 1}),
             ("hp", {"degrees": {"hp": n}, "micro_batch_size": 1}),
             ("zero3", {"degrees": {"dp": n}, "micro_batch_size": 1, "zero_stage": 3})]
    return plans, []


def plan_rows(names_plans: list[tuple[str, dict[str, Any]]], model: ModelSpec, cluster: Any, seq: int, batch: int,
              dtype: str, device: str) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """Price every plan on ``cluster`` and check the runtime takes it; (priced rows, refused)."""
    from autotune.cost import estimate
    from autotune.errors import InputError
    from autotune.plan import Plan
    from autotune.runtime.trial import prepare

    rows, refused = [], []
    for name, d in names_plans:
        plan = Plan.from_dict({**d, "dtype": dtype})
        try:
            est = estimate(plan, model, cluster, seq, batch)
            prepare(est.plan, model, seq, batch, device=device)
        except InputError as e:  # not a plan here, or one the runtime does not run: say so, go on
            refused.append((name, e.message))
            continue
        rows.append({"name": name, "plan": est.plan, "predicted": est.predicted})
    return rows, refused


def report(rows: list[dict[str, Any]], skipped: list[tuple[str, str]]) -> str:
    """The table: per plan predicted vs measured step time and memory of the busiest rank, errors
    ((predicted - measured) / measured), then the medians of |error| over the plans that ran."""
    from autotune.units import fmt_bytes
    from autotune.validate import memory_errors

    lines = [f"{'plan':18} {'pred s':>9} {'meas s':>9} {'err':>7}   {'pred mem':>10} {'meas mem':>10} {'err':>7}"]
    t_err, m_err = [], []
    for r in rows:
        pred, meas = r["predicted"], r.get("measured")
        if r.get("failure") or not meas:
            lines.append(f"{r['name']:18} {pred['step_time_s']:9.4f} {'failed':>9}   "
                         f"{(r.get('failure') or {}).get('message', '')[:80]}")
            continue
        e = (pred["step_time_s"] - meas["step_time_s"]) / meas["step_time_s"]
        t_err.append(abs(e))
        mem = memory_errors(pred, meas)
        busiest = max(range(len(meas["peak_memory_bytes"])), key=lambda i: meas["peak_memory_bytes"][i])
        pm, mm = pred["memory_bytes"][busiest], meas["peak_memory_bytes"][busiest]
        me = mem["error"][busiest] if mem else None
        if mem and mem["median_error"] is not None:
            m_err.append(mem["median_error"])
        lines.append(f"{r['name']:18} {pred['step_time_s']:9.4f} {meas['step_time_s']:9.4f} {e:+7.1%}   "
                     f"{fmt_bytes(pm):>10} {fmt_bytes(mm):>10} " + (f"{me:+7.1%}" if me is not None else f"{'n/a':>7}"))
    for name, why in skipped:
        lines.append(f"{name:18} not run: {why}")
    if t_err:
        lines.append(f"median |error| over {len(t_err)} plans: step time {statistics.median(t_err):.1%}"
                     + (f", memory {statistics.median(m_err):.1%} (median over ranks per plan)" if m_err else ""))
    return "\n".join(lines)


CATALOGUE_BY_NAME = (("H200", "H200"), ("H100", "H100-SXM"), ("A100-SXM4-40GB", "A100-40GB"), ("A100", "A100-80GB"),
                     ("L40S", "L40S"), ("V100", "V100"))
"""Substring of torch.cuda.get_device_name() -> the catalogue entry that prices the same GPU from its
datasheet (the first match wins)."""


def catalogue_name(device_name: str) -> str | None:
    return next((cat for key, cat in CATALOGUE_BY_NAME if key in device_name), None)


def add_sheet_predictions(rows: list[dict[str, Any]], model: ModelSpec, entry: str, gpus: int, seq: int,
                          batch: int) -> None:
    """Each row's plan priced again on the catalogue's ``entry`` (the size-aware datasheet model and
    the runtime's kernels: what an estimate without a profile gives) as ``row["sheet"]``."""
    from autotune.cost import estimate

    cluster = _sheet_cluster(entry, gpus)
    for r in rows:
        r["sheet"] = estimate(r["plan"], model, cluster, seq, batch).predicted


def _sheet_cluster(entry: str, gpus: int) -> Any:
    from autotune.specs.cluster import cluster_from_dict

    return cluster_from_dict({"name": f"sheet-{entry}", "nodes": [
        {"count": 1, "devices_per_node": gpus, "device": entry}]}, source="gpu_check")


def sheet_report(rows: list[dict[str, Any]], entry: str) -> str:
    """Predicted (datasheet entry) vs measured step time per plan that ran, and the median |error|."""
    lines, errs = [f"datasheet prices ({entry} from the catalogue, no profile):"], []
    for r in rows:
        meas, sheet = r.get("measured"), r.get("sheet")
        if not meas or not sheet or r.get("failure"):
            continue
        e = (sheet["step_time_s"] - meas["step_time_s"]) / meas["step_time_s"]
        errs.append(abs(e))
        lines.append(f"  {r['name']:18} {sheet['step_time_s']:9.4f} {meas['step_time_s']:9.4f} {e:+7.1%}")
    if errs:
        lines.append(f"  median |error| over {len(errs)} plans: {statistics.median(errs):.1%}")
    return "\n".join(lines)


def _profile(device: str, gpus: int, storage: str, say) -> tuple[str, float]:
    from profilers.launch import check_request, launch_local
    from profilers.store import save_profile

    t0 = time.perf_counter()
    result = launch_local(check_request(device, gpus), gpus, quick=True, timeout_s=240.0)
    pid = save_profile(result, storage, label="gpu_check", nproc=gpus, wall_s=time.perf_counter() - t0)
    say(f"profiled {gpus} {device} device(s): profile {pid} ({time.perf_counter() - t0:.0f} s)")
    return str(pid), time.perf_counter() - t0


def measured_cluster(pid: str, gpus: int, storage: str) -> Any:
    from autotune.specs.cluster import cluster_from_dict

    return cluster_from_dict({"name": f"gpu-check-{gpus}", "nodes": [
        {"count": 1, "devices_per_node": gpus, "device": f"profile:{pid}"}]}, source="gpu_check", storage=storage)


def predict_rows(cluster: Any, gpus: int, model: ModelSpec = CHECK_MODEL, seq: int = CHECK_SEQ,
                 batch: int = CHECK_BATCH, dtype: str = "bf16") -> list[tuple[str, float]]:
    """(plan name, predicted step seconds) of the check's plans on ``cluster``, nothing run."""
    from autotune.cost import estimate
    from autotune.plan import Plan

    chosen, _ = select_plans(gpus)
    return [(name, estimate(Plan.from_dict({**d, "dtype": dtype}), model, cluster, seq, batch).predicted["step_time_s"])
            for name, d in chosen]


def predict_only(entry: str, gpus: int, pid: str | None, storage: str | None) -> str:
    """The ``--predict-only`` table: per plan the prediction on the catalogue entry (and the profile)."""
    sheet = predict_rows(_sheet_cluster(entry, gpus), gpus)
    prof = predict_rows(measured_cluster(pid, gpus, storage), gpus) if pid else None
    lines = [f"predictions only: model {CHECK_MODEL.name}, seq {CHECK_SEQ}, global batch {CHECK_BATCH}, bf16, "
             f"{gpus} GPU(s)", f"{'plan':18} {entry + ' sheet s':>14}" + (f" {'profile ' + pid + ' s':>14}" if prof else "")]
    for i, (name, t) in enumerate(sheet):
        lines.append(f"{name:18} {t:14.4f}" + (f" {prof[i][1]:14.4f}" if prof else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--gpus", type=int, help="devices to use (default: every visible GPU; cpu: 2 workers)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--storage", help="profile storage (default: a temporary SQLite file)")
    ap.add_argument("--json", dest="json_out", help="write the rows here")
    ap.add_argument("--predict-only", action="store_true", help="print the predictions, run nothing")
    ap.add_argument("--entry", default="H200", help="--predict-only: the catalogue entry to price on")
    ap.add_argument("--profile", help="--predict-only: also price on this stored profile ID (--storage)")
    args = ap.parse_args(argv)
    if args.predict_only:
        from autotune.errors import InputError

        try:
            print(predict_only(args.entry, args.gpus or 1, args.profile, args.storage))
        except InputError as e:
            print(f"gpu_check: {e.message}", file=sys.stderr)
            return 2
        return 0

    import torch

    from autotune.errors import WorkError
    from autotune.runtime.trial import run_trial

    def say(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is false); "
              "--device cpu runs the steps on CPU as a smoke test", file=sys.stderr)
        return 2
    gpus = args.gpus or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if args.device == "cuda":
        model, seq, batch = CHECK_MODEL, CHECK_SEQ, CHECK_BATCH
        dtype = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        say(f"{gpus} x {torch.cuda.get_device_name(0)}; model {model.name}, seq {seq}, batch {batch}, {dtype}")
    else:
        from autotune.specs import load_model

        model, seq, batch, dtype = load_model(SMOKE_MODEL), SMOKE_SEQ, SMOKE_BATCH, "bf16"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        storage = args.storage or f"sqlite:///{tmp}/gpu_check.db"
        entry = catalogue_name(torch.cuda.get_device_name(0)) if args.device == "cuda" else None
        try:
            pid, _ = _profile(args.device, gpus, storage, say)
            cluster = measured_cluster(pid, gpus, storage)
        except WorkError as e:
            if not entry:
                raise
            # the trials still say how the datasheet prices compare: the profile's failure is printed
            say(f"the profile failed ({e}); pricing on the catalogue's {entry} only")
            pid, cluster = f"none ({e})", _sheet_cluster(entry, gpus)
        chosen, skipped = select_plans(gpus)
        rows, refused = plan_rows(chosen, model, cluster, seq, batch, dtype, args.device)
        if entry:
            add_sheet_predictions(rows, model, entry, gpus, seq, batch)
        for r in rows:
            say(f"{r['name']}: running {r['plan'].degrees.inline()} ({args.warmup}+{args.steps} steps)")
            res = run_trial(r["plan"], model, seq, batch, steps=args.steps, warmup=args.warmup, device=args.device,
                            timeout_s=300)
            r["measured"], r["failure"] = res.measured, res.failure
            say(f"{r['name']}: predicted {r['predicted']['step_time_s']:.4f} s, measured "
                + (f"{res.measured['step_time_s']:.4f} s" if res.measured else f"failed: {res.failure}"))
    print(f"profile {pid}; {gpus} {args.device} device(s); model {model.name}, seq {seq}, global batch {batch}, "
          f"{dtype}; {time.perf_counter() - t0:.0f} s in all")
    print(report(rows, skipped + refused), flush=True)
    if entry:
        print(sheet_report(rows, entry), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"profile": pid, "device": args.device, "gpus": gpus, "model": model.to_dict(), "seq_len": seq,
             "global_batch": batch, "skipped": skipped + refused,
             "rows": [{**r, "plan": r["plan"].to_dict()} for r in rows]}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
