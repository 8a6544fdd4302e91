"""What every exporter shares: the export context, the refusal error, the nearest expressible plan,
provenance and the all-or-nothing file write.

A target framework expresses only some plans (Megatron splits the sequence into equal chunks,
torchtitan has no Ulysses, Accelerate no pipeline ...). An exporter never flattens a plan silently:
``reasons(plan, ctx)`` lists every feature the target cannot express, and ``candidates(plan)``
proposes the plans closest to it that the target can (even shares, one dimension folded into
another, the nearest schedule). ``nearest_expressible`` resolves those candidates, keeps the ones
the target accepts, prices them with the cost model and returns the fastest, so the refusal can say
what the user loses by choosing this framework.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from autotune import __version__, dims
from autotune.errors import InputError
from autotune.plan import GRAD_REDUCE_DTYPE, MOE_DISPATCHER, MOMENTS_DTYPE, Degrees, Plan, Shares
from autotune.plan_record import PlanRecord


@dataclass(frozen=True, kw_only=True)
class ExportContext:
    """What a plan is for and where it came from; every exporter reads the same one."""

    model: Any
    """ModelSpec the plan trains."""
    cluster: Any
    """ClusterSpec the plan runs on (prices the nearest plan; places ranks for launch)."""
    seq_len: int
    global_batch: int
    study: str | None = None
    trial: int | None = None
    storage: str | None = None
    source: str = ""
    """Where the plan was read from (``study NAME`` or a plan file path)."""
    calibration: dict[str, Any] | None = None
    """The study's fitted calibration (``validate``), passed to the cost model."""
    cluster_digest: str = ""
    cluster_assumed: bool = False
    """True when no cluster was given and ``local:WORLD`` stands in (provenance says so)."""
    left_out: tuple[str, ...] = ()
    """For a pool search's chosen plan: why each left-out node group pays (autotune/search/pool.py)."""
    study_plans: tuple[Plan, ...] = ()
    """The plans the study found best for each target (its ``best_per_target``): a refused per-stage
    plan's nearest uniform plan is among them when the target runs one (autotune/export/stages.py)."""


@dataclass(frozen=True)
class Export:
    """One exporter's output: the file text and the same content as data (for --json and tests)."""

    format: str
    text: str
    data: Any
    suffix: str


class Exporter(Protocol):
    NAME: str
    SUFFIX: str

    def reasons(self, plan: Plan, ctx: ExportContext) -> list[str]: ...
    def candidates(self, plan: Plan, ctx: ExportContext) -> list[Plan]: ...
    def render(self, record: PlanRecord, ctx: ExportContext) -> Export: ...


class ExportRefused(InputError):
    """The target cannot express the plan. Carries every reason and the nearest plan it can express
    (resolved, with ``predicted`` from the cost model when that is available)."""

    def __init__(self, target: str, reasons: list[str], nearest: PlanRecord | None, note: str = "",
                 original: dict[str, Any] | None = None):
        self.target = target
        self.original = original
        self.reasons = list(reasons)
        self.nearest = nearest
        self.note = note
        msg = f"{target} cannot express this plan: " + "; ".join(self.reasons)
        if nearest is not None:
            msg += f". Nearest plan {target} can express: {describe(nearest.plan)}"
            if nearest.predicted:
                msg += f" ({predicted_text(nearest.predicted)}"
                if original and original.get("tokens_per_s") and nearest.predicted.get("tokens_per_s"):
                    msg += (f"; this plan: {original['tokens_per_s']:.4g} tokens/s, nearest x"
                            f"{nearest.predicted['tokens_per_s'] / original['tokens_per_s']:.3f}")
                msg += f"; {note})" if note else ")"
            else:
                msg += f" ({note or 'no cost'})"
        else:
            msg += f". No nearby plan is expressible in {target}" + (f" ({note})" if note else "")
        super().__init__(msg, field="--format")

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "reasons": self.reasons, "original_predicted": self.original,
                "nearest": self.nearest.to_dict() if self.nearest is not None else None,
                "note": self.note or None}


# ---- describing plans ---------------------------------------------------------------------------
def describe(plan: Plan) -> str:
    """``dp=2,pp=2,tp=2 mbs=1 1f1b layers=[16,16]`` — enough to tell two plans apart on one line."""
    parts = [plan.degrees.inline(), f"mbs={plan.micro_batch_size}", plan.schedule]
    if plan.virtual_stages > 1:
        parts.append(f"vpp={plan.virtual_stages}")
    if plan.recompute != "none":
        parts.append(f"recompute={plan.recompute}")
    if plan.recompute_modules:
        parts.append("recompute_modules=" + "/".join(plan.recompute_modules))
    if plan.zero_stage:
        parts.append(f"zero={plan.zero_stage}")
    if plan.sequence_parallel:
        parts.append("sp")
    if plan.degrees.cp > 1:
        parts.append(f"cp_layout={plan.cp_layout}")
    sh = plan.shares
    for name in ("layers", "tokens", "heads", "samples"):
        v = getattr(sh, name)
        if v is not None and len(v) > 1:
            parts.append(f"{name}={list(v)}")
    return " ".join(parts)


def predicted_text(p: dict[str, Any] | None) -> str:
    if not p:
        return "no prediction"
    out = []
    if p.get("step_time_s") is not None:
        out.append(f"predicted {p['step_time_s']:.4g} s/step")
    if p.get("tokens_per_s") is not None:
        out.append(f"{p['tokens_per_s']:.4g} tokens/s")
    if p.get("feasible") is False:
        out.append("infeasible: " + str(p.get("infeasible_reason") or "?"))
    return ", ".join(out) or "no prediction"


# ---- what a target expresses ---------------------------------------------------------------------
def unexpressed(plan: Plan, target: str, expresses: Iterable[str], why: dict[str, str] | None = None) -> list[str]:
    """One reason per declared dimension (``autotune/dims.py``) of degree > 1 that the target does
    not list in ``expresses`` (``why[name]``: the target's own words; else the declaration's), so a
    new dimension is refused by every target that has not said it runs it; and HeterMoE's
    disaggregation (``Plan.disaggregate``), which no exporter writes."""
    d, known, why = plan.degrees, set(expresses), why or {}
    out = [f"{n}({getattr(d, n)}): " + why.get(n, f"{target} has no {dims.dimension(n).doc}")
           for n in dims.WRITTEN if getattr(d, n) > 1 and n not in known]
    if plan.disaggregate:
        out.append(f"disaggregate: {target} runs attention and routed experts on every rank (no expert-only ranks)")
    out += [f"{name}: {why}" for name, (on, why) in _options(plan, target).items() if on and name not in known]
    return out


def _options(plan: Plan, target: str) -> dict[str, tuple[bool, str]]:
    """The plan options a target writes only where its exporter lists them in ``expresses``: whether
    the plan sets each, and what a target without it does instead."""
    return {
        "moe_a2a_overlap": (plan.moe_a2a_overlap, f"{target} waits for each MoE all-to-all (no overlap with "
                            "another micro-batch's compute)"),
        "moe_dispatcher": (plan.moe_dispatcher != MOE_DISPATCHER, f"{plan.moe_dispatcher}: {target} sends MoE tokens "
                           f"by {MOE_DISPATCHER} as exported (one copy per routed expert)"),
        "grad_reduce": (plan.grad_reduce != GRAD_REDUCE_DTYPE, f"{plan.grad_reduce}: {target} accumulates and "
                        f"reduces gradients in {GRAD_REDUCE_DTYPE} as exported"),
        "moments": (plan.moments != MOMENTS_DTYPE, f"{plan.moments}: {target} keeps Adam's moments in "
                    f"{MOMENTS_DTYPE} as exported"),
        "cuda_graph_scope": (bool(plan.cuda_graph_scope), f"{'/'.join(plan.cuda_graph_scope)}: {target} issues "
                             "every kernel eagerly as exported (no CUDA graphs)"),
    }


# ---- share rules every exporter uses ------------------------------------------------------------
def uneven(values: tuple[int, ...] | None) -> bool:
    return values is not None and len(set(values)) > 1


def even_share_reasons(plan: Plan, target: str, dims: Iterable[str], why: dict[str, str]) -> list[str]:
    """One reason per uneven share in ``dims`` (layers, tokens, heads, samples, experts)."""
    out = []
    for name in dims:
        v = getattr(plan.shares, name)
        if uneven(v):
            out.append(f"shares.{name} {list(v)} is uneven: {why[name]}")
    return out


def with_even(plan: Plan, *names: str) -> Plan:
    """The plan with the named shares dropped (``resolve`` splits them evenly again)."""
    sh = dataclasses.asdict(plan.shares)
    for n in names:
        sh[n] = None
    out = plan.replace(shares=Shares(**sh))
    if "samples" in names:
        out = out.replace(num_microbatches=None)  # re-counted from the new samples
    return out


def fold(plan: Plan, src: str, dst: str) -> Plan:
    """Move degree ``src`` into ``dst`` (dst *= src, src = 1); the shares of both are re-split."""
    deg = plan.degrees.to_dict()
    deg[dst] *= deg[src]
    deg[src] = 1
    drop = [n for n in (dims.dimension(src).share, dims.dimension(dst).share) if n]
    if "tp" in (src, dst):
        drop.append("heads")  # heads are counted per tp rank
    out = with_even(plan, *drop).replace(degrees=Degrees(**deg))
    if src == "pp":
        out = out.replace(schedule="1f1b", virtual_stages=1)
    return out


def even_everything(plan: Plan) -> Plan:
    return with_even(plan, "layers", "tokens", "heads", "samples", "experts")


def even_experts(plan: Plan, ctx: ExportContext, etps: Iterable[int] | None = None) -> list[Plan]:
    """The plans nearest ``plan`` whose experts split evenly over the EP ranks, as every framework
    splits them: its own ep with even shares where ep divides the experts, then the other ep
    (and, for a target that allows only some, the ``etps`` it allows) that divide both the experts
    and a stage's ranks, the closest degrees first. A dense model's plan comes back as it is."""
    moe = ctx.model.moe
    if moe is None:
        return [plan]
    d = plan.degrees
    options = []
    for etp in (d.etp, *(etps or ())):
        for ep in range(1, d.stage_ranks + 1):
            if moe.experts % ep == 0 and d.stage_ranks % (ep * etp) == 0 and moe.expert_ffn_hidden % etp == 0:
                options.append((abs(math.log(ep * etp / (d.ep * d.etp))), etp != d.etp, ep, etp))
    out = []
    for *_, ep, etp in sorted(set(options)):
        out.append(with_even(plan, "experts").replace(degrees=dataclasses.replace(d, ep=ep, etp=etp)))
    return out[:4]


# ---- nearest expressible plan -------------------------------------------------------------------
def predict(plan: Plan, ctx: ExportContext, kernels: Any = None) -> tuple[PlanRecord, str]:
    """``plan`` resolved, with ``predicted`` from the cost model as ``kernels``' runtime runs it (an
    exporter's ``KERNELS``: the figures ``estimate --target`` and ``search --target`` give; None:
    autotune's own runtime), and a note on what it was priced on."""
    from autotune.cost import estimate  # imported lazily (the CLI starts faster)

    if ctx.cluster_assumed:
        note = f"priced on an assumed local:{plan.world} cluster; pass --cluster for real figures"
    else:
        note = ""
    # no catch-all: a cost model that fails is an error with its message, not an export without figures
    est = estimate(plan, ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch, calibration=ctx.calibration,
                   kernels=kernels)
    return PlanRecord(est.plan, predicted=est.predicted), note


def nearest_expressible(exporter: Exporter, plan: Plan, ctx: ExportContext,
                        price: Callable[[Plan, ExportContext], tuple[PlanRecord, str]] | None = None
                        ) -> tuple[PlanRecord | None, str]:
    """The fastest (by predicted tokens/s, else the first) candidate that resolves and that the
    target accepts, priced as the target runs it (its ``KERNELS``); ``None`` when no candidate does."""
    if price is None:
        def price(p: Plan, c: ExportContext) -> tuple[PlanRecord, str]:
            return predict(p, c, kernels=getattr(exporter, "KERNELS", None))
    seen: set[str] = set()
    accepted: list[Plan] = []
    for cand in exporter.candidates(plan, ctx):
        for c in (cand, cand.replace(placement=None)):
            try:
                r = c.resolve(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)
            except InputError:
                continue
            key = r.to_json(indent=None)
            if key in seen:
                break
            seen.add(key)
            if not exporter.reasons(r, ctx):
                accepted.append(r)
            break
    if not accepted:
        return None, "no candidate resolved against the model and cluster"
    priced: list[PlanRecord] = []
    notes = ""
    for r in accepted[:8]:  # the closest few; pricing is cheap but not free
        try:
            p, note = price(r, ctx)
        except InputError as e:
            p, note = PlanRecord(r), f"cost model refused it: {e}"
        notes = notes or note
        priced.append(p)
    with_cost = [p for p in priced if p.tokens_per_s() is not None]
    if with_cost:
        feasible = [p for p in with_cost if (p.predicted or {}).get("feasible", True)] or with_cost
        return max(feasible, key=lambda p: p.tokens_per_s() or 0.0), notes
    return priced[0], notes


def refuse_or_pass(exporter: Exporter, record: PlanRecord, ctx: ExportContext) -> None:
    reasons = exporter.reasons(record.plan, ctx)
    if reasons:
        nearest, note = nearest_expressible(exporter, record.plan, ctx)
        raise ExportRefused(exporter.NAME, reasons, nearest, note, original=record.predicted)


# ---- placement under torchrun -------------------------------------------------------------------
_NODE_BLOCKS: dict[int, tuple[Any, tuple[list[tuple[int, list[int]]], str | None]]] = {}


def node_blocks(plan: Plan) -> tuple[list[tuple[int, list[int]]], str | None]:
    """torchrun gives node ``k`` the ranks ``[k*n, (k+1)*n)``. Returns, in node-rank order,
    ``(physical node, [local device of each local rank])``, or a reason why the plan's placement
    cannot be launched that way. Memoised per placement tuple (a search's plans of one layout share
    one: each target's refusals of a search's best plans read it ~700 times, 0.4 CPU s of a 1,024-device
    search); the caller gets lists of its own."""
    pl = plan.placement
    if pl is None:
        return [], "the plan has no placement (resolve it first)"
    hit = _NODE_BLOCKS.get(id(pl))
    if hit is None or hit[0] is not pl:  # the entry holds the tuple: its id is not reused while cached
        if len(_NODE_BLOCKS) > 1024:
            _NODE_BLOCKS.clear()
        hit = _NODE_BLOCKS[id(pl)] = (pl, _node_blocks(pl))
    blocks, why = hit[1]
    return [(node, list(devs)) for node, devs in blocks], why


def _node_blocks(pl: Any) -> tuple[list[tuple[int, list[int]]], str | None]:
    by_node: dict[int, list[int]] = {}
    order: list[int] = []
    for e in pl:
        if e.node not in by_node:
            by_node[e.node] = []
            order.append(e.node)
        by_node[e.node].append(e.rank)
    sizes = {len(v) for v in by_node.values()}
    if len(sizes) > 1:
        return [], (f"placement uses {sorted(len(by_node[n]) for n in order)} devices on its nodes; "
                    "torchrun runs the same --nproc-per-node on every node")
    n = sizes.pop()
    blocks = []
    for k, node in enumerate(order):
        ranks = by_node[node]
        if ranks != list(range(k * n, (k + 1) * n)):
            return [], (f"placement puts ranks {ranks} on node {node}; torchrun gives each node a contiguous "
                        f"block of {n} ranks")
        blocks.append((node, [pl[r].device for r in ranks]))
    return blocks, None


def node_order(plan: Plan) -> list[dict[str, Any]]:
    """Per torchrun node-rank: the physical node and the devices in local-rank order (the
    placement the exported config relies on; pass these as --node-rank and CUDA_VISIBLE_DEVICES)."""
    blocks, _ = node_blocks(plan)
    return [{"node_rank": k, "node": node, "devices": devs} for k, (node, devs) in enumerate(blocks)]


def placement_comment(plan: Plan, prefix: str = "# ") -> list[str]:
    order = node_order(plan)
    if len(order) == 1 and order[0]["devices"] == list(range(len(order[0]["devices"]))):
        return []
    return [f"{prefix}placement: launch node-rank {o['node_rank']} on cluster node {o['node']} with "
            f"CUDA_VISIBLE_DEVICES={','.join(map(str, o['devices']))}" for o in order]


def placement_reasons(plan: Plan) -> list[str]:
    _, why = node_blocks(plan)
    return [why] if why else []


# ---- provenance ---------------------------------------------------------------------------------
def profile_ids(cluster: Any) -> list[str]:
    """Profile ids of the cluster's measured devices (``device: profile:ID`` in the cluster file)."""
    out: list[str] = []
    for g in getattr(cluster, "groups", ()):
        name = getattr(g.device, "name", "")
        pid = None
        if name.startswith("profile:"):
            pid = name.split(":", 1)[1]
        elif getattr(g.device, "provenance", "") == "measured":
            pid = str((g.device.profile or {}).get("id", name))
        if pid and pid not in out:
            out.append(pid)
    return out


def provenance(record: PlanRecord, ctx: ExportContext) -> dict[str, Any]:
    """Where the exported plan came from; a plan file's own provenance becomes ``previous``."""
    cl = ctx.cluster
    prev = dict(record.provenance or {})
    prov = {
        "tool": "autotune",
        "version": __version__,
        "exported_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": ctx.model.name,
        "seq_len": ctx.seq_len,
        "global_batch": ctx.global_batch,
        "cluster": getattr(cl, "name", ""),
        "cluster_digest": ctx.cluster_digest or getattr(cl, "digest", "") or None,
        "cluster_assumed": ctx.cluster_assumed,
        "profile_ids": profile_ids(cl),
        "study": ctx.study,
        "trial": ctx.trial,
        "source": ctx.source,
        "measured": record.measured is not None,
    }
    if ctx.left_out:
        prov["left_out"] = list(ctx.left_out)
    if prev:
        prov["previous"] = {k: v for k, v in prev.items() if k != "previous"}
    return prov


def comment_lines(prov: dict[str, Any], prefix: str = "# ") -> list[str]:
    keys = ("version", "model", "seq_len", "global_batch", "cluster", "cluster_digest", "profile_ids", "study",
            "trial", "source", "exported_at")
    return [f"{prefix}autotune {prov['version']} export"] + [
        f"{prefix}  {k}: {prov.get(k)}" for k in keys[1:] if prov.get(k) not in (None, "", [])]


# ---- all-or-nothing output ----------------------------------------------------------------------
def write_atomic(path: str | Path, text: str, *, check: Callable[[Path], None] | None = None) -> Path:
    """Write ``text`` to a temp file beside ``path``, run ``check`` on it, then rename it into
    place; on any failure nothing is left at ``path`` (and an old file there is kept)."""
    p = Path(path)
    where = "-o"
    if p.is_dir():
        raise InputError(f"{p} is a directory; give a file name", field=where)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"cannot write {p}: folder {parent} does not exist", field=where)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if check is not None:
            check(Path(tmp))
        os.replace(tmp, p)
        tmp = None
    except OSError as exc:
        raise InputError(f"cannot write {p}: {exc.strerror or exc}", field=where) from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return p


@dataclass
class Collected:
    """Reasons gathered by an exporter's checks (small helper so each check reads as one line)."""

    items: list[str] = field(default_factory=list)

    def add(self, cond: bool, text: str) -> None:
        if cond:
            self.items.append(text)


def degrees_text(d: Degrees) -> str:
    return d.product_text()
