"""How long the dashboard takes on studies of growing size, and how big the report is.

Builds studies in the contract's shape (docs/contracts.md, "Study") with Optuna directly: N trials
of pp=4 plans with a stored GPipe timeline (32 micro-batches) on the fastest fifth (as the search keeps
timelines for its best plans),
then times reading the study, the terminal view, writing the HTML report, and (when Chromium is
installed) the browser drawing all six charts ("!" after the time: not all drew). Run: ``python benchmarks/bench_dashboard.py [N ...]``.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
from rich.console import Console

from autotune.dashboard.data import load_view
from autotune.dashboard.report import write_report
from autotune.dashboard.terminal import render
from autotune.plan import Degrees, Plan
from autotune.plan_record import PlanRecord
from autotune.specs.cluster import load_cluster
from autotune.specs.model import PRESETS

MODEL, SEQ, BATCH, CLUSTER = PRESETS["small"], 256, 64, "local:8"


def timeline(fwd: float, bwd: float, p: int, m: int) -> list[dict]:
    """GPipe events per stage: forwards after the stage above, backwards after the stage below."""
    ev = []
    for s in range(p):
        for i in range(m):
            ev.append({"stage": s, "rank": s, "kind": "fwd", "microbatch": i, "start": (s + i) * fwd,
                       "end": (s + i + 1) * fwd})
        b0 = (p + m - 1) * fwd
        for i in range(m):
            st = b0 + (p - 1 - s + i) * bwd
            ev.append({"stage": s, "rank": s, "kind": "bwd", "microbatch": i, "start": st, "end": st + bwd})
        ev.append({"stage": s, "rank": s, "kind": "bubble", "microbatch": None, "start": m * fwd + s * fwd,
                   "end": b0 + (p - 1 - s) * bwd})
    return ev


def build(url: str, n: int) -> None:
    rng = random.Random(0)
    cl = load_cluster(CLUSTER)
    study = optuna.create_study(study_name="bench", storage=url, direction="maximize")
    for k, v in {"model": MODEL.name, "model_spec": MODEL.to_dict(), "cluster": CLUSTER,
                 "cluster_spec": cl.to_dict(), "seq_len": SEQ, "global_batch": BATCH}.items():
        study.set_user_attr(k, v)
    shapes = [Degrees(dp=8), Degrees(dp=4, pp=2), Degrees(dp=2, pp=4), Degrees(pp=4, tp=2), Degrees(dp=2, tp=4)]
    resolved = [Plan(degrees=d).resolve(MODEL, cl, SEQ, BATCH) for d in shapes]
    trials = []
    for i in range(n):
        plan = resolved[i % len(resolved)]
        tps = rng.uniform(50, 500)
        feasible = rng.random() > 0.2
        pred = {"step_time_s": SEQ * BATCH / tps, "tokens_per_s": tps, "mfu": 0.3,
                "memory_bytes": [rng.uniform(0.5, 4) * 2**30] * plan.world,
                "capacity_bytes": [cl.devices[0].spec.memory_bytes] * plan.world, "feasible": feasible}
        meas = ({"measured": {"tokens_per_s": tps * rng.uniform(0.8, 1.1), "peak_memory_bytes":
                              [2**30] * plan.world}} if feasible and i % 7 == 0 else {})
        bd = {"timeline": timeline(0.001, 0.002, plan.degrees.pp, 32)} if tps > 400 else {}
        trials.append(optuna.trial.create_trial(
            value=tps if feasible else 0.0, constraints={"memory": -1.0 if feasible else 1.0},
            user_attrs={"plan": PlanRecord(plan, predicted=pred).to_dict(), "breakdown": bd,
                        "infeasible_reason": None if feasible else "memory: rank 0 over capacity",
                        "baseline": None, **meas}))
    study.add_trials(trials)


def main(sizes: list[int]) -> None:
    chromium = shutil.which("chromium")
    print(f"{'trials':>7} {'read s':>7} {'terminal s':>10} {'report s':>8} {'report MB':>9} {'browser s':>9}")
    for n in sizes:
        with tempfile.TemporaryDirectory() as d:
            url = f"sqlite:///{d}/b.db"
            build(url, n)
            t0 = time.perf_counter()
            view = load_view("bench", url)
            t1 = time.perf_counter()
            Console(file=open("/dev/null", "w"), width=200).print(render(view, 30))  # noqa: SIM115
            t2 = time.perf_counter()
            facts = write_report(view, Path(d) / "r.html")
            t3 = time.perf_counter()
            browser = "-"
            if chromium:
                tb = time.perf_counter()
                r = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                                    "--no-first-run", "--disable-background-networking", "--disable-component-update",
                                    "--disable-sync", f"--user-data-dir={d}/prof", "--enable-unsafe-swiftshader",
                                    "--virtual-time-budget=60000", "--dump-dom", Path(facts["html"]).as_uri()],
                                   capture_output=True, text=True, timeout=300)
                ok = f'data-charts-drawn="{len(facts["charts"])}"' in r.stdout and len(facts["charts"]) == 6
                browser = f"{time.perf_counter() - tb:.1f}" + ("" if ok else "!")
            print(f"{n:>7} {t1 - t0:>7.2f} {t2 - t1:>10.3f} {t3 - t2:>8.2f} {facts['bytes'] / 1e6:>9.1f} {browser:>9}")


if __name__ == "__main__":
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    main([int(x) for x in sys.argv[1:]] or [100, 1000, 5000])
