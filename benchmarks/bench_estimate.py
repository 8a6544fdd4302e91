"""Cost-model speed: estimates per second for a 128-device cluster of 4 device types (H100, A100,
H200, L40S; 4 nodes x 8 each), llama3-70b at 8k tokens, 32 micro-batches per replica, over a mix of
plans (pipeline stages on different device types, uneven layers, tp/cp/hp/dp), with and without
the Gantt timeline. Target: <= 1 ms per estimate (what the search needs). Times are CPU time of
this process (time.process_time), so other load on a shared machine inflates them less. The search
prices many plans per layout, so the layout caches stay warm (as in the main figures); the "new
layout" line clears them before every estimate too.

    python benchmarks/bench_estimate.py [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import time

from autotune.cost import estimate
from autotune.cost.pipeline import simulate_cached
from autotune.plan import Plan
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model

CLUSTER = {
    "name": "bench-128",
    "nodes": [{"count": 4, "devices_per_node": 8, "device": d} for d in ("H100-SXM", "A100-80GB", "H200", "L40S")],
    "inter_node": {"bandwidth": "25GB/s", "latency": "10us"},
}
SEQ, MBS = 8192, 1

PLANS = [  # each with 32 micro-batches per DP replica
    {"degrees": {"dp": 4, "pp": 4, "tp": 8}, "recompute": "selective", "sequence_parallel": True},
    {"degrees": {"dp": 4, "pp": 4, "tp": 8}, "shares": {"layers": [24, 14, 26, 16]}, "recompute": "selective"},
    {"degrees": {"dp": 2, "pp": 4, "cp": 2, "tp": 8}, "recompute": "full", "zero_stage": 1},
    {"degrees": {"dp": 4, "pp": 4, "hp": 2, "tp": 4}, "schedule": "gpipe", "recompute": "selective"},
    {"degrees": {"dp": 2, "pp": 8, "tp": 8}, "schedule": "interleaved_1f1b", "virtual_stages": 2,
     "recompute": "selective"},
    {"degrees": {"dp": 16, "pp": 8}, "recompute": "full", "zero_stage": 3},
]


def forget_layouts() -> None:
    """Empty the caches keyed by layout (each tp group's links, the ranks' device indices, the
    placement check, the datasheet block and GEMM times): what a plan costs whose mesh and shares
    the search has not priced before. Simulations are cleared before every estimate anyway."""
    from autotune import plan as plan_module
    from autotune.cost import compute, context, datasheet

    context._MESH_LINKS.clear()
    context._DEVICES.clear()
    plan_module._PLACEMENT_CHECKS.clear()
    compute._SIZED.clear()
    datasheet._gemm_time.cache_clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    model = load_model("llama3-70b")
    cluster = cluster_from_dict(CLUSTER)
    print(f"cluster {cluster.name}: {cluster.num_devices} devices, {len(cluster.device_types())} device types; "
          f"model {model.name}, seq {SEQ}")
    for timeline in (False, True):
        per_plan = []
        for d in PLANS:
            plan = Plan.from_dict(d)
            batch = d["degrees"].get("dp", 1) * 32 * MBS
            est = estimate(plan, model, cluster, SEQ, batch, timeline=timeline)  # warm the caches
            assert est.plan.num_microbatches == 32
            samples = []
            for _ in range(5):
                t0 = time.process_time()
                for _ in range(args.repeat // 5):
                    # every search trial is a new plan: no simulation may come from the cache
                    simulate_cached.cache_clear()
                    estimate(plan, model, cluster, SEQ, batch, timeline=timeline)
                samples.append((time.process_time() - t0) / (args.repeat // 5))
            per_plan.append((plan.degrees.inline(), plan.schedule, min(samples), statistics.median(samples),
                             len(est.breakdown["timeline"] or [])))
        print(f"\ntimeline={timeline}")
        for name, sched, best, med, ev in per_plan:
            print(f"  {name:<22} {sched:<17} best {best * 1e3:6.3f} ms  median {med * 1e3:6.3f} ms  "
                  f"({1 / med:7.0f} estimates/s){f'  {ev} events' if timeline else ''}")
        meds = [m for *_, m, _ in per_plan]
        print(f"  all plans: median {statistics.median(meds) * 1e3:.3f} ms per estimate, "
              f"{1 / statistics.median(meds):.0f} estimates/s")
    # a layout met for the first time: the layout caches cleared before every estimate (timeline off)
    meds = []
    for d in PLANS:
        plan, batch = Plan.from_dict(d), d["degrees"].get("dp", 1) * 32 * MBS
        samples = []
        for _ in range(5):
            t0 = time.process_time()
            for _ in range(args.repeat // 5):
                simulate_cached.cache_clear()
                forget_layouts()
                estimate(plan, model, cluster, SEQ, batch)
            samples.append((time.process_time() - t0) / (args.repeat // 5))
        meds.append(statistics.median(samples))
    print(f"\nnew layout (layout caches cleared too, timeline=False): median {statistics.median(meds) * 1e3:.3f} ms "
          "per estimate")
    # the uncached first estimate of a new cluster object (topology and throughput caches cold)
    t0 = time.process_time()
    estimate(Plan.from_dict(PLANS[0]), model, cluster_from_dict(CLUSTER), SEQ, 128)
    print(f"\ncold first estimate (new cluster object, caches empty): {(time.process_time() - t0) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
