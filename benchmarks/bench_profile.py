"""Wall time of `autotune profile` and whether two runs agree.

Runs `autotune profile --quick --nproc 2` twice and the default profile twice (each a fresh
`python -m autotune` process, as a user would), into a temporary database, then prints:

- the wall time of each run (targets on a 2-core machine: quick <= 15 s, default <= 60 s);
- for each pair of runs, how many measured points' medians agree within 10% (all, and by kind of
  point), and the headline figures (GEMM peak per dtype, attention forward rate, copy bandwidth,
  p2p bandwidth and latency, all_reduce busbw at the largest size) side by side with their
  relative difference; the load average before each run (other work on a shared machine is the
  main source of disagreement).

Usage: python benchmarks/bench_profile.py [--nproc 2] [--skip-default] [--only quick|default]
       [--pairs N]   (N pairs of consecutive runs per mode)
Set AUTOTUNE_PROFILE_PIN=0 to compare with unpinned ranks, AUTOTUNE_PROFILE_PIN=own to keep gloo's
socket loop thread on its rank's own core for every message size (profilers/placement.py).
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

VERBOSE = False


def run_profile(url: str, nproc: int, quick: bool) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "autotune", "profile", "--nproc", str(nproc), "--storage", url, "--json"]
    if quick:
        cmd.append("--quick")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"profile failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    return wall, json.loads(r.stdout)


def headline(s: dict) -> dict[str, float]:
    c0 = s["compute"]["0"]
    out = {f"gemm {dt} peak GFLOP/s": v / 1e9 for dt, v in c0["gemm_peak_flops_per_s"].items()}
    for hd, a in c0["attention"].items():
        out[f"attn d{hd} fwd GFLOP/s"] = a["fwd_flops_per_s"] / 1e9
    out["copy GB/s"] = c0["memory"]["bandwidth_bytes_per_s"] / 1e9
    p2p = s["links"]["p2p"]
    if p2p:
        out["p2p 0-1 GB/s"] = p2p[0][1]
        out["p2p 0-1 latency us"] = s["links"]["p2p_latency_us"][0][1]
        ar = [r for r in s["links"]["collectives"] if r["op"] == "all_reduce" and r["group_size"] == len(p2p)]
        if ar:
            big = max(ar, key=lambda r: r["bytes"])
            out[f"all_reduce {big['bytes'] >> 10}KiB busbw GB/s"] = big["busbw_bytes_per_s"] / 1e9
    return out


def point_agreement(url: str, a: int, b: int) -> tuple[int, int, float, dict[str, tuple[int, int]]]:
    from profilers.store import load_profile

    def medians(pid):
        return {(s["rank"], s["kind"], json.dumps(s["params"], sort_keys=True)): s["timing"]["median_s"]
                for s in load_profile(pid, url)["samples"]}

    ma, mb = medians(a), medians(b)
    keys = sorted(set(ma) & set(mb))
    dev = {k: abs(mb[k] - ma[k]) / ma[k] for k in keys if ma[k] > 0}
    by_kind: dict[str, tuple[int, int]] = {}
    for k, d in dev.items():
        ok, n = by_kind.get(k[1], (0, 0))
        by_kind[k[1]] = (ok + (d <= 0.10), n + 1)
    if VERBOSE:
        for k, d in sorted(dev.items(), key=lambda kv: -kv[1]):
            if d > 0.10:
                print(f"      differs {d * 100:5.1f}%: rank {k[0]} {k[1]} {k[2]} {ma[k] * 1e3:.3f} vs {mb[k] * 1e3:.3f} ms")
    vals = list(dev.values())
    return sum(d <= 0.10 for d in vals), len(vals), statistics.median(vals) if vals else float("nan"), by_kind


def compare(url: str, name: str, ra: dict, rb: dict) -> tuple[int, int, int, int]:
    ok, n, med, by_kind = point_agreement(url, ra["id"], rb["id"])
    print(f"  {name}: {ok}/{n} points' medians agree within 10% ({100 * ok / max(n, 1):.0f}%; median deviation "
          f"{med * 100:.1f}%); by kind: " + ", ".join(f"{k} {a}/{b}" for k, (a, b) in sorted(by_kind.items())))
    ha, hb = headline(ra), headline(rb)
    agree = 0
    for k in ha:
        d = abs(hb[k] - ha[k]) / ha[k] if ha[k] else float("nan")
        agree += d <= 0.10
        print(f"    {k:32s} {ha[k]:10.3f} {hb[k]:10.3f}  {d * 100:5.1f}% {'ok' if d <= 0.10 else 'DIFFERS'}")
    print(f"    headline figures within 10%: {agree}/{len(ha)}")
    return ok, n, agree, len(ha)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--skip-default", action="store_true")
    p.add_argument("--only", choices=["quick", "default"], default=None)
    p.add_argument("--pairs", type=int, default=1, help="pairs of consecutive runs per mode")
    p.add_argument("--verbose", action="store_true", help="list every point that differs by more than 10%%")
    a = p.parse_args()
    global VERBOSE
    VERBOSE = a.verbose
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start"
          + (f"; AUTOTUNE_PROFILE_PIN={os.environ['AUTOTUNE_PROFILE_PIN']}" if "AUTOTUNE_PROFILE_PIN" in os.environ
             else ""))
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bench.db"
        modes = [("quick", True)] + ([] if a.skip_default else [("default", False)])
        if a.only:
            modes = [m for m in modes if m[0] == a.only] or [(a.only, a.only == "quick")]
        for name, quick in modes:
            tot = [0, 0, 0, 0]
            for _ in range(a.pairs):
                l1 = os.getloadavg()[0]
                w1, r1 = run_profile(url, a.nproc, quick)
                l2 = os.getloadavg()[0]
                w2, r2 = run_profile(url, a.nproc, quick)
                target = 15 if quick else 60
                print(f"{name} --nproc {a.nproc}: wall {w1:.1f} s and {w2:.1f} s (target <= {target} s: "
                      f"{'ok' if max(w1, w2) <= target else 'OVER'}); measuring {r1['measure_s']:.1f} s / "
                      f"{r2['measure_s']:.1f} s; load average {l1:.1f} / {l2:.1f} before each; unstable points "
                      f"{len(r1['unstable'])}/{r1['samples']}, {len(r2['unstable'])}/{r2['samples']}")
                for i, v in enumerate(compare(url, name, r1, r2)):
                    tot[i] += v
            if a.pairs > 1:
                print(f"  {name} over {a.pairs} pairs: points within 10% {tot[0]}/{tot[1]} "
                      f"({100 * tot[0] / max(tot[1], 1):.0f}%), headline figures within 10% {tot[2]}/{tot[3]}")
    print(f"load average {os.getloadavg()[0]:.1f} at end (other work on the machine widens the spread)")


if __name__ == "__main__":
    main()
