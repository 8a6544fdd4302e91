"""Uneven expert shares and HeterMoE's disaggregation on a mixed cluster (issue 38 items 3 and 4):
what the search chooses and what each is worth, all predicted.

Qwen3-30B-A3B (128 experts, top-8) in fp16 at 4096 tokens, global batch 128, on two DGX A100-80GB
nodes and two V100-32GB nodes (benchmarks/data/bench/a100-80x16-v100-32x16.yaml: NVLink 3 / NVLink 2
inside, 200 Gbit/s per GPU across). Printed:

1. ``search`` as the CLI runs it (``--target runtime``): the best plan the runtime can run here.
2. The same search with the runtime's refusal of disaggregated plans set aside, so the cost model's
   answer is seen: the best plan, its expert shares, the best plan of the study whose shares are all
   even, the best plan again with its expert shares made even, and the terms of the step that differ.
3. Where uneven expert shares can pay: an EP group spanning both device types (dp=32, ep=32), even
   experts against experts ~ each EP rank's device speed, with the terms that move (routed experts'
   compute at the slowest EP rank, token exchange).
4. HeterMoE-like (arXiv 2504.03871; ``Plan.disaggregate``, ``cost/disaggregation.py``): attention on
   the A100s, the V100s experts only, experts over all 32 ranks, more on the A100s, two micro-batches
   overlapped: the study's best such plan and a hand-written one, each with its per-layer terms
   (attention, expert-only ranks' experts, exchange, the one-micro-batch chain and the overlapped
   period) and its step without the overlap.

    PYTHONPATH=. python benchmarks/bench_hetero_moe.py
"""

from __future__ import annotations

import dataclasses
import itertools
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
LIFTED = ("disaggregate: ",)
"""The start of the runtime's refusal set aside in part 2 (autotune/runtime/trial.py): disaggregated
plans (priced and searched, not run)."""
TERMS = ("compute_s", "bubble_s", "dp_exposed_s", "optimizer_s")
MOE_TERMS = ("experts_s", "ep_comm_s", "ep_exposed_s", "router_s")


def _price(plan: Plan, m, c) -> dict:
    e = estimate(plan, m, c, SEQ, BATCH)
    b = e.breakdown
    return {"step": e.predicted["step_time_s"], "feasible": e.predicted["feasible"], "moe": b["moe"],
            "terms": {**{k: b[k] for k in TERMS}, **{k: b["moe"].get(k, 0.0) for k in MOE_TERMS}},
            "disagg": b.get("disaggregation")}


def _even(plan: Plan) -> Plan:
    return dataclasses.replace(plan, shares=dataclasses.replace(plan.shares, experts=None))


def _shares_even(plan_dict: dict) -> bool:
    sh = plan_dict.get("shares") or {}
    return all(len(set(v)) <= 1 for v in sh.values() if isinstance(v, list | tuple))


def _experts_uneven(plan_dict: dict) -> bool:
    """A uniform plan whose EP ranks hold different expert counts."""
    ex = (plan_dict.get("shares") or {}).get("experts") or ()
    return len(set(ex)) > 1 and not plan_dict.get("disaggregate")


def _search(m, c, storage: str, name: str):
    t = time.process_time()
    res = search(m, c, SEQ, BATCH, study_name=name, storage=storage, options=SearchOptions(seed=0, dtype="fp16"))
    return res, time.process_time() - t


def _lifted(target, plan, ctx):
    """The targets' refusals less the runtime's disaggregation refusal (part 2)."""
    return [r for r in _REFUSALS(target, plan, ctx) if not r.startswith(LIFTED)]


_REFUSALS = T.refusals


def _describe(plan: Plan) -> str:
    d = plan.degrees
    sh = plan.shares
    return (f"{d.inline()},mbs={plan.micro_batch_size},{plan.schedule},vpp={plan.virtual_stages},"
            f"recompute={plan.recompute},zero={plan.zero_stage}{',disaggregate' if plan.disaggregate else ''}; "
            f"layers {'/'.join(map(str, sh.layers))}; samples {_runs(sh.samples)}; experts {_runs(sh.experts or ())}")


def _runs(v) -> str:
    """``8x16/0x16``: a share as runs of equal entries."""
    out = [[x, len(list(g))] for x, g in itertools.groupby(v)]
    return "/".join(f"{x}x{k}" if k > 1 else str(x) for x, k in out)


def _differ(a: dict, b: dict) -> str:
    """The step terms of ``a`` and ``b`` (critical ranks) that differ by more than 5%: 'term a -> b s'."""
    out = [f"{k} {a['terms'][k]:.2f} -> {b['terms'][k]:.2f} s" for k in (*TERMS, *MOE_TERMS)
           if abs(a["terms"][k] - b["terms"][k]) > 0.05 * max(abs(a["terms"][k]), abs(b["terms"][k]), 1e-9)]
    return "; ".join(out) or "none over 5%"


def _disagg_line(label: str, plan: Plan, r: dict, best: dict) -> None:
    d = r["disagg"]
    f, b = d["forward"], d["backward"]
    print(f"   {label}: {r['step']:.3f} s/step, fits {r['feasible']}, {best['step'] / r['step']:.3f}x the search's best; "
          f"{_describe(plan)}")
    print(f"     per MoE layer and micro-batch, fwd/bwd ms: attention {1e3 * f['attention']:.2f}/{1e3 * b['attention']:.2f}, "
          f"A100 load (attention + own experts) {1e3 * f['attention_load']:.2f}/{1e3 * b['attention_load']:.2f}, "
          f"V100 experts {1e3 * f['expert_only']:.2f}/{1e3 * b['expert_only']:.2f}, "
          f"exchange {1e3 * f['exchange']:.2f}/{1e3 * b['exchange']:.2f}; "
          f"one micro-batch alone {1e3 * f['chain']:.2f}/{1e3 * b['chain']:.2f}, two interleaved "
          f"{1e3 * f['per_layer']:.2f}/{1e3 * b['per_layer']:.2f} each (bound {1e3 * f['bound']:.2f}/{1e3 * b['bound']:.2f})")
    slots = d["microbatches"] * (d["other_s"] + d["moe_layers"] * (f["per_layer"] + b["per_layer"]))
    print(f"     micro-batches' time without the overlap {d['step_unoverlapped_s']:.3f} s, with it {slots:.3f} s "
          f"({d['step_unoverlapped_s'] / slots:.2f}x)")


def _study_part(m, c) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        storage = str(Path(tmp) / "study.log")
        try:
            run, _ = _search(m, c, storage, "runtime")
            print(f"1. search --target runtime: best {_price(run.best.plan, m, c)['step']:.3f} s/step  "
                  f"{_describe(run.best.plan)}")
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
        _, even_plan = next(iter_trial_plans(study, where=_shares_even))
        even_best = _price(even_plan, m, c)
        same_even = _price(_even(b), m, c) if b.shares.experts is not None and not b.disaggregate else best
        dis = next(iter_trial_plans(study, where=lambda d: bool(d.get("disaggregate"))), None)
        uneven = b.shares.experts is not None and len(set(b.shares.experts)) > 1
        print(f"2. search (the disaggregation refusal set aside): {res.trials} trials, {cpu:.0f} CPU s")
        print(f"   best:               {best['step']:.3f} s/step  {_describe(b)}")
        print(f"   best even-split:    {even_best['step']:.3f} s/step  {_describe(even_plan)}")
        print(f"   best, experts even: {same_even['step']:.3f} s/step")
        print(f"   best / best even-split: {even_best['step'] / best['step']:.3f}x (bar 1.15); "
              f"experts even / best: {same_even['step'] / best['step']:.3f}x (bar 1.05); "
              f"expert shares uneven: {uneven}")
        print(f"   where (best even-split -> best): {_differ(even_best, best)}")
        up = next(iter_trial_plans(study, where=_experts_uneven), None)
        if up is not None:
            u = _price(up[1], m, c)
            print(f"   best with uneven expert shares: {u['step']:.3f} s/step ({best['step'] / u['step']:.3f}x the best) "
                  f"{_describe(up[1])}; where (it -> best): {_differ(u, best)}")
        out = {"best": best, "dis": None}
        if dis is not None:
            out["dis"] = (dis[1], _price(dis[1], m, c))
        return out


def main() -> None:
    m, c = load_model("qwen3-30b-a3b"), load_cluster(str(CLUSTER))
    got = _study_part(m, c)
    best = got["best"]
    print("3. one EP group over both device types (dp=32, ep=32, ZeRO-1, full recomputation):")
    rows = {}
    for label, sh in (("even", None), ("~ speed", "5/" * 16 + "3/" * 15 + "3"), ("~ speed, 6/2", "6/" * 16 + "2/" * 15 + "2")):
        p = parse_inline(f"dp=32,ep=32,zero=1,recompute=full,dtype=fp16{',experts=' + sh if sh else ''}")
        rows[label] = r = _price(p.resolve(m, c, SEQ, BATCH), m, c)
        x = r["moe"]
        print(f"   experts {label:13s} {r['step']:.3f} s/step: routed experts {x['experts_s']:.2f} s "
              f"(tokens/expert {x['tokens_per_expert']:.0f} on the pace-setting rank), exchange {x['ep_comm_s']:.2f} s, "
              f"fits {r['feasible']}")
    print(f"   gain of expert shares ~ speed: {rows['even']['step'] / rows['~ speed']['step']:.3f}x; "
          f"where (even -> ~ speed): {_differ(rows['even'], rows['~ speed'])}")
    print("4. HeterMoE-like: attention on the A100s, the V100s experts only, experts over all 32 ranks "
          "(Plan.disaggregate, cost/disaggregation.py):")
    if got["dis"] is not None:
        _disagg_line("the study's best disaggregated plan", got["dis"][0], got["dis"][1], best)
    else:
        print("   the study priced no disaggregated plan")
    het = parse_inline("dp=32,ep=32,zero=1,recompute=full,dtype=fp16,disaggregate=1,samples=" + "8/" * 16 + "0/" * 15
                       + "0,experts=" + "5/" * 16 + "3/" * 15 + "3")
    hp = het.resolve(m, c, SEQ, BATCH)
    _disagg_line("hand-written (samples 8 per A100, experts 5 per A100 / 3 per V100)", hp, _price(hp, m, c), best)


if __name__ == "__main__":
    main()
