"""Generate ``tests/data/cost_corpus.json``: the cost model's figures pinned over a few hundred plans.

The corpus pins what ``autotune.cost.estimate`` predicts (``predicted`` and the full ``breakdown``)
for plans over the catalogue's GPUs, mixed clusters (H100 + A100, A100 + V100), a measured GPU
profile and local CPU clusters with a measured-style profile built here deterministically (GEMM fit
and points, attention call times, per-call overheads, a gloo collective table). Every schedule,
ZeRO stage, recompute mode, dtype, CP layout and sequence-parallel setting that exists is drawn,
with uneven layers, tokens, heads and samples. ``tests/unit/test_cost_corpus.py`` re-prices every
entry and asserts bit-identical figures, so a reshaping of the cost model cannot move a number
unnoticed; a change that moves figures on purpose regenerates the corpus in the same commit and
says why::

    python tests/data/make_cost_corpus.py            # rewrite tests/data/cost_corpus.json
    python tests/data/make_cost_corpus.py --check    # compare only (what the test does)

Entries are drawn with a fixed seed; nothing reads the machine (no ``local_cpu``, no nvidia-smi).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path
from typing import Any

from autotune.cost import estimate
from autotune.plan import FP8_RECIPES, Plan, PlanError
from autotune.plan_parts import lacks_dtype
from autotune.specs.catalogue import GB, DeviceSpec
from autotune.specs.cluster import ClusterSpec, cluster_from_dict
from autotune.specs.model import load_model

CORPUS = Path(__file__).with_name("cost_corpus.json")
SEED = 17
PER_CLUSTER = 50
FP8_PER_CLUSTER = 8


def _cpu_profile() -> dict[str, Any]:
    """A measured-style CPU profile (the shape ``profilers.store.device_spec_from_profile`` gives),
    with figures of the order this project's 2-core machine measures."""
    gemm_pts = [[1e6, 4.0e10], [4e6, 1.2e11], [1.6e7, 3.5e11], [6.4e7, 6.0e11], [2.56e8, 8.0e11],
                [2.56e8, 8.4e11], [1.0e9, 4.6e11]]
    table = []
    for op, base in (("all_reduce", 2.0e-4), ("all_gather", 2.5e-4), ("reduce_scatter", 5.0e-4),
                     ("all_to_all", 1.5e-4)):
        for n in (2, 4):
            for b in (4096, 65536, 1048576, 4194304):
                table.append({"op": op, "group_size": n, "bytes": b,
                              "time_s": base * (n - 1) + b * (n - 1) / n / 1.0e9})
    return {
        "id": "corpus-cpu", "rank": 0, "emulated_slowdown": None,
        "gemm": {"bf16": {"peak_flops_per_s": 4.6e11, "overhead_s": 2.0e-5, "points": gemm_pts},
                 "fp32": {"peak_flops_per_s": 1.3e11, "overhead_s": 1.0e-5,
                          "points": [[a, b / 3.5] for a, b in gemm_pts]}},
        "attention": {"dtype": "bf16", "batch": 1, "heads": 4, "causal": True,
                      "by_head_dim": {"32": {"points": [[64, 1.2e-3, 2.6e-3], [128, 1.8e-3, 4.0e-3],
                                                        [256, 3.6e-3, 8.4e-3], [512, 1.1e-2, 2.5e-2]]},
                                      "64": {"points": [[64, 1.6e-3, 3.4e-3], [128, 2.4e-3, 5.2e-3],
                                                        [256, 6.8e-3, 1.3e-2], [512, 1.97e-2, 4.1e-2]]}}},
        "memory": {"capacity_bytes": 24 * 2**30, "bandwidth_bytes_per_s": 8 * GB},
        "links": {"collective_table": table},
        "overheads": {"gemm_call_s": {"bf16": 2.3e-5, "fp32": 7.0e-6}, "op_s": 2.1e-6},
        # the runtime's block and head at profilers/block_ref.py's shapes (issue 25), figures of the
        # order this machine measured (bf16; fp32 left without, so both CPU paths stay pinned)
        "block_ref": {"bf16": {"shape": {"hidden": 160, "heads": 5, "kv_heads": 1, "ffn_hidden": 448, "vocab": 1280,
                                         "activation": "swiglu", "seq": 160,
                                         "fixed": {"hidden": 40, "heads": 5, "kv_heads": 1, "ffn_hidden": 112,
                                                   "vocab": 80, "activation": "swiglu", "seq": 8}},
                               "points": [["block", 0, 5.1e-4, 2.7e-3], ["block", 1, 3.3e-3, 6.5e-3],
                                          ["block", 4, 7.0e-3, 2.0e-2], ["head", 0, 1.2e-4, 2.5e-4],
                                          ["head", 1, 1.6e-3, 2.2e-3], ["head", 4, 4.5e-3, 1.15e-2]]}},
    }


def _gpu_profile() -> dict[str, Any]:
    """A measured-style H100 profile: affine GEMM fit and attention rates by sequence length."""
    att_rows = []
    for seq in (1024, 2048, 4096, 8192):
        flops = 2.0 * 1 * 16 * seq * seq * 128
        att_rows.append([seq, flops / (3.0e14 + 2.0e10 * seq), 2.5 * flops / (2.2e14 + 1.5e10 * seq)])
    return {
        "id": "corpus-gpu", "rank": 0, "emulated_slowdown": None,
        "gemm": {"bf16": {"peak_flops_per_s": 6.6e14, "overhead_s": 8.0e-6},
                 "fp16": {"peak_flops_per_s": 6.5e14, "overhead_s": 8.0e-6},
                 "fp32": {"points": [[1e9, 3.0e13], [1e11, 4.8e13]]}},
        "attention": {"dtype": "bf16", "batch": 1, "heads": 16, "causal": True,
                      "by_head_dim": {"128": {"points": att_rows}}},
        "memory": {"capacity_bytes": 80 * GB, "bandwidth_bytes_per_s": 2.9e12},
        "links": {},
        "overheads": {},
    }


PROFILES: dict[str, DeviceSpec] = {
    "profile:corpus-cpu": DeviceSpec(
        name="profile:corpus-cpu", kind="cpu", peak_flops={"bf16": 4.6e11, "fp32": 1.3e11, "fp16": 1.3e11},
        memory_bytes=6 * 2**30, memory_bandwidth=8 * GB, intra_node_bandwidth=1.0 * GB, intra_node_latency=5e-5,
        interconnect="loopback (gloo)", nic_bandwidth=1.0 * GB, achievable_fraction=1.0, provenance="measured",
        source="tests/data/make_cost_corpus.py", profile=_cpu_profile()),
    "profile:corpus-cpu-derived": DeviceSpec(
        name="CPU", kind="cpu", peak_flops={"fp32": 2.56e11, "bf16": 2.56e11, "fp16": 2.56e11},
        memory_bytes=12 * 2**30, memory_bandwidth=10 * GB, intra_node_bandwidth=1.0 * GB, intra_node_latency=5e-5,
        interconnect="loopback (gloo)", pcie_bandwidth=20 * GB, nic_bandwidth=1.0 * GB, achievable_fraction=0.25,
        provenance="derived", source="tests/data/make_cost_corpus.py"),
    "profile:corpus-gpu": DeviceSpec(
        name="profile:corpus-gpu", kind="cuda", peak_flops={"bf16": 6.6e14, "fp16": 6.5e14, "fp32": 4.8e13},
        memory_bytes=80 * GB, memory_bandwidth=2.9e12, intra_node_bandwidth=380 * GB, intra_node_latency=4e-6,
        interconnect="measured", nic_bandwidth=40 * GB, achievable_fraction=1.0, provenance="measured",
        source="tests/data/make_cost_corpus.py", profile=_gpu_profile()),
}

CLUSTERS: dict[str, dict[str, Any]] = {
    "h100x8": {"name": "h100x8", "nodes": [{"count": 1, "devices_per_node": 8, "device": "H100-SXM"}]},
    "h100+a100": {"name": "h100+a100", "nodes": [
        {"count": 1, "devices_per_node": 8, "device": "H100-SXM"},
        {"count": 1, "devices_per_node": 8, "device": "A100-80GB"}],
        "inter_node": {"bandwidth": "25GB/s", "latency": "10us"}},
    "h100+a100-40gb-4x2": {"name": "h100+a100-40gb-4x2", "nodes": [
        {"count": 1, "devices_per_node": 4, "device": "H100-SXM"},
        {"count": 1, "devices_per_node": 4, "device": "A100-40GB", "intra_node": {"bandwidth": "200GB/s"}}],
        "inter_node": {"bandwidth": "12.5GB/s", "latency": "15us"}},
    "a100+v100": {"name": "a100+v100", "nodes": [
        {"count": 1, "devices_per_node": 8, "device": "A100-40GB"},
        {"count": 1, "devices_per_node": 8, "device": "V100"}],
        "inter_node": {"bandwidth": "12.5GB/s", "latency": "10us"}},
    "measured-gpu-2x4": {"name": "measured-gpu-2x4", "nodes": [
        {"count": 2, "devices_per_node": 4, "device": "profile:corpus-gpu"}],
        "inter_node": {"bandwidth": "50GB/s", "latency": "8us"}},
    "cpu-measured-4": {"name": "cpu-measured-4", "nodes": [
        {"count": 1, "devices_per_node": 4, "device": "profile:corpus-cpu"}]},
    "cpu-measured-2": {"name": "cpu-measured-2", "nodes": [
        {"count": 1, "devices_per_node": 2, "device": "profile:corpus-cpu"}]},
    "cpu-derived-4": {"name": "cpu-derived-4", "nodes": [
        {"count": 1, "devices_per_node": 4, "device": "profile:corpus-cpu-derived"}]},
    "b200-2x4": {"name": "b200-2x4", "nodes": [{"count": 2, "devices_per_node": 4, "device": "B200"}],
                 "inter_node": {"bandwidth": "50GB/s", "latency": "8us"}},
}

WORKLOADS: dict[str, list[tuple[str, int]]] = {
    # (model, sequence length) drawn per cluster
    "h100x8": [("llama2-7b", 4096), ("llama3-8b", 8192), ("llama2-13b", 2048)],
    "h100+a100": [("llama2-7b", 4096), ("llama3-8b", 16384), ("llama2-13b", 4096)],
    "h100+a100-40gb-4x2": [("llama2-7b", 4096), ("llama3-8b", 8192)],
    "a100+v100": [("llama2-7b", 2048), ("llama2-13b", 4096)],
    "measured-gpu-2x4": [("llama3-8b", 4096), ("llama2-7b", 8192)],
    "cpu-measured-4": [("tiny", 128), ("small", 256), ("tiny", 512)],
    "cpu-measured-2": [("tiny", 256), ("small", 128)],
    "cpu-derived-4": [("tiny", 256), ("small", 512)],
    "b200-2x4": [("llama3-8b", 8192), ("llama2-13b", 4096)],
}

CALIBRATION = {"profile:corpus-cpu": {"compute": 1.25, "comm": 1.6}, "H100-SXM": {"compute": 1.1, "comm": 0.9},
               "A100-80GB": {"compute": 1.2, "comm": 1.3}}


def build_cluster(key: str) -> ClusterSpec:
    return cluster_from_dict(CLUSTERS[key], resolve_profile=lambda ref, storage: PROFILES[ref])


def _factorisations(world: int) -> list[dict[str, int]]:
    dims = ("pp", "dp", "cp", "hp", "tp")
    divs = [d for d in range(1, world + 1) if world % d == 0]
    out = []
    for combo in itertools.product(divs, repeat=4):
        rest = world
        ok = True
        for x in combo:
            if rest % x:
                ok = False
                break
            rest //= x
        if ok:
            out.append(dict(zip(dims, (*combo, rest), strict=True)))
    return out


def _shift(values: list[int], unit: int, rng: random.Random) -> list[int] | None:
    """Move ``unit`` from one entry to another (an uneven share), None when no entry can give it."""
    if len(values) < 2:
        return None
    i, j = rng.sample(range(len(values)), 2)
    if values[i] - unit < unit:
        return None
    out = list(values)
    out[i] -= unit
    out[j] += unit
    return out


def _draw_plan(rng: random.Random, world: int, dtypes: list[str]) -> tuple[dict[str, Any], int]:
    """A plan dict (degrees, knobs, maybe uneven shares) and its global batch."""
    deg = rng.choice(_factorisations(world))
    pp = deg["pp"]
    schedule = rng.choice(["gpipe", "1f1b", "interleaved_1f1b"] if pp > 1 else ["1f1b", "gpipe"])
    v = 2 if schedule == "interleaved_1f1b" else 1
    mbs = rng.choice([1, 1, 2])
    nmb = rng.choice([pp, 2 * pp, 4 * pp]) if pp > 1 else rng.choice([1, 2, 4])
    d = {"degrees": deg, "micro_batch_size": mbs, "schedule": schedule, "virtual_stages": v,
         "recompute": rng.choice(["none", "selective", "full"]), "zero_stage": rng.choice([0, 1, 2, 3]),
         "sequence_parallel": deg["tp"] > 1 and rng.random() < 0.5,
         "cp_layout": rng.choice(["zigzag", "contiguous"]), "dtype": rng.choice(dtypes)}
    return d, deg["dp"] * nmb * mbs


def _unevened(rng: random.Random, resolved: Plan) -> dict[str, Any]:
    """Some of the resolved plan's shares moved off the even split (each with probability 0.4)."""
    sh, out = resolved.shares, {}
    mbs = resolved.micro_batch_size
    for name, unit in (("layers", 1), ("tokens", resolved.token_granule()), ("heads", 1), ("samples", mbs)):
        if rng.random() < 0.4:
            moved = _shift(list(getattr(sh, name)), unit, rng)
            if moved is not None:
                out[name] = moved
    return out


def draw_entries() -> list[dict[str, Any]]:
    """The corpus inputs: per cluster ``PER_CLUSTER`` plans that resolve in a 16/32-bit dtype (the
    draws the corpus had before FP8), then ``FP8_PER_CLUSTER`` FP8 plans on the clusters that run FP8
    (their own random stream, so the earlier entries are drawn as before)."""
    rng = random.Random(SEED)
    entries = []
    for key in CLUSTERS:
        cluster = build_cluster(key)
        dtypes = sorted({dt for dev in cluster.device_types() for dt in dev.peak_flops
                         if all(dt in o.peak_flops for o in cluster.device_types())} - set(FP8_RECIPES))
        entries += _draw(rng, key, cluster, dtypes, PER_CLUSTER)
    rng8 = random.Random(SEED + 8)
    for key in CLUSTERS:
        cluster = build_cluster(key)
        fp8 = [dt for dt in FP8_RECIPES if not any(lacks_dtype(d.peak_flops, dt) for d in cluster.device_types())]
        if fp8:
            entries += _draw(rng8, key, cluster, fp8, FP8_PER_CLUSTER)
    return entries


def _draw(rng: random.Random, key: str, cluster: ClusterSpec, dtypes: list[str], count: int) -> list[dict[str, Any]]:
    """``count`` plans over ``cluster`` in ``dtypes`` that resolve (uneven shares on some)."""
    entries: list[dict[str, Any]] = []
    got = tries = 0
    while got < count and tries < 5000:
        tries += 1
        model_name, seq = rng.choice(WORKLOADS[key])
        model = load_model(model_name)
        plan_d, batch = _draw_plan(rng, cluster.num_devices, dtypes)
        try:
            resolved = Plan.from_dict(plan_d).resolve(model, cluster, seq, batch)
            uneven = _unevened(rng, resolved)
            if uneven:
                plan_d = {**plan_d, "shares": uneven}
                Plan.from_dict(plan_d).resolve(model, cluster, seq, batch)
        except PlanError:
            continue
        calibrated = rng.random() < 0.15
        entries.append({"cluster": key, "model": model_name, "seq_len": seq, "global_batch": batch,
                        "plan": plan_d, "calibration": CALIBRATION if calibrated else None,
                        "timeline": got % 10 == 0})
        got += 1
    return entries


def price(entry: dict[str, Any], cluster: ClusterSpec | None = None) -> dict[str, Any]:
    """The figures the corpus pins for one entry, as JSON values (a round trip through json)."""
    cluster = cluster or build_cluster(entry["cluster"])
    est = estimate(Plan.from_dict(entry["plan"]), load_model(entry["model"]), cluster, entry["seq_len"],
                   entry["global_batch"], calibration=entry["calibration"], timeline=entry["timeline"])
    return json.loads(json.dumps({"predicted": est.predicted, "breakdown": est.breakdown}, default=str))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the stored corpus, write nothing")
    args = ap.parse_args()
    clusters = {k: build_cluster(k) for k in CLUSTERS}
    if args.check:
        stored = json.loads(CORPUS.read_text())
        bad = [i for i, e in enumerate(stored["entries"])
               if price(e, clusters[e["cluster"]]) != {"predicted": e["predicted"], "breakdown": e["breakdown"]}]
        print(f"{len(stored['entries'])} entries, {len(bad)} differ: {bad[:20]}")
        return 1 if bad else 0
    entries = [{**e, **price(e, clusters[e["cluster"]])} for e in draw_entries()]
    CORPUS.write_text(json.dumps({"generator": "tests/data/make_cost_corpus.py", "seed": SEED,
                                  "entries": entries}, separators=(",", ":")) + "\n")
    feasible = sum(e["predicted"]["feasible"] for e in entries)
    print(f"wrote {CORPUS} ({len(entries)} entries, {feasible} feasible, "
          f"{CORPUS.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
