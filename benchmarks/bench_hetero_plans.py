"""The plans autotune chooses on A100-40GB + V100-16GB, from the datasheet and from measured layers.

Issue 18's second figure: OPT-350M and GPT-Neo-2.7B (benchmarks/data/*.yaml) at sequence 2048,
global batch 1024 and 2048, on 8 A100-40GB + 8 V100-16GB and 16 + 16 (4 GPUs per node), each
searched by the real search (``autotune.search.search``, a temporary SQLite study) under

- ``flat-fp16``: the datasheet model without its size awareness (every GEMM at the catalogue's
  ``achievable_fraction`` of peak whatever its shape: ``sm_count`` 0, what the cost model did before
  issue 18), fp16, the V100-16GB entry (which the CLI did not have before);
- ``sheet-fp16``: the size-aware datasheet model (autotune/cost/datasheet.py), fp16: the issue's setting;
- ``sheet-fp32``: the same model in fp32 (TF32 on the A100, CUDA cores on the V100): the
  precision Sailor measured in, for comparison with the next;
- ``sailor-fp32``: Sailor's published per-layer measurements (benchmarks/data/sailor, MIT;
  Megatron-DeepSpeed, fp32 = TF32 on the A100, materialised attention, seq 2048, micro-batch 1-8,
  tp 1-8) imported through ``profilers/foreign/sailor.py`` into a layer-profile store and attached
  to each node group with ``layer_profile: layers:ID``. The files carry no precision; they are
  imported as fp32 because that is what they measured, so this variant searches fp32 (there are no
  fp16 measurements to price an fp16 search from). Sailor's ``llm_info.json`` comes with them: the
  activation memory per layer is Sailor's measurement. A plan with cp or hp > 1 (which whole-sequence
  profiles cannot price directly) is priced on the same scale: the datasheet's shard times
  measured / datasheet on the whole sequence (``autotune/cost/layers.py``).

Every variant prices materialised attention (the runtime Sailor measured and the peers' simulator
ran: ``attention: materialized``) and the catalogue's framework reserve (2 GiB per GPU).
Inter-node link: 100 Gbit/s Ethernet per node shared by its 4 GPUs, 25 Gbit/s per device per
direction, 10 us (an assumption: neither the issue nor Sailor's files give the network).

For each plan it prints degrees, micro-batch, the stage layer splits with their device types, the
predicted step time and tokens/s, the peak memory per device type against capacity, what priced
the compute, and one line on why (the search's own comparison with its best even-split plan).
After the table, the measured A100:V100 block-time ratio at the chosen micro-batch and tp, next
to the layers-per-stage ratio of the chosen split.

Usage: python benchmarks/bench_hetero_plans.py [--trials N] [--variants a,b] [--models opt,neo]
       [--batches 1024,2048] [--clusters 8+8,16+16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from autotune.cost import compute as _compute
from autotune.cost.estimate import estimate
from autotune.search.options import SearchOptions
from autotune.search.run import search
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model
from autotune.study import iter_trial_plans
from profilers import store
from profilers.foreign import ImportContext, read_foreign

HERE = Path(__file__).parent
DATA = HERE / "data"
MODELS = {"opt": ("opt-350m.yaml", "OPT-350"), "neo": ("gpt-neo-2.7b.yaml", "GPT-Neo-2.7")}
SAILOR_GPU = {"A100-40GB": "A100-40", "V100-16GB": "V100-16"}
SEQ = 2048
INTER = {"bandwidth": "25Gbit/s", "latency": "10us"}  # 100 Gbit/s per 4-GPU node
VARIANTS = ("flat-fp16", "sheet-fp16", "sheet-fp32", "sailor-fp32")


def cluster_doc(nodes_per_type: int, profiles: dict[str, int] | None) -> dict:
    groups = []
    for dev in ("A100-40GB", "V100-16GB"):
        g = {"count": nodes_per_type, "devices_per_node": 4, "device": dev, "attention": "materialized"}
        if profiles:
            g["layer_profile"] = f"layers:{profiles[dev]}"
        groups.append(g)
    return {"name": f"{4 * nodes_per_type}xA100-40GB+{4 * nodes_per_type}xV100-16GB", "nodes": groups,
            "inter_node": dict(INTER)}


def flatten(cluster):
    """The flat datasheet model: no SM count, so every GEMM runs at achievable_fraction of peak."""
    import dataclasses

    return dataclasses.replace(cluster, groups=tuple(
        dataclasses.replace(g, device=dataclasses.replace(g.device, sm_count=0)) for g in cluster.groups))


def import_sailor(model, key: str, url: str) -> dict[str, int]:
    ids = {}
    for dev, gpu in SAILOR_GPU.items():
        # the timing profile and Sailor's model description (its measured activation bytes per layer)
        doc = read_foreign("sailor", [DATA / "sailor" / key / gpu / "profile.json", DATA / "sailor" / "llm_info.json"],
                           ImportContext(model=model, seq=SEQ, dtype="fp32"))
        assert doc["device_name"] == dev, doc["device_name"]
        ids[dev] = store.save_layer_profile(doc, url, label=f"sailor {key} {gpu}")
    return ids


def split_text(bd) -> str:
    """Layers per pipeline stage with the device types that run it (A = A100, V = V100)."""
    return "[" + " ".join("+".join(map(str, st["layers"])) + "".join(d[0] for d in st["devices"])
                          for st in bd["stages"]) + "]"


def memory_text(bd) -> str:
    """Peak predicted memory per device type against its capacity, GB."""
    peak: dict[str, tuple[float, float]] = {}
    for r in bd["ranks"]:
        m, cap = r["memory_bytes"], r["capacity_bytes"]
        if r["device"] not in peak or m > peak[r["device"]][0]:
            peak[r["device"]] = (m, cap)
    return " ".join(f"{d[0]} {m / 1e9:.1f}/{c / 1e9:.0f}" for d, (m, c) in sorted(peak.items()))


def source_text(bd) -> str:
    """What priced the block on each device type (layers:ID (sailor) or the datasheet)."""
    return ", ".join(f"{d[0]}: {src['block'].split(',')[0]}" for d, src in sorted(bd["compute_source"].items()))


def measured_block(key: str, gpu: str, mbs: int, tp: int) -> float | None:
    """Sailor's block fwd + bwd (s) at exactly (mbs, tp), None where not measured."""
    prof = json.loads((DATA / "sailor" / key / gpu / "profile.json").read_text())
    row = prof.get(str(mbs), {}).get(str(tp))
    return None if row is None else row["2"][0] + row["2"][1]


def balance_text(key: str, plan, bd) -> str:
    """The measured V100:A100 block-time ratio at the plan's (mbs, tp) next to the split's A:V layers."""
    a = measured_block(key, "A100-40", plan.micro_batch_size, plan.degrees.tp)
    v = measured_block(key, "V100-16", plan.micro_batch_size, plan.degrees.tp)
    meas = f"measured block V100/A100 at mbs {plan.micro_batch_size} tp {plan.degrees.tp}: " + (
        f"{1e3 * v:.1f}/{1e3 * a:.1f} ms = {v / a:.2f}" if a and v else "not measured")
    # the last stage of each device type (dict order: a later stage overwrites an earlier one)
    last = {st["devices"][0]: sum(st["layers"]) for st in bd["stages"] if len(st["devices"]) == 1}
    if "A100-40GB" in last and "V100-16GB" in last:
        return meas + f"; last A100 stage : last V100 stage layers {last['A100-40GB']}:{last['V100-16GB']} = " \
                      f"{last['A100-40GB'] / last['V100-16GB']:.2f} (the last stage also runs the head)"
    samples = plan.shares.samples
    if samples:
        return meas + f"; data-parallel samples per replica {list(samples)}"
    return meas


def no_split_sequence(plan_dict) -> bool:
    """cp = hp = 1: a plan whose block the layer profile prices itself (a split sequence is priced by
    the datasheet on the profile's scale: the profiles hold whole sequences only)."""
    deg = plan_dict.get("degrees") or {}
    return deg.get("cp", 1) == 1 and deg.get("hp", 1) == 1


def run_one(model, nodes: int, batch: int, variant: str, trials: int, url: str, profiles) -> dict:
    dtype = variant.split("-")[1]
    c = cluster_from_dict(cluster_doc(nodes, profiles if variant.startswith("sailor") else None), storage=url)
    if variant.startswith("flat"):
        c = flatten(c)
    _compute._RATES.clear()
    t0 = time.perf_counter()
    name = f"{model.name}-{nodes}-{batch}-{variant}"
    res = search(model, c, SEQ, batch, study_name=name, storage=url,
                 options=SearchOptions(trials=trials, dtype=dtype, seed=0, top=3))
    out = {"res": res, "wall": time.perf_counter() - t0, "cluster": c,
           "best": (res.best.plan, estimate(res.best.plan, model, c, SEQ, batch))}
    if variant.startswith("sailor") and not no_split_sequence(res.best.to_dict()):
        import optuna

        study = optuna.load_study(study_name=name, storage=url)
        hit = next(iter_trial_plans(study, where=no_split_sequence), None)
        if hit is not None:
            out["measured_best"] = (hit[1], estimate(hit[1], model, c, SEQ, batch))
    return out


def plan_line(label: str, key: str, plan, est) -> list[str]:
    bd, pr = est.breakdown, est.predicted
    return [f"  {label:12s} {plan.degrees.inline():16s} mbs {plan.micro_batch_size:<2d} {plan.schedule:6s} "
            f"recompute {plan.recompute:9s} split {split_text(bd):18s} step {pr['step_time_s']:7.3f} s  "
            f"{pr['tokens_per_s'] / 1e3:6.1f}k tok/s  mem GB {memory_text(bd)}  "
            f"{'' if pr['feasible'] else 'INFEASIBLE '}block priced by {source_text(bd)}",
            f"  {'':12s} {balance_text(key, plan, bd)}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10, help="sampler trials per search (baselines, balanced starts "
                    "and the polish come on top: ~250 priced plans at 10)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--models", default="opt,neo")
    ap.add_argument("--batches", default="1024,2048")
    ap.add_argument("--clusters", default="8+8,16+16")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        sys.exit(f"--variants: unknown {', '.join(sorted(unknown))} (known: {', '.join(VARIANTS)})")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, --trials {args.trials}, seq {SEQ}, "
          f"inter-node {INTER['bandwidth']} per device ({INTER['latency']}), materialised attention")
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/plans.db"
        for mk in args.models.split(","):
            fname, key = MODELS[mk]
            model = load_model(str(DATA / fname))
            profiles = import_sailor(model, key, url) if any(v.startswith("sailor") for v in variants) else None
            for cl in args.clusters.split(","):
                nodes = int(cl.split("+")[0]) // 4
                for batch in (int(b) for b in args.batches.split(",")):
                    print(f"\n{model.name}, {cl} (A100-40GB + V100-16GB), global batch {batch}")
                    for v in variants:
                        r = run_one(model, nodes, batch, v, args.trials, url, profiles)
                        res = r["res"]
                        for line in plan_line(v, key, *r["best"]):
                            print(line)
                        print(f"  {'':12s} why: {res.why or '-'} [{res.trials} trials, {r['wall']:.0f} s]")
                        if "measured_best" in r:
                            for line in plan_line("  cp=hp=1", key, *r["measured_best"]):
                                print(line)
                        sys.stdout.flush()
    print(f"\n# total {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
