"""The stage program: per-stage plans (``autotune/stages.py``) built by a dynamic program, as Metis,
Sailor and HexiScale partition a pipeline over mixed devices.

How the work is divided with Optuna. Optuna samples what a program cannot split into independent
sub-problems: the micro-batch size, the schedule and its virtual stages, recomputation and the ZeRO
stage (each changes every stage's time and memory at once, and the step's memory feasibility is not
monotone in them). Given those, this program chooses what decomposes along the pipeline:

1. **replica options**: a device type with a tp, a cp and an hp whose product divides its nodes (tp
   and hp the model's heads allow); each priced once by the cost model itself (``option_costs``: a
   one-replica plan of one and of two layers, so the per-layer time and memory, the ring and the
   all-to-alls, and what the embedding and head add are the model's own);
2. **device groups**: the data-parallel degree, one cp x hp split for every replica (the runtime
   passes each sequence shard to the same shard of the next stage), and for every device type its
   option and how many stages it takes (all its replicas or none, so a type too small or too slow for
   the model can sit out), the stages ordered slow-first or fast-first (``compositions``); and stages
   whose replicas run different tp on two device types (``mixed_compositions``);
3. **layer split**: per composition, the split of the layers over the stages that minimises the
   slowest stage under each stage's memory cap (``split_layers``: a bisection on the bottleneck
   over the stages' affine times, which solves the min-max partition of an ordered chain exactly
   with integer layers), then the approximate step ``(m - 1) * slowest + sum of stages +
   the slowest stage's gradient sync``;
4. the best few compositions (``TOP``), each in two device assignments (a stage's replicas next to
   each other, or a replica's stages next to each other), are priced by the real cost model
   (``autotune.cost.estimate``) and the fastest that fits is the point's plan; with it are kept the
   fastest plan of each of ``KINDS`` (stages of different tp, a stage of replicas of different tp,
   replicas that split the sequence; the approximate best ``KIND_TOP`` of a kind are priced too
   when the best few have none) and the next fastest, up to ``KEEP`` distinct ones that fit: its runners-up
   (``best_plans``; the space's ``stage_rank`` knob).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from autotune import stages as ST
from autotune.cost import comm as C
from autotune.errors import InputError
from autotune.plan import Plan, PlanError, even_split
from autotune.schedules import get_schedule

TOP = 3
"""Compositions priced exactly per point (each in two device assignments)."""
KIND_TOP = 2
"""Compositions of a kind of alternative (``KINDS``) priced exactly per point where the best ``TOP``
hold none of it: the approximate step of a stage of replicas of different tp (its slower part's
time) can misorder the first two by 8% (GPT-Neo-2.7B on 8 A100 + 8 V100, micro-batch 2)."""
KEEP = 5
"""Distinct feasible plans kept per knob set, fastest first (``best_plans``): the best and four
runners-up, so where the best does not fit a framework's own memory the next plan is at hand, up to
three places of them kept for the fastest plan of each of ``KINDS`` where no kept one is of that kind.
They come from the compositions already priced: keeping them costs no estimate."""


@dataclass(frozen=True)
class Option:
    """A replica of tp ``tp`` (times ``cp`` x ``hp`` for the sequence) on devices of node group
    ``group`` (one device type), priced; or, with ``parts``, a stage of replicas of several options
    (``mixed_option``)."""

    group: int
    tp: int
    name: str
    slots: tuple[tuple[int, ...], ...]
    """Replica slots: cp * hp * tp devices inside one node each, in node order."""
    layer_s: float
    """Seconds of one layer's forward and backward for one micro-batch."""
    head_s: float
    """What the embedding and the LM head add to the stages that hold them, per micro-batch."""
    layer_states: float
    """Bytes of one layer's weights, gradients and optimizer states on one rank (ZeRO-1 over dp: /dp)."""
    layer_optimizer: float
    """The optimizer states' part of ``layer_states`` (what ZeRO-1 shards)."""
    layer_act: float
    """Bytes of one layer's activations for one micro-batch in flight."""
    ends_states: float
    """Bytes the embedding, final norm and head add (split between the first and last stage)."""
    logits: float
    fixed: float
    """Bytes a rank holds whatever its layers (the reserve)."""
    capacity: float
    cp: int = 1
    hp: int = 1
    parts: tuple[tuple[Option, int], ...] = ()
    """A mixed stage (``mixed_option``): (option, replicas of it) of each device type, in replica order;
    empty for a stage of one option."""

    @property
    def split(self) -> tuple[int, int]:
        """(cp, hp): every stage of a plan splits the sequence alike (``stages.split_problem``)."""
        return self.cp, self.hp

    @property
    def tps(self) -> frozenset[int]:
        """The tp of every replica a stage of this option runs."""
        return frozenset(o.tp for o, _ in self.parts) if self.parts else frozenset((self.tp,))


def replica_options(ctx: Any) -> list[tuple[int, int, int, int, str, tuple[tuple[int, ...], ...]]]:
    """(node group, tp, cp, hp, device type, replica slots) for every tp x cp x hp that divides the
    group's nodes and that the model allows (``stages.tp_problems``; cp or hp a power of two, not
    both: inside a node the two split the sequence over the same links, and each option costs the
    program a set of compositions; the replica's devices inside one node)."""
    out = []
    cl = ctx.cluster
    for gi, g in enumerate(cl.groups):
        devs = [d for d in cl.devices if d.group == gi]
        nodes: dict[int, list[int]] = {}
        for d in devs:
            nodes.setdefault(d.node, []).append(d.index)
        n = g.devices_per_node
        splits = [(c, 1) for c in _powers(n)] + [(1, h) for h in _powers(n)[1:]]  # ring or Ulysses, not both
        for t in range(1, n + 1):
            for c, h in splits:
                w = t * c * h
                if n % w or ST.tp_problems(t, ctx.model, h):
                    continue
                slots = tuple(tuple(ids[k:k + w]) for ids in nodes.values() for k in range(0, len(ids), w))
                out.append((gi, t, c, h, g.device.name, slots))
    return out


def _powers(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``."""
    return [1 << k for k in range(n.bit_length()) if 1 << k <= n]


def kernels_of(ctx: Any) -> Any:
    """The per-kernel costs every price of the program takes: those of the runtime that will run the
    plans, ``autotune.targets.kernel_costs(ctx.target)``, the ones the search's Evaluator prices the
    program's plans with (autotune/search/pricing.py). Priced with autotune's own runtime's instead,
    a megatron or torchtitan search's program kept as its best a plan up to 2.2% slower under the
    final price than a runner-up it had priced (OPT-350M on 8 A100 + 8 V100)."""
    from autotune.targets import kernel_costs

    return kernel_costs(ctx.target)


def option_costs(ctx: Any, knobs: tuple, cache: dict) -> list[Option]:
    """Every replica option priced by the cost model (``knobs``: mbs, recompute, dtype), cached."""
    hit = cache.get(knobs)
    if hit is not None:
        return hit
    from autotune.cost.estimate import estimate

    mbs, recompute, dtype = knobs
    kernels = kernels_of(ctx)
    out = []
    for gi, t, cp, hp, name, slots in replica_options(ctx):
        figs = []
        for n in (1, 2):
            model = dataclasses.replace(ctx.model, layers=n)
            plan = Plan(stages=(ST.Stage(layers=n, replicas=(ST.Replica(tp=t, cp=cp, hp=hp, devices=slots[0]),)),),
                        micro_batch_size=mbs, recompute=recompute, dtype=dtype, schedule="1f1b")
            try:
                e = estimate(plan, model, ctx.cluster, ctx.seq_len, mbs, kernels=kernels)
            except (PlanError, InputError):
                figs = None
                break
            st, row = e.breakdown["stages"][0], e.breakdown["ranks"][0]
            figs.append((st["fwd_s"][0] + st["bwd_s"][0], row["memory"]))
        if figs is None:
            continue
        (t1, m1), (t2, m2) = figs
        states = lambda m: m["weights"] + m["gradients"] + m["optimizer"]  # noqa: E731
        layer_states = states(m2) - states(m1)
        out.append(Option(group=gi, tp=t, name=name, slots=slots, layer_s=t2 - t1, head_s=max(0.0, 2 * t1 - t2),
                          layer_states=layer_states, layer_optimizer=m2["optimizer"] - m1["optimizer"],
                          layer_act=m2["activations"] - m1["activations"],
                          ends_states=max(0.0, states(m1) - layer_states), logits=m1["logits"],
                          fixed=m1["reserve"], capacity=ctx.cluster.groups[gi].device.memory_bytes, cp=cp, hp=hp))
    cache[knobs] = out
    return out


def mixed_option(a: Option, na: int, b: Option, nb: int) -> Option:
    """A stage of ``na`` replicas of ``a`` and ``nb`` of ``b`` (Sailor's stages of replicas of several
    device types and tp; their shards nest, ``stages.nesting_problem``). Its figures are the slower
    and the larger of the two (every replica runs as many micro-batches, so the slowest paces the
    step; every device must hold its layers), so the layer split is one that both parts take."""
    worst = max(a, b, key=lambda o: o.layer_s)
    tight = min(a, b, key=lambda o: o.capacity - o.fixed)
    return dataclasses.replace(
        worst, group=-1, tp=max(a.tp, b.tp), name=f"{a.name}+{b.name}", slots=(),
        head_s=max(a.head_s, b.head_s), layer_states=max(a.layer_states, b.layer_states),
        layer_optimizer=max(a.layer_optimizer, b.layer_optimizer), layer_act=max(a.layer_act, b.layer_act),
        ends_states=max(a.ends_states, b.ends_states), logits=max(a.logits, b.logits), fixed=tight.fixed,
        capacity=tight.capacity, parts=((a, na), (b, nb)))


def mixed_compositions(opts: list[Option], dp: int, max_stages: int) -> list[Composition]:
    """Compositions with stages whose replicas run different tp: for two options of one split on two
    device types (tp a and b nesting), ``k`` stages of ``na`` replicas of the first and ``dp - na`` of
    the second, as many as one of the two types' slots fill (Sailor's shape: a type whole in mixed
    stages), and the other type's slots left over in whole stages of its own option (every device used
    where they divide), slow stages first and fast first."""
    out: list[Composition] = []
    for a, b in itertools.permutations(opts, 2):
        if (a.group >= b.group or a.split != b.split or a.tp == b.tp
                or ST.nesting_problem((a.tp, b.tp)) is not None):
            continue
        for na in range(max(1, dp - len(b.slots)), min(dp - 1, len(a.slots)) + 1):  # a stage's share of each
            nb = dp - na
            mixed = mixed_option(a, na, b, nb)
            kmax = min(len(a.slots) // na, len(b.slots) // nb)
            for k in {kmax, len(a.slots) // na, len(b.slots) // nb} - {0}:  # one type's slots all in mixed stages
                rest = [(o, (len(o.slots) - k * n) // dp) for o, n in ((a, na), (b, nb))
                        if len(o.slots) >= k * n and (len(o.slots) - k * n) % dp == 0]
                if len(rest) < 2 or k + sum(r for _, r in rest) > max_stages:
                    continue
                chosen = [(mixed, k), *((o, r) for o, r in rest if r)]
                for reverse in (False, True):
                    order = sorted(chosen, key=lambda ok: ok[0].layer_s, reverse=reverse)
                    out.append(Composition(dp=dp, stages=tuple(o for o, r in order for _ in range(r))))
    return out


@dataclass(frozen=True)
class Composition:
    dp: int
    stages: tuple[Option, ...]
    """Stage options in pipeline order."""


def compositions(opts: list[Option], dp: int, max_stages: int) -> list[Composition]:
    """For one dp: per node group one tp and all of its stages or none (its replica slots must split
    into whole stages of dp replicas); slow types first and fast types first."""
    by_group: dict[int, list[tuple[Option, int]]] = {}
    for o in opts:
        k = len(o.slots) // dp
        if k >= 1 and k * dp == len(o.slots):  # a device type is used whole or sits out
            by_group.setdefault(o.group, []).append((o, k))
    groups = sorted(by_group)
    out: list[Composition] = []
    seen: set[tuple] = set()

    def rec(i: int, chosen: list[tuple[Option, int]], n: int) -> None:
        if n > max_stages:  # more stages than layers allow: no split
            return
        if i == len(groups):
            if not chosen:
                return
            for reverse in (False, True):
                order = sorted(chosen, key=lambda ok: ok[0].layer_s, reverse=reverse)
                key = tuple((id(o), k) for o, k in order)
                if key not in seen:
                    seen.add(key)
                    out.append(Composition(dp=dp, stages=tuple(o for o, k in order for _ in range(k))))
            return
        rec(i + 1, chosen, n)  # this group sits out
        for o, k in by_group[groups[i]]:
            rec(i + 1, chosen + [(o, k)], n + k)

    rec(0, [], 0)
    return out


def split_layers(c: Composition, layers: int, v: int, m: int, in_flight: list[float]) -> tuple[list[int], float] | None:
    """Integer layers per stage (each >= v) minimising the slowest stage under each stage's memory
    cap; None when no split fits. ``in_flight[s]``: micro-batches' worth of one layer's activations
    stage s holds per layer it holds (the schedule's ``in_flight``)."""
    p = len(c.stages)
    ext, cap = [], []
    for s, o in enumerate(c.stages):
        first, last = s == 0, s == p - 1
        ends = o.ends_states * ((0.5 if first else 0) + (0.5 if last else 0)) if p > 1 else o.ends_states
        free = o.capacity - o.fixed - ends - (o.logits if last else 0.0)
        per = o.layer_states + o.layer_act * in_flight[s]
        cap.append(int(free // per) if per > 0 else layers)
        ext.append(o.head_s if last else 0.0)
    if any(x < v for x in cap) or sum(cap) < layers or p * v > layers:
        return None
    bound = _bottleneck(c, layers, v, cap, ext)
    if bound is None:
        return None
    n = _take(c, cap, ext, bound)
    surplus = sum(n) - layers
    for s in sorted(range(p), key=lambda s: -c.stages[s].layer_s):  # shed from the slowest per layer
        d = min(surplus, n[s] - v)
        n[s] -= d
        surplus -= d
    times = [n[s] * o.layer_s + ext[s] for s, o in enumerate(c.stages)]
    return n, (m - 1) * max(times) + sum(times)


def _take(c: Composition, cap: list[int], ext: list[float], bound: float) -> list[int]:
    """Per stage the most layers whose time stays within ``bound`` (and its memory cap)."""
    return [min(cap[s], int((bound - ext[s]) / o.layer_s + 1e-9) if o.layer_s > 0 else cap[s])
            for s, o in enumerate(c.stages)]


def _bottleneck(c: Composition, layers: int, v: int, cap: list[int], ext: list[float]) -> float | None:
    """The least slowest-stage time of any split: it is one stage's time at a whole layer count, so
    a binary search over those candidate times (sorted) for the first whose greedy ``_take`` gives
    every stage at least ``v`` layers and all of them in total; the test is monotone in the bound.
    Exact, and ~log2(stages x layers) tests where a bisection of the real line took 60."""
    kinds = {(o.layer_s, ext[s], min(cap[s], layers)) for s, o in enumerate(c.stages)}  # stages alike: one set
    cands = sorted({k * t + e for t, e, top in kinds for k in range(v, top + 1)})

    def fits(bound: float) -> bool:
        n = _take(c, cap, ext, bound)
        return min(n) >= v and sum(n) >= layers

    lo, hi = 0, len(cands) - 1
    if not cands or not fits(cands[hi]):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(cands[mid]):
            hi = mid
        else:
            lo = mid + 1
    return cands[lo]


def assign(c: Composition, layers: list[int], replica_major: bool) -> tuple[ST.Stage, ...]:
    """Devices for a composition: each node group's stages take its replica slots in node order,
    stage by stage (a stage's replicas side by side) or replica by replica (a replica's stages side
    by side: its hops stay inside a node)."""
    runs: list[tuple[Option, list[int]]] = []  # consecutive stages of one option
    for s, o in enumerate(c.stages):
        if runs and runs[-1][0] is o:
            runs[-1][1].append(s)
        else:
            runs.append((o, [s]))
    reps: dict[int, list[ST.Replica]] = {}
    used: dict[int, int] = {}
    for o, ss in runs:
        k = len(ss)
        for part, n in o.parts or ((o, c.dp),):  # a mixed stage takes n slots of each part's type
            base = used.get(part.group, 0)
            for i, s in enumerate(ss):
                reps.setdefault(s, []).extend(
                    ST.Replica(tp=part.tp, cp=part.cp, hp=part.hp,
                               devices=part.slots[base + (r * k + i if replica_major else i * n + r)])
                    for r in range(n))
            used[part.group] = base + k * n
    return tuple(ST.Stage(layers=layers[s], replicas=tuple(reps[s])) for s in range(len(c.stages)))


def best_plan(ctx: Any, *, mbs: int, schedule: str, vs: int, recompute: str, zero: int, cache: dict,
              estimator: Any = None) -> Plan | str:
    """The fastest per-stage plan the program finds for these knobs (priced exactly), or why there is
    none as ``kind: reason`` (kind: schedule, zero_stage, batch, memory, divisibility)."""
    got = best_plans(ctx, mbs=mbs, schedule=schedule, vs=vs, recompute=recompute, zero=zero, cache=cache,
                     estimator=estimator)
    return got if isinstance(got, str) else got[0]


def best_plans(ctx: Any, *, mbs: int, schedule: str, vs: int, recompute: str, zero: int, cache: dict,
               estimator: Any = None, keep: int = KEEP) -> list[Plan] | str:
    """Up to ``keep`` distinct feasible per-stage plans for these knobs, fastest first (each priced
    exactly), or why there is none (``best_plan``'s reasons)."""
    if (why := ST.schedule_problem(schedule)) is not None:
        return "schedule: " + why
    if (why := ST.zero_problem(zero)) is not None:
        return why
    from autotune.cost.estimate import estimate

    est = estimator or estimate
    gbs = ctx.global_batch
    opts = option_costs(ctx, (mbs, recompute, ctx.dtype), cache)
    if not opts:
        return "memory: no replica option fits one layer"
    sched = get_schedule(schedule)
    if gbs % mbs:
        return f"global_batch({gbs}) not divisible by micro_batch_size({mbs})"
    cands, rejected = _candidates(ctx, opts, sched, mbs=mbs, schedule=schedule, vs=vs, zero=zero)
    if not cands:
        if rejected["memory"]:
            return "memory: no composition of stages fits the memory of its devices"
        if rejected["batch"]:
            return (f"batch: global_batch({gbs}) at micro_batch_size({mbs}) gives no pipeline of these stages "
                    f"enough micro-batches for {schedule}")
        return "divisibility: no device group splits into stages of whole replicas"
    cands.sort(key=lambda x: x[0])
    # the approximate-best compositions of each kind of alternative (``KINDS``), priced too when the
    # best few have none: the runners-up then hold one of each (one more alternative, not one more of a kind)
    kinds = [kinds_of([o.tps for o in c.stages], c.stages[0].split) for _, c, n in cands]
    picked = list(range(min(TOP, len(cands))))
    for kind in KINDS:
        if not any(kind in kinds[i] for i in picked):
            picked += [i for i, k in enumerate(kinds) if kind in k][:KIND_TOP]
    top = min(TOP, len(cands))  # the best few in both device assignments, the kinds' in one
    return _fastest(ctx, [cands[i] for i in picked], est, keep, mbs=mbs, schedule=schedule, vs=vs,
                    recompute=recompute, zero=zero, both=top, memo=cache.setdefault(("exact", est, ctx.target), {}))


KINDS = ("stages", "replicas", "split")
"""The alternatives a program run keeps one of where the faster plans have none: ``stages``, a plan
whose stages run different tp (the tp of their replicas); ``replicas``, one with a stage whose replicas
run different tp; ``split``, one whose replicas split the sequence (cp or hp > 1)."""


def stage_kinds(stages: tuple[ST.Stage, ...]) -> set[str]:
    """Which of ``KINDS`` a plan of these stages is (``kinds_of``)."""
    first = stages[0].replicas[0]
    return kinds_of([frozenset(st.tps) for st in stages], (first.cp, first.hp))


def kinds_of(stage_tps: list[frozenset[int]], split: tuple[int, int]) -> set[str]:
    """The one rule of ``KINDS`` for a plan whose stages' replicas run ``stage_tps`` and split the
    sequence ``split`` = (cp, hp); a composition is asked with its options' ``tps`` and ``split``."""
    out = {"split"} if split != (1, 1) else set()
    if any(len(t) > 1 for t in stage_tps):
        out.add("replicas")
    if len(set(stage_tps)) > 1:
        out.add("stages")
    return out


def _candidates(ctx: Any, opts: list[Option], sched: Any, *, mbs: int, schedule: str, vs: int,
                zero: int) -> tuple[list[tuple[float, Composition, list[int]]], dict[str, int]]:
    """Every composition that fits, with its approximate step time and layer split, over every dp that
    divides the micro-batch count; and how many were rejected for batch and for memory."""
    model, gbs = ctx.model, ctx.global_batch
    cands: list[tuple[float, Composition, list[int]]] = []
    rejected = {"batch": 0, "memory": 0}
    sync: dict[tuple, float] = {}  # a stage's gradient sync, by its devices and layers (``_sync_s``)
    # a stage holds dp replicas of at least one slot each: no dp above every slot of every option
    # has a composition (``compositions``, ``mixed_compositions``), so those are not walked
    most_dp = sum(len(o.slots) for o in opts)
    for dp in range(1, min(gbs // mbs, most_dp) + 1):
        if (gbs // mbs) % dp:
            continue
        m = gbs // mbs // dp
        scaled = _scaled(opts, zero, dp)
        # a layer must fit a device with one micro-batch in flight; 1F1B-like schedules need m >= stages
        fits = [o for o in scaled if o.capacity - o.fixed >= o.layer_states * vs + o.layer_act]
        most = min(model.layers // vs, m if schedule != "gpipe" else model.layers)
        comps = [c for split in sorted({o.split for o in fits}) for same in [[o for o in fits if o.split == split]]
                 for c in compositions(same, dp, most) + mixed_compositions(same, dp, most)]
        for c in comps:
            p = len(c.stages)
            if sched.check_shape(p, vs) or sched.check_microbatches(p, vs, [m] * dp):
                rejected["batch"] += 1
                continue
            fl = _in_flight(sched, p, vs, m)
            got = split_layers(c, model.layers, vs, m, fl)
            if got is None:
                rejected["memory"] += 1
                continue
            n, approx = got
            approx += _sync_s(ctx, c, n, zero, sync)
            cands.append((approx, c, n))
    return cands, rejected


def _fastest(ctx: Any, cands: list[tuple[float, Composition, list[int]]], est: Any, keep: int, *, mbs: int,
             schedule: str, vs: int, recompute: str, zero: int, both: int | None = None,
             memo: dict | None = None) -> list[Plan] | str:
    """The ``keep`` fastest distinct plans of these candidates priced exactly (the first ``both``, all
    by default, in both replica orders, the rest a stage's replicas side by side; equal step times
    keep the pricing order, so the first is the one a single best took), or why none is feasible.
    ``memo``: what ``est`` said of each plan, kept across the program's runs (a plan with one stage
    or one replica a stage is the same plan under several schedules or ZeRO stages: priced once)."""
    gbs = ctx.global_batch
    priced: dict[Plan, float] = {}  # resolved plan -> step time
    tried: set[Plan] = set()  # dp = 1 gives one plan for both orders: priced once
    reason = "memory: no per-stage plan fits"
    for i, (_, c, n) in enumerate(cands):
        for major in (False, True) if both is None or i < both else (False,):
            one = len(c.stages) == 1  # no pipeline: the schedule does not apply (the uniform space's rule)
            plan = Plan(stages=assign(c, n, major), micro_batch_size=mbs, schedule="1f1b" if one else schedule,
                        virtual_stages=1 if one else vs,
                        recompute=recompute, zero_stage=zero if c.dp > 1 else 0, dtype=ctx.dtype,
                        shares=_samples(gbs, mbs, c.dp))
            if plan in tried:  # the same plan gives the same estimate (and the same reason)
                continue
            tried.add(plan)
            got = memo.get(plan) if memo is not None else None
            if got is None:
                got = _exact(ctx, plan, est)
                if memo is not None:
                    memo[plan] = got
            if isinstance(got, str):
                reason = got
                continue
            priced.setdefault(*got)
    if not priced:
        return reason
    return _kept(priced, keep)


def _exact(ctx: Any, plan: Plan, est: Any) -> tuple[Plan, float] | str:
    """``plan`` priced by ``est``: (the resolved plan, its step time), or why it is not a plan
    (``kind: reason``: divisibility, or memory when it does not fit)."""
    try:
        e = est(plan, ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch, kernels=kernels_of(ctx))
    except PlanError as exc:
        return "divisibility: " + exc.message
    if not e.predicted["feasible"]:
        return "memory: " + str(e.predicted["infeasible_reason"])
    return e.plan, e.predicted["step_time_s"]


def _kept(priced: dict[Plan, float], keep: int) -> list[Plan]:
    """Up to ``keep`` plans, fastest first: the fastest, the fastest plan of each of ``KINDS`` (one
    whose stages run different tp, one whose replicas do, one that splits the sequence), then the
    fastest of the rest, those of a shape not kept yet first (the same stages on other devices is
    a lesser alternative); stable sorts: ties stay in pricing order, so the first is the one a single
    best took. A plan of several kinds stands for each of them."""
    ranked = sorted(priced, key=priced.__getitem__)
    out = ranked[:1]
    for kind in KINDS:
        if not any(kind in stage_kinds(q.stages) for q in out):
            out += [q for q in ranked if kind in stage_kinds(q.stages)][:1]
    shapes = {ST.inline(q.stages) for q in out}  # the next fastest of another shape first, then the rest
    rest = sorted((q for q in ranked if q not in out), key=lambda q: ST.inline(q.stages) in shapes)
    out += rest[:max(0, keep - len(out))]
    return sorted(out[:keep], key=priced.__getitem__)


_IN_FLIGHT: dict[tuple, list[float]] = {}


def _in_flight(sched: Any, p: int, vs: int, m: int) -> list[float]:
    """Per stage: micro-batches' worth of a layer's activations held per layer (the schedule's own
    ``in_flight`` over its op order), memoised (it walks the order: m up to the batch)."""
    key = (sched.name, p, vs, m)
    hit = _IN_FLIGHT.get(key)
    if hit is None:
        if len(_IN_FLIGHT) > 4096:
            _IN_FLIGHT.clear()
        hit = _IN_FLIGHT[key] = [sched.in_flight(p, vs, m, s, (1,) * vs)[0] / vs for s in range(p)]
    return hit


def _samples(gbs: int, mbs: int, dp: int) -> Any:
    from autotune.plan import Shares

    return Shares(samples=tuple(x * mbs for x in even_split(gbs // mbs, dp)))


_SCALED: dict[tuple, tuple[list[Option], list[Option]]] = {}


def _scaled(opts: list[Option], zero: int, dp: int) -> list[Option]:
    """``opts`` with the states one rank holds under ``zero`` over ``dp`` replicas: ZeRO-1 shards the
    optimizer states over the stage's dp x cp x hp ranks (dims.SHARED_BY). Memoised per options list
    (``option_costs`` hands out one list per knobs): the program meets the same dp under every
    schedule and ZeRO stage, and equal options keep the compositions' ``id`` keys stable."""
    key = (id(opts), zero, dp)
    hit = _SCALED.get(key)
    if hit is None or hit[0] is not opts:
        if len(_SCALED) > 4096:
            _SCALED.clear()
        hit = _SCALED[key] = (opts, [dataclasses.replace(o, layer_states=o.layer_states - (1 - 1 / (dp * o.cp * o.hp))
                                                         * _opt_share(o) if zero == 1 else o.layer_states)
                                     for o in opts])
    return hit[1]


def _opt_share(o: Option) -> float:
    """The optimizer states' part of a layer's states (ZeRO-1 shards it over the replicas): the cost
    model's own optimizer term of the layer (``memory.state_bytes_per_param``: 12 of 18 bytes a
    parameter under 16-bit compute, 8 of 16 in fp32)."""
    return o.layer_optimizer


def _sync_s(ctx: Any, c: Composition, n: list[int], zero: int, memo: dict | None = None) -> float:
    """Seconds of the slowest stage's gradient reduction after the pipeline (fp32 gradients).
    ``memo``: each stage's time by what it depends on (its parts' devices and tp, the replicas, its
    layers), so a run of the program prices a stage met in many compositions once."""
    from autotune.cost.collectives import collectives_for

    if c.dp == 1:
        return 0.0

    memo = {} if memo is None else memo
    worst = 0.0
    for s, o in enumerate(c.stages):
        parts = o.parts or ((o, c.dp),)
        key = (tuple((p.group, p.tp, p.cp, p.hp, p.slots[:r]) for p, r in parts), c.dp, n[s])
        t = memo.get(key)
        if t is None:
            # the ring over the stage's dp x cp x hp cells (each replica's cp x hp tp groups)
            devs = [slot[k * p.tp] for p, r in parts for slot in p.slots[:r] for k in range(p.cp * p.hp)]
            link = C.topology(ctx.cluster).ring_link(devs)  # the cost model's link for a ring over replicas
            slow = min((p for p, _ in parts), key=lambda p: p.tp)  # replicas of different tp: paced by the smallest
            nbytes = 4 * n[s] * ctx.model.layer_params() / slow.tp
            coll = collectives_for(ctx.cluster.groups[slow.group].device)
            t = memo[key] = coll.all_reduce(link, c.dp * o.cp * o.hp, nbytes)
        worst = max(worst, t)
    return worst



