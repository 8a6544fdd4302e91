"""Packed documents with masks: predicted against measured step time on this machine, the gain of
balancing, and how the best plan moves from fixed-length windows to a length distribution (issue 28).

Workload: document lengths from a log-normal, ln(length) ~ N(MU, SIGMA), clipped to [2, 64k]; the
parameters are *not* fitted to a corpus here (no corpus statistic could be checked offline): MU =
5.5 (median 245 tokens) and SIGMA = 1.3 give a long tail (p99 ~5k tokens), the shape web-text
document lengths are commonly described with. ``--lengths FILE`` takes a ``length,count``
histogram instead (as ``autotune search --lengths`` reads one): benchmarks/data/two_mode_lengths.csv
holds whole-window files among 32-token snippets, half the tokens each, where the gain of balancing
is largest (the log-normal's is ~3-5%, too close to the noise of a few dozen CPU steps to judge a
prediction by). Windows are packed in data order (autotune/documents.py) and trials draw them
synthetically from the histogram.

1. CPU trials (``run_trial`` on 2 local processes, ``small`` at a 4096 window, batch 4, fp32): each
   plan priced by the cost model (measured profile of this machine) with the distribution, then run
   for real with the same distribution; plain packing (windows to replicas in order) and balanced
   packing (by cost), plus the plan ``search --lengths`` returns. Printed: predicted (the expected
   step over the distribution), measured, error; and ``same windows``: the model priced on the very
   windows the trial ran (``cost.documents.trial_windows``), step by step, median as the trial takes
   it, and its error: a window's cost is heavy-tailed (one window in ten is one document), so a
   3-step trial's windows may cost far more or less than the expectation, and only this column
   compares the model with the runtime free of that draw. The median |error| over plans; the
   predicted and measured gain of balancing (both columns).
   ``--layers N`` runs ``small`` with N blocks (a loaded machine: the ratios of interest hold).
2. The best plan with and without the distribution at the same window: on this machine (2 ranks,
   priced), and on a mixed 8 x H100 + 8 x A100 cluster for llama3-8b at 32k (priced).

    python benchmarks/bench_varlen.py [--profile ID] [--storage URL] [--steps 3] [--repeat 1] [--layers N] [--json FILE]
    python benchmarks/bench_varlen.py --ratio-only --profile ID [--steps 4] [--layers N] [--seed S]
    python benchmarks/bench_varlen.py --attention-only --profile ID [--windows 6] [--seed S]
    python benchmarks/bench_varlen.py --gain-only --profile ID [--steps 8] [--layers N] [--seed S] [--repeat 2]
    (each mode also takes --lengths FILE)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MU, SIGMA, MAX_LEN = 5.5, 1.3, 65536
MODEL, SEQ, BATCH = "small", 4096, 4
PLANS = [
    ("dp2 plain", {"degrees": {"dp": 2}}),
    ("dp2 balanced", {"degrees": {"dp": 2}, "balance": "cost"}),
    ("cp2", {"degrees": {"cp": 2}}),
    ("hp2", {"degrees": {"hp": 2}}),
    ("tp2", {"degrees": {"tp": 2}}),
]
MIXED = {"name": "mixed-h100-a100",
         "nodes": [{"count": 1, "devices_per_node": 8, "device": "H100-SXM",
                    "intra_node": {"bandwidth": "450GB/s", "latency": "3us"}},
                   {"count": 1, "devices_per_node": 8, "device": "A100-80GB",
                    "intra_node": {"bandwidth": "300GB/s", "latency": "3us"}}],
         "inter_node": {"bandwidth": "25GB/s", "latency": "10us"}}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load() -> float:
    return os.getloadavg()[0]


def describe(p: dict[str, Any]) -> str:
    deg = ",".join(f"{k}={v}" for k, v in p["degrees"].items() if v > 1) or "dp=1"
    extra = [f"{k} {v}" for k, v in (p.get("shares") or {}).items() if v and len(v) > 1 and max(v) != min(v)]
    return deg + (f" balance={p['balance']}" if p.get("balance") else "") + (" " + " ".join(extra) if extra else "")


def best_of(model: Any, cluster: Any, seq: int, gb: int, docs: Any, trials: int, storage: str) -> dict[str, Any]:
    from autotune.search import SearchOptions, search

    opts = SearchOptions(trials=trials, dtype="fp32" if cluster.groups[0].device.kind == "cpu" else "bf16",
                         documents=None if docs is None else {**docs.record(), "doc_mask": True})
    name = f"bench-varlen-{cluster.name}-{seq}-{'docs' if docs else 'fixed'}-{time.time_ns()}"
    return search(model, cluster, seq, gb, study_name=name, storage=storage, options=opts).best.to_dict()


LENGTHS: str | None = None  # --lengths FILE: the distribution instead of the log-normal


def the_distribution() -> Any:
    """The documents' length distribution: ``--lengths FILE`` (a ``length,count`` histogram, as
    ``autotune search --lengths`` reads it), else the log-normal of the module docstring."""
    from autotune import documents as W

    return W.read_histogram(LENGTHS) if LENGTHS else W.lognormal(MU, SIGMA, n=50000, seed=0, max_len=MAX_LEN)


def the_model(layers: int | None) -> Any:
    import dataclasses

    from autotune.specs import load_model

    m = load_model(MODEL)
    return m if not layers else dataclasses.replace(m, name=f"{MODEL}-{layers}l", layers=layers)


def priced_steps(plan: Any, model: Any, cluster: Any, dist: Any, gb: int, seed: int, first: int, count: int
                 ) -> list[float]:
    """The model's step time for each of the steps a trial with ``seed`` runs (its very windows)."""
    from autotune.cost import documents as DOC
    from autotune.cost import estimate

    return [estimate(plan, model, cluster, SEQ, gb, documents=DOC.trial_windows(dist, SEQ, gb, seed, st, 1))
            .predicted["step_time_s"] for st in range(first, first + count)]


def ratio_check(pid: str, storage: str, steps: int, layers: int | None = None, seed: int = 0) -> dict[str, Any]:
    """One process, masked and whole windows alternated step by step (ABAB: drifting load hits both
    alike): the measured ratio of their step times against the predicted one. A ratio survives a
    loaded machine that absolute times do not."""
    import torch

    from autotune import documents as W
    from autotune.commands.tune import measured_cluster
    from autotune.cost import documents as DOC
    from autotune.cost import estimate
    from autotune.plan import Degrees, Plan, Shares
    from autotune.runtime.mesh import single_process_mesh
    from autotune.runtime.worker import RankTrainer

    torch.set_num_threads(1)  # as a trial's process and the profile's ranks run (2 on 2 cores)
    dist = the_distribution()
    model = the_model(layers)
    cluster = measured_cluster(pid, storage, per_node=1)
    plan = Plan(degrees=Degrees(), dtype="fp32", micro_batch_size=1, num_microbatches=2,
                shares=Shares(layers=(model.layers,), tokens=(SEQ,), heads=(model.heads,), samples=(2,)))
    pred_full = estimate(plan, model, cluster, SEQ, 2).predicted["step_time_s"]
    pred_docs = estimate(plan.replace(doc_mask=True), model, cluster, SEQ, 2, documents=dist).predicted["step_time_s"]
    mesh = single_process_mesh(plan, torch.device("cpu"))
    trainers = {"full": RankTrainer(plan, model, mesh, SEQ, 2, seed),
                "docs": RankTrainer(plan, model, mesh, SEQ, 2, seed, documents=dist.to_payload())}
    times: dict[str, list[float]] = {"full": [], "docs": []}
    for i in range(steps + 1):
        for name, tr in trainers.items():
            t0 = time.perf_counter()
            tr.step(i)
            if i:  # the first step of each warms up
                times[name].append(time.perf_counter() - t0)
    meas = {k: statistics.median(v) for k, v in times.items()}
    # the windows the masked trainer ran (its seed, steps 1..steps), priced one step at a time
    same = priced_steps(plan.replace(doc_mask=True), model, cluster, dist, 2, seed, 1, steps)
    pairs = [statistics.fmean(W.attention_pairs(d) for d in st) / (SEQ * (SEQ + 1) / 2)
             for st in DOC.trial_windows(dist, SEQ, 2, seed, 1, steps).steps]
    out = {"predicted_ratio": pred_docs / pred_full, "measured_ratio": meas["docs"] / meas["full"],
           "same_windows_ratio": statistics.median(same) / pred_full,
           "predicted_s": {"full": pred_full, "docs": pred_docs, "docs_same_windows": same},
           "measured_s": meas, "measured_steps_s": times, "pairs_fraction": pairs, "seed": seed, "load": load()}
    print(f"one process, {model.name} at {SEQ}, 2 windows a step (seed {seed}), masked / whole windows: measured "
          f"{out['measured_ratio']:.3f} ({meas['docs']:.3f} / {meas['full']:.3f} s, median of {steps}, load "
          f"{load():.1f}); predicted on the same windows {out['same_windows_ratio']:.3f} "
          f"({statistics.median(same):.3f} / {pred_full:.3f} s); expected over the distribution "
          f"{out['predicted_ratio']:.3f} ({pred_docs:.3f} s); the measured steps' windows hold "
          f"{', '.join(f'{p:.2f}' for p in pairs)} of a whole window's pairs")
    return out


def attention_check(pid: str, storage: str, windows: int, seed: int) -> dict[str, Any]:
    """The runtime's attention core alone (one layer of ``small``: GQA repeat, then one SDPA per
    document piece or one for the whole window), forward and backward, whole and masked alternated
    (ABAB, median of 3 each), against the cost model's CPU attention price of the same windows
    (``cpu.block_extras``' per-call pricing of ``cost.documents.masked_blocks``, before the block's
    in-context factor). What documents change is this part of a step."""
    import numpy as np
    import torch

    from autotune import documents as W
    from autotune.commands.tune import measured_cluster
    from autotune.cost import documents as DOC
    from autotune.cost.compute import cached_rates
    from autotune.cost.cpu import attention_calls
    from autotune.runtime.model import attention_core

    torch.set_num_threads(1)
    m = the_model(None)
    h, kv, d = m.heads, m.kv_heads, m.head_dim
    cpu = cached_rates(measured_cluster(pid, storage, per_node=1).groups[0].device, "fp32", d).cpu
    dist = the_distribution()
    rng = np.random.default_rng(seed)
    wins = [W.sample_window(dist, SEQ, rng) for _ in range(windows)]

    def run(docs):
        q = torch.randn(1, SEQ, h * d).view(1, SEQ, h, d).transpose(1, 2).requires_grad_()
        k, v = (torch.randn(1, SEQ, kv * d).view(1, SEQ, kv, d).transpose(1, 2).requires_grad_() for _ in range(2))
        t0 = time.perf_counter()
        o = attention_core(q, k, v, None, docs)
        t1 = time.perf_counter()
        o.backward(torch.randn_like(o))
        return time.perf_counter() - t0, t1 - t0

    def price(docs):
        calls = [(SEQ, SEQ, True)] if docs is None else DOC.masked_blocks(docs, [[(0, SEQ)]], 0)
        return attention_calls(cpu, calls, d, h)

    run(None)
    rows = []
    for w in wins:
        full, docs = [], []
        for _ in range(3):
            full.append(run(None)[0])
            docs.append(run((w,))[0])
        mf, md = statistics.median(full), statistics.median(docs)
        pf, pd = price(None), price(w)
        rows.append({"pieces": len(w), "pairs_fraction": W.attention_pairs(w) / (SEQ * (SEQ + 1) / 2),
                     "measured_s": {"full": mf, "docs": md}, "priced_s": {"full": pf, "docs": pd},
                     "measured_ratio": md / mf, "priced_ratio": pd / pf, "load": load()})
        r = rows[-1]
        print(f"window of {len(w):3d} pieces, {r['pairs_fraction']:.2f} of the pairs: masked / whole attention "
              f"measured {r['measured_ratio']:.3f} ({md:.3f} / {mf:.3f} s), priced {r['priced_ratio']:.3f} "
              f"({pd:.3f} / {pf:.3f} s), error {r['priced_ratio'] / r['measured_ratio'] - 1:+.1%}, load {load():.1f}",
              flush=True)
    errs = [r["priced_ratio"] / r["measured_ratio"] - 1 for r in rows]
    print(f"median |error| of the masked / whole attention ratio over {len(rows)} windows: "
          f"{statistics.median(abs(e) for e in errs):.1%}; whole-window attention priced / measured "
          f"{statistics.median(r['priced_s']['full'] / r['measured_s']['full'] for r in rows):.2f}")
    return {"rows": rows}


class _GivenFeed:
    """A trainer's document feed that serves the windows it is handed (``gain_check``)."""

    def __init__(self) -> None:
        self.windows: tuple[tuple[int, ...], ...] = ()

    def docs(self, step, first, last, global_batch, seq_len, rows=None):
        return self.windows[first:last]


def gain_check(pid: str, storage: str, steps: int, layers: int | None, seed: int, repeat: int) -> dict[str, Any]:
    """The gain of dealing windows by cost over dealing them in order, measured side by side in one
    process: the windows of ``steps`` steps of a dp=2 trial (``seed``, 4 windows a step), every pair of
    windows that one replica gets under either dealing run as one step of a 2-window trainer (the
    replica's work: 2 micro-batches and its optimizer step; the gradient all-reduce, the same for
    both dealings, left out); a dealing's step is its slower pair. Against the cost model's dp=2 plain
    and balanced prices of the very same steps, and its expected gain over the distribution."""
    import torch

    from autotune import documents as W
    from autotune.commands.tune import measured_cluster
    from autotune.cost import documents as DOC
    from autotune.cost import estimate
    from autotune.plan import Degrees, Plan, Shares
    from autotune.runtime.mesh import single_process_mesh
    from autotune.runtime.worker import RankTrainer

    torch.set_num_threads(1)
    dist = the_distribution()
    model = the_model(layers)
    cluster = measured_cluster(pid, storage, per_node=2)
    one = Plan(degrees=Degrees(), dtype="fp32", micro_batch_size=1, num_microbatches=2,
               shares=Shares(layers=(model.layers,), tokens=(SEQ,), heads=(model.heads,), samples=(2,)))
    tr = RankTrainer(one, model, single_process_mesh(one, torch.device("cpu")), SEQ, 2, seed,
                     documents=dist.to_payload())
    feed = tr.feed = _GivenFeed()
    wins = DOC.trial_windows(dist, SEQ, BATCH, seed, 1, steps)
    dp2 = {b: Plan.from_dict({"degrees": {"dp": 2}, "balance": b, "dtype": "fp32", "doc_mask": True})
           for b in ("count", "cost")}
    timed: dict[tuple[tuple[int, ...], ...], list[float]] = {}
    feed.windows = wins.steps[0][:2]
    tr.step(0)  # warm-up
    deals = [{b: W.replica_rows(st, (2, 2), b) for b in dp2} for st in wins.steps]
    for _ in range(repeat):  # every pair once a round, in step order (drifting load hits both dealings)
        for st, deal in zip(wins.steps, deals, strict=True):
            for rows in {tuple(r) for d in deal.values() for r in d}:
                feed.windows = tuple(st[r] for r in rows)
                t0 = time.perf_counter()
                tr.step(1)
                timed.setdefault(feed.windows, []).append(time.perf_counter() - t0)
    meas = {b: [max(statistics.median(timed[tuple(st[r] for r in rows)]) for rows in deal[b])
                for st, deal in zip(wins.steps, deals, strict=True)] for b in dp2}
    same = {b: [estimate(p, model, cluster, SEQ, BATCH, documents=DOC.GivenWindows((st,))).predicted["step_time_s"]
                for st in wins.steps] for b, p in dp2.items()}
    exp = {b: estimate(p, model, cluster, SEQ, BATCH, documents=dist).predicted["step_time_s"] for b, p in dp2.items()}

    def gain(t):
        return statistics.fmean(t["count"]) / statistics.fmean(t["cost"]) - 1

    out = {"measured_gain": gain(meas), "same_windows_gain": gain(same), "expected_gain": gain({k: [v] for k, v in
                                                                                               exp.items()}),
           "measured_s": meas, "same_windows_s": same, "expected_s": exp, "steps_dealt_differently":
           sum(d["count"] != d["cost"] for d in deals), "seed": seed, "load": load()}
    print(f"gain of balancing, one process, {model.name} at {SEQ}, {steps} steps of {BATCH} windows (seed {seed}, "
          f"{out['steps_dealt_differently']} dealt differently), mean step plain / balanced - 1: measured "
          f"{out['measured_gain']:+.1%} ({statistics.fmean(meas['count']):.3f} / {statistics.fmean(meas['cost']):.3f} s"
          f", median of {repeat} per pair), priced on the same windows {out['same_windows_gain']:+.1%} "
          f"({statistics.fmean(same['count']):.3f} / {statistics.fmean(same['cost']):.3f} s); expected over the "
          f"distribution {out['expected_gain']:+.1%}; load {load():.1f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="profile id of this machine in --storage (default: profile it, quick)")
    ap.add_argument("--storage", default="sqlite:///results/bench_varlen.db")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1, help="trials per plan; the median step time is kept")
    ap.add_argument("--trials", type=int, default=40, help="search trials for the searched plan")
    ap.add_argument("--json", dest="json_out", help="write every figure here")
    ap.add_argument("--ratio-only", action="store_true", help="only the one-process masked/whole ratio (needs --profile)")
    ap.add_argument("--attention-only", action="store_true",
                    help="only the attention core, masked / whole, measured against its price (needs --profile)")
    ap.add_argument("--gain-only", action="store_true",
                    help="only the gain of balancing, measured side by side in one process (needs --profile)")
    ap.add_argument("--windows", type=int, default=6, help="--attention-only: windows drawn")
    ap.add_argument("--seed", type=int, default=0, help="--ratio-only: the trainers' seed (which windows they draw)")
    ap.add_argument("--no-moves", action="store_true", help="skip part 2 (the searches with and without documents)")
    ap.add_argument("--lengths", help="a length,count histogram of the documents (default: the log-normal)")
    ap.add_argument("--layers", type=int, help=f"run {MODEL} with this many blocks (default: all)")
    args = ap.parse_args()
    global LENGTHS
    LENGTHS = args.lengths
    if args.attention_only:
        out = attention_check(args.profile, args.storage, args.windows, args.seed)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(out, indent=2, default=str))
        return
    if args.gain_only:
        out = gain_check(args.profile, args.storage, args.steps, args.layers, args.seed, args.repeat)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(out, indent=2, default=str))
        return
    if args.ratio_only:
        out = ratio_check(args.profile, args.storage, max(args.steps, 3), args.layers, args.seed)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(out, indent=2, default=str))
        return

    from autotune import documents as W
    from autotune.commands.tune import measured_cluster, profile_quick
    from autotune.cost import estimate
    from autotune.plan import Plan
    from autotune.runtime.trial import run_trial
    from autotune.specs import load_model
    from autotune.specs.cluster import cluster_from_dict

    dist = the_distribution()
    s = dist.summary()
    print(f"distribution: {dist.source}: mean {s['mean']:.0f}, p50 {s['p50']}, p90 {s['p90']}, p99 {s['p99']}, "
          f"max {s['max']} tokens")
    docs = W.DocumentSource(dist)
    pid = args.profile or profile_quick(args.storage, 2, log)[0]
    cluster = measured_cluster(pid, args.storage, per_node=2)
    model = the_model(args.layers)
    print(f"profile {pid}; {model.name} at window {SEQ}, batch {BATCH}, fp32, 2 local processes; load {load():.1f}")

    store = f"sqlite:///{tempfile.mkdtemp()}/search.db"
    searched = best_of(model, cluster, SEQ, BATCH, docs, args.trials, store)
    keep = ("degrees", "micro_batch_size", "num_microbatches", "schedule", "virtual_stages", "helix_folds",
            "helix_attention", "recompute", "zero_stage", "sequence_parallel", "cp_layout", "shares", "balance")
    plans = PLANS + [("searched", {k: searched[k] for k in keep if searched.get(k) is not None})]
    rows = []
    for name, d in plans:
        plan = Plan.from_dict({**d, "dtype": "fp32", "doc_mask": True})
        pred = estimate(plan, model, cluster, SEQ, BATCH, documents=dist).predicted["step_time_s"]
        full = estimate(plan.replace(doc_mask=False), model, cluster, SEQ, BATCH).predicted["step_time_s"]
        times, same = [], []
        for rep in range(args.repeat):
            log(f"{name}: trial {rep + 1}/{args.repeat} (load {load():.1f})")
            res = run_trial(plan, model, SEQ, BATCH, steps=args.steps, warmup=args.warmup, device="cpu",
                            timeout_s=600, seed=rep, documents=docs)
            if res.failure is None:
                times.append(res.measured["step_time_s"])
                same.append(statistics.median(priced_steps(plan, model, cluster, dist, BATCH, rep, args.warmup,
                                                           args.steps)))
            else:
                log(f"  failed: {res.failure}")
        meas = statistics.median(times) if times else None
        sw = statistics.median(same) if same else None
        rows.append({"name": name, "plan": describe(plan.to_dict()), "predicted_s": pred, "full_window_s": full,
                     "measured_s": meas, "error": (pred - meas) / meas if meas else None,
                     "same_windows_s": sw, "same_windows_error": (sw - meas) / meas if meas else None,
                     "load": load()})
    print(f"\n{'plan':<14} {'layout':<30} {'full window':>11} {'predicted':>10} {'measured':>10} {'error':>8} "
          f"{'same windows':>12} {'error':>8}")
    for r in rows:
        m = f"{r['measured_s']:.3f}s" if r["measured_s"] else "failed"
        e = f"{r['error']:+.1%}" if r["error"] is not None else "-"
        sw = f"{r['same_windows_s']:.3f}s" if r["same_windows_s"] else "-"
        se = f"{r['same_windows_error']:+.1%}" if r["same_windows_error"] is not None else "-"
        print(f"{r['name']:<14} {r['plan']:<30} {r['full_window_s']:>10.3f}s {r['predicted_s']:>9.3f}s {m:>10} {e:>8} "
              f"{sw:>12} {se:>8}")
    for key, what in (("error", "expected step"), ("same_windows_error", "same windows")):
        errs = [abs(r[key]) for r in rows if r[key] is not None]
        print(f"median |error| over {len(errs)} plans, {what}: {statistics.median(errs):.1%}" if errs else "no plan ran")
    by = {r["name"]: r for r in rows}
    gain = {}
    if by["dp2 plain"]["measured_s"] and by["dp2 balanced"]["measured_s"]:
        gain = {"predicted": by["dp2 plain"]["predicted_s"] / by["dp2 balanced"]["predicted_s"] - 1,
                "same_windows": by["dp2 plain"]["same_windows_s"] / by["dp2 balanced"]["same_windows_s"] - 1,
                "measured": by["dp2 plain"]["measured_s"] / by["dp2 balanced"]["measured_s"] - 1}
        print(f"gain of balancing (dp2, plain / balanced - 1): predicted {gain['predicted']:+.1%} (expected), "
              f"{gain['same_windows']:+.1%} (same windows), measured {gain['measured']:+.1%}")

    moves = []
    if not args.no_moves:
        print("\nbest plan, fixed-length windows against the distribution at the same window (priced):")
    for cname, cl, mname, seq, gb in () if args.no_moves else (
            ("this machine, 2 ranks", cluster, MODEL, SEQ, BATCH),
            ("8 H100 + 8 A100", cluster_from_dict(MIXED), "llama3-8b", 32768, 16)):
        m = load_model(mname)
        fixed = best_of(m, cl, seq, gb, None, args.trials, store)
        with_docs = best_of(m, cl, seq, gb, docs, args.trials, store)
        moves.append({"cluster": cname, "model": mname, "seq_len": seq, "fixed": describe(fixed),
                      "fixed_step_s": fixed["predicted"]["step_time_s"], "documents": describe(with_docs),
                      "documents_step_s": with_docs["predicted"]["step_time_s"]})
        print(f"  {cname}, {mname} at {seq}: fixed {describe(fixed)} ({fixed['predicted']['step_time_s']:.3f} s) -> "
              f"documents {describe(with_docs)} ({with_docs['predicted']['step_time_s']:.3f} s)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"distribution": s, "profile": pid, "rows": rows, "gain": gain,
                                                   "moves": moves}, indent=2, default=str))


if __name__ == "__main__":
    main()
