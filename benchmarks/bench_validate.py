"""Real-trial error of the cost model on this machine (issue 6, "Real-trial error").

A fixed, diverse set of plans for the local ranks (dp, tp, tp+sp, pp 1f1b / gpipe, cp, hp, several
micro-batch sizes, recomputation, ZeRO-1) on ``tiny`` and ``small``, each run as a real trial
(``autotune.runtime.trial.run_trial``), priced by the cost model on the measured profile of this
machine. Prints per plan: predicted vs measured step time and the compute / comm split (the
breakdown's pacing rank against the runtime's ``time_split``), then the median
|predicted - measured| / measured

* before calibration,
* after calibration fitted on all plans (in-sample),
* leave-one-out: calibration fitted on all plans but one, error measured on that one (held-out),
* cross-model: fitted on the plans of one model, measured on the other model's plans (held-out).

Repeats (``--repeat``) run every plan again and quote medians of the measured step times.

``--fresh`` runs the *fresh set* instead: plans that no constant of the cost model was ever chosen
on (docs/cpu-constants.md says which data chose each). A model the constants never saw
(``FRESH_MODEL``: other width, depth, head count and GQA ratio than ``tiny`` and ``small``), another
sequence length and batch, other layouts (interleaved 1F1B, contiguous CP, selective recomputation,
mixed tp+dp / pp+dp, ZeRO-2/3 and fp16 where the runtime runs them: a layout the runtime refuses is
listed and left out), repeats with other data seeds (``FRESH_SEEDS``) summarised by their median.
It prints the error before calibration (the frozen constants alone) and validate's leave-one-out
error inside the fresh set (the figure a new study reports), beside memory predicted vs measured.

    python benchmarks/bench_validate.py [--profile ID | --quick-profile] [--storage URL]
        [--models tiny,small] [--steps 3] [--repeat 1] [--only NAME,...] [--json FILE] [--fresh]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.specs.model import ModelSpec  # noqa: E402

WORKLOADS = {"tiny": (128, 8), "small": (256, 8)}

FRESH_MODEL = ModelSpec(name="fresh", layers=6, hidden=192, heads=6, kv_heads=2, ffn_hidden=512, vocab=1536,
                        source="benchmarks/bench_validate.py --fresh: a shape no CPU constant was chosen on")
"""head_dim 32, GQA 3:1, 6 layers: between tiny and small in every dimension, equal to neither."""
FRESH_WORKLOAD = (192, 6)
FRESH_SEEDS = (11, 12, 13)
"""Data seeds of the fresh set's repeats (the constants were chosen on seed-0 trials)."""

# every plan for 2 local ranks; none of them was run while a constant was chosen
FRESH_PLANS: list[tuple[str, dict[str, Any]]] = [
    ("dp2-mbs3", {"degrees": {"dp": 2}, "micro_batch_size": 3}),
    ("dp2-mbs1-rcsel", {"degrees": {"dp": 2}, "micro_batch_size": 1, "recompute": "selective"}),
    ("dp2-uneven", {"degrees": {"dp": 2}, "micro_batch_size": 1, "shares": {"samples": [2, 4]}}),
    ("tp2-mbs2", {"degrees": {"tp": 2}, "micro_batch_size": 2}),
    ("tp2-mbs6-sp-rcfull", {"degrees": {"tp": 2}, "micro_batch_size": 6, "sequence_parallel": True,
                            "recompute": "full"}),
    ("pp2-interleaved", {"degrees": {"pp": 2}, "micro_batch_size": 1, "schedule": "interleaved_1f1b",
                         "virtual_stages": 3}),
    ("pp2-1f1b-mbs3", {"degrees": {"pp": 2}, "micro_batch_size": 3, "schedule": "1f1b"}),
    ("cp2-contiguous", {"degrees": {"cp": 2}, "micro_batch_size": 2, "cp_layout": "contiguous"}),
    ("hp2-mbs3", {"degrees": {"hp": 2}, "micro_batch_size": 3}),
    ("dp2-z2", {"degrees": {"dp": 2}, "micro_batch_size": 2, "zero_stage": 2}),
    ("dp2-z3", {"degrees": {"dp": 2}, "micro_batch_size": 2, "zero_stage": 3}),
    ("dp2-fp16", {"degrees": {"dp": 2}, "micro_batch_size": 2, "dtype": "fp16"}),
]

# (name, plan dict): every plan for 2 local ranks
PLANS: list[tuple[str, dict[str, Any]]] = [
    ("dp2-mbs1", {"degrees": {"dp": 2}, "micro_batch_size": 1}),
    ("dp2-mbs4", {"degrees": {"dp": 2}, "micro_batch_size": 4}),
    ("dp2-mbs2-z1", {"degrees": {"dp": 2}, "micro_batch_size": 2, "zero_stage": 1}),
    ("dp2-mbs2-rcfull", {"degrees": {"dp": 2}, "micro_batch_size": 2, "recompute": "full"}),
    ("tp2-mbs1", {"degrees": {"tp": 2}, "micro_batch_size": 1}),
    ("tp2-mbs4-sp", {"degrees": {"tp": 2}, "micro_batch_size": 4, "sequence_parallel": True}),
    ("pp2-1f1b-mbs1", {"degrees": {"pp": 2}, "micro_batch_size": 1, "schedule": "1f1b"}),
    ("pp2-gpipe-mbs2", {"degrees": {"pp": 2}, "micro_batch_size": 2, "schedule": "gpipe"}),
    ("pp2-1f1b-mbs4", {"degrees": {"pp": 2}, "micro_batch_size": 4, "schedule": "1f1b"}),
    ("cp2-mbs1", {"degrees": {"cp": 2}, "micro_batch_size": 1}),
    ("cp2-mbs4", {"degrees": {"cp": 2}, "micro_batch_size": 4}),
    ("hp2-mbs2", {"degrees": {"hp": 2}, "micro_batch_size": 2}),
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load() -> str:
    try:
        a, b, c = os.getloadavg()
        return f"{a:.2f} {b:.2f} {c:.2f}"
    except OSError:
        return "n/a"


def get_profile(args: argparse.Namespace) -> str:
    if args.profile:
        return str(args.profile)
    from autotune.commands.tune import profile_quick

    pid, note = profile_quick(args.storage, 2, log) if args.quick_profile else _full_profile(args.storage)
    log(note)
    if pid is None:
        raise SystemExit(f"no profile: {note}")
    return pid


def _full_profile(storage: str) -> tuple[str | None, str]:
    from profilers.launch import check_request, launch_local
    from profilers.store import save_profile

    t0 = time.perf_counter()
    result = launch_local(check_request("auto", 2), 2, quick=False, timeout_s=120.0)
    pid = save_profile(result, storage, label="bench_validate", nproc=2, wall_s=time.perf_counter() - t0)
    return str(pid), f"profiled this machine: profile {pid} ({time.perf_counter() - t0:.1f} s)"


def split_of(measured: dict[str, Any], rank: int) -> dict[str, float]:
    for s in measured.get("time_split") or []:
        if s.get("rank") == rank:
            return s
    return {}


def merge_runs(sets: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per (model, plan): its repeats summarised by their median (the repeat whose step
    time is the median, the lower one of an even count; the fastest would keep whichever repeat
    luck favoured and bias every error towards over-prediction), with how many there were and the
    spread (max / min step time) so a disturbed plan shows."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for runs in sets:
        for r in runs:
            by.setdefault((r["model"], r["name"]), []).append(r)
    out = []
    for group in by.values():
        group = sorted(group, key=lambda g: g["measured"]["step_time_s"])
        rec = dict(group[(len(group) - 1) // 2])
        rec["repeats"] = len(group)
        rec["spread"] = group[-1]["measured"]["step_time_s"] / group[0]["measured"]["step_time_s"]
        out.append(rec)
    return out


def model_of(name: str) -> ModelSpec:
    from autotune.specs import load_model

    return FRESH_MODEL if name == FRESH_MODEL.name else load_model(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", help="profile id in --storage (default: profile this machine first)")
    ap.add_argument("--quick-profile", action="store_true", help="profile with --quick (as `tune` does)")
    ap.add_argument("--storage", default="sqlite:///results/autotune.db")
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated plan names")
    ap.add_argument("--json", dest="json_out", help="write every run to this file")
    ap.add_argument("--runs", help="re-price the runs of earlier --json files (comma-separated: per plan the "
                                   "median over the files) instead of running trials")
    ap.add_argument("--fresh", action="store_true", help="the fresh set: plans no constant was chosen on "
                    "(FRESH_MODEL, FRESH_PLANS, seeds FRESH_SEEDS, --repeat defaults to 3)")
    args = ap.parse_args()

    from autotune.commands.tune import measured_cluster
    from autotune.cost import estimate
    from autotune.plan import Plan

    plans, workloads, seeds = PLANS, {m: WORKLOADS[m] for m in args.models.split(",")}, (0,)
    if args.fresh:
        plans, workloads, seeds = FRESH_PLANS, {FRESH_MODEL.name: FRESH_WORKLOAD}, FRESH_SEEDS
        args.repeat = args.repeat if args.repeat > 1 else len(FRESH_SEEDS)

    if args.runs:
        files = [json.loads(Path(f).read_text()) for f in args.runs.split(",")]
        pid, storage = files[0]["profile"], files[0]["storage"]
        if args.profile:  # re-price the same measurements on another profile of the same storage
            pid = str(args.profile)
        records = merge_runs([f["runs"] for f in files])
    else:
        storage = args.storage
        pid = get_profile(args)
        records = []
    cluster = measured_cluster(pid, storage)
    print(f"profile {pid} ({storage}); load average at start: {load()}")
    only = {x for x in args.only.split(",") if x}

    if not args.runs:
        from autotune.errors import InputError
        from autotune.runtime.trial import prepare, run_trial

        left_out = []
        for name, (seq, gb) in workloads.items():
            model = model_of(name)
            for pname, d in plans:
                if only and pname not in only:
                    continue
                plan = Plan.from_dict({**d, "dtype": d.get("dtype", "bf16")})
                try:  # a plan the rules or the runtime refuse is said, and left out
                    prepare(plan.resolve(model, cluster, seq, gb), model, seq, gb, device="cpu")
                except InputError as e:
                    log(f"{name} {pname}: left out: {e.message}")
                    left_out.append((pname, e.message))
                    continue
                steps_all, splits = [], []
                for rep in range(args.repeat):
                    seed = seeds[rep % len(seeds)]
                    log(f"{name} {pname}: trial {rep + 1}/{args.repeat}, seed {seed} (load {load()})")
                    res = run_trial(plan, model, seq, gb, steps=args.steps, warmup=args.warmup, timeout_s=300,
                                    seed=seed, device="cpu")
                    if res.failure:
                        log(f"  failed: {res.failure}")
                        continue
                    steps_all.append(res.measured["step_time_s"])
                    splits.append(res.measured)
                if not splits:
                    continue
                m = dict(splits[-1])
                m["step_time_s"] = statistics.median(steps_all)  # the median repeat, never the fastest
                m["peak_memory_bytes"] = [statistics.median(s["peak_memory_bytes"][r] for s in splits)
                                          for r in range(plan.world)]
                # per-rank split: median over repeats
                m["time_split"] = [
                    {k: statistics.median(split_of(s, r).get(k, 0.0) for s in splits)
                     for k in ("compute_s", "comm_s", "idle_s", "emulated_s")} | {"rank": r}
                    for r in range(plan.world)]
                records.append({"model": name, "seq_len": seq, "global_batch": gb, "name": pname,
                                "plan": d, "measured": m, "load": load(), "repeats": len(splits),
                                "spread": max(steps_all) / min(steps_all)})
        for pname, why in left_out:
            print(f"left out {pname}: {why}")
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"profile": pid, "storage": storage, "runs": records,
                                                       "fresh": args.fresh, "left_out": left_out}))

    report(records, cluster, estimate, Plan, model_of, only)


def report(records, cluster, estimate, Plan, load_model, only) -> None:
    from autotune.validate import calibrate_runs, held_out_errors, memory_errors

    runs = []
    print(f"{'model':6} {'plan':18} {'pred s':>8} {'meas s':>8} {'err':>7} | {'p.comp':>7} {'m.comp':>7} "
          f"{'p.comm':>7} {'m.comm':>7} {'m.idle':>7} | {'p.mem':>8} {'m.mem':>8} {'mem err':>7}")
    mem_errs = []
    for rec in records:
        if only and rec["name"] not in only:
            continue
        model = load_model(rec["model"])
        est = estimate(Plan.from_dict({**rec["plan"], "dtype": rec["plan"].get("dtype", "bf16")}), model, cluster,
                       rec["seq_len"], rec["global_batch"])
        pred, meas = est.predicted["step_time_s"], rec["measured"]["step_time_s"]
        br = est.breakdown
        cr = br["critical_rank"]
        row = br["ranks"][cr]
        ms = split_of(rec["measured"], cr)
        mem = memory_errors(est.predicted, rec["measured"])
        if mem and mem["median_error"] is not None:
            mem_errs.append(mem["median_error"])
        mcell = (f"{max(mem['predicted_bytes']) / 2**20:7.1f}M {max(mem['measured_bytes']) / 2**20:7.1f}M "
                 f"{mem['median_error']:7.0%}") if mem else f"{'n/a':>8} {'n/a':>8} {'n/a':>7}"
        print(f"{rec['model']:6} {rec['name']:18} {pred:8.4f} {meas:8.4f} {(pred - meas) / meas:+7.1%} | "
              f"{row['compute_s']:7.4f} {ms.get('compute_s', 0):7.4f} {row['comm_s']:7.4f} "
              f"{ms.get('comm_s', 0):7.4f} {ms.get('idle_s', 0):7.4f} | {mcell}")
        runs.append({"plan": est.plan, "predicted": est.predicted, "breakdown": br, "measured": rec["measured"],
                     "ctx": (model, cluster, rec["seq_len"], rec["global_batch"]), "model_name": rec["model"]})
    if not runs:
        return

    def step_of(r, cal):
        return float(estimate(r["plan"], *r["ctx"], calibration=cal).predicted["step_time_s"])

    before = [abs(r["predicted"]["step_time_s"] - r["measured"]["step_time_s"]) / r["measured"]["step_time_s"]
              for r in runs]
    cal = calibrate_runs(runs, cluster, step_of)
    inside = [abs(step_of(r, cal) - r["measured"]["step_time_s"]) / r["measured"]["step_time_s"] for r in runs]
    loo = held_out_errors(runs, cluster, step_of)
    print(f"\nplans {len(runs)}; load average now {load()}")
    print(f"median |pred - meas| / meas: before {statistics.median(before):.1%}, after (in-sample) "
          f"{statistics.median(inside):.1%}, leave-one-out {statistics.median(loo):.1%}")
    print(f"calibration (all plans): {json.dumps(cal)}")
    if mem_errs:
        print(f"memory: median over plans of the median |pred - meas| / meas over ranks {statistics.median(mem_errs):.1%} "
              "(CPU: the process's resident high-water mark; docs/validation.md)")
    names = sorted({r["model_name"] for r in runs})
    if len(names) == 2:
        for a, b in (names, names[::-1]):
            fit = [r for r in runs if r["model_name"] == a]
            test = [r for r in runs if r["model_name"] == b]
            c = calibrate_runs(fit, cluster, step_of)
            errs = [abs(step_of(r, c) - r["measured"]["step_time_s"]) / r["measured"]["step_time_s"] for r in test]
            print(f"fit on {a}, held-out on {b}: median {statistics.median(errs):.1%} (before "
                  f"{statistics.median(abs(r['predicted']['step_time_s'] - r['measured']['step_time_s']) / r['measured']['step_time_s'] for r in test):.1%})")
    for name in names:
        sub = [r for r in runs if r["model_name"] == name]
        b = [abs(r["predicted"]["step_time_s"] - r["measured"]["step_time_s"]) / r["measured"]["step_time_s"]
             for r in sub]
        c = calibrate_runs(sub, cluster, step_of)
        i = [abs(step_of(r, c) - r["measured"]["step_time_s"]) / r["measured"]["step_time_s"] for r in sub]
        lo = held_out_errors(sub, cluster, step_of)
        print(f"{name}: before {statistics.median(b):.1%}, in-sample {statistics.median(i):.1%}, "
              f"leave-one-out {statistics.median(lo):.1%} ({len(sub)} plans)")


if __name__ == "__main__":
    main()
