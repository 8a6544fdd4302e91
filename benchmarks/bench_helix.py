"""HelixPipe against 1F1B in real CPU trials on this machine, measured and predicted side by side.

An attention-heavy small model (sequence long relative to the hidden size: attention's s^2 work
outweighs the blocks' GEMMs) on 2 local ranks: 1F1B, GPipe and interleaved 1F1B (the chain
schedules, the reference for the prediction error) and HelixPipe with 1 and 2 folds, with and
without recomputation, each run as a real trial (``autotune.runtime.trial.run_trial``) and priced
by the cost model on the measured profile of this machine (no calibration). Prints per plan the
predicted and measured step time and the error, then the median |error| of the HelixPipe plans and
of the chain schedules.

    python benchmarks/bench_helix.py [--profile ID | --quick-profile] [--storage URL] [--steps 3]
        [--repeat 1] [--seq 1024] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from autotune.specs.model import ModelSpec  # noqa: E402

MODEL = ModelSpec(name="helix-bench", layers=4, hidden=128, heads=4, kv_heads=4, ffn_hidden=256, vocab=512,
                  source="benchmarks/bench_helix.py: attention-heavy (seq >> hidden)")
BATCH = 8
PLANS: list[tuple[str, dict[str, Any]]] = [
    ("1f1b", {"degrees": {"pp": 2}, "schedule": "1f1b"}),
    ("1f1b-rcfull", {"degrees": {"pp": 2}, "schedule": "1f1b", "recompute": "full"}),
    ("gpipe", {"degrees": {"pp": 2}, "schedule": "gpipe"}),
    ("interleaved", {"degrees": {"pp": 2}, "schedule": "interleaved_1f1b", "virtual_stages": 2}),
    ("helix-F1", {"degrees": {"pp": 2}, "schedule": "helixpipe", "helix_folds": 1}),
    ("helix-F2", {"degrees": {"pp": 2}, "schedule": "helixpipe", "helix_folds": 2}),
    ("helix-F2-rcfull", {"degrees": {"pp": 2}, "schedule": "helixpipe", "helix_folds": 2, "recompute": "full"}),
]


def measured_local(profile_id: str, storage: str):
    """``local`` with its device replaced by the measured profile (as ``tune``'s measured_cluster,
    with the link figures written with their units, as cluster files now require)."""
    from autotune.specs.cluster import cluster_from_dict, load_cluster

    g = load_cluster("local").groups[0]
    d = {"name": "measured-local", "nodes": [{"count": 1, "devices_per_node": g.devices_per_node,
                                              "device": f"profile:{profile_id}",
                                              "intra_node": {"bandwidth": f"{g.intra_node.bandwidth}B/s",
                                                             "latency": f"{g.intra_node.latency}s"}}]}
    return cluster_from_dict(d, source="local (measured)", storage=storage)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", help="profile id in --storage (default: profile this machine first)")
    ap.add_argument("--quick-profile", action="store_true", help="profile with --quick (as `tune` does)")
    ap.add_argument("--storage", default="sqlite:///results/autotune.db")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--only", default="", help="comma-separated plan names")
    ap.add_argument("--json", dest="json_out", help="write every run to this file")
    args = ap.parse_args()

    from bench_validate import get_profile, load, log

    from autotune.cost import estimate
    from autotune.plan import Plan
    from autotune.runtime.trial import run_trial

    Path("results").mkdir(exist_ok=True)
    pid = get_profile(args)
    cluster = measured_local(pid, args.storage)
    print(f"profile {pid} ({args.storage}); model {MODEL.name}: L={MODEL.layers} h={MODEL.hidden} "
          f"heads={MODEL.heads} seq={args.seq} batch={BATCH} {args.dtype}; load {load()}")
    only = {x for x in args.only.split(",") if x}
    rows = []
    for name, d in PLANS:
        if only and name not in only:
            continue
        plan = Plan.from_dict({**d, "dtype": args.dtype})
        est = estimate(plan, MODEL, cluster, args.seq, BATCH)
        pred = est.predicted["step_time_s"]
        times = []
        for rep in range(args.repeat):
            log(f"{name}: trial {rep + 1}/{args.repeat} (load {load()})")
            t0 = time.perf_counter()
            res = run_trial(plan, MODEL, args.seq, BATCH, steps=args.steps, warmup=args.warmup, timeout_s=600,
                            device="cpu")
            if res.failure:
                log(f"  failed: {res.failure}")
                continue
            times.append(res.measured["step_time_s"])
            log(f"  {res.measured['step_time_s']:.3f} s/step ({time.perf_counter() - t0:.0f} s wall)")
        if not times:
            continue
        meas = statistics.median(times)
        rows.append({"name": name, "plan": d, "predicted_s": pred, "measured_s": meas,
                     "error": (pred - meas) / meas, "bubble_predicted": est.predicted["bubble_fraction"],
                     "memory_predicted": max(est.predicted["memory_bytes"])})
    print(f"\n{'plan':18} {'predicted s':>12} {'measured s':>11} {'error':>8} {'pred. bubble':>13}")
    for r in rows:
        print(f"{r['name']:18} {r['predicted_s']:12.3f} {r['measured_s']:11.3f} {r['error']:+8.1%} "
              f"{r['bubble_predicted']:13.3f}")
    helix = [abs(r["error"]) for r in rows if r["name"].startswith("helix")]
    chain = [abs(r["error"]) for r in rows if not r["name"].startswith("helix")]
    if helix and chain:
        print(f"\nmedian |error|: helixpipe {statistics.median(helix):.1%} ({len(helix)} plans), "
              f"chain schedules {statistics.median(chain):.1%} ({len(chain)} plans)")
    by = {r["name"]: r for r in rows}
    if "1f1b" in by:
        for h in ("helix-F1", "helix-F2", "helix-F2-rcfull"):
            if h in by:
                print(f"{h} vs 1f1b: measured {by['1f1b']['measured_s'] / by[h]['measured_s'] - 1:+.1%} faster, "
                      f"predicted {by['1f1b']['predicted_s'] / by[h]['predicted_s'] - 1:+.1%}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"profile": pid, "storage": args.storage, "seq": args.seq,
                                                   "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
