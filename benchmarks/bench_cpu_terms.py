"""The CPU price of a micro-batch against the runtime's own stage, side by side (issue 25, item 5).

For each model (``tiny`` seq 128, ``small`` seq 256, the fresh set's model seq 192), precision (bf16,
fp32) and micro-batch size (1, 2, 4): the whole stage (embedding, every block, head) forward +
backward measured on one thread with the thread's CPU clock (as a trial's rank runs; another
process's slices not counted), interleaved rounds, median; beside it what the cost model prices
one micro-batch at on this machine's profile, with the in-context mapping (``cpu.Context``, from the
profile's ``block_ref``) and without it (the kernel price alone). Then the ratios a search decides
on: per token at micro-batch 1 over 4 (the per-micro-batch fixed cost) and bf16 over fp32 (the
precision), measured and priced.

    python benchmarks/bench_cpu_terms.py [--profile ID --storage URL] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TD = {"bf16": "bfloat16", "fp32": "float32"}


def measure(cases, rounds: int) -> dict:
    import torch

    from autotune.runtime.model import StageModel, build_on_meta, materialize, unsharded_layout

    torch.set_num_threads(1)
    built = []
    for key in cases:
        model, seq, dt, b = key
        m = materialize(build_on_meta(lambda model=model, seq=seq: StageModel(
            model, unsharded_layout(), list(range(model.layers)), True, True, seq)), model, 0, torch.device("cpu"),
            getattr(torch, TD[dt]))
        g = torch.Generator().manual_seed(b)
        built.append((key, m, torch.randint(0, model.vocab, (b, seq), generator=g),
                      torch.randint(0, model.vocab, (b, seq), generator=g)))
    res = {key: [] for key in cases}
    for _ in range(rounds):  # interleaved: a burst of load spoils one round of every case, not one case
        for key, m, x, t in built:
            best = None
            for _ in range(2):
                t0 = time.thread_time()
                y = m.token_losses(m(x), t).mean()
                y.backward()
                dt_s = time.thread_time() - t0
                for p in m.parameters():
                    p.grad = None
                best = dt_s if best is None else min(best, dt_s)
            res[key].append(best)
    return {k: statistics.median(v) for k, v in res.items()}


def price(cluster, model, seq, dt, b, context: bool) -> float:
    from autotune.cost import compute as CC
    from autotune.cost import cpu as CPU
    from autotune.cost import estimate
    from autotune.cost import rank as R
    from autotune.plan import Plan

    orig = CPU.context_of
    if not context:
        CPU.context_of = lambda *a, **k: None
    CC._RATES.clear()
    R._MEMO.clear()
    try:
        e = estimate(Plan.from_dict({"degrees": {"dp": 2}, "micro_batch_size": b, "dtype": dt}), model, cluster, seq,
                     2 * b)
    finally:
        CPU.context_of = orig
        CC._RATES.clear()
        R._MEMO.clear()
    st = e.breakdown["stages"][0]
    return st["fwd_s"][0] + st["bwd_s"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", help="profile id in --storage (default: profile this machine, --quick, first)")
    ap.add_argument("--storage", default="sqlite:///results/autotune.db")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    from autotune.commands.tune import measured_cluster, profile_quick
    from autotune.specs import load_model
    from benchmarks.bench_validate import FRESH_MODEL

    pid = args.profile
    if pid is None:
        pid, note = profile_quick(args.storage, 2, lambda m: print(m, file=sys.stderr))
        print(note)
    cluster = measured_cluster(str(pid), args.storage)
    models = [(load_model("tiny"), 128), (load_model("small"), 256), (FRESH_MODEL, 192)]
    cases = [(m, s, dt, b) for m, s in models for dt in ("bf16", "fp32") for b in (1, 2, 4)]
    print(f"profile {pid}; load average before {os.getloadavg()}")
    meas = measure(cases, args.rounds)
    print(f"load average after {os.getloadavg()}; per micro-batch, fwd + bwd of the whole stage (ms)")
    print(f"{'model':6} {'dtype':5} {'mbs':>3} {'measured':>9} {'in context':>10} {'err':>7} {'kernels':>8} {'err':>7}")
    errs_c, errs_k, priced = [], [], {}
    for key in cases:
        m, s, dt, b = key
        pc, pk = price(cluster, m, s, dt, b, True), price(cluster, m, s, dt, b, False)
        priced[key] = (pc, pk)
        ec, ek = pc / meas[key] - 1, pk / meas[key] - 1
        errs_c.append(abs(ec))
        errs_k.append(abs(ek))
        print(f"{m.name:6} {dt:5} {b:3} {meas[key] * 1e3:9.2f} {pc * 1e3:10.2f} {ec:+7.1%} {pk * 1e3:8.2f} {ek:+7.1%}")
    print(f"median |error|: in context {statistics.median(errs_c):.1%} (worst {max(errs_c):.0%}), kernels alone "
          f"{statistics.median(errs_k):.1%} (worst {max(errs_k):.0%})")
    print("\nratios (measured / in context / kernels alone):")
    for m, s in models:
        for dt in ("bf16", "fp32"):
            r = [meas[m, s, dt, 1] / meas[m, s, dt, 4] * 4] + [priced[m, s, dt, 1][i] / priced[m, s, dt, 4][i] * 4
                                                                   for i in (0, 1)]
            print(f"  {m.name:6} {dt}: per token at mbs 1 / at mbs 4   {r[0]:.2f} / {r[1]:.2f} / {r[2]:.2f}")
        r = [meas[m, s, "bf16", 4] / meas[m, s, "fp32", 4]] + [priced[m, s, "bf16", 4][i] / priced[m, s, "fp32", 4][i]
                                                                 for i in (0, 1)]
        print(f"  {m.name:6} bf16 / fp32 at mbs 4              {r[0]:.2f} / {r[1]:.2f} / {r[2]:.2f}")


if __name__ == "__main__":
    main()
