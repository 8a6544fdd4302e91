"""Uneven expert shares and HeterMoE's disaggregation on a mixed cluster (issue 38 items 3 and 4):
what the search chooses and what each is worth, all predicted.

Qwen3-30B-A3B (128 experts, top-8) in fp16 at 4096 tokens, global batch 128, on two DGX A100-80GB
nodes and two V100-32GB nodes (benchmarks/data/bench/a100-80x16-v100-32x16.yaml: NVLink 3 / NVLink 2
inside, 200 Gbit/s per GPU across). Printed:

0. What the cost model prices for one A100 against one V100 on this run's kernels: the routed
   experts' grouped GEMMs at the per-expert tokens of ep=8, causal attention at 4096 tokens (the V100
   has no FlashAttention-2: its memory-efficient kernel, ``datasheet.SizeModel.attention``), the
   dense projections.
1. ``search`` as the CLI runs it (``--target runtime``): the best plan the runtime can run here.
2. The same search with the runtime's refusal of disaggregated plans set aside, so the cost model's
   answer is seen: the best plan, its expert shares, the best plan of the study whose shares are all
   even, the best plan again with its expert shares made even, the study's best with uneven experts.
3. Stages spanning both device types (pp=2, an A100 node and a V100 node per stage, EP over the
   stage's 16 ranks), experts even and ~ speed: a layout the search does not place.
4. One EP group spanning both device types (dp=32, ep=32), even experts against experts ~ each EP
   rank's device speed, with the terms that move.
5. HeterMoE-like (arXiv 2504.03871; ``Plan.disaggregate``, ``cost/disaggregation.py``): attention on
   the A100s, the V100s experts only, two micro-batches overlapped: the study's best (one EP group over
   all 32), a hand-written one, and EP groups of one A100 node and one V100 node (ep=16, experts even
   and ~ speed; the search does not build it), each with its per-layer terms.
6. Summary: best plan, best even-split, best with experts ~ speed, the best plan with its expert
   shares evened, the best HeterMoE-like plan, whether issue 38's bar is met, where the gain comes from.

    PYTHONPATH=. python benchmarks/bench_hetero_moe.py [--volta-attention 1.8]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import autotune.targets as T
from autotune.cost import datasheet as D
from autotune.cost import estimate
from autotune.cost import grouped_gemm as GG
from autotune.errors import AutotuneError
from autotune.plan import Plan, parse_inline
from autotune.plan_parts import Placement
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
            "memory": e.predicted["memory_bytes"],
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
        out = {"best": (b, best), "even": (even_plan, even_best), "same_even": (_even(b), same_even),
               "uneven": None, "dis": None}
        if up is not None:
            u = _price(up[1], m, c)
            out["uneven"] = (up[1], u)
            print(f"   best with uneven expert shares: {u['step']:.3f} s/step ({best['step'] / u['step']:.3f}x the best) "
                  f"{_describe(up[1])}; where (it -> best): {_differ(u, best)}")
        if dis is not None:
            out["dis"] = (dis[1], _price(dis[1], m, c))
        return out


def _device_ratios(m, c) -> None:
    """Part 0: what the cost model prices for one A100 against one V100 on this run's kernels."""
    a, v = (g.device for g in c.groups)  # the A100 nodes, then the V100 nodes
    sa, sv = (D.size_model(d, "fp16", 2) for d in (a, v))
    e, per = m.moe.experts // 8, 8 * SEQ * m.moe.top_k // m.moe.experts  # ep=8: 16 experts per rank, 2048 tokens each
    experts = [GG.mlp_gemm_time(SimpleNamespace(size=x), m, e * per, m.moe.expert_ffn_hidden, e) for x in (sa, sv)]
    pairs = SEQ * (SEQ + 1) / 2
    attn = [sum(x.attention(m.heads, SEQ, m.head_dim, pairs)) for x in (sa, sv)]
    q = m.heads * m.head_dim + 2 * m.kv_heads * m.head_dim
    dense = [x.gemm_time(SEQ, q, m.hidden) + x.gemm_time(SEQ, m.hidden, m.heads * m.head_dim) for x in (sa, sv)]
    print(f"0. priced per micro-batch of {SEQ} tokens and layer, forward (+ backward for attention), "
          f"{a.name} vs {v.name} (ratio V100/A100):")
    print(f"   routed experts' grouped GEMMs (16 experts x {per} tokens): {1e3 * experts[0]:.2f} vs "
          f"{1e3 * experts[1]:.2f} ms ({experts[1] / experts[0]:.2f}x)")
    print(f"   causal attention, {m.heads} heads x {m.head_dim} (A100 FlashAttention-2 rate, V100 the memory-efficient "
          f"kernel): {1e3 * attn[0]:.2f} vs {1e3 * attn[1]:.2f} ms ({attn[1] / attn[0]:.2f}x)")
    print(f"   dense projections (q, k, v, o): {1e3 * dense[0]:.2f} vs {1e3 * dense[1]:.2f} ms ({dense[1] / dense[0]:.2f}x)")


MIXED = tuple(Placement(rank=r, node=(0, 2, 1, 3)[r // 8], device=r % 8) for r in range(32))
"""pp=2 with each stage one A100 node and one V100 node (mesh ranks 0-15 stage 0 on nodes 0 and 2)."""


def _mixed_stages(m, c) -> dict:
    """Part 3: stages spanning both device types, EP over the stage's 16 ranks, experts even or ~ speed."""
    print("3. stages spanning both device types (pp=2, each stage one A100 node + one V100 node, dp=16, ep=16, "
          "ZeRO-1, micro-batch 1; samples even: uneven samples over one EP group are refused, their "
          "all-to-alls would not pair up):")
    best: dict = {}
    for rc in ("none", "selective", "full"):
        for a in (8, 10, 11, 12):
            sh = "" if a == 8 else ",experts=" + "/".join([str(a)] * 8 + [str(16 - a)] * 8)
            p = dataclasses.replace(parse_inline(f"dp=16,pp=2,ep=16,mbs=1,zero=1,recompute={rc},dtype=fp16{sh}"),
                                    placement=MIXED).resolve(m, c, SEQ, BATCH)
            r = _price(p, m, c)
            key = "even" if a == 8 else "speed"
            if r["feasible"] and (key not in best or r["step"] < best[key][1]["step"]):
                best[key] = (p, r)
    for key, (p, r) in sorted(best.items()):
        print(f"   best, experts {key:5s}: {r['step']:.3f} s/step  {_describe(p)}")
    if len(best) == 2:
        print(f"   experts ~ speed / even: {best['even'][1]['step'] / best['speed'][1]['step']:.3f}x; "
              f"where (even -> ~ speed): {_differ(best['even'][1], best['speed'][1])}")
    return best


def _one_group(m, c) -> dict:
    """Part 4: one EP group over all 32 ranks, experts even or ~ speed."""
    print("4. one EP group over both device types (dp=32, ep=32, ZeRO-1, full recomputation):")
    rows = {}
    for label, sh in (("even", None), ("~ speed", "5/" * 16 + "3/" * 15 + "3"), ("~ speed, 6/2", "6/" * 16 + "2/" * 15 + "2")):
        p = parse_inline(f"dp=32,ep=32,zero=1,recompute=full,dtype=fp16{',experts=' + sh if sh else ''}").resolve(
            m, c, SEQ, BATCH)
        rows[label] = (p, r := _price(p, m, c))
        x = r["moe"]
        print(f"   experts {label:13s} {r['step']:.3f} s/step: routed experts {x['experts_s']:.2f} s "
              f"(tokens/expert {x['tokens_per_expert']:.0f} on the pace-setting rank), exchange {x['ep_comm_s']:.2f} s, "
              f"fits {r['feasible']}")
    print(f"   gain of expert shares ~ speed: {rows['even'][1]['step'] / rows['~ speed'][1]['step']:.3f}x; "
          f"where (even -> ~ speed): {_differ(rows['even'][1], rows['~ speed'][1])}")
    return rows


def _hetermoe(m, c, got: dict) -> tuple:
    """Part 5: HeterMoE's disaggregation, the study's best, a hand-written one and EP groups of one node
    of each type; back: the fastest that fits, and the fastest of the last with experts ~ speed."""
    best = got["best"][1]
    print("5. HeterMoE-like: attention on the A100s, the V100s experts only, experts over all 32 ranks "
          "(Plan.disaggregate, cost/disaggregation.py):")
    if got["dis"] is not None:
        _disagg_line("the study's best disaggregated plan", got["dis"][0], got["dis"][1], best)
    else:
        print("   the study priced no disaggregated plan")
    het = parse_inline("dp=32,ep=32,zero=1,recompute=full,dtype=fp16,disaggregate=1,samples=" + "8/" * 16 + "0/" * 15
                       + "0,experts=" + "5/" * 16 + "3/" * 15 + "3")
    hp = het.resolve(m, c, SEQ, BATCH)
    hand = (hp, _price(hp, m, c))
    _disagg_line("hand-written (samples 8 per A100, experts 5 per A100 / 3 per V100)", hp, hand[1], best)
    paired = _paired(m, c)
    for key in ("even", "~ speed"):
        if key in paired:
            _disagg_line(f"EP groups of one A100 node + one V100 node (ep=16, the search does not build it), experts "
                         f"{key}", *paired[key], best)
    over = paired.get("~ speed, over memory")
    if over is not None and over[1]["step"] < paired.get("~ speed", over)[1]["step"]:
        mem = max(over[1]["memory"])
        print(f"     the fastest with experts ~ speed does not fit: {over[1]['step']:.3f} s/step "
              f"({paired['even'][1]['step'] / over[1]['step']:.3f}x the even one), {mem / 2**30:.1f} GiB on an A100; "
              f"{_describe(over[0])}")
    return min((x for x in (got["dis"], hand, paired.get("even"), paired.get("~ speed")) if x is not None),
               key=lambda x: x[1]["step"]), paired.get("~ speed")


def _paired(m, c) -> dict:
    """The fastest feasible disaggregated plans with EP groups of one A100 node and one V100 node
    (dp=32, ep=16, placement ``MIXED``), experts even and ~ speed, over recomputation and ZeRO."""
    best: dict = {}
    samples = "/".join((["8"] * 8 + ["0"] * 8) * 2)
    for rc, z, a in itertools.product(("none", "selective", "full"), (1, 3), (8, 10, 11, 12, 13, 14)):
        ex = "" if a == 8 else ",experts=" + "/".join([str(a)] * 8 + [str(16 - a)] * 8)
        p = dataclasses.replace(parse_inline(f"dp=32,ep=16,mbs=1,zero={z},recompute={rc},dtype=fp16,disaggregate=1,"
                                             f"samples={samples}{ex}"), placement=MIXED).resolve(m, c, SEQ, BATCH)
        r = _price(p, m, c)
        key = "even" if a == 8 else "~ speed"
        if r["feasible"] and (key not in best or r["step"] < best[key][1]["step"]):
            best[key] = (p, r)
        if not r["feasible"] and (key + ", over memory" not in best or r["step"] < best[key + ", over memory"][1]["step"]):
            best[key + ", over memory"] = (p, r)
    return best


def _summary(got: dict, mixed: dict, one: dict, hetermoe: tuple) -> None:
    """The lines issue 38 asks for, each plan's step and the bar."""
    (bp, best), (ep_, even), (_, same) = got["best"], got["even"], got["same_even"]
    het, het_speed = hetermoe
    cands = [x for x in (got["uneven"], mixed.get("speed"), one["~ speed"], het_speed)
             if x is not None and x[1]["feasible"]]
    sp = min(cands, key=lambda x: x[1]["step"])
    uneven = bp.shares.experts is not None and len(set(bp.shares.experts)) > 1
    gain, evened = even["step"] / best["step"], same["step"] / best["step"]
    print("6. Summary (predicted s/step; the study's plans less the disaggregation refusal, parts 3-5 hand-built):")
    print(f"   best plan:                        {best['step']:.3f}  {_describe(bp)}")
    print(f"   best even-split plan:             {even['step']:.3f}  ({gain:.3f}x slower; bar 1.15)  {_describe(ep_)}")
    print(f"   best with experts ~ speed:        {sp[1]['step']:.3f}  ({sp[1]['step'] / best['step']:.3f}x slower)  "
          f"{_describe(sp[0])}")
    print(f"   best plan, its expert shares even: {same['step']:.3f}  ({evened:.3f}x slower; bar 1.05)")
    print(f"   HeterMoE-like (disaggregated):    {het[1]['step']:.3f}  ({het[1]['step'] / best['step']:.3f}x slower)  "
          f"{_describe(het[0])}")
    met = uneven and gain >= 1.15 and evened >= 1.05
    print(f"   issue 38's bar met: {met} (best plan's expert shares uneven: {uneven})")
    print(f"   where the best plan's gain over the best even-split comes from: {_differ(even, best)}")


def _slower_volta_attention(factor: float) -> None:
    """What-if (``--volta-attention F``): the memory-efficient attention of a GPU without
    FlashAttention-2 F times the price (HeterMoE measured an A40 3.7x a V100 at attention at 64k
    tokens where the price says 2.06x: F = 1.8). Set before anything is priced."""
    base = D.SizeModel._memory_efficient_attention

    def slower(self, *args):
        fwd, bwd = base(self, *args)
        return factor * fwd, factor * bwd

    D.SizeModel._memory_efficient_attention = slower


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--volta-attention", type=float, default=1.0, metavar="F",
                    help="what-if: the V100's attention F times its price (1.8: HeterMoE's measured ratio)")
    args = ap.parse_args()
    if args.volta_attention != 1.0:
        _slower_volta_attention(args.volta_attention)
        print(f"what-if: the V100's attention {args.volta_attention:g}x its price")
    m, c = load_model("qwen3-30b-a3b"), load_cluster(str(CLUSTER))
    _device_ratios(m, c)
    got = _study_part(m, c)
    mixed = _mixed_stages(m, c)
    one = _one_group(m, c)
    het = _hetermoe(m, c, got)
    _summary(got, mixed, one, het)


if __name__ == "__main__":
    main()
