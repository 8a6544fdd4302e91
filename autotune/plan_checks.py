"""The rules a resolved Plan must keep against its model and cluster (``Plan.resolve`` runs them and
raises one PlanError naming every problem): degrees the model divides by, shares that add up,
what the schedule says about itself (``autotune/schedules``: shape, micro-batch counts, its own
rules), what the runtime's ZeRO-2/3 does not compose with, a placement that is a permutation of the
cluster's devices with tp inside a node. Memoised where the search calls them per plan.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any

from autotune import dims
from autotune.plan_parts import (
    HELIX_FOLDS,
    Degrees,
    Placement,
    Shares,
    compute_dtype,
    lacks_dtype,
    mesh_groups,
)
from autotune.schedules import schedule_of

if TYPE_CHECKING:  # annotations only: the Plan builds on these checks
    from autotune.plan import Plan


def _check_basic(plan: Plan, model: Any, cluster: Any, seq_len: int, global_batch: int) -> list[str]:
    """What can be checked before defaults are filled in."""
    from autotune.divisibility import degree_problems

    d = plan.degrees
    p = [f"{f}: {t}" for f, t in degree_problems(d, model, cluster.num_devices, plan.virtual_stages)]
    if d.dp > global_batch:
        p.append(f"degrees.dp: dp({d.dp}) > global_batch({global_batch})")
    if seq_len < 1:
        p.append(f"seq_len: must be positive, got {seq_len}")
    if d.cp * d.hp > seq_len:
        p.append(f"degrees.cp: cp({d.cp})*hp({d.hp}) > seq_len({seq_len})")
    p += schedule_of(plan).check_shape(d.pp, plan.virtual_stages)
    if plan.helix_folds not in HELIX_FOLDS:
        p.append(f"helix_folds: must be one of {', '.join(map(str, HELIX_FOLDS))}, got {plan.helix_folds}")
    elif plan.helix_folds not in schedule_of(plan).fold_choices:
        p.append(f"helix_folds: only helixpipe folds micro-batches, {plan.schedule} needs helix_folds(1)")
    if plan.helix_attention is not None and not schedule_of(plan).places_attention:
        p.append(f"helix_attention: only helixpipe places attention apart from its layer, {plan.schedule} "
                 "needs helix_attention null")
    if all(lacks_dtype(dev.peak_flops, plan.dtype) for dev in cluster.device_types()):
        p.append(f"dtype: no device in the cluster supports {plan.dtype}")
    return p


def _sharding_problems(plan: Plan, counts: list[int]) -> list[str]:
    """What the runtime's ZeRO-2/3 (FSDP2, autotune/runtime/sharding.py) does not compose with, as
    measured against one process: a schedule that splits the backward into input and weight halves
    runs the weight half outside FSDP2's backward hooks (ZeRO-3 then computed wrong gradients), and
    its schedule runtime gathers per micro-batch, so replicas must run equal micro-batch counts."""
    d = plan.degrees
    if plan.zero_stage < 2 or dims.shard_size(d) == 1 or not schedule_of(plan).splits_backward:
        return []
    if plan.zero_stage == 3:
        return [f"zero_stage: ZeRO-3 with {plan.schedule} (backward split into input and weight gradients) is "
                "not run: the weight half runs outside FSDP2's backward hooks; use ZeRO-2 or an unsplit schedule"]
    if len(set(counts)) > 1:
        return [f"zero_stage: ZeRO-2 with {plan.schedule} needs the same micro-batch count on every replica "
                f"(its schedule runtime gathers per micro-batch), got {counts}"]
    return []


def _check_shares(name: str, values: tuple[int, ...] | None, n: int, total: int, what: str,
                  multiple: int = 1, minimum: int = 1) -> list[str]:
    if values is None:
        return [f"shares.{name}: missing"]
    p = []
    if len(values) != n:
        p.append(f"shares.{name}: {len(values)} entries, expected {n} ({what})")
    if any(v < minimum for v in values):
        p.append(f"shares.{name}: every entry must be >= {minimum}, got {list(values)}")
    if sum(values) != total:
        p.append(f"shares.{name}: {list(values)} adds up to {sum(values)}, expected {total}")
    if multiple > 1 and any(v % multiple for v in values):
        p.append(f"shares.{name}: every entry must be a multiple of {multiple}, got {list(values)}")
    return p


def _share_rules(plan: Plan, model: Any, seq_len: int, global_batch: int) -> dict[str, tuple[int, int, str, int, int]]:
    """Per share field: (entries, total, what an entry is, multiple, minimum); a declared dimension's
    share (``autotune/dims.py``) without a rule here is a KeyError in ``_check_resolved``."""
    d, mbs = plan.degrees, plan.micro_batch_size
    return {
        "layers": (d.pp * plan.virtual_stages, model.layers,
                   "pp*virtual_stages stages; a stage with no layers is not allowed", 1, 1),
        "tokens": (d.cp, seq_len, "cp shards", plan.token_granule(), 1),
        "heads": (d.hp, model.heads // d.tp, "hp ranks, of the heads of one tp rank", 1, 1),
        # a disaggregated plan's expert-only replicas take no samples (``_disaggregation_problems``)
        "samples": (d.dp, global_batch, "dp replicas", mbs, 0 if plan.disaggregate else mbs),
    }


_SHARES_CHECKED = tuple(sorted((share for n, share in dims.SHARES if not dims.dimension(n).folds),
                               key=[f.name for f in fields(Shares)].index))
"""The share of every declared dimension that multiplies the world, in the order ``Shares`` lists
them (the order problems are named in); a folding dimension's share (experts) depends on the
model's experts and is checked with them (``_expert_problems``)."""


def _check_resolved(plan: Plan, model: Any, cluster: Any, seq_len: int, global_batch: int) -> list[str]:
    d, sh, p = plan.degrees, plan.shares, []
    rules = _share_rules(plan, model, seq_len, global_batch)
    for share in _SHARES_CHECKED:
        n, total, what, multiple, minimum = rules[share]
        p += _check_shares(share, getattr(sh, share), n, total, what, multiple=multiple, minimum=minimum)
    mbs = plan.micro_batch_size
    if sh.samples is not None and not any("shares.samples" in x for x in p):
        counts = [s // mbs for s in sh.samples]
        if plan.num_microbatches != max(counts):
            p.append(f"num_microbatches: {plan.num_microbatches} but the largest replica runs "
                     f"samples({max(sh.samples)})/micro_batch_size({mbs}) = {max(counts)}")
        p += schedule_of(plan).check_microbatches(d.pp, plan.virtual_stages, counts)
        p += _sharding_problems(plan, counts)
    p += _expert_problems(plan, model)
    p += _disaggregation_problems(plan, model)
    p += _option_problems(plan, model)
    p += schedule_of(plan).check_plan(plan, model)  # rules of its own (helixpipe: L % p, even layers, ...)
    p += _placement_problems(plan.placement or (), d, cluster)
    return p


def _expert_problems(plan: Plan, model: Any) -> list[str]:
    """Expert parallelism's rules (Megatron-Core's, with parallel folding): ep*etp ranks fold onto each
    stage's dp*cp*hp*tp ranks, so they divide them; every EP rank holds at least one expert and the
    shares add up to the model's experts (even shares: experts divisible by ep); etp divides each
    expert's FFN width; a dense model takes no expert degree."""
    d, moe = plan.degrees, getattr(model, "moe", None)
    if moe is None:
        bad = [f"degrees.{k}: {k}({getattr(d, k)}) > 1 but model {model.name!r} has no experts"
               for k in ("ep", "etp") if getattr(d, k) > 1]
        if plan.shares.experts is not None:
            bad.append(f"shares.experts: model {model.name!r} has no experts")
        return bad
    p = []
    if not schedule_of(plan).chain:
        p.append(f"schedule: {plan.schedule} is priced by its own cost module, which has no experts")
    if d.stage_ranks % (d.ep * d.etp):
        p.append(f"degrees.ep: ep({d.ep})*etp({d.etp}) does not divide a stage's ranks "
                 f"dp({d.dp})*cp({d.cp})*hp({d.hp})*tp({d.tp}) = {d.stage_ranks}")
    if moe.expert_ffn_hidden % d.etp:
        p.append(f"degrees.etp: moe.expert_ffn_hidden({moe.expert_ffn_hidden}) is not divisible by etp({d.etp})")
    if plan.shares.experts is None:  # even shares are filled only where ep divides the experts
        p.append(f"shares.experts: moe.experts({moe.experts}) is not divisible by ep({d.ep}); give uneven shares "
                 "(experts=a/b/...) or another ep")
    else:
        p += _check_shares("experts", plan.shares.experts, d.ep, moe.experts,
                           "ep ranks; an EP rank with no expert is not allowed")
    return p


def _disaggregation_problems(plan: Plan, model: Any) -> list[str]:
    """HeterMoE's disaggregation (``Plan.disaggregate``) as ``cost/disaggregation.py`` prices it: a MoE
    model over data and expert parallelism alone (no pp, cp, hp, tp or etp), EP groups folded onto the
    replicas (ep divides dp; ep == dp: one group spanning every replica), each group with the same
    replicas taking samples (attention) and the same without (experts only), at least one of each."""
    if not plan.disaggregate:
        return []
    d = plan.degrees
    if getattr(model, "moe", None) is None:
        return [f"disaggregate: model {model.name!r} has no experts to give the expert-only ranks"]
    p = [f"degrees.{k}: disaggregate is priced over dp and ep alone, got {k}({getattr(d, k)})"
         for k in ("pp", "cp", "hp", "tp", "etp") if getattr(d, k) > 1]
    samples = plan.shares.samples or ()
    if d.dp % d.ep:
        p.append(f"degrees.ep: disaggregate folds its EP groups onto the replicas (ep divides dp({d.dp})), got ep({d.ep})")
    elif samples and len({tuple(x > 0 for x in samples[g:g + d.ep]) for g in range(0, len(samples), d.ep)}) > 1:
        p.append(f"shares.samples: every EP group of {d.ep} replicas needs the same attention and expert-only "
                 f"replicas, got {'/'.join(map(str, samples))}")
    if samples and (0 not in samples or not any(samples)):
        p.append(f"shares.samples: disaggregate needs replicas with samples (attention) and replicas with 0 "
                 f"(experts only), got {'/'.join(map(str, samples))}")
    return p


def _dispatcher_problems(plan: Plan, model: Any) -> list[str]:
    """The flex dispatcher (``Plan.moe_dispatcher``) needs a MoE model, and dropless routing:
    Megatron-Core's ``TransformerConfig.__post_init__`` refuses the DeepEP backend with
    ``moe_pad_expert_input_to_capacity``, which a capacity-factor router exports."""
    if plan.moe_dispatcher == "alltoall":
        return []
    moe = getattr(model, "moe", None)
    if moe is None:
        return [f"moe_dispatcher: {plan.moe_dispatcher} needs a MoE model, got model {model.name!r}"]
    if not moe.router.dropless:
        return [f"moe_dispatcher: {plan.moe_dispatcher} needs dropless routing: Megatron-Core's DeepEP backend does "
                "not pad expert inputs to a capacity (TransformerConfig's own check)"]
    return []


def _option_problems(plan: Plan, model: Any) -> list[str]:
    """CUDA graph scopes (``Plan.cuda_graph_scope``) as Megatron Core takes them, priced on MoE models;
    the MoE all-to-all overlap (``Plan.moe_a2a_overlap``) needs expert parallelism to overlap (and,
    as Megatron-Core checks in ``TransformerConfig.__post_init__``, no full recomputation nor the
    ``moe`` module: the overlapped layer is not re-run); bf16 gradient reduction (``Plan.grad_reduce``)
    needs bf16 weights (bf16 or an FP8 recipe: what Megatron's ``--grad-reduce-in-bf16`` applies to);
    bf16 Adam moments (``Plan.moments``) are Megatron's precision-aware optimizer, which
    megatron/core/optimizer/optimizer_config.py allows only with the distributed optimizer (zero >= 1)
    and which keeps its master as the remainder of a bf16 weight (bf16 weights again)."""
    p = []
    if plan.moe_a2a_overlap:
        if getattr(model, "moe", None) is None or plan.degrees.ep <= 1:
            p.append(f"moe_a2a_overlap: needs a MoE model with ep > 1, got model {model.name!r}, ep({plan.degrees.ep})")
        if plan.recompute == "full" or "moe" in plan.recompute_modules:
            p.append("moe_a2a_overlap: the overlapped MoE layer is not recomputed (recompute full or the moe "
                     "module), as Megatron-Core requires")
    p += _dispatcher_problems(plan, model)
    g = plan.cuda_graph_scope
    if g and getattr(model, "moe", None) is None:
        p.append(f"cuda_graph_scope: priced for a MoE model's layers only, got model {model.name!r}")
    if "moe_preprocess" in g and "moe_router" not in g:
        p.append("cuda_graph_scope: moe_preprocess is captured only with moe_router (Megatron Core's own rule)")
    if plan.grad_reduce == "bf16" and compute_dtype(plan.dtype) != "bf16":
        p.append(f"grad_reduce: bf16 reduction needs bf16 weights (dtype bf16 or FP8), got dtype {plan.dtype}")
    if plan.moments == "bf16" and (compute_dtype(plan.dtype) != "bf16" or plan.zero_stage < 1):
        p.append(f"moments: bf16 moments are Megatron's precision-aware optimizer, which needs bf16 weights (dtype "
                 f"bf16 or FP8) and the distributed optimizer (zero >= 1), got dtype {plan.dtype}, zero "
                 f"{plan.zero_stage}")
    return p


_NODE_ORDER: dict[tuple[int, int], tuple[Any, tuple[Placement, ...]]] = {}
_PLACEMENT_CHECKS: dict[tuple[int, int, Degrees], tuple[Any, tuple[Placement, ...], list[str]]] = {}


def _node_order_placement(cluster: Any, n: int) -> tuple[Placement, ...]:
    """Rank r on the r-th device of the cluster, for ranks 0..n-1. Memoised per (cluster object, n):
    specs and Placement are frozen, so the shared tuple never changes; the entry holds the cluster,
    so its id is not reused while cached. Every estimate of the search resolves a plan with it."""
    hit = _NODE_ORDER.get((id(cluster), n))
    if hit is None or hit[0] is not cluster:
        if len(_NODE_ORDER) > 64:
            _NODE_ORDER.clear()
        hit = _NODE_ORDER[(id(cluster), n)] = (cluster, tuple(
            Placement(rank=r, node=cluster.devices[r].node, device=cluster.devices[r].local) for r in range(n)))
    return hit[1]


def _placement_problems(pl: tuple[Placement, ...], d: Degrees, cluster: Any) -> list[str]:
    """``_check_placement`` memoised per (cluster object, placement object, degrees): a pure function
    of the three (all frozen); the entry holds the cluster and placement, so their ids are not reused
    while cached. The node-order placement is one shared object per cluster, so the search checks it
    once per degrees. A copy of the list goes out (callers append to theirs)."""
    key = (id(cluster), id(pl), d)
    hit = _PLACEMENT_CHECKS.get(key)
    if hit is None or hit[0] is not cluster or hit[1] is not pl:
        if len(_PLACEMENT_CHECKS) > 4096:  # 128 devices: ~260 layouts x 5 placements
            _PLACEMENT_CHECKS.clear()
        hit = _PLACEMENT_CHECKS[key] = (cluster, pl, _check_placement(pl, d, cluster))
    return list(hit[2])


def _check_placement(pl: tuple[Placement, ...], d: Degrees, cluster: Any) -> list[str]:
    """Problems with a placement: a permutation of the cluster's devices, tp groups inside one node."""
    p: list[str] = []
    if len(pl) != d.world:
        p.append(f"placement: {len(pl)} entries, expected {d.world}")
        return p
    valid = {(dev.node, dev.local) for dev in cluster.devices}
    # the whole placement at once (list and set operations: a search at 1,024 devices checks
    # thousands of placements of 1,024 entries), the first bad entry named only when there is one
    keys = [(e.node, e.device) for e in pl]
    distinct = set(keys)
    if [e.rank for e in pl] != list(range(len(pl))) or len(distinct) < len(keys) or not distinct <= valid:
        return _entry_problem(pl, valid)
    if d.tp > 1:
        nodes = [e.node for e in pl]
        for g in mesh_groups(d, "tp"):
            in_group = {nodes[r] for r in g}
            if len(in_group) > 1:
                p.append(f"degrees.tp: tp group of ranks {g} crosses nodes {sorted(in_group)}; "
                         "tp must stay inside a node")
                break
    return p


def _entry_problem(pl: tuple[Placement, ...], valid: set[tuple[int, int]]) -> list[str]:
    """The first placement entry with a wrong rank, a device not in the cluster or one used twice."""
    seen: set[tuple[int, int]] = set()
    for i, e in enumerate(pl):
        if e.rank != i:
            return [f"placement[{i}].rank: expected {i}, got {e.rank}"]
        key = (e.node, e.device)
        if key not in valid:
            return [f"placement[{i}]: node {e.node} device {e.device} is not in the cluster"]
        if key in seen:
            return [f"placement[{i}]: node {e.node} device {e.device} is used twice"]
        seen.add(key)
    return []
