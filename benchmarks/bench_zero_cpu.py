"""ZeRO-2 / ZeRO-3 plans of `small` on this CPU: the prediction before calibration against real trials,
priced with and without FSDP2's measured work (``meta.fsdp``, profilers/fsdp_costs.py; issue 25).

`tune` validates the plans its search ranks first, which on this machine are mostly ZeRO-0; this runs
the same dp=2 plan at every ZeRO stage through `autotune trial` and prices each on the layer profile
`tune` measured (a storage kept by ``bench_tune.py --keep DIR``, or measured here when none is given).
Per plan: the prediction with ``meta.fsdp`` (what `tune` prices now) and without it (the rest of
the cost model as it is now), the measured step (median over ``--repeats`` trials, wall clock) and the slowest rank's CPU
seconds per step (``time_split.cpu_s``), and both errors.

    python benchmarks/bench_zero_cpu.py [--storage sqlite:///DIR/run1.db] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SEQ, BATCH = 256, 8
PLANS = [(mbs, 8 // (2 * mbs), z) for mbs in (2, 4) for z in (0, 1, 2, 3)]
"""(micro-batch size, micro-batches, ZeRO stage) of the dp=2 plans run, `tune`'s workload (s=256, b=8)."""


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def inline(mbs: int, nmb: int, z: int) -> str:
    return f"dp=2,mbs={mbs},nmb={nmb},zero={z},dtype=bf16"


def measured_storage(work: Path) -> str:
    """A storage holding `tune`'s profile and layer profile of `small` (its layers:1 and profile 1)."""
    storage = f"sqlite:///{work / 'tune.db'}"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "autotune", "tune", "--storage", storage, "--out-dir",
                        str(work / "plans"), "--json", "--top", "1"], capture_output=True, text=True, env=env,
                       cwd=work)
    if r.returncode != 0:
        raise SystemExit(f"tune failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
    return storage


def predictions(storage: str) -> dict[tuple[int, int, int], tuple[float, float]]:
    """{plan: (seconds with meta.fsdp, seconds without)} on the storage's profile 1 and layers:1."""
    from autotune.commands.tune import measured_cluster
    from autotune.cost import estimate
    from autotune.cost import layers as LY
    from autotune.cost import rank as R
    from autotune.plan import load_plan_for
    from autotune.specs import load_model

    cluster = measured_cluster("1", storage, layers=("layers:1",))
    model = load_model("small")

    def price() -> dict:
        R._MEMO.clear()  # the same rank costs are memoised by shape, not by the profile's fields
        return {k: estimate(load_plan_for(inline(*k), cluster, "bf16"), model, cluster, SEQ, BATCH
                            ).predicted["step_time_s"] for k in PLANS}

    with_ = price()
    tables = list(LY._TABLES.values())
    if not any(t.fsdp for t in tables):
        print("note: the profile holds no meta.fsdp (measured before profilers/fsdp_costs.py): both prices agree")
    for t in tables:
        t.fsdp = {}
    without = price()
    return {k: (with_[k], without[k]) for k in PLANS}


def trial(mbs: int, nmb: int, z: int) -> tuple[float, float]:
    """(wall seconds, slowest rank's CPU seconds) per step of one `autotune trial`."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "autotune", "trial", "-p", inline(mbs, nmb, z), "-m", "small",
                        "-s", str(SEQ), "-b", str(BATCH), "--json", "--steps", "5"], capture_output=True,
                       text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"trial {inline(mbs, nmb, z)} failed: {r.stderr.strip().splitlines()[-1:]}")
    out = json.loads(r.stdout)
    m = out.get("measured", out)
    return m["step_time_s"], max(s["cpu_s"] for s in m["time_split"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--storage", help="a storage `bench_tune.py --keep DIR` left (DIR/run1.db); default: tune here")
    ap.add_argument("--repeats", type=int, default=3, help="trials per plan (the median is compared)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-zero-") as tmp:
        storage = args.storage or measured_storage(Path(tmp))
        pred = predictions(storage)
        print(f"load before the trials {load()}")
        runs: dict = {k: [] for k in PLANS}
        for _ in range(args.repeats):  # rounds over every plan: a load change hits each plan alike
            for k in PLANS:
                runs[k].append(trial(*k))
        print(f"{'plan':34} {'priced':>9} {'no fsdp':>9} {'measured':>9} {'cpu':>9}   error (cpu)       "
              "without meta.fsdp (cpu)")
        for k in PLANS:
            wall = statistics.median(w for w, _ in runs[k])
            cpu = statistics.median(c for _, c in runs[k])
            w, wo = pred[k]
            print(f"{inline(*k):34} {w * 1e3:7.1f}ms {wo * 1e3:7.1f}ms {wall * 1e3:7.1f}ms {cpu * 1e3:7.1f}ms   "
                  f"{(w - wall) / wall:+6.1%} ({(w - cpu) / cpu:+6.1%})   {(wo - wall) / wall:+6.1%} ({(wo - cpu) / cpu:+6.1%})")
        print(f"load after {load()}")


if __name__ == "__main__":
    main()
