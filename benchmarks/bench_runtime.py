"""Runtime speed figures (issue 5, "Speed"); prints, asserts nothing.

1. Pure DP over 2 processes: ``run_trial`` vs torch DDP on the same model, data, micro-batching
   and AdamW (DDP with ``no_sync`` on all but the last micro-batch), same timing (barrier to barrier).
2. Time-split coverage: (compute + comm + idle) / step time per rank, for a few plans.
3. Heterogeneity: rank 1 emulated 2x slower; the even DP split vs an uneven one (2:1 samples).

    python benchmarks/bench_runtime.py [--model small] [--seq-len 256] [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def ddp_job(payload, rank, world, device):
    """torch DDP on the unsharded StageModel: the baseline the runtime's DP is measured against."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autotune.runtime import data as D
    from autotune.runtime.model import StageModel, init_weights, unsharded_layout
    from autotune.runtime.worker import LR, WEIGHT_DECAY
    from autotune.specs.model import model_from_dict

    spec = model_from_dict(payload["model"])
    S, B, mbs = payload["seq_len"], payload["global_batch"], payload["mbs"]
    model = StageModel(spec, unsharded_layout(), list(range(spec.layers)), first=True, last=True, seq_len=S)
    init_weights(model, spec, payload["seed"])
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    per = B // world
    n_micro = per // mbs
    times = []
    for i in range(payload["warmup"] + payload["steps"]):
        tokens = D.synthetic_tokens(payload["seed"], spec.vocab, B, S, i)
        x, y = tokens[rank * per:(rank + 1) * per, :-1], tokens[rank * per:(rank + 1) * per, 1:]
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for j, (xm, ym) in enumerate(zip(x.split(mbs), y.split(mbs), strict=True)):
            ctx = ddp.no_sync() if j < n_micro - 1 else torch.enable_grad()
            with ctx:
                loss = model.token_losses(ddp(xm), ym).sum() / (per * S)  # DDP averages over replicas
                loss.backward()
        opt.step()
        dist.barrier()
        if i >= payload["warmup"]:
            times.append(time.perf_counter() - t0)
    return {"rank": rank, "step_times": times}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runtime/DDP runs")
    args = ap.parse_args()

    from autotune.plan import Plan
    from autotune.runtime.launcher import launch
    from autotune.runtime.trial import run_trial
    from autotune.specs import load_model

    spec = load_model(args.model)
    S, B = args.seq_len, args.global_batch
    common = dict(steps=args.steps, warmup=args.warmup, seed=0, device="cpu")
    print(f"model {spec.name} ({spec.param_count() / 1e6:.1f}M params), seq {S}, global batch {B}, fp32, "
          f"{args.steps} measured steps after {args.warmup} warm-up")

    # 1. DP=2 vs DDP, alternating runs (the machine may be shared): the best median of each
    ours_all, ddp_all = [], []
    for _ in range(args.repeats):
        dp = run_trial(Plan.from_dict({"degrees": {"dp": 2}, "dtype": "fp32"}), spec, S, B, **common)
        assert dp.ok, dp.failure
        ours_all.append(dp.measured["step_time_s"])
        res = launch("bench_runtime:ddp_job", {"model": spec.to_dict(), "seq_len": S, "global_batch": B, "mbs": 1,
                                               "seed": 0, "steps": args.steps, "warmup": args.warmup}, 2,
                     timeout_s=600, device="cpu")
        assert res.failure is None, res.failure
        ddp_all.append(statistics.median(max(r["step_times"][i] for r in res.results) for i in range(args.steps)))
    ours, ddp_t = min(ours_all), min(ddp_all)
    print(f"[1] dp=2 runtime step {ours * 1e3:.1f} ms vs torch DDP {ddp_t * 1e3:.1f} ms: "
          f"ratio {ours / ddp_t:.3f} ({(ours / ddp_t - 1) * 100:+.1f}%)  "
          f"[runs: ours {[round(x * 1e3) for x in ours_all]}, DDP {[round(x * 1e3) for x in ddp_all]} ms]")

    # 2. coverage of the time split
    print("[2] time-split coverage (compute+comm+idle)/step per rank:")
    runs = {"dp=2": dp}
    for text, deg in (("pp=2 (1f1b)", {"pp": 2}), ("tp=2", {"tp": 2})):
        runs[text] = run_trial(Plan.from_dict({"degrees": deg, "dtype": "fp32"}), spec, S, B, **common)
    for text, r in runs.items():
        assert r.ok, (text, r.failure)
        parts = ", ".join(f"r{s['rank']}: {100 * s['coverage']:.1f}% (compute {s['compute_s'] * 1e3:.0f} / comm "
                          f"{s['comm_s'] * 1e3:.0f} / idle {s['idle_s'] * 1e3:.0f} ms)" for s in r.measured["time_split"])
        print(f"    {text:12s} step {r.measured['step_time_s'] * 1e3:.0f} ms  {parts}")

    # 3. uneven vs even with rank 1 emulated 2x slower
    B3 = 12
    slow = {1: 2.0}
    even = run_trial(Plan.from_dict({"degrees": {"dp": 2}, "dtype": "fp32"}), spec, S, B3, emulate_slowdown=slow,
                     **common)
    uneven = run_trial(Plan.from_dict({"degrees": {"dp": 2}, "dtype": "fp32", "shares": {"samples": [8, 4]}}),
                       spec, S, B3, emulate_slowdown=slow, **common)
    assert even.ok and uneven.ok, (even.failure, uneven.failure)
    te, tu = even.measured["step_time_s"], uneven.measured["step_time_s"]
    print(f"[3] rank 1 emulated 2x slower, global batch {B3}: even samples [6, 6] step {te * 1e3:.0f} ms, "
          f"uneven [8, 4] step {tu * 1e3:.0f} ms: uneven is {te / tu:.2f}x faster "
          f"({'faster' if tu < te else 'NOT faster'})")


if __name__ == "__main__":
    main()
