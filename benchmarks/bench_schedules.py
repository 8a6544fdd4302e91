"""Predicted step time of every pipeline schedule for a 7B Llama-style model at long sequences.

Workload: llama2-7b (32 layers, h 4096), sequences of 16k, 32k, 64k, 128k and 256k tokens, bf16, on
64 H20 (8 nodes of 8) and on a mixed cluster of 32 H100 + 32 A100-80GB (4 + 4 nodes). For each
pipeline size (4, 8) and schedule the best layout is kept: tensor parallelism tp in {1, 2, 4, 8}
(sequence parallel with tp > 1), dp the rest, recomputation none / selective / full (the first two
rarely fit at 128k+), every replica running m = 2 * pp micro-batches of one sequence (a multiple
of p x F for HelixPipe's two folds), so a plan's global batch is dp * m sequences and plans compare
by tokens per second. Schedules: 1F1B, interleaved 1F1B (v = 2), ZB1P (interleaved zero bubble,
v = 2), ZB-V (zero bubble, V-shaped) and HelixPipe with F = 1 and F = 2 folds (when its module is
registered; a note is printed otherwise).

Prints one table per cluster: best tokens/s per schedule (its tp and recompute), the bubble share,
the peak memory of the best plan, and HelixPipe's gain over the best of the paper's baselines
(1F1B, ZB1P) and over the best of all the others, next to the paper's claim (Zhang et al. 2025: +26% over the best baseline at 128k on 64 H20, growing with
length). Cost-model predictions, not measurements.

    python benchmarks/bench_schedules.py [--seqs 16384,32768] [--pp 4,8]
"""

from __future__ import annotations

import argparse
import time

from autotune.cost import estimate
from autotune.plan import Degrees, Plan, PlanError
from autotune.schedules import names
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model

MODEL = "llama2-7b"
CLUSTERS = {
    "64 x H20": {"name": "h20-64", "nodes": [{"count": 8, "devices_per_node": 8, "device": "H20"}]},
    "32 H100 + 32 A100": {"name": "h100-a100-64", "nodes": [
        {"count": 4, "devices_per_node": 8, "device": "H100-SXM"},
        {"count": 4, "devices_per_node": 8, "device": "A100-80GB"}]},
}
SEQS = (16384, 32768, 65536, 131072, 262144)
PPS = (4, 8)
TPS = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")
PAPER_GAIN_128K = 0.26  # HelixPipe (arXiv 2507.00394): 26% over the best baseline, 7B, 128k, 64 H20
PAPER_BASELINES = ("1F1B", "ZB1P v2")  # the paper's baselines (both with flash attention and sp)


def variants() -> list[tuple[str, dict]]:
    """(label, plan fields) of every schedule to compare; HelixPipe when it is registered."""
    out = [("1F1B", {"schedule": "1f1b"}), ("interleaved v2", {"schedule": "interleaved_1f1b", "virtual_stages": 2}),
           ("ZB1P v2", {"schedule": "interleaved_zb", "virtual_stages": 2}),
           ("ZB-V", {"schedule": "zbv", "virtual_stages": 2})]
    if "helixpipe" in names():
        out += [("HelixPipe F1", {"schedule": "helixpipe", "helix_folds": 1}),
                ("HelixPipe F2", {"schedule": "helixpipe", "helix_folds": 2})]
    return out


def best(cluster, model, seq: int, pp: int, fields: dict) -> dict | None:
    """The fastest feasible plan of one schedule over tp and recomputation (None if none fits)."""
    world = cluster.num_devices
    top = None
    for tp in TPS:
        if world % (pp * tp) or model.heads % tp or model.kv_heads % tp:
            continue
        dp = world // (pp * tp)
        m = 2 * pp
        for rc in RECOMPUTE:
            plan = Plan(degrees=Degrees(dp=dp, pp=pp, tp=tp), micro_batch_size=1, recompute=rc,
                        sequence_parallel=tp > 1, zero_stage=1 if dp > 1 else 0, dtype="bf16", **fields)
            try:
                e = estimate(plan, model, cluster, seq, dp * m)
            except PlanError:
                continue
            p = e.predicted
            if not p["feasible"]:
                continue
            if top is None or p["tokens_per_s"] > top["tokens_per_s"]:
                top = {"tokens_per_s": p["tokens_per_s"], "step_s": p["step_time_s"], "tp": tp, "rc": rc,
                       "bubble": p["bubble_fraction"], "mem": max(p["memory_bytes"]) / 2**30}
    return top


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default=",".join(map(str, SEQS)))
    ap.add_argument("--pp", default=",".join(map(str, PPS)))
    args = ap.parse_args()
    seqs = [int(x) for x in args.seqs.split(",")]
    pps = [int(x) for x in args.pp.split(",")]
    model = load_model(MODEL)
    vs = variants()
    if "helixpipe" not in names():
        print("note: no 'helixpipe' schedule is registered in this build; its columns are skipped")
    t0 = time.perf_counter()
    for cname, cdict in CLUSTERS.items():
        cluster = cluster_from_dict(cdict)
        print(f"\n{MODEL} on {cname}: best tokens/s per schedule (tp, recompute; bubble; peak GiB), "
              "m = 2*pp micro-batches of 1 sequence per replica")
        head = f"{'seq':>6} {'pp':>3} " + " ".join(f"{label:>27}" for label, _ in vs)
        helix_on = any(label.startswith("HelixPipe") for label, _ in vs)
        if helix_on:
            head += f" {'vs 1F1B/ZB1P':>12} {'vs best':>8}"
        print(head)
        for seq in seqs:
            for pp in pps:
                cells, tput = [], {}
                for label, fields in vs:
                    b = best(cluster, model, seq, pp, fields)
                    if b is None:
                        cells.append(f"{'no plan fits':>27}")
                        continue
                    tput[label] = b["tokens_per_s"]
                    cells.append(f"{b['tokens_per_s']:>9.0f} (t{b['tp']},{b['rc'][:4]};"
                                 f"{100 * b['bubble']:>3.0f}%;{b['mem']:>4.0f})")
                line = f"{seq // 1024:>5}k {pp:>3} " + " ".join(cells)
                helix = max((v for k, v in tput.items() if k.startswith("HelixPipe")), default=None)
                paper = max((v for k, v in tput.items() if k in PAPER_BASELINES), default=None)
                others = max((v for k, v in tput.items() if not k.startswith("HelixPipe")), default=None)
                if helix_on:
                    for base, width in ((paper, 12), (others, 8)):
                        line += f" {100 * (helix / base - 1):+{width - 1}.0f}%" if helix and base else f" {'-':>{width}}"
                print(line)
    if "helixpipe" in names():
        print(f"\npaper's claim (HelixPipe vs best of 1F1B / ZB1P, 7B, 128k, 64 H20): +{100 * PAPER_GAIN_128K:.0f}%")
    print(f"({time.perf_counter() - t0:.0f} s of cost-model time)")


if __name__ == "__main__":
    main()
