"""Per-layer times: predicted vs measured, on this CPU and on Sailor's measured GPUs.

**CPU** (this machine): a quick kernel profile (``autotune profile --quick --nproc 2``) and a
per-layer profile (``autotune profile --layers``, bf16, the runtime's own pieces) of three models:
``tiny`` and ``small`` (the cost model's CPU constants were tuned on their trials) and ``mid``
(hidden 384, 6 heads, 2 kv heads, MLP 1024, vocab 4096: a shape no constant saw). For every measured
point (piece, tp shard, micro-batch, sequence) it prints the relative error of

- the **kernel model** (``autotune/cost``: the CPU kernel profile's GEMM and attention curves plus
  the per-call costs), and
- the **layer profile** used as the cost model uses it (``autotune/cost/layers.py``), leave-one-out:
  each point predicted by interpolating the profile *without* that point.

**GPU** (Sailor's public per-layer profiles, benchmarks/data/sailor, MIT licence, measured with
Megatron-DeepSpeed in fp32 = TF32 on the A100, materialised attention, sequence 2048): the block's
forward + backward on A100-40GB and V100-16GB at micro-batch 1-8 and tp 1-8, predicted by the flat
datasheet rate (``peak x achievable_fraction``) and by the size-aware datasheet model
(``autotune/cost/datasheet.py``) whose one fitted constant, ``LAUNCH_S``, is re-fitted here on
OPT-350 (grid) and then checked on GPT-Neo-2.7B, which the fit never saw.

Usage: python benchmarks/bench_layers.py [--skip-cpu] [--skip-gpu] [--profile-storage URL --profile-id N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from autotune.cost import compute as _compute
from autotune.cost import kernels as K
from autotune.cost.layers import LayerTable, predicted_pieces
from autotune.plan import parse_inline
from autotune.specs.catalogue import device_from_catalogue
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model, model_from_dict

DATA = Path(__file__).with_name("data") / "sailor"
MID = {"name": "mid", "layers": 4, "hidden": 384, "heads": 6, "kv_heads": 2, "ffn_hidden": 1024, "vocab": 4096}
GPU_MODELS = {
    "OPT-350": {"name": "opt-350m", "layers": 24, "hidden": 1024, "heads": 16, "ffn_hidden": 4096, "vocab": 50272},
    "GPT-Neo-2.7": {"name": "gpt-neo-2.7b", "layers": 32, "hidden": 2560, "heads": 20, "ffn_hidden": 10240,
                    "vocab": 50257},
}
GPUS = {"A100-40": "A100-40GB", "V100-16": "V100-16GB"}


def _pct(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"median {100 * statistics.median(xs):5.1f}%  max {100 * max(xs):6.1f}%  (n={len(xs)})"


# ---- CPU ------------------------------------------------------------------------------------------
def kernel_profile(url: str) -> int:
    from profilers.launch import launch_local
    from profilers.store import save_profile

    t0 = time.perf_counter()
    result = launch_local("cpu", 2, quick=True, timeout_s=120.0)
    pid = save_profile(result, url, label="bench_layers", nproc=2, wall_s=time.perf_counter() - t0)
    print(f"kernel profile {pid}: {time.perf_counter() - t0:.0f} s")
    return pid


def cpu_section(url: str, pid: int) -> None:
    from profilers.layers import default_sweep, profile_layers

    print("\n== CPU: per-layer time predicted vs measured (bf16, 1 thread per rank) ==")
    for model in (load_model("tiny"), load_model("small"), model_from_dict(MID)):
        sweep = default_sweep(model, "cpu", "bf16")
        t0 = time.perf_counter()
        doc = profile_layers(model, "cpu", sweep)
        doc["id"] = 0
        print(f"\n{model.name}: layer profile {len(doc['points'])} points in {time.perf_counter() - t0:.0f} s "
              f"(measure {doc['meta']['measure_s']:.0f} s); unstable {sum(p['unstable'] for p in doc['points'])}")
        kern = {pc: [] for pc in ("embed", "block", "head")}
        loo = {pc: [] for pc in ("embed", "block", "head")}
        rows = []
        for p in doc["points"]:
            measured = p["fwd_s"] + p["bwd_s"]
            c = cluster_from_dict({"nodes": [{"devices_per_node": p["tp"], "device": f"profile:{pid}"}]},
                                  storage=url)
            plan = parse_inline(f"tp={p['tp']},mbs={p['micro_batch']},dtype=bf16")
            pred = predicted_pieces(plan, model, c, p["seq"], p["micro_batch"])[p["piece"]]
            kern[p["piece"]].append(abs(pred.fwd + pred.bwd - measured) / measured)
            rest = dict(doc, points=[q for q in doc["points"] if q is not p])
            hit = LayerTable(rest).lookup(p["piece"], p["micro_batch"], p["seq"], p["tp"])
            if hit is not None:
                loo[p["piece"]].append(abs(hit.fwd + hit.bwd - measured) / measured)
            if p["piece"] == "block" and p["tp"] == 1:
                rows.append((p["micro_batch"], p["seq"], measured, pred.fwd + pred.bwd,
                             hit.fwd + hit.bwd if hit else float("nan")))
        print("  block tp1: mbs seq  measured  kernel-model  layer-profile(leave-one-out)")
        for b, s, m, k, lp in rows:
            print(f"             {b:3d} {s:4d}  {1e3 * m:7.2f}ms  {1e3 * k:9.2f}ms  {1e3 * lp:9.2f}ms")
        for pc in kern:
            print(f"  {pc:5s} kernel model: {_pct(kern[pc])}")
            print(f"  {pc:5s} layer profile: {_pct(loo[pc])}")


# ---- GPU (Sailor's measurements) -----------------------------------------------------------------
def _gpu_model(key: str):
    return model_from_dict({**GPU_MODELS[key], "activation": "gelu", "norm": "layernorm", "position": "learned",
                            "max_positions": 2048, "bias": True})


def gpu_errors(key: str, flat: bool, runtime: K.KernelCosts = K.MEGATRON_DEEPSPEED_EAGER) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for gpu, dev in GPUS.items():
        prof = json.loads((DATA / key / gpu / "profile.json").read_text())
        spec = dataclasses.replace(device_from_catalogue(dev), attention_impl="materialized",
                                   **({"sm_count": 0} if flat else {}))
        _compute._RATES.clear()
        for mbs, by_tp in prof.items():
            for tp, layers in by_tp.items():
                c = cluster_from_dict({"nodes": [{"devices_per_node": int(tp), "device": dev}]})
                c = dataclasses.replace(c, groups=tuple(dataclasses.replace(g, device=spec) for g in c.groups))
                blk = predicted_pieces(parse_inline(f"tp={tp},mbs={mbs},dtype=fp32"), _gpu_model(key), c, 2048,
                                       int(mbs), kernels=runtime)["block"]
                measured = layers["2"][0] + layers["2"][1]
                out.setdefault(dev, []).append(abs(blk.fwd + blk.bwd - measured) / measured)
    return out


def gpu_section() -> None:
    print("\n== GPU: block fwd+bwd, Sailor's measured profiles (fp32/TF32, materialised attention, seq 2048) ==")
    keep = K.MEGATRON_DEEPSPEED_EAGER
    fit = {}
    for host in (2e-6, 4e-6, 8e-6, 16e-6, 24e-6, 28e-6, 32e-6, 40e-6, 48e-6, 64e-6):
        errs = [e for v in gpu_errors("OPT-350", False, dataclasses.replace(keep, host_s=host)).values() for e in v]
        fit[host] = statistics.median(errs)
    best = min(fit, key=fit.get)
    print("fit the runtime's host time per kernel on OPT-350 (median error): "
          + ", ".join(f"{1e6 * k:g}us {100 * v:.1f}%" for k, v in fit.items())
          + f" -> {1e6 * best:g} us (kernels.MEGATRON_DEEPSPEED_EAGER.host_s: {1e6 * keep.host_s:g} us)")
    runtime = dataclasses.replace(keep, host_s=best)
    try:
        for key, role in (("OPT-350", "fitted on"), ("GPT-Neo-2.7", "held out")):
            for label, flat in (("flat datasheet", True), ("size-aware", False)):
                for dev, errs in gpu_errors(key, flat, runtime).items():
                    print(f"  {key:12s} ({role:9s}) {dev:10s} {label:15s} {_pct(errs)}")
    finally:
        _compute._RATES.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--skip-gpu", action="store_true")
    ap.add_argument("--profile-storage", default=None, help="reuse a stored CPU kernel profile (with --profile-id)")
    ap.add_argument("--profile-id", type=int, default=None)
    args = ap.parse_args()
    if not args.skip_gpu:
        gpu_section()
    if not args.skip_cpu:
        with tempfile.TemporaryDirectory() as tmp:
            url = args.profile_storage or f"sqlite:///{tmp}/bench.db"
            pid = args.profile_id or kernel_profile(url)
            cpu_section(url, pid)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
