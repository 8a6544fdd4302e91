"""The search on a Mixture-of-Experts workload against the layout NeMo publishes for it.

Qwen3-30B-A3B on 2 DGX H100 nodes (16 GPUs, NVLink 450 GB/s per direction, one 400 Gbit/s NIC per
GPU), sequence 4096, global batch 512, priced as Megatron runs it (``--target megatron``). NeMo's
Megatron-Bridge performance summary publishes TP1, PP2, 24 virtual stages (12 per rank), EP8, MBS 2
for this run. Printed: that layout priced bare (its recomputation and optimizer settings are not
published: none and ZeRO-0 here) and with the least memory relief that fits autotune's memory model
and Megatron runs (ZeRO 0 or 1, a recomputation),
then the default search's best plan (seed 0) with its expert degrees, the search's time and trials.

    PYTHONPATH=. python benchmarks/bench_moe_search.py
"""

from __future__ import annotations

import time

from autotune.cost import estimate
from autotune.plan import parse_inline
from autotune.search.options import SearchOptions
from autotune.search.run import search
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model
from autotune.targets import context, kernel_costs, refusals

NEMO = "dp=8,tp=1,pp=2,ep=8,mbs=2,vpp=12,schedule=interleaved_1f1b"
CLUSTER = {"name": "dgx-h100-2n", "inter_node": {"bandwidth": "400Gbit/s", "latency": "10us"},
           "nodes": [{"count": 2, "devices_per_node": 8, "device": "H100-SXM",
                      "intra_node": {"bandwidth": "450GB/s", "latency": "3us"}}]}


def main() -> None:
    m, c, k = load_model("qwen3-30b-a3b"), cluster_from_dict(CLUSTER), kernel_costs("megatron")
    tctx = context(m, c, 4096, 512)
    rows = []
    for rc in ("none", "selective", "full"):
        for z in (0, 1, 2, 3):  # the variants Megatron runs (its own rules: ZeRO 0 and 1)
            plan = parse_inline(f"{NEMO},recompute={rc},zero={z}").resolve(m, c, 4096, 512)
            if not refusals("megatron", plan, tctx):
                rows.append((f"{NEMO},recompute={rc},zero={z}", estimate(plan, m, c, 4096, 512, kernels=k).predicted))
    bare = rows[0][1]
    print(f"NeMo layout, bare:       {bare['step_time_s']:.3f} s/step, MFU {bare['mfu']:.1%}, peak "
          f"{max(bare['memory_bytes']) / 2**30:.1f} GiB, feasible {bare['feasible']}")
    fit = min((r for r in rows if r[1]["feasible"]), key=lambda r: r[1]["step_time_s"])
    print(f"NeMo layout, fitting:    {fit[1]['step_time_s']:.3f} s/step, MFU {fit[1]['mfu']:.1%} ({fit[0]})")
    t = time.monotonic()
    res = search(m, c, 4096, 512, study_name="bench-moe", storage=":memory:",
                 options=SearchOptions(target="megatron", seed=0))
    b = res.best
    print(f"search best:             {b.predicted['step_time_s']:.3f} s/step, MFU {b.predicted['mfu']:.1%} "
          f"({b.plan.degrees.inline()},mbs={b.plan.micro_batch_size},{b.plan.schedule},vpp={b.plan.virtual_stages},"
          f"recompute={b.plan.recompute},zero={b.plan.zero_stage},moe_a2a_overlap={int(b.plan.moe_a2a_overlap)},"
          f"cuda_graph_scope={'/'.join(b.plan.cuda_graph_scope) or 'none'}); ep {b.plan.degrees.ep}; "
          f"{res.trials} trials in {time.monotonic() - t:.1f} s")
    print(f"best / NeMo fitting: {b.predicted['step_time_s'] / fit[1]['step_time_s']:.3f}; "
          f"best / NeMo bare: {b.predicted['step_time_s'] / bare['step_time_s']:.3f}")


if __name__ == "__main__":
    main()
