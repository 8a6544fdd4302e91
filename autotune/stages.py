"""Per-stage plans: each pipeline stage its own devices, layer count and replicas, each replica its own tp.

The shape Sailor, Metis and HexiScale plan on mixed clusters (A100 + V100): a stage is a group of
devices holding a contiguous run of layers; it runs ``dp`` replicas (the plan's data-parallel degree:
micro-batches of replica ``r`` flow through replica ``r`` of every stage, so every stage has as many
replicas), and each replica is a tensor-parallel group of its own size on devices inside one node.
Replicas of one stage may differ in tp (Sailor's heterogeneous replicas: 6 A100s at tp=1 beside 4
V100 groups at tp=4), as long as their shards nest (every tp of the stage divides its largest), so a
gradient reduces piece by piece over the replicas and ZeRO-1 shards each piece.

This module is the one source of the rules such a plan obeys (what may differ, what must divide,
which schedules run it); the plan (``Plan.resolve``), the cost model (``cost/stages.py``), the
runtime, the search and the exporters ask it. A uniform plan is the special case where every stage
has the same replicas; ``as_stages`` writes any uniform 1-D-pipeline plan in this form, and the cost
model prices both forms alike (tests/unit/test_stages_cost.py).

A replica may also split the sequence (context parallelism, ``cp``: ring attention) and the heads
(Ulysses, ``hp``) over cp x hp tp groups of its own: its devices are then cp * hp * tp, cp outermost
and tp innermost (the uniform mesh order inside the replica). Every replica of the plan has the same cp
and hp (``degrees.cp``/``degrees.hp``): the hop between stages passes each CP/HP shard of the
sequence to the same shard of the next stage, which stages of different cp would have to re-split.

Ranks of a per-stage plan are numbered stage by stage, replica by replica, then cp, hp, tp rank
innermost (``layout_of``): the uniform mesh order (pp, dp, cp, hp, tp). Devices are named by their
index in the cluster's device order (``ClusterSpec.devices``, the order of the node-order placement).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from autotune.errors import InputError
from autotune.specs import fields as F

STAGED_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
"""Schedules a per-stage plan runs with. The others refuse (``schedule_problem`` says why)."""
_SCHEDULE_REASONS = {
    "helixpipe": "HelixPipe runs every attention on another pipeline rank, so a stage is no device group "
                 "of its own",
    "interleaved_zb": "the zero-bubble schedules split the backward into input and weight halves, whose "
                      "gradient reduction over replicas of different tp is not built",
    "zbv": "the zero-bubble schedules split the backward into input and weight halves, whose gradient "
           "reduction over replicas of different tp is not built",
}


@dataclass(frozen=True, kw_only=True)
class Replica:
    """One data-parallel replica of a stage: cp x hp tensor-parallel groups, each on devices of one node."""

    tp: int
    """Tensor-parallel degree of this replica."""
    devices: tuple[int, ...]
    """Cluster device indices (``ClusterSpec.devices`` order), cp * hp * tp of them in mesh order (cp
    outermost, tp rank innermost): each run of ``tp`` is one tp group."""
    cp: int = 1
    """Context-parallel degree (ring attention over the sequence's shards): the plan's, in every replica."""
    hp: int = 1
    """Ulysses head-parallel degree: the plan's, in every replica."""

    @property
    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        """The devices of each tp group, in (cp, hp) order."""
        t = self.tp
        return tuple(self.devices[i:i + t] for i in range(0, len(self.devices), t))

    def to_dict(self) -> dict[str, Any]:
        more = {k: getattr(self, k) for k in ("cp", "hp") if getattr(self, k) > 1}  # files without them read alike
        return {"tp": self.tp, **more, "devices": list(self.devices)}


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One pipeline stage: its layers (all its model chunks together) and its replicas."""

    layers: int
    """Transformer blocks this stage holds (with virtual stages: over all its chunks)."""
    replicas: tuple[Replica, ...]

    @property
    def dp(self) -> int:
        return len(self.replicas)

    @property
    def tps(self) -> tuple[int, ...]:
        return tuple(r.tp for r in self.replicas)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for r in self.replicas for d in r.devices)

    def to_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "replicas": [r.to_dict() for r in self.replicas]}


@dataclass(frozen=True)
class RankSlot:
    """Where rank ``rank`` of a per-stage plan sits."""

    rank: int
    stage: int
    replica: int
    tp_index: int
    tp: int
    device: int
    """Cluster device index."""
    cp_index: int = 0
    hp_index: int = 0


@dataclass(frozen=True)
class StageLayout:
    """The rank arithmetic of a tuple of stages, computed once (``layout_of``)."""

    stages: tuple[Stage, ...]

    @cached_property
    def slots(self) -> tuple[RankSlot, ...]:
        out = []
        for s, st in enumerate(self.stages):
            for r, rep in enumerate(st.replicas):
                t = rep.tp
                for i, dev in enumerate(rep.devices):
                    out.append(RankSlot(rank=len(out), stage=s, replica=r, tp_index=i % t, tp=t, device=dev,
                                        cp_index=i // (t * rep.hp), hp_index=i // t % rep.hp))
        return tuple(out)

    @cached_property
    def first_rank(self) -> dict[tuple[int, int], int]:
        """{(stage, replica): its first rank (cp, hp and tp index 0)}."""
        return {(x.stage, x.replica): x.rank for x in self.slots if x.tp_index == x.cp_index == x.hp_index == 0}

    @cached_property
    def cell_first(self) -> dict[tuple[int, int, int, int], int]:
        """{(stage, replica, cp index, hp index): the first rank of that tp group}, in rank order."""
        return {(x.stage, x.replica, x.cp_index, x.hp_index): x.rank for x in self.slots if x.tp_index == 0}

    @property
    def world(self) -> int:
        return len(self.slots)

    def cell_ranks(self, stage: int, replica: int, cp: int = 0, hp: int = 0) -> list[int]:
        """The ranks of one tp group: replica ``replica`` of ``stage`` at cp index ``cp``, hp index ``hp``."""
        r0 = self.cell_first[(stage, replica, cp, hp)]
        return list(range(r0, r0 + self.stages[stage].replicas[replica].tp))


def layout_of(stages: tuple[Stage, ...]) -> StageLayout:
    return StageLayout(stages)


# ---- the rules ----------------------------------------------------------------------------------
def nesting_problem(tps: tuple[int, ...]) -> str | None:
    """Replicas of one stage may differ in tp when their shards nest: every tp divides the largest,
    so each rank's shard is a whole number of the finest replica's shards (the gradient reduces and
    ZeRO-1 shards piece by piece: ``pieces``)."""
    top = max(tps)
    bad = sorted({t for t in tps if top % t})
    if bad:
        return f"replica tp {bad} does not divide the stage's largest tp({top}); their shards would not nest"
    return None


def pieces(tp: int, finest: int, tp_index: int) -> range:
    """The pieces (of ``finest`` equal pieces of every tp-split tensor) that tp rank ``tp_index`` of a
    replica of degree ``tp`` holds: contiguous, ``finest // tp`` of them."""
    k = finest // tp
    return range(tp_index * k, (tp_index + 1) * k)


def hop_source(senders: int, receiver: int) -> int:
    """The tp index of the sending stage (tp ``senders``) whose copy of a hop's tensor tp rank
    ``receiver`` of the next stage takes. Without sequence parallelism every tp rank of a stage holds
    the whole hidden state (the row-parallel output is all-reduced) and the whole gradient of its
    input (the column-parallel input's backward is all-reduced), so each receiver takes the whole
    tensor from one sender, spread round-robin over the senders."""
    return receiver % senders


def hop_targets(senders: int, receivers: int, sender: int) -> list[int]:
    """The tp indices of the receiving stage that tp rank ``sender`` of the sending stage sends the
    whole tensor to (``hop_source`` the other way round)."""
    return [k for k in range(receivers) if hop_source(senders, k) == sender]


def hop_copies(senders: int, receivers: int) -> int:
    """Whole tensors the busiest sending tp rank sends in one hop: ceil(receivers / senders). Why
    whole tensors and not 1/tp slices gathered by the receivers (Megatron's old scatter/gather): on
    gloo the receivers' all-gather costs more than the bytes it saves (docs/architecture.md,
    "Per-stage degrees"); megatron-core also sends the whole tensor without sequence parallelism."""
    return max(len(hop_targets(senders, receivers, j)) for j in range(senders))


def zero_problem(zero_stage: int) -> str | None:
    """The ZeRO stages a per-stage plan runs (0 and 1): FSDP2 over replicas whose shards differ is not built."""
    if zero_stage <= 1:
        return None
    return (f"zero_stage: {zero_stage} is not run with per-stage degrees (FSDP2 over replicas whose shards "
            "differ is not built); use 0 or 1")


def schedule_problem(schedule: str) -> str | None:
    if schedule in STAGED_SCHEDULES:
        return None
    why = _SCHEDULE_REASONS.get(schedule, "not checked with per-stage degrees")
    return (f"schedule: {schedule} does not run per-stage plans ({why}); use one of "
            f"{', '.join(STAGED_SCHEDULES)}")


def tp_problems(tp: int, model: Any, hp: int = 1) -> list[str]:
    """What a tp degree (with ``hp`` Ulysses ranks beside it) must divide: the uniform rules of
    ``autotune.divisibility`` for tp and hp."""
    from autotune.divisibility import degree_problems
    from autotune.plan_parts import Degrees

    return [t for f, t in degree_problems(Degrees(tp=tp, hp=hp), model, hp) if f in ("degrees.tp", "degrees.hp")]


def split_problem(stages: tuple[Stage, ...]) -> str | None:
    """Every replica of a per-stage plan splits the sequence alike (one cp, one hp): a stage's CP/HP
    shard of each micro-batch goes to the same shard of the next stage (``hop_source`` within it), and
    the gradient group of a stage spans its replicas' shards (``dims.SHARED_BY``). Stages of different
    cp or hp (HexiSeq's Ulysses groups of different sizes) would re-split the sequence at the hop: not built."""
    splits = sorted({(r.cp, r.hp) for st in stages for r in st.replicas})
    if len(splits) > 1:
        return ("stages: every replica needs the same cp and hp (the hop between stages passes each sequence "
                f"shard to the same shard; re-splitting it between stages is not built), got (cp, hp) {splits}")
    return None


def problems(plan: Any, model: Any, cluster: Any) -> list[str]:
    """Every broken rule of ``plan.stages`` against the model and the cluster, one line each."""
    stages, p = plan.stages, []
    if not stages:
        return ["stages: a per-stage plan needs at least one stage"]
    if (split := split_problem(stages)) is not None:
        p.append(split)
    if plan.sequence_parallel:
        p.append("sequence_parallel: not run with per-stage degrees (the hop between stages of different tp "
                 "would re-split the sequence)")
    zp = zero_problem(plan.zero_stage)
    if zp:
        p.append(zp)
    if getattr(plan, "doc_mask", False):
        p.append("doc_mask: document masks are not priced or run with per-stage degrees yet")
    if getattr(model, "moe", None) is not None:
        p.append(f"stages: model {model.name!r} has experts; per-stage plans of a MoE model are not priced yet "
                 "(use one mesh with ep/etp)")
    sp = schedule_problem(plan.schedule)
    if sp:
        p.append(sp)
    dps = {st.dp for st in stages}
    if len(dps) > 1:
        p.append(f"stages: every stage needs the same number of replicas (micro-batches of replica r flow "
                 f"through replica r of every stage), got {[st.dp for st in stages]}")
    v = plan.virtual_stages
    total = sum(st.layers for st in stages)
    if total != model.layers:
        p.append(f"stages: layers {[st.layers for st in stages]} add up to {total}, expected {model.layers}")
    n = cluster.num_devices
    seen: dict[int, str] = {}
    tps_seen: set[tuple[int, int]] = set()
    for s, st in enumerate(stages):
        where = f"stages[{s}]"
        if st.layers < v:
            p.append(f"{where}.layers: {st.layers} < virtual_stages({v}): a chunk would have no layers")
        if not st.replicas:
            p.append(f"{where}.replicas: a stage needs at least one replica")
            continue
        nest = nesting_problem(st.tps)
        if nest:
            p.append(f"{where}: {nest}")
        for r, rep in enumerate(st.replicas):
            w = f"{where}.replicas[{r}]"
            if len(rep.devices) != rep.tp * rep.cp * rep.hp:
                split = f"cp({rep.cp}) x hp({rep.hp}) x " if rep.cp * rep.hp > 1 else ""
                p.append(f"{w}: {len(rep.devices)} devices for {split}tp({rep.tp})")
            if (rep.tp, rep.hp) not in tps_seen:
                tps_seen.add((rep.tp, rep.hp))
                p += [f"{w}.tp: {t}" for t in tp_problems(rep.tp, model, rep.hp)]
            bad = [dev for dev in rep.devices if not 0 <= dev < n]
            p += [f"{w}.devices: device {dev} is not in the cluster (0..{n - 1})" for dev in bad]
            p += _shared(w, [d for d in rep.devices if 0 <= d < n], seen)
            for group in rep.tp_groups:
                nodes = {cluster.devices[dev].node for dev in group if 0 <= dev < n}
                if len(nodes) > 1:
                    p.append(f"{w}: tp group on devices {list(group)} crosses nodes {sorted(nodes)}; "
                             "tp must stay inside a node")
    return p


def _shared(where: str, devices: list[int], seen: dict[int, str]) -> list[str]:
    """The devices of replica ``where`` already given to another replica (or listed twice in it), one
    line per replica they are shared with; ``seen`` records the replica each device was given to."""
    twice: dict[str, list[int]] = {}
    for dev in devices:
        if dev in seen:
            twice.setdefault(seen[dev], []).append(dev)
        seen[dev] = where
    return [_used_twice(where, other, devs) for other, devs in twice.items()]


def devices_used_twice(stages: tuple[Stage, ...]) -> list[str]:
    """The devices two replicas of a per-stage plan share (or one lists twice): a plan no cluster
    runs, refused by the plan checks and by a local trial before it numbers the devices anew
    (``on_local_devices``, which would otherwise run it as if they were distinct)."""
    seen: dict[int, str] = {}
    return [line for s, st in enumerate(stages) for r, rep in enumerate(st.replicas)
            for line in _shared(f"stages[{s}].replicas[{r}]", list(rep.devices), seen)]


def _used_twice(where: str, other: str, devices: list[int]) -> str:
    """One line for the devices a replica shares with an earlier one (or lists twice itself)."""
    named = f"device {devices[0]} is" if len(devices) == 1 else f"devices {', '.join(map(str, devices))} are"
    also = "listed twice in it" if other == where else f"also in {other}"
    return f"{where}.devices: {named} used twice ({also})"


def envelope(stages: tuple[Stage, ...]) -> Any:
    """The plan's ``degrees`` for these stages: pp stages, dp replicas per stage (the first stage's),
    cp and hp the first replica's (every replica's: ``split_problem``), tp the largest of any replica.
    Their product is no device count: ``Plan.world`` counts devices."""
    from autotune.plan_parts import Degrees

    first = stages[0].replicas[0] if stages and stages[0].replicas else Replica(tp=1, devices=(0,))
    return Degrees(pp=len(stages), dp=stages[0].dp if stages else 1, cp=first.cp, hp=first.hp,
                   tp=max(tp_degrees(stages), default=1))


def chunk_layers(stages: tuple[Stage, ...], v: int) -> tuple[int, ...]:
    """``shares.layers`` (pp * v entries in model order) of these stages: each stage's layers split
    as evenly as possible over its v chunks; chunk c of stage s is model chunk ``c * pp + s`` (the
    looped placement of 1F1B and interleaved 1F1B)."""
    from autotune.plan_parts import even_split

    p = len(stages)
    out = [0] * (p * v)
    for s, st in enumerate(stages):
        for c, n in enumerate(even_split(st.layers, v)):
            out[c * p + s] = n
    return tuple(out)


def resolve(plan: Any, model: Any, cluster: Any, seq_len: int, global_batch: int) -> Any:
    """``Plan.resolve`` of a per-stage plan: degrees (the ``envelope``), layers per chunk, even
    samples by default, the placement the stages name; raises PlanError naming every problem."""
    from autotune.plan_parts import Placement, PlanError, Shares, Workload, even_split, lacks_dtype
    from autotune.schedules import schedule_of

    p = problems(plan, model, cluster)
    if p:  # each line names its own field (stages[1].layers, degrees, ...)
        raise PlanError("; ".join(p))
    stages = plan.stages
    env = envelope(stages)
    if plan.degrees != env and plan.degrees.world != 1:
        raise PlanError(f"degrees {plan.degrees.inline()} disagree with the stages' ({env.inline()}: pp stages, "
                        "dp replicas, the replicas' cp and hp, tp the largest)", field="degrees")
    sh, mbs, v = plan.shares, plan.micro_batch_size, plan.virtual_stages
    layers = chunk_layers(stages, v)
    if sh.layers is not None and tuple(sh.layers) != layers:
        raise PlanError(f"shares.layers {list(sh.layers)} disagree with the stages' {list(layers)}", field="shares.layers")
    samples = sh.samples
    if samples is None:
        samples = tuple(x * mbs for x in even_split(global_batch // mbs, env.dp)) if global_batch % mbs == 0 \
            else tuple(even_split(global_batch, env.dp))
    # the sequence's CP shards: even in units of the uniform plan's granule (zigzag halves, hp slices;
    # no sequence parallelism here), as Plan._with_defaults splits them
    g = plan.replace(degrees=env).token_granule()
    tokens = sh.tokens or tuple(x * g for x in even_split(seq_len // g, env.cp))
    probs = []
    if seq_len % g or len(tokens) != env.cp or sum(tokens) != seq_len or any(t < 1 or t % g for t in tokens):
        probs.append(f"shares.tokens: {list(tokens)} must be {env.cp} multiples of {g} (the CP shards: zigzag "
                     f"halves, hp slices) adding up to seq_len({seq_len})")
    if env.dp > global_batch:
        probs.append(f"degrees.dp: dp({env.dp}) > global_batch({global_batch})")
    if len(samples) != env.dp or sum(samples) != global_batch or any(s < mbs or s % mbs for s in samples):
        probs.append(f"shares.samples: {list(samples)} must be {env.dp} multiples of micro_batch_size({mbs}) "
                     f"adding up to {global_batch}")
    if all(lacks_dtype(dev.peak_flops, plan.dtype) for dev in cluster.device_types()):
        probs.append(f"dtype: no device in the cluster supports {plan.dtype}")
    if probs:
        raise PlanError("; ".join(probs), field="plan")
    counts = [s // mbs for s in samples]
    nmb = max(counts)
    if plan.num_microbatches is not None and plan.num_microbatches != nmb:
        raise PlanError(f"num_microbatches: {plan.num_microbatches} but the largest replica runs {nmb}",
                        field="num_microbatches")
    devs = cluster.devices
    placement = tuple(Placement(rank=x.rank, node=devs[x.device].node, device=devs[x.device].local)
                      for x in layout_of(stages).slots)
    out = plan.replace(
        degrees=env, num_microbatches=nmb, placement=placement,
        # no heads share: each cell's tp ranks attend heads / its own tp (cost/stages.py, runtime/stages.py),
        # so the largest tp's figure would be wrong for every other cell
        shares=Shares(layers=layers, tokens=tuple(tokens), heads=None, samples=tuple(samples)),
        workload=Workload(model=model.name, seq_len=seq_len, global_batch=global_batch,
                          cluster=getattr(cluster, "name", "")))
    sched = schedule_of(out)
    probs = sched.check_shape(env.pp, v) + sched.check_microbatches(env.pp, v, counts)
    if probs:
        raise PlanError("; ".join(probs), field="plan")
    return out


def as_stages(plan: Any, cluster: Any) -> tuple[Stage, ...]:
    """A resolved uniform plan written as stages: stage s holds its chunks' layers, replica r the
    devices its placement gives ranks (s, r, *, *, *) (its cp x hp tp groups, in mesh order: the
    uniform rank order is the per-stage one)."""
    d = plan.degrees
    out = []
    n = d.cp * d.hp * d.tp
    for s in range(d.pp):
        reps = []
        for r in range(d.dp):
            r0 = plan.rank_of(pp=s, dp=r)
            reps.append(Replica(tp=d.tp, cp=d.cp, hp=d.hp,
                                devices=tuple(plan.device_index(r0 + i, cluster) for i in range(n))))
        out.append(Stage(layers=sum(plan.layers_of_stage(s)), replicas=tuple(reps)))
    return tuple(out)


def on_local_devices(plan: Any, nproc: int | None, model: Any) -> Any:
    """``plan`` as a local trial runs it, rank r as process r on ``local:N``: its placement (devices
    of the cluster it was made for) dropped; a per-stage plan's stages renumbered onto devices 0..n-1,
    and, when ``nproc`` differs from its device count, its shape scaled to ``nproc`` (``scaled``;
    shares, micro-batch count and degrees found again by ``resolve``)."""
    from autotune.plan_parts import PlanError, Shares

    local = plan.replace(placement=None)
    if plan.stages is None:
        return local
    if twice := devices_used_twice(plan.stages):  # renumbered would run them as distinct devices
        raise PlanError("; ".join(twice))  # each line names its field, as the plan checks say it
    if nproc is not None and nproc != plan.world:
        return local.replace(stages=scaled(plan.stages, nproc, model), shares=Shares(), num_microbatches=None,
                             degrees=type(plan.degrees)())
    return local.replace(stages=renumbered(plan.stages))


def renumbered(stages: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """The same stages on devices 0..n-1 in rank order: a local trial runs rank r as process r
    (``local:N`` is one node, so every tp group stays inside it)."""
    out, n = [], 0
    for st in stages:
        reps = []
        for rep in st.replicas:
            k = len(rep.devices)
            reps.append(Replica(tp=rep.tp, cp=rep.cp, hp=rep.hp, devices=tuple(range(n, n + k))))
            n += k
        out.append(Stage(layers=st.layers, replicas=tuple(reps)))
    return tuple(out)


def scaled(stages: tuple[Stage, ...], n: int, model: Any) -> tuple[Stage, ...]:
    """The same shape on ``n`` local devices (``trial --nproc N`` of a plan made for a larger
    cluster): adjacent stages merged (their layers added), fewer replicas, each replica's tp shrunk
    to a power of two the model allows; of the ways to do so, the one that keeps what distinguishes
    the plan (a stage wider in tp than another, replicas of different tp in one stage, the sequence
    split with its cp and hp), then the most stages, then every device used."""
    wide = not is_uniform(stages)
    mixed = any(len(set(st.tps)) > 1 for st in stages)
    split = (stages[0].replicas[0].cp, stages[0].replicas[0].hp)
    best: tuple[tuple, tuple[Stage, ...]] | None = None
    for p in range(1, min(len(stages), n) + 1):
        groups = [list(range(len(stages)))[i * len(stages) // p:(i + 1) * len(stages) // p] for i in range(p)]
        for dp, (c, h) in ((d, x) for d in range(1, min(stages[0].dp, n // p) + 1) for x in {split, (1, 1)}):
            out = _shrink(stages, groups, dp, n, model, c, h)
            if out is None:
                continue
            score = (not is_uniform(out) or not wide,
                     any(len(set(st.tps)) > 1 for st in out) or not mixed, (c, h) == split, p,
                     sum(len(st.devices) for st in out))
            if best is None or score > best[0]:
                best = (score, out)
    assert best is not None, "one device holds any plan"
    return renumbered(best[1])


def _shrink(stages: tuple[Stage, ...], groups: list[list[int]], dp: int, n: int, model: Any, cp: int = 1,
            hp: int = 1) -> tuple[Stage, ...] | None:
    """``groups`` of stages merged, ``dp`` replicas each at ``cp`` x ``hp``, on ``n`` devices; None
    when they do not fit."""
    p = len(groups)
    w = cp * hp  # devices per unit of tp
    budget = [(n // p + (1 if i < n % p else 0)) // w for i in range(p)]
    out = []
    for g, b in zip(groups, budget, strict=True):
        first = stages[g[0]]
        by_tp: dict[int, list[int]] = {}
        for rep in first.replicas:
            by_tp.setdefault(rep.tp, []).append(rep.tp)
        order = [t for k in range(max(len(v) for v in by_tp.values())) for t in sorted(by_tp, reverse=True)
                 if k < len(by_tp[t])]  # one replica of each tp first
        reps: list[Replica] = []
        for r in range(dp):
            cap = b - (dp - 1 - r) - sum(x.tp for x in reps)
            if cap < 1:
                return None
            t = 1
            while t * 2 <= min(order[r % len(order)], cap) and not tp_problems(t * 2, model, hp):
                t *= 2
            reps.append(Replica(tp=t, cp=cp, hp=hp, devices=tuple(range(t * w))))
        st = Stage(layers=sum(stages[i].layers for i in g), replicas=tuple(reps))
        if nesting_problem(st.tps):
            return None
        out.append(st)
    return tuple(out)


def tp_degrees(stages: tuple[Stage, ...]) -> tuple[int, ...]:
    """Every tp the stages' replicas use, smallest first (``Plan.tp_degrees`` asks it)."""
    return tuple(sorted({r.tp for st in stages for r in st.replicas}))


def is_uniform(stages: tuple[Stage, ...]) -> bool:
    """Every replica of every stage at one tp (what Megatron and torchtitan express, placement aside;
    ``Plan.is_uniform`` asks it)."""
    return len(tp_degrees(stages)) <= 1


def inline(stages: tuple[Stage, ...]) -> str:
    """One line per plan for tables: ``6L(tp4x2) | 7L(tp1x2) ...`` (replicas of one tp grouped;
    ``cp2.tp1x4``: four replicas of two tp1 groups each splitting the sequence; parentheses, not
    brackets, which rich would read as markup)."""
    parts = []
    for st in stages:
        groups: dict[str, int] = {}
        for r in st.replicas:  # a replica that splits the sequence: cp2.tp1 (its cp and hp, then tp)
            name = "".join(f"{k}{getattr(r, k)}." for k in ("cp", "hp") if getattr(r, k) > 1) + f"tp{r.tp}"
            groups[name] = groups.get(name, 0) + 1
        parts.append(f"{st.layers}L(" + "+".join(f"{g}x{n}" for g, n in groups.items()) + ")")
    return " | ".join(parts)


def degrees_text(plan: dict[str, Any] | None) -> str:
    """How tables show a plan dict's layout: ``dp=2,pp=2,tp=4`` (``,disaggregate`` with expert-only
    ranks, docs/moe.md), or a per-stage plan's stages with their own degrees (``stages 6L(tp4x2) |
    7L(tp1x2)``; one place for the CLI and the dashboard).
    A per-stage plan whose stages share one tp is the mesh of its degrees (``Plan.layout``'s rule):
    ``stages 4L(tp1x2)`` is shown as the ``dp=2`` it is, so a table never lists one layout twice
    under two names."""
    plan = plan or {}
    if plan.get("stages"):
        try:
            stages = stages_from(plan["stages"]) or ()
        except InputError:
            return "stages ?"
        if not is_uniform(stages) or not plan.get("degrees"):
            return "stages " + inline(stages)
    text = ",".join(f"{k}={v}" for k, v in (plan.get("degrees") or {}).items() if v > 1) or "dp=1"
    return text + (",disaggregate" if plan.get("disaggregate") else "")  # expert-only ranks (docs/moe.md)


def shares_text(plan: dict[str, Any] | None, sep: str = "  ") -> str:
    """How tables show a plan dict's shares (one place for the CLI and the dashboard): layers per
    pipeline rank always, a rank's model chunks joined by ``+`` with virtual stages (``12+12/4+4``:
    rank 0 holds chunks of 12 and 12 layers, in the schedule's placement of chunks on ranks), and the
    tokens, heads and samples where they are split unevenly (``layers 14/18  tokens 70000/61072``).
    Equal neighbours run together (``12x4/4x4``); past 8 runs a list reads as its range and length."""
    plan = plan or {}
    shares = plan.get("shares") or {}
    parts = []
    layers = shares.get("layers")
    pp, vs = int((plan.get("degrees") or {}).get("pp", 1)), int(plan.get("virtual_stages") or 1)
    if layers and len(layers) > 1:
        if vs > 1 and len(layers) == pp * vs:
            from autotune.schedules import as_schedule

            sched = as_schedule(plan.get("schedule") or "interleaved_1f1b")
            ranks = ["+".join(str(layers[j]) for j in sched.stages_of_rank(r, pp, vs)) for r in range(pp)]
            parts.append("layers " + ("/".join(ranks) if pp <= 8 else f"{min(layers)}..{max(layers)} x{len(layers)}"))
        else:
            parts.append("layers " + _runs(list(layers)))
    for k in ("tokens", "heads", "samples"):
        v = shares.get(k)
        if v and len(v) > 1 and max(v) != min(v):
            parts.append(f"{k} " + _runs(list(v)))
    return sep.join(parts) or "even"


def _runs(values: list[int]) -> str:
    """``[12, 12, 12, 12, 4, 4, 4, 4]`` -> ``12x4/4x4``; ``[3, 5]`` -> ``3/5``; more than 8 runs
    -> ``3..9 x64`` (the range and the count)."""
    out: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        n = j - i + 1
        out.append(f"{values[i]}x{n}" if n > 2 else "/".join([str(values[i])] * n))
        i = j + 1
    return "/".join(out) if len(out) <= 8 else f"{min(values)}..{max(values)} x{len(values)}"


# ---- JSON ---------------------------------------------------------------------------------------
def stages_from(v: Any) -> tuple[Stage, ...] | None:
    """Parse ``stages`` of a plan JSON (None or a list of {layers, replicas: [{tp, devices}]})."""
    if v is None:
        return None
    if not isinstance(v, list) or not v:
        raise InputError(f"expected a non-empty list of stages, got {v!r}", field="stages")
    out = []
    for s, st in enumerate(v):
        where = f"stages[{s}]"
        if not isinstance(st, dict):
            raise InputError(f"expected a mapping of layers and replicas, got {st!r}", field=where)
        F.reject_unknown(st, {"layers", "replicas"}, where)
        reps = st.get("replicas")
        if not isinstance(reps, list) or not reps:
            raise InputError(f"expected a non-empty list of {{tp, devices}}, got {reps!r}", field=f"{where}.replicas")
        rs = []
        for r, rep in enumerate(reps):
            w = f"{where}.replicas[{r}]"
            if not isinstance(rep, dict):
                raise InputError(f"expected a mapping of tp and devices, got {rep!r}", field=w)
            F.reject_unknown(rep, {"tp", "cp", "hp", "devices"}, w)
            devs = rep.get("devices")
            if not isinstance(devs, list) or not devs or not all(
                    isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in devs):
                raise InputError(f"expected a list of device indices, got {devs!r}", field=f"{w}.devices")
            cp, hp = (F.get_int(rep, k, f"{w}.{k}", default=1) for k in ("cp", "hp"))
            if cp < 1 or hp < 1:
                raise InputError(f"cp({cp}) and hp({hp}) must be >= 1", field=w)
            tp = F.get_int(rep, "tp", f"{w}.tp", default=max(1, len(devs) // (cp * hp)))
            rs.append(Replica(tp=tp, cp=cp, hp=hp, devices=tuple(devs)))
        out.append(Stage(layers=F.get_int(st, "layers", f"{where}.layers"), replicas=tuple(rs)))
    return tuple(out)
