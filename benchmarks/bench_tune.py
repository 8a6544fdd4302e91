"""`autotune tune` as a new user runs it (README command 1), several times, each on a fresh storage:
the error before calibration of every validated plan and the held-out error after it (issue 25,
"Done when": every validated plan within 15% before calibration, median of three runs; held-out
<= 10%).

Per run it prints each validated plan's predicted and measured tokens/s and their error, the
calibration's held-out (leave-one-out) error, the precision `tune` chose and the machine's load
average before and after (a CPU trial is timed on the wall clock: other processes on the cores
slow it, the prediction does not know them). Then, per plan layout validated in any run, the
median over the runs of its error before calibration, and the median held-out error.

Beside the wall-clock error, ``cpu`` is the error against the step's CPU time (the slowest rank's
process CPU seconds per step, ``time_split.cpu_s``: every thread, gloo's included; the layers are
timed on the thread clock too). On a shared machine it is the figure that says something about the
model: it leaves out the slices the cores gave to other processes (and, on a quiet machine, the
waits for the other rank, which the wall clock counts).

    python benchmarks/bench_tune.py [--runs 3] [--keep DIR] [-- extra tune options]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load() -> str:
    a, b, c = os.getloadavg()
    return f"{a:.2f} {b:.2f} {c:.2f}"


def layout(plan: dict) -> str:
    """A validated plan's configuration in one short string (what identifies it across runs)."""
    d = plan["degrees"]
    deg = ",".join(f"{k}={v}" for k, v in d.items() if v > 1) or "single"
    sh = plan.get("shares") or {}
    uneven = "".join(f" {k}={'/'.join(map(str, v))}" for k, v in sh.items()
                     if isinstance(v, list) and len(set(v)) > 1)  # uneven shares tell two plans apart
    return (f"{deg} mbs{plan['micro_batch_size']}x{plan['num_microbatches']} {plan['schedule']} "
            f"z{plan['zero_stage']} rc={plan['recompute']}{' sp' if plan.get('sequence_parallel') else ''}{uneven}")


def cpu_error(v: dict) -> float | None:
    """(predicted - CPU step) / CPU step, the CPU step the slowest rank's median CPU seconds per
    step (None where the trial did not measure them)."""
    cpu = [s.get("cpu_s") for s in v["measured"].get("time_split") or []]
    if not cpu or any(c is None or c <= 0 for c in cpu):
        return None
    step = max(cpu)
    return (v["predicted"]["step_time_s"] - step) / step


def one_run(i: int, work: Path, extra: list[str]) -> dict:
    storage = f"sqlite:///{work / f'run{i}.db'}"
    before = load()
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "autotune", "tune", "--storage", storage, "--out-dir",
                        str(work / f"plans{i}"), "--json", *extra], capture_output=True, text=True, env=env, cwd=work)
    if r.returncode != 0:
        raise SystemExit(f"run {i}: tune failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
    out = json.loads(r.stdout)
    out["_load"] = (before, load())
    out["_wall_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keep", help="keep the storages here (default: a temporary directory)")
    ap.add_argument("extra", nargs="*", help="options passed on to `autotune tune` (after --)")
    args = ap.parse_args()
    tmp = None
    if args.keep:
        work = Path(args.keep)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench-tune-")
        work = Path(tmp.name)
    by_layout: dict[str, list[float]] = {}
    by_layout_cpu: dict[str, list[float]] = {}
    held: list[float] = []
    for i in range(1, args.runs + 1):
        out = one_run(i, work, args.extra)
        lb, la = out["_load"]
        errs = out["errors"]
        print(f"run {i}: precision {out.get('dtype')}, {out['_wall_s']:.0f} s, load average before {lb}, after {la}")
        for n in out.get("notes") or []:
            if n.startswith("precision:"):
                print(f"  {n}")
        for v in out["validate"]["validated"]:
            if not v.get("measured"):
                print(f"  {layout(v['plan']):52} failed: {(v.get('failure') or {}).get('message')}")
                continue
            p, m = v["predicted"]["tokens_per_s"], v["measured"]["tokens_per_s"]
            err = v["error"]  # validate's: (predicted - measured) / measured step time, as the issue quotes it
            by_layout.setdefault(layout(v["plan"]), []).append(err)
            cpu = cpu_error(v)
            if cpu is not None:
                by_layout_cpu.setdefault(layout(v["plan"]), []).append(cpu)
            ho = v.get("error_held_out")
            ho_s = "n/a" if ho is None else f"{ho:+.1%}"
            cpu_s = "n/a" if cpu is None else f"{cpu:+.1%}"
            print(f"  {layout(v['plan']):52} predicted {p:9,.0f} tok/s  measured {m:9,.0f}  error {err:+7.1%}  "
                  f"cpu {cpu_s}  held out {ho_s}")
        if errs.get("held_out") is not None:
            held.append(errs["held_out"])
        print(f"  median |error|: before {errs.get('before'):.1%}, after (in-sample) {errs.get('after'):.1%}, "
              f"held out {errs.get('held_out'):.1%}" if errs.get("before") is not None else "  no errors")
    print("\nper layout, median over the runs it was validated in (error before calibration, step time):")
    worst = 0.0
    for lay, es in sorted(by_layout.items()):
        med = statistics.median(es)
        worst = max(worst, abs(med))
        cpu = by_layout_cpu.get(lay)
        cpu_s = f"  cpu {statistics.median(cpu):+7.1%}" if cpu else ""
        print(f"  {lay:52} {med:+7.1%}{cpu_s}  ({len(es)} run{'s' if len(es) > 1 else ''})")
    if held:
        print(f"held-out error after calibration: median {statistics.median(held):.1%} over {len(held)} runs; "
              f"worst plan before calibration {worst:.1%}; load average now {load()}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
