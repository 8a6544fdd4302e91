"""The Plan: the one object every stage passes on (sampled, estimated, run, stored, exported, shown).

Mesh layout. Ranks are the linearised coordinates of a 5-D mesh in ``MESH_ORDER``
(``pp`` outermost, ``tp`` innermost), as torchtitan orders ``ParallelDims``: consecutive ranks
share a tp group (so tp stays inside a node under the default placement) and each pipeline stage
owns a contiguous block of ranks (so a stage can sit on one device type)::

    rank = (((pp_i * dp + dp_i) * cp + cp_i) * hp + hp_i) * tp + tp_i

``placement[rank]`` says which physical device (node, local index) holds that rank.

Shares (uneven splits). Along each dimension the share at index i is the same for every coordinate
of the other dimensions, so the runtime can execute it:

* ``layers``:  ``pp * virtual_stages`` entries in model order (which pp rank holds virtual stage j
  is the schedule's placement, ``autotune/schedules``: ``j % pp`` for the looped schedules), each
  >= 1, summing to the model's layers;
* ``tokens``:  ``cp`` entries summing to the sequence length; with ``cp_layout = "zigzag"`` each CP
  rank holds two chunks (front and mirrored back) so causal work balances; inside a CP shard the
  Ulysses (hp) ranks split the tokens evenly;
* ``heads``:   ``hp`` entries summing to ``heads / tp`` (the query heads of one tp rank);
* ``samples``: ``dp`` entries summing to the global batch; replica i runs ``samples[i] /
  micro_batch_size`` micro-batches. ``num_microbatches`` is the largest replica's count (every
  replica's count under even shares), as Megatron counts micro-batches per replica.

Modules: the parts a Plan is made of (degrees, shares, placement, the enumerated choices, PlanError)
are ``autotune/plan_parts.py``; the rules ``resolve`` checks are ``autotune/plan_checks.py``; this
module holds the Plan, its JSON and inline forms and its schema, and every public name of the other
two is importable from here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune import dims
from autotune.errors import InputError, suggest
from autotune.plan_checks import (  # noqa: F401  (_PLACEMENT_CHECKS: benchmarks/bench_estimate.py clears it)
    _PLACEMENT_CHECKS,
    _check_basic,
    _check_resolved,
    _node_order_placement,
)
from autotune.plan_parts import (  # noqa: F401  (every part is importable from autotune.plan)
    BALANCES,
    CP_LAYOUTS,
    CUDA_GRAPH_SCOPES,
    DIMS,
    DTYPE_CHOICES,
    DTYPES,
    EXPERT_DIMS,
    FP8_RECIPES,
    GRAD_REDUCE_DTYPE,
    GRAD_REDUCES,
    HELIX_FOLDS,
    MESH_ORDER,
    MOE_DISPATCHER,
    MOE_DISPATCHERS,
    MOMENTS,
    MOMENTS_DTYPE,
    RECOMPUTE,
    RECOMPUTE_MODULES,
    ZERO_STAGES,
    Degrees,
    Placement,
    PlanError,
    Shares,
    Workload,
    _degrees_from,
    _int_list,
    _placement_from,
    _shares_from,
    _uses_from,
    _workload_from,
    even_split,
    expert_groups,
    lacks_dtype,
    mesh_groups,
    shares_are_even,
    stored_plan_is_even,
)
from autotune.schedules import names, schedule_of
from autotune.specs import fields as F
from autotune.stages import envelope, is_uniform, layout_of, stages_from, tp_degrees

SCHEMA_VERSION = 3
"""3: optional fields of this round: per-stage degrees (``stages``, autotune/stages.py), the subset
of a pool a plan runs on (``uses``, autotune/specs/pool.py), packed documents (``doc_mask``,
``balance``, autotune/documents.py); absent, a plan is what 2 was, and a plan writes them only where
they change something. 2: ``dtype`` is the mixed-precision recipe (low-precision compute, fp32 master
weights and AdamW states, gradients reduced in ``GRAD_REDUCE_DTYPE``). Version-1 and -2 plans load
unchanged."""
READABLE_SCHEMA_VERSIONS = (1, 2, 3)
RECORD_KEYS = ("predicted", "measured", "provenance")
"""Keys of a plan JSON that say what happened to the plan, not what it is: they travel beside the
Plan in ``autotune.plan_record.PlanRecord``; ``Plan.from_dict`` checks and skips them."""
SCHEDULES = names()
"""Every pipeline schedule name a Plan may carry: the registry of ``autotune.schedules`` (one module
each; the constructor, the JSON parser, the search space and the schema test read it)."""
SCHEMA_PATH = Path(__file__).parent / "schema" / "plan.schema.json"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A parallel training plan: configuration only, so plans hash and compare as configurations
    (the search caches and deduplicates by them). What was predicted and measured for a plan, and
    where it came from, travel beside it in ``autotune.plan_record.PlanRecord``. Build from JSON
    with ``Plan.from_dict``; fill defaults with ``resolve``."""

    degrees: Degrees = field(default_factory=Degrees)
    micro_batch_size: int = 1
    """Samples per micro-batch."""
    num_microbatches: int | None = None
    """Micro-batches of the largest DP replica per step (None: as many as the batch allows)."""
    schedule: str = "1f1b"
    """Pipeline schedule, a name ``autotune.schedules.get_schedule`` knows (gpipe, 1f1b, ...)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (the schedule says which counts it runs)."""
    helix_folds: int = 1
    """HelixPipe's fold count F (1 or 2): micro-batches go through the attention-parallel pipeline
    in groups of pp * F, each operation running back to back for the F folds so one fold's
    transfers overlap the other's compute (autotune/schedules/helixpipe.py). 1 for other schedules."""
    helix_attention: tuple[int, ...] | None = None
    """HelixPipe only: attentions per micro-batch each pipeline rank runs (``pp`` entries summing to
    the layers; None: L/p each, the published rotation). On a mixed cluster faster ranks can take
    more of the rotating attention (``helixpipe.attention_slots`` interleaves them)."""
    recompute: str = "none"
    """Activation recomputation: none, selective (attention core, or ``recompute_modules``), full (whole blocks)."""
    recompute_modules: tuple[str, ...] = ()
    """Under ``recompute=selective``: the parts of each layer rebuilt in the backward, Megatron-Core's
    ``--recompute-modules`` (``RECOMPUTE_MODULES``); empty: the attention core alone (Megatron's default)."""
    zero_stage: int = 0
    """Optimizer-state sharding over DP: 0 none, 1 optimizer states (Megatron distributed optimizer),
    2 + gradients, 3 + parameters (FSDP)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism with tp: norms/dropout sharded along the sequence."""
    cp_layout: str = "zigzag"
    """CP shard placement: zigzag (load-balanced causal) or contiguous."""
    dtype: str = "bf16"
    """Compute dtype (fp32 for bit-comparable CPU trials)."""
    doc_mask: bool = False
    """Attention stops at document boundaries inside packed windows (needs a length distribution or
    a token file with its document ends; False: every window is one causal sequence)."""
    balance: str = "count"
    """With documents: how windows are dealt to DP replicas (``BALANCES``)."""
    disaggregate: bool = False
    """HeterMoE's disaggregation (arXiv 2504.03871) of a MoE model: the DP replicas whose
    ``shares.samples`` entry is 0 hold routed experts only (no attention, dense FFN, router, embedding
    or head work), the others take every sample; the EP group spans all of them, and the expert-only
    ranks compute micro-batch i's experts while the attention ranks run micro-batch i+1's attention
    (``cost/disaggregation.py``). Priced and searched; no runtime or exporter runs it yet."""
    moe_a2a_overlap: bool = False
    """A MoE model's token all-to-all run beside another micro-batch's compute: Megatron-Core's
    ``--overlap-moe-expert-parallel-comm --delay-wgrad-compute`` (Megatron-Bridge's ``moe_a2a_overlap``),
    which pairs each steady-state forward with a backward layer by layer and runs one's dispatch and
    combine on a second stream while the other computes (``cost/expert_dispatch.py``)."""
    moe_dispatcher: str = MOE_DISPATCHER
    """How a MoE model's tokens reach their experts (``MOE_DISPATCHERS``): ``flex`` is Megatron-Core's
    DeepEP dispatcher, one network copy per remote node rather than per remote expert
    (``cost/flex_dispatch.py``); only the Megatron target runs it."""
    grad_reduce: str = GRAD_REDUCE_DTYPE
    """Precision gradients are accumulated and reduced in under 16-bit compute (``GRAD_REDUCES``)."""
    moments: str = MOMENTS_DTYPE
    """Precision Adam's two moments are kept in (``MOMENTS``): bf16 is Megatron's precision-aware
    optimizer (``cost/memory.state_bytes_per_param``)."""
    cuda_graph_scope: tuple[str, ...] = ()
    """The parts of each layer captured in CUDA graphs (``CUDA_GRAPH_SCOPES``; empty: none, every
    kernel issued eagerly). Priced for a MoE model's MoE layers (``cost/kernels.moe_layer_host``)."""
    shares: Shares = field(default_factory=Shares)
    placement: tuple[Placement, ...] | None = None
    workload: Workload | None = None
    stages: tuple[Any, ...] | None = None
    """Per-stage device groups and degrees (``autotune.stages.Stage``; None: the uniform mesh of
    ``degrees``). With stages, ``degrees`` is their envelope (pp stages, dp replicas, the largest tp)
    and the ranks are numbered stage, replica, tp rank (``autotune.stages.rank_table``)."""
    uses: tuple[int, ...] | None = None
    """Nodes used per node group of the pool (the first ``uses[g]`` of group ``g``); None: every
    node. The plan is resolved and priced on ``autotune.specs.pool.subset(cluster, uses)``, and its
    placement names nodes of that sub-cluster (docs/files.md, "Pools")."""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        """The enumerated fields are checked here, so a Plan built in code is as safe as one read from
        JSON (a misspelt schedule must not be priced as another one)."""
        for name, choices in (("schedule", SCHEDULES), ("recompute", RECOMPUTE), ("cp_layout", CP_LAYOUTS),
                              ("dtype", DTYPES), ("balance", BALANCES), ("grad_reduce", GRAD_REDUCES),
                              ("moments", MOMENTS), ("moe_dispatcher", MOE_DISPATCHERS)):
            _check_choice(getattr(self, name), choices, name)
        for m in self.recompute_modules:
            _check_choice(m, RECOMPUTE_MODULES, "recompute_modules")
        for m in self.cuda_graph_scope:
            _check_choice(m, CUDA_GRAPH_SCOPES, "cuda_graph_scope")
        if self.recompute_modules and self.recompute != "selective":
            raise PlanError(f"needs recompute=selective, got recompute={self.recompute}", field="recompute_modules")
        z = self.zero_stage
        if isinstance(z, bool) or z not in ZERO_STAGES:
            raise PlanError(f"must be 0, 1, 2 or 3, got {z!r}", field="zero_stage")

    # ---- its form: one mesh, or stage by stage -------------------------------------------------
    @property
    def per_stage(self) -> bool:
        """Written stage by stage (``stages``: each stage its own devices, replicas and tp) rather than
        as the mesh of ``degrees``. Only the dispatch points ask (``cost/steps.py``, the runtime's
        ``worker._runtime``, ``export/stages.Routed``; tests/unit/test_one_plan_form.py keeps it so);
        everyone else asks the accessors that answer for both forms (``world``, ``coords``,
        ``tp_degrees``, ``is_uniform``)."""
        return self.stages is not None

    def tp_degrees(self) -> tuple[int, ...]:
        """Every tp the plan's tensor-parallel groups use, smallest first (one mesh: its tp)."""
        return tp_degrees(self.stages) if self.stages is not None else (self.degrees.tp,)

    @property
    def is_uniform(self) -> bool:
        """Every tp group at one tp: the mesh of its degrees, placement aside (``stages 4L(tp1x4)`` is
        ``dp=4``; what Megatron and torchtitan express). Always true of a plan of one mesh."""
        return self.stages is None or is_uniform(self.stages)

    # ---- mesh arithmetic ----------------------------------------------------------------------
    @property
    def world(self) -> int:
        if self.stages is not None:
            return sum(len(r.devices) for st in self.stages for r in st.replicas)
        return self.degrees.world

    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self.degrees, d) for d in MESH_ORDER)

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinate of ``rank`` as {dim: index} (of a per-stage plan: its stage, replica, cp and
        hp index in the replica and index in its tp group)."""
        if self.stages is not None:
            x = layout_of(self.stages).slots[rank]
            return dims.origin(pp=x.stage, dp=x.replica, cp=x.cp_index, hp=x.hp_index, tp=x.tp_index)
        return dims.coords(self.degrees, rank)

    def rank_of(self, **coords: int) -> int:
        r = 0
        for d in MESH_ORDER:
            r = r * getattr(self.degrees, d) + coords.get(d, 0)
        return r

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """Ranks of the ``dim`` group that contains ``rank``, in index order."""
        c = self.coords(rank)
        return [self.rank_of(**{**c, dim: i}) for i in range(getattr(self.degrees, dim))]

    def all_groups(self, dim: str) -> list[list[int]]:
        """Every ``dim`` group, ordered by first rank. Stride arithmetic (same result as calling
        ``group_ranks`` per rank, which cost ~2 ms at 128 ranks inside every ``resolve``)."""
        return mesh_groups(self.degrees, dim, self.world)

    def device_index(self, rank: int, cluster: Any) -> int:
        """Flattened cluster device index (ClusterSpec.devices) that runs ``rank``."""
        if self.placement is None:
            return rank
        p = self.placement[rank]
        for d in cluster.devices:
            if d.node == p.node and d.local == p.device:
                return d.index
        raise PlanError(f"placement[{rank}] names node {p.node} device {p.device}, not in the cluster",
                        field="placement")

    def microbatches_of_replica(self, dp_index: int) -> int:
        assert self.shares.samples is not None, "resolve the plan first"
        return self.shares.samples[dp_index] // self.micro_batch_size

    def stages_of_rank(self, pp_index: int) -> tuple[int, ...]:
        """Virtual stages (model chunks, in model order) on pp rank ``pp_index``: the schedule's placement."""
        return schedule_of(self).stages_of_rank(pp_index, self.degrees.pp, self.virtual_stages)

    def layers_of_stage(self, pp_index: int) -> list[int]:
        """Layer counts of the virtual stages on pp rank ``pp_index`` (one entry per chunk)."""
        assert self.shares.layers is not None, "resolve the plan first"
        return [self.shares.layers[j] for j in self.stages_of_rank(pp_index)]

    def layout(self) -> tuple[Any, ...]:
        """What tells two layouts apart, as opposed to share variations of one layout: degrees,
        schedule, virtual stages and micro-batch size. ``validate`` measures the best plan of each
        layout first and ``search`` shows one plan per layout, by this one rule. A per-stage plan whose
        stages share one tp is the mesh of its degrees (``stages 4L(tp1x4)`` is ``dp=4``), so its
        stages (layers and devices: shares and placement) do not tell it apart."""
        stages = None if self.is_uniform else self.stages
        return (self.degrees, self.schedule, self.virtual_stages, self.micro_batch_size, stages)

    def is_even(self) -> bool:
        """True when every resolved share is an even split (the Megatron/torchtitan baseline shape):
        a per-stage plan is one only when its stages share one tp (the mesh it then is)."""
        if not self.is_uniform:
            return False
        return shares_are_even(self.shares.layers, self.shares.tokens, self.shares.heads, self.shares.samples)

    def replace(self, **kw: Any) -> Plan:
        return dataclasses.replace(self, **kw)

    # ---- defaults and validation --------------------------------------------------------------
    def token_granule(self) -> int:
        """Each CP shard must divide by this: zigzag halves it, the hp ranks split each half evenly,
        and with sequence parallelism the tp ranks split each hp rank's tokens again."""
        zigzag = 2 if self.cp_layout == "zigzag" and self.degrees.cp > 1 else 1
        sp = self.degrees.tp if self.sequence_parallel else 1
        return zigzag * self.degrees.hp * sp

    def resolve(self, model: Any, cluster: Any, seq_len: int, global_batch: int) -> Plan:
        """Fill what a hand-written plan left out (even shares, node-order placement, micro-batch
        count) and validate against the model and cluster; raises PlanError naming every problem.
        A plan this returned resolves to itself against the same workload without being checked
        again (the search resolves each plan it builds, and the estimate resolves it once more).
        The subset and per-stage plans branch off first, then ``_with_defaults`` fills the rest."""
        if self.uses is not None:  # a plan on a subset of a pool resolves on that subset
            from autotune.specs.pool import subset

            cluster = subset(cluster, self.uses)
        key = (id(self), id(model), id(cluster), seq_len, global_batch)
        hit = _RESOLVED.get(key)
        if hit is not None and hit[0] is self and hit[1] is model and hit[2] is cluster:
            return self
        if self.stages is not None:
            from autotune import stages as ST

            plan = ST.resolve(self, model, cluster, seq_len, global_batch)
            _RESOLVED[(id(plan), id(model), id(cluster), seq_len, global_batch)] = (plan, model, cluster)
            return plan
        problems = _check_basic(self, model, cluster, seq_len, global_batch)
        if problems:
            raise PlanError("; ".join(problems), field="plan")
        plan = self._with_defaults(model, cluster, seq_len, global_batch)
        problems = _check_resolved(plan, model, cluster, seq_len, global_batch)
        if problems:
            raise PlanError("; ".join(problems), field="plan")
        if len(_RESOLVED) > 4096:
            _RESOLVED.clear()
        # Plan, ModelSpec and ClusterSpec are frozen; the entry holds all three, so no id is reused
        _RESOLVED[(id(plan), id(model), id(cluster), seq_len, global_batch)] = (plan, model, cluster)
        return plan

    def _with_defaults(self, model: Any, cluster: Any, seq_len: int, global_batch: int) -> Plan:
        """This plan with what it left out filled in, in the order the checks need them (even shares,
        node-order placement, micro-batch count) and its workload named; not yet checked."""
        d = self.degrees
        sh = self.shares
        layers = sh.layers or tuple(even_split(model.layers, d.pp * self.virtual_stages))
        heads = sh.heads or tuple(even_split(model.heads // d.tp, d.hp))
        g = self.token_granule()
        tokens = sh.tokens
        if tokens is None:  # even in units of the granule; an indivisible length is reported below
            tokens = tuple(x * g for x in even_split(seq_len // g, d.cp)) if seq_len % g == 0 else tuple(
                even_split(seq_len, d.cp))
        mbs = self.micro_batch_size
        samples = sh.samples
        if samples is None:
            if global_batch % mbs == 0:
                samples = tuple(x * mbs for x in even_split(global_batch // mbs, d.dp))
            else:
                samples = tuple(even_split(global_batch, d.dp))
        placement = self.placement or _node_order_placement(cluster, min(d.world, cluster.num_devices))
        nmb = self.num_microbatches
        if nmb is None and all(s % mbs == 0 for s in samples):
            nmb = max(samples) // mbs
        experts = sh.experts
        moe = getattr(model, "moe", None)
        if experts is None and moe is not None and moe.experts % d.ep == 0:  # even (else refused: plan_checks)
            experts = (moe.experts // d.ep,) * d.ep
        return self.replace(
            shares=Shares(layers=tuple(layers), tokens=tuple(tokens), heads=tuple(heads), samples=tuple(samples),
                          experts=experts),
            placement=tuple(placement), num_microbatches=nmb,
            workload=Workload(model=model.name, seq_len=seq_len, global_batch=global_batch,
                              cluster=getattr(cluster, "name", "")))

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = self._base_dict()
        if self.stages is not None:  # absent for uniform plans: their JSON reads as before
            d["stages"] = [st.to_dict() for st in self.stages]
        if self.doc_mask:  # version-3 fields only where they change something (old plans stay as they were)
            d["doc_mask"] = True
        if self.balance != "count":
            d["balance"] = self.balance
        if self.recompute_modules:  # absent by default: plans without it read as before
            d["recompute_modules"] = list(self.recompute_modules)
        if self.disaggregate:
            d["disaggregate"] = True
        if self.moe_a2a_overlap:
            d["moe_a2a_overlap"] = True
        if self.moe_dispatcher != MOE_DISPATCHER:
            d["moe_dispatcher"] = self.moe_dispatcher
        if self.grad_reduce != GRAD_REDUCE_DTYPE:
            d["grad_reduce"] = self.grad_reduce
        if self.moments != MOMENTS_DTYPE:
            d["moments"] = self.moments
        if self.cuda_graph_scope:
            d["cuda_graph_scope"] = list(self.cuda_graph_scope)
        return d

    def _base_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "degrees": self.degrees.to_dict(),
            "micro_batch_size": self.micro_batch_size,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "helix_folds": self.helix_folds,
            "helix_attention": list(self.helix_attention) if self.helix_attention is not None else None,
            "recompute": self.recompute,
            "zero_stage": self.zero_stage,
            "sequence_parallel": self.sequence_parallel,
            "cp_layout": self.cp_layout,
            "dtype": self.dtype,
            "shares": self.shares.to_dict(),
            "placement": ([dataclasses.asdict(p) for p in self.placement] if self.placement is not None else None),
            "workload": dataclasses.asdict(self.workload) if self.workload else None,
            **({"uses": list(self.uses)} if self.uses is not None else {}),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Any, source: str | None = None) -> Plan:
        try:
            return _plan_from_dict(d)
        except InputError as e:
            raise PlanError(e.message, source=source or e.source, field=e.field) from None

    @classmethod
    def from_json(cls, text: str, source: str | None = None) -> Plan:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise PlanError(f"does not parse as JSON: {exc}", source=source) from None
        return cls.from_dict(data, source=source)


def _check_choice(value: Any, choices: tuple[str, ...], field: str) -> None:
    if value not in choices:
        hint = suggest(value, choices) if isinstance(value, str) else "; known: " + ", ".join(choices)
        raise PlanError(f"unknown {field} {value!r}" + hint, field=field)


def choose_dtype(option: str, cluster: Any, plan_dtype: str | None = None) -> str:
    """The precision a command runs in: ``option`` from ``--dtype`` (auto or one of ``DTYPES``), checked
    against every device of ``cluster`` (a device without it refuses the whole cluster up front).
    ``auto`` keeps ``plan_dtype`` when a plan states one, else takes bf16 where every device has
    it, else fp16 (V100, T4: the fp16 tensor cores with loss scaling)."""
    _check_choice(option, DTYPE_CHOICES, "--dtype")
    types = list(cluster.device_types())
    lacking = lambda dt: sorted({t.name for t in types if lacks_dtype(t.peak_flops, dt)})  # noqa: E731
    if option == "auto":
        if plan_dtype is not None:
            option = plan_dtype
        else:  # bf16, else fp16, else (a device with neither) fp32
            option = next((dt for dt in ("bf16", "fp16") if not lacking(dt)), "fp32")
    missing = lacking(option)
    if missing:  # an FP8 recipe falls back to another the devices run (MXFP8 -> blockwise on Hopper), then 16-bit
        others = (*(dt for dt in FP8_RECIPES if dt != option), "bf16") if option in FP8_RECIPES else ()
        fallback = next((dt for dt in (*others, "fp16", "fp32") if dt != option and not lacking(dt)), None)
        raise PlanError(f"{option} is not supported by {', '.join(missing)} in cluster "
                        f"{getattr(cluster, 'name', '')!r}" + (f"; use --dtype {fallback}" if fallback else ""),
                        field="--dtype" if plan_dtype is None or option != plan_dtype else "dtype")
    return option


_RESOLVED: dict[tuple[int, int, int, int, int], tuple[Plan, Any, Any]] = {}  # Plan.resolve's own results


def validate(plan: Plan, model: Any, cluster: Any, seq_len: int, global_batch: int) -> Plan:
    """Resolve and validate; returns the resolved plan or raises PlanError."""
    return plan.resolve(model, cluster, seq_len, global_batch)


# ---- parsing ------------------------------------------------------------------------------------
_PLAN_KEYS = {f.name for f in dataclasses.fields(Plan)} | set(RECORD_KEYS)


def _plan_from_dict(d: Any) -> Plan:
    """A Plan from its JSON object: one field after another, each read and checked where it is named,
    so an error names the field it is about (in the order the fields are checked)."""
    if not isinstance(d, dict):
        raise InputError(f"a plan must be a JSON object, got {type(d).__name__}")
    F.reject_unknown(d, _PLAN_KEYS, None)
    sv = _schema_version_from(d)
    degrees = _degrees_from(d)
    shares = _shares_from(d)
    placement = None if d.get("placement") is None else _placement_from(d["placement"])
    stages = stages_from(d.get("stages"))
    if stages is not None and sv < 3:
        raise InputError(f"stages need schema_version 3, the file says {sv}", field="stages")
    workload = None if d.get("workload") is None else _workload_from(d["workload"])
    nmb = d.get("num_microbatches")
    _check_record_keys(d)
    zero = F.get_int(d, "zero_stage", "zero_stage", default=0, minimum=0)
    if zero > 3:
        raise InputError(f"must be 0, 1, 2 or 3, got {zero}", field="zero_stage")
    if stages is not None and degrees == Degrees():
        degrees = envelope(stages)
    return Plan(
        degrees=degrees,
        micro_batch_size=F.get_int(d, "micro_batch_size", "micro_batch_size", default=1),
        num_microbatches=None if nmb is None else F.get_int(d, "num_microbatches", "num_microbatches"),
        schedule=F.get_str(d, "schedule", "schedule", default="1f1b", choices=SCHEDULES),
        virtual_stages=F.get_int(d, "virtual_stages", "virtual_stages", default=1),
        helix_folds=F.get_int(d, "helix_folds", "helix_folds", default=1),
        helix_attention=_int_list(d.get("helix_attention"), "helix_attention"),
        recompute=F.get_str(d, "recompute", "recompute", default="none", choices=RECOMPUTE),
        recompute_modules=_modules_from(d.get("recompute_modules")),
        zero_stage=zero,
        sequence_parallel=F.get_bool(d, "sequence_parallel", "sequence_parallel", default=False),
        cp_layout=F.get_str(d, "cp_layout", "cp_layout", default="zigzag", choices=CP_LAYOUTS),
        dtype=F.get_str(d, "dtype", "dtype", default="bf16", choices=DTYPES),
        doc_mask=F.get_bool(d, "doc_mask", "doc_mask", default=False),
        balance=F.get_str(d, "balance", "balance", default="count", choices=BALANCES),
        disaggregate=F.get_bool(d, "disaggregate", "disaggregate", default=False),
        moe_a2a_overlap=F.get_bool(d, "moe_a2a_overlap", "moe_a2a_overlap", default=False),
        moe_dispatcher=F.get_str(d, "moe_dispatcher", "moe_dispatcher", default=MOE_DISPATCHER,
                                 choices=MOE_DISPATCHERS),
        grad_reduce=F.get_str(d, "grad_reduce", "grad_reduce", default=GRAD_REDUCE_DTYPE, choices=GRAD_REDUCES),
        moments=F.get_str(d, "moments", "moments", default=MOMENTS_DTYPE, choices=MOMENTS),
        cuda_graph_scope=_names_from(d.get("cuda_graph_scope"), CUDA_GRAPH_SCOPES, "cuda_graph_scope"),
        shares=shares, placement=placement, workload=workload, stages=stages,
        uses=_uses_from(d.get("uses")),
    )


def _modules_from(v: Any) -> tuple[str, ...]:
    """``recompute_modules``: a list of ``RECOMPUTE_MODULES`` names (inline: ``moe_act/layernorm``)."""
    return _names_from(v, RECOMPUTE_MODULES, "recompute_modules")


def _names_from(v: Any, choices: tuple[str, ...], field: str) -> tuple[str, ...]:
    """A list of names from ``choices`` (inline: ``a/b``), each once, in the order given."""
    if v is None:
        return ()
    if isinstance(v, str):
        v = [x.strip() for x in v.split("/") if x.strip()]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise InputError(f"expected a list of module names, got {v!r}", field=field)
    for x in v:
        if x not in choices:
            raise InputError(f"unknown module {x!r}; one of {', '.join(choices)}" + suggest(x, choices), field=field)
    return tuple(dict.fromkeys(v))


def _schema_version_from(d: dict) -> int:
    """``schema_version`` (this version when absent), one of the versions this autotune reads."""
    sv = d.get("schema_version", SCHEMA_VERSION)
    if isinstance(sv, bool) or sv not in READABLE_SCHEMA_VERSIONS:
        raise InputError(f"schema_version {sv!r} is not supported (this autotune reads "
                         f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))})", field="schema_version")
    return sv


def _check_record_keys(d: dict) -> None:
    """The record fields (read by autotune.plan_record; a Plan is the configuration alone) are mappings or null."""
    for key in RECORD_KEYS:
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise InputError(f"expected a mapping or null, got {d[key]!r}", field=key)


_INLINE_DIMS = {dims.dimension(n).inline_key: n for n in dims.WRITTEN}
"""Inline key -> dimension (``autotune/dims.py``)."""
_INLINE_ALIASES = {"mbs": "micro_batch_size", "nmb": "num_microbatches", "vpp": "virtual_stages", "folds": "helix_folds",
                   "zero": "zero_stage", "sp": "sequence_parallel"}


_INLINE_KEYS = (*_INLINE_DIMS, *_INLINE_ALIASES, "schedule", "recompute", "recompute_modules", "cp_layout", "dtype", "layers", "tokens",
                "heads", "samples", "experts", "doc_mask", "balance", "uses", "disaggregate", "moe_a2a_overlap",
                "moe_dispatcher", "grad_reduce", "moments", "cuda_graph_scope")
"""Every key an inline plan takes (the nearest is suggested for one it does not)."""


def parse_inline(text: str) -> Plan:
    """``dp=32,pp=2,tp=8`` (plus optional ``mbs=2,schedule=gpipe,recompute=full,zero=1,sp=1``, and the
    expert degrees ``ep=8,etp=1``), and uneven shares as ``/``-separated lists: ``pp=2,layers=13/19``
    (layers per stage, model order), ``tokens=``, ``heads=``, ``samples=``, ``experts=`` likewise
    (docs/files.md, "Plan")."""
    degrees: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    shares: dict[str, list[int]] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep:
            raise PlanError(f"bad inline plan item {part!r}; write key=value, e.g. dp=2,pp=2", field="plan")
        key = _INLINE_ALIASES.get(key, key)
        value = value.strip()
        if key in _INLINE_DIMS:
            key = _INLINE_DIMS[key]
            if not value.isdigit():
                raise PlanError(f"expected a positive integer, got {value!r}", field=f"degrees.{key}")
            degrees[key] = int(value)
        elif key in ("micro_batch_size", "num_microbatches", "virtual_stages", "zero_stage", "helix_folds"):
            if not value.isdigit():
                raise PlanError(f"expected an integer, got {value!r}", field=key)
            rest[key] = int(value)
        elif key in _SHARE_KEYS:
            shares[key] = _counts(value, f"shares.{key}", f"{key}=13/19")
        elif key == "uses":  # node counts per node group of a pool, e.g. uses=1/0
            rest["uses"] = _counts(value, "uses", "uses=2/0", what="node counts")
        elif key in ("sequence_parallel", "doc_mask", "disaggregate", "moe_a2a_overlap"):
            rest[key] = value.lower() in ("1", "true", "yes", "on")
        elif key in ("schedule", "recompute", "cp_layout", "dtype", "balance", "recompute_modules", "grad_reduce",
                     "moments", "cuda_graph_scope", "moe_dispatcher"):
            rest[key] = value
        else:
            raise PlanError(f"unknown inline plan key {key!r}" + suggest(key, _INLINE_KEYS), field="plan")
    if shares:
        rest["shares"] = shares
    return Plan.from_dict({"degrees": degrees, **rest}, source="--plan")


_SHARE_KEYS = tuple(f.name for f in dataclasses.fields(Shares))
"""The inline keys of uneven shares (``layers=13/19``): the Shares fields, one per dimension that may carry one."""


def _counts(value: str, field: str, example: str, what: str = "counts") -> list[int]:
    """An inline ``a/b/c`` list of counts, or a one-line error naming ``field``."""
    parts = value.split("/")
    if not all(x.strip().isdigit() for x in parts):
        raise PlanError(f"expected {what} separated by '/', e.g. {example}, got {value!r}", field=field)
    return [int(x) for x in parts]


@contextlib.contextmanager
def located(path_or_inline: str | Path) -> Iterator[None]:
    """A PlanError without a source, raised while a plan read from a file is resolved or priced,
    names that file (as an error reading it does): ``plan.json: stages[1].layers: ...``."""
    try:
        yield
    except PlanError as e:
        s = str(path_or_inline)
        if e.source is not None or ("=" in s and not Path(s).exists()):  # located already, or inline
            raise
        raise PlanError(e.message, source=s, field=e.field) from None


def load_plan(path_or_inline: str | Path) -> Plan:
    """A plan JSON file, or an inline ``dp=2,pp=2`` string."""
    return read_plan(path_or_inline)[0]


def load_plan_for(path_or_inline: str | Path, cluster: Any, dtype: str = "auto") -> Plan:
    """``load_plan`` with the precision ``--dtype`` chooses for ``cluster`` (``choose_dtype``): an
    explicit bf16/fp16/fp32 wins, ``auto`` keeps the precision the plan states and fills the
    cluster's default where it states none (an inline ``dp=2`` or a file without ``dtype``)."""
    from autotune.specs.pool import plan_cluster  # the devices the plan uses (a pool's subset)

    plan, _, stated = read_plan(path_or_inline)
    chosen = choose_dtype(dtype, plan_cluster(plan, cluster), plan.dtype if stated else None)
    if chosen == plan.dtype:
        return plan
    return plan.replace(dtype=chosen)


def read_plan(path_or_inline: str | Path) -> tuple[Plan, dict[str, Any], bool]:
    """(plan, the file's record keys (``RECORD_KEYS``: empty for an inline plan), whether it states
    its dtype). ``autotune.plan_record.load_record`` gives the plan with its record."""
    s = str(path_or_inline)
    p = Path(s)
    if "=" in s and not p.exists():
        keys = {_INLINE_ALIASES.get(k.strip(), k.strip()) for k in (x.partition("=")[0] for x in s.split(","))}
        return parse_inline(s), {}, "dtype" in keys
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlanError("plan file not found", source=s) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"cannot read plan file: {exc}", source=s) from None
    plan = Plan.from_json(text, source=s)
    data = json.loads(text)  # a mapping: from_json refused anything else
    record = {k: data.get(k) for k in RECORD_KEYS}
    check_schema({**plan.to_dict(), **record}, source=s)
    return plan, record, data.get("dtype") is not None


def plan_schema() -> dict[str, Any]:
    """The shipped JSON Schema (autotune/schema/plan.schema.json) with the schedule names of the
    registry (``autotune.schedules``) as the ``schedule`` enum, ``plan_parts.DTYPES`` as the ``dtype``
    enum and the declared dimensions (``autotune/dims.py``) as the ``degrees`` properties: the file
    lists none of them, so that a new schedule is one module, a new dtype one entry and a new
    dimension one declaration."""
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    schema["properties"]["schedule"]["enum"] = list(SCHEDULES)
    schema["properties"]["dtype"]["enum"] = list(DTYPES)  # one list of dtypes (plan_parts.DTYPES)
    schema["properties"]["degrees"]["properties"] = {  # the declared dimensions (autotune/dims.py)
        n: {"type": "integer", "minimum": 1, "description": dims.dimension(n).doc} for n in dims.WRITTEN}
    return schema


def check_schema(d: dict[str, Any], source: str | None = None) -> None:
    """Validate a plan dict against the plan's JSON Schema (``plan_schema``)."""
    import jsonschema

    schema = plan_schema()
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(d), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        where = ".".join(str(x) for x in e.path) or None
        raise PlanError(f"does not match the plan schema: {e.message}", source=source, field=where)
