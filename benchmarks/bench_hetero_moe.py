"""Uneven expert shares on a mixed cluster (issue 38 item 3): what the search chooses and what the
expert shares are worth, all predicted.

Qwen3-30B-A3B (128 experts, top-8) in fp16 at 4096 tokens, global batch 128, on two DGX A100-80GB
nodes and two V100-32GB nodes (benchmarks/data/bench/a100-80x16-v100-32x16.yaml: NVLink 3 / NVLink 2
inside, 200 Gbit/s per GPU across). Printed:

1. ``search`` as the CLI runs it (``--target runtime``): which plans the runtime can run here.
2. The same search with the runtime's one refusal that rules out every plan here (fp16 MoE: its loss
   scale is per gradient group) set aside, so the cost model's answer is seen: the best plan, its
   expert shares, the best plan of the study whose shares are all even, and the best plan again with
   its expert shares made even.
3. Where uneven expert shares can pay: an EP group spanning both device types (dp=32, ep=32), even
   experts against experts ~ each EP rank's device speed, with the terms that move (routed experts'
   compute at the slowest EP rank, token exchange).
4. A HeterMoE-like setup (arXiv 2504.03871: attention on the newer GPUs, experts spread over all) as
   far as a plan can say it: attention cannot leave the V100s (every rank of a folded expert mesh
   also runs attention), so the nearest priced plan gives the A100s more samples (attention work) and
   more experts by speed.

    PYTHONPATH=. python benchmarks/bench_hetero_moe.py
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import autotune.targets as T
from autotune.cost import estimate
from autotune.errors import AutotuneError
from autotune.plan import Plan, parse_inline
from autotune.search.options import SearchOptions
from autotune.search.run import search
from autotune.specs.cluster import load_cluster
from autotune.specs.model import load_model
from autotune.study import iter_trial_plans, open_study

CLUSTER = Path(__file__).parent / "data" / "bench" / "a100-80x16-v100-32x16.yaml"
SEQ, BATCH = 4096, 128
FP16_MOE = "dtype: fp16's dynamic loss scale"
"""The start of the runtime's refusal of fp16 MoE plans (autotune/runtime/trial.py)."""


def _price(plan: Plan, m, c) -> dict:
    e = estimate(plan, m, c, SEQ, BATCH)
    return {"step": e.predicted["step_time_s"], "feasible": e.predicted["feasible"], "moe": e.breakdown["moe"]}


def _even(plan: Plan) -> Plan:
    return dataclasses.replace(plan, shares=dataclasses.replace(plan.shares, experts=None))



def _shares_even(plan_dict: dict) -> bool:
    sh = plan_dict.get("shares") or {}
    return all(len(set(v)) <= 1 for v in sh.values() if isinstance(v, list | tuple))


def _search(m, c, storage: str, name: str):
    t = time.process_time()
    res = search(m, c, SEQ, BATCH, study_name=name, storage=storage, options=SearchOptions(seed=0, dtype="fp16"))
    return res, time.process_time() - t


def _lifted(target, plan, ctx):
    """The targets' refusals less the runtime's fp16 MoE refusal (part 2 of the module docstring)."""
    return [r for r in _REFUSALS(target, plan, ctx) if not r.startswith(FP16_MOE)]


_REFUSALS = T.refusals


def _describe(plan: Plan) -> str:
    d = plan.degrees
    return (f"{d.inline()},mbs={plan.micro_batch_size},{plan.schedule},vpp={plan.virtual_stages},"
            f"recompute={plan.recompute},zero={plan.zero_stage}; layers {'/'.join(map(str, plan.shares.layers))}; "
            f"experts {'/'.join(map(str, plan.shares.experts or ()))}")


def main() -> None:
    m, c = load_model("qwen3-30b-a3b"), load_cluster(str(CLUSTER))
    with tempfile.TemporaryDirectory() as tmp:
        storage = str(Path(tmp) / "study.log")
        try:
            _search(m, c, storage, "runtime")
            print("1. search --target runtime: found plans")
        except AutotuneError as e:
            print(f"1. search --target runtime: no plan ({str(e).split(';')[0][:160]}...)")
        T.refusals = _lifted
        try:
            res, cpu = _search(m, c, storage, "lifted")
        finally:
            T.refusals = _REFUSALS
        b = res.best.plan
        best = _price(b, m, c)
        study = open_study("lifted", storage)
        even_t, even_plan = next(iter_trial_plans(study, where=_shares_even))
        even_best = _price(even_plan, m, c)
        same_even = _price(_even(b), m, c) if b.shares.experts is not None else best
        print(f"2. search (fp16 MoE refusal set aside): {res.trials} trials, {cpu:.0f} CPU s")
        print(f"   best:              {best['step']:.3f} s/step  {_describe(b)}")
        print(f"   best even-split:   {even_best['step']:.3f} s/step  {_describe(even_plan)}")
        print(f"   best, experts even: {same_even['step']:.3f} s/step")
        print(f"   best / best even-split: {even_best['step'] / best['step']:.3f}x (bar 1.15); "
              f"experts even / best: {same_even['step'] / best['step']:.3f}x (bar 1.05); "
              f"expert shares uneven: {b.shares.experts is not None and len(set(b.shares.experts)) > 1}")
    print("3. one EP group over both device types (dp=32, ep=32, ZeRO-1, full recomputation):")
    rows = {}
    for label, sh in (("even", None), ("~ speed", "5/" * 16 + "3/" * 15 + "3"), ("~ speed, 6/2", "6/" * 16 + "2/" * 15 + "2")):
        p = parse_inline(f"dp=32,ep=32,zero=1,recompute=full,dtype=fp16{',experts=' + sh if sh else ''}")
        rows[label] = r = _price(p.resolve(m, c, SEQ, BATCH), m, c)
        x = r["moe"]
        print(f"   experts {label:13s} {r['step']:.3f} s/step: routed experts {x['experts_s']:.2f} s "
              f"(tokens/expert {x['tokens_per_expert']:.0f} on the pace-setting rank), exchange {x['ep_comm_s']:.2f} s, "
              f"fits {r['feasible']}")
    print(f"   gain of expert shares ~ speed: {rows['even']['step'] / rows['~ speed']['step']:.3f}x")
    het = parse_inline("dp=32,ep=32,zero=1,recompute=full,dtype=fp16,samples=" + "6/" * 16 + "2/" * 15 + "2"
                       + ",experts=" + "5/" * 16 + "3/" * 15 + "3")
    h = _price(het.resolve(m, c, SEQ, BATCH), m, c)
    print(f"4. HeterMoE-like (A100s: 3x the samples and 5/3 the experts; attention cannot leave the V100s): "
          f"{h['step']:.3f} s/step, fits {h['feasible']}; vs the search's best {h['step'] / best['step']:.3f}x")


if __name__ == "__main__":
    main()
