"""The parts a Plan is made of (``autotune/plan.py`` holds the Plan itself and reads and writes it):
the enumerated choices, the error a plan raises, the parallel degrees and the mesh order, uneven
shares, the placement of a rank, the workload a plan was resolved for. Plain frozen data with no
import above ``autotune.errors``: the plan's checks (``autotune/plan_checks.py``) and the Plan both
build on it; every name here is importable from ``autotune.plan`` too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autotune import dims
from autotune.errors import InputError
from autotune.schedules.helixpipe import FOLDS
from autotune.specs import fields as F

DIMS = tuple(n for n in dims.WRITTEN if not dims.dimension(n).folds)
"""The names of the dimensions that multiply the world, in the order plans write them (dp, pp, cp,
hp, tp; ``autotune/dims.py`` declares every dimension)."""
EXPERT_DIMS = tuple(n for n in dims.WRITTEN if dims.dimension(n).folds)
"""Expert parallelism's degrees (ep, etp). They fold onto the ranks the dimensions above already
count (Megatron-Core's "parallel folding"): within a pipeline stage the dp*cp*hp*tp attention ranks
are also edp*ep*etp expert ranks, ordered pp, edp, ep, etp (etp innermost); edp, the expert data
parallelism, is derived (``Degrees.edp``), never written. They do not multiply the world."""
MESH_ORDER = dims.MESH_ORDER


RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mla_up_proj", "moe_act", "mlp", "shared_experts", "moe")
"""The parts of a layer ``recompute=selective`` may rebuild in the backward, Megatron-Core's
``--recompute-modules`` names (megatron/core/transformer/transformer_config.py ``recompute_modules``):
the attention core (its scores; the default), the two norms' outputs, MLA's up-projections (q, k, v),
the routed experts' activation function, a dense layer's MLP, the shared experts, the whole MoE layer.
What each keeps and costs: ``autotune/cost/recompute_modules.py``."""
CUDA_GRAPH_SCOPES = ("attn", "moe_router", "moe_preprocess")
"""The parts of each layer a Megatron run captures in CUDA graphs (``--cuda-graph-impl transformer_engine
--cuda-graph-scope ...``, megatron.core.transformer.enums.CudaGraphScope): the attention sub-block,
the MoE router, the dispatcher's preprocessing (which Megatron Core captures only with the router).
Their kernels replay from the graph instead of being issued one by one (``cost/kernels.py``)."""
MOE_DISPATCHERS = ("alltoall", "flex")
"""How a MoE layer's tokens reach their experts (``Plan.moe_dispatcher``): ``alltoall`` sends one copy
per routed expert over each rank pair (Megatron-Core's ``--moe-token-dispatcher-type alltoall``, NCCL's
all-to-all); ``flex`` with DeepEP (``--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend
deepep``) sends a token across the network once per remote node holding one of its experts and
forwards it over NVLink there (DeepSeek-V3 report, arXiv 2412.19437 section 3.2.2;
``cost/flex_dispatch.py``)."""
MOE_DISPATCHER = "alltoall"
"""The dispatcher unless a plan says otherwise (what every target runs)."""
HELIX_FOLDS = FOLDS  # HelixPipe's fold counts (autotune/schedules/helixpipe.py)
CP_LAYOUTS = ("zigzag", "contiguous")
BALANCES = ("count", "cost")
"""How packed windows go to DP replicas: ``count`` (rows in order, ``shares.samples`` each) or
``cost`` (the same counts, heavy windows spread by attention cost: autotune/documents.py)."""
FP8_RECIPES = {"fp8": "delayed", "fp8-current": "current", "fp8-blockwise": "blockwise", "fp8-mx": "mxfp8"}
"""The FP8 training dtypes and the scaling recipe each names (Transformer Engine's recipes, which
Megatron's ``--fp8-recipe`` selects): the linear layers' GEMMs take FP8 inputs, everything else
(attention, norms, router, embedding, LM head, loss, optimizer) stays in bf16 with fp32 master
weights. ``fp8``: delayed scaling (per-tensor scale from the amax history of earlier steps, TE's and
Megatron's default); ``fp8-current``: per-tensor scale from this step's amax (NeMo's FP8-CS,
Megatron's ``tensorwise``); ``fp8-blockwise``: DeepSeek-V3's 1x128 activation / 128x128 weight tiles;
``fp8-mx``: MXFP8, 1x32 blocks with E8M0 scales applied inside the tensor core (Blackwell only)."""
DTYPES = ("bf16", "fp16", "fp32", "fp32-strict", *FP8_RECIPES)  # fp32: TF32 GEMMs where the device has them
DTYPE_CHOICES = ("auto", *DTYPES)
"""What ``--dtype`` takes: ``auto`` is bf16 where every device of the cluster has it, else fp16
(``choose_dtype``); it never picks an FP8 dtype (a numerical choice the user makes)."""


def gemm_peak(dtype: str) -> str:
    """The ``DeviceSpec.peak_flops`` key a plan of ``dtype`` runs its linear layers' GEMMs at: ``fp8``
    for the per-tensor and blockwise recipes, ``mxfp8`` for MXFP8, else the dtype itself."""
    if dtype in FP8_RECIPES:
        return "mxfp8" if FP8_RECIPES[dtype] == "mxfp8" else "fp8"
    return dtype


def compute_dtype(dtype: str) -> str:
    """The precision of everything but the FP8 GEMMs (bf16 under an FP8 recipe, else ``dtype``)."""
    return "bf16" if dtype in FP8_RECIPES else dtype


def dtype_peaks(dtype: str) -> tuple[str, ...]:
    """The ``peak_flops`` keys a device must have to train in ``dtype`` (one source for the plan's,
    the per-stage and the ``--dtype`` checks)."""
    return tuple(dict.fromkeys((gemm_peak(dtype), compute_dtype(dtype))))


def lacks_dtype(peak_flops: Any, dtype: str) -> bool:
    """Whether a device with ``peak_flops`` cannot train in ``dtype``."""
    return any(k not in peak_flops for k in dtype_peaks(dtype))
ZERO_STAGES = (0, 1, 2, 3)
GRAD_REDUCES = ("fp32", "bf16")
"""What ``Plan.grad_reduce`` takes: gradients accumulated and reduced in fp32 (``GRAD_REDUCE_DTYPE``,
Megatron's default under --bf16) or in bf16 (Megatron's ``--grad-reduce-in-bf16``, Megatron-Bridge's
``grad_reduce_in_fp32 = False``: half the gradient buffer and half the bytes reduced)."""
GRAD_REDUCE_DTYPE = "fp32"
"""Mixed precision: the precision gradients are accumulated and reduced in over the data-parallel
ranks, whatever the compute dtype (Megatron's default under --bf16; the runtime does this, the cost
model prices these bytes, the exporters emit the matching flag)."""
MOMENTS = ("fp32", "bf16")
"""What ``Plan.moments`` takes: Adam's two moments kept in fp32 (``MOMENTS_DTYPE``, every framework's
default) or in bf16 (Megatron's precision-aware optimizer, ``--use-precision-aware-optimizer
--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``, as DeepSeek-V3 trained: "the AdamW optimizer ... we
adopt the BF16 data format instead of FP32 to track the first and second moments", arXiv 2412.19437
section 3.3.3)."""
MOMENTS_DTYPE = "fp32"
"""Adam's moments in fp32 unless a plan says otherwise (``Plan.moments``)."""


class PlanError(InputError):
    """A plan that does not fit the model or the cluster; the message names every factor that is off."""


class _DegreesMethods:
    """What ``Degrees`` does; its fields come from ``autotune.dims.DIMENSIONS`` (``_degrees_class``)."""

    __slots__ = ()

    def __post_init__(self) -> None:
        for d in dims.WRITTEN:
            v = getattr(self, d)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"must be a positive integer, got {v!r}", field=f"degrees.{d}")
        object.__setattr__(self, "_world", dims.world(self))  # read per rank group: computed once

    @property
    def world(self) -> int:
        return self._world  # type: ignore[attr-defined]

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage: the attention's dp*cp*hp*tp, the experts' edp*ep*etp."""
        return dims.stride(self, "pp")

    @property
    def edp(self) -> int:
        """Expert data-parallel replicas of one stage (derived: the stage's ranks over ep*etp;
        0 where ep*etp does not divide them, which the plan checks refuse)."""
        n = self.ep * self.etp
        return self.stage_ranks // n if self.stage_ranks % n == 0 else 0

    def product_text(self) -> str:
        """``dp(2)*pp(1)*...``: the degrees whose product is the world."""
        return "*".join(f"{d}({getattr(self, d)})" for d in DIMS if not dims.dimension(d).folds)

    def to_dict(self) -> dict[str, int]:
        """Every degree, a folding one only where it is not 1 (plans written before it read the same)."""
        return {d: getattr(self, d) for d in dims.WRITTEN if getattr(self, d) != 1 or not dims.dimension(d).folds}

    def inline(self) -> str:
        return ",".join(f"{dims.dimension(d).inline_key}={getattr(self, d)}" for d in dims.WRITTEN
                        if getattr(self, d) != 1) or "dp=1"


def _degrees_class() -> type:
    """``Degrees``: one int field per declared dimension (default 1), in the written order, frozen and
    keyword-only, so ``plan.degrees.tp`` reads as before and a new declaration is a new field."""
    fields = [(n, int, dataclasses.field(default=1)) for n in dims.WRITTEN]
    cls = dataclasses.make_dataclass("Degrees", fields, bases=(_DegreesMethods,), frozen=True, kw_only=True,
                                     namespace={"__module__": __name__})
    cls.__doc__ = "Parallel degrees; the product of those that do not fold is the number of devices. " + "; ".join(
        f"{d.name}: {d.doc}" for d in dims.DIMENSIONS)
    return cls


Degrees = _degrees_class()


@dataclass(frozen=True, kw_only=True)
class Shares:
    """Uneven splits along each dimension (None: not resolved yet, even split by default)."""

    layers: tuple[int, ...] | None = None
    tokens: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    samples: tuple[int, ...] | None = None
    experts: tuple[int, ...] | None = None
    """Routed experts each EP rank holds (``ep`` entries summing to the model's experts); None for a
    dense model (and left out of its JSON, so dense plans read as before)."""

    def to_dict(self) -> dict[str, list[int] | None]:
        return {k: (list(v) if v is not None else None) for k, v in dataclasses.asdict(self).items()
                if k != "experts" or v is not None}


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Mesh rank ``rank`` runs on device ``device`` of node ``node`` (global node index)."""

    rank: int
    node: int
    device: int


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What the plan is for; recorded when a plan is resolved against a model and a cluster."""

    model: str
    seq_len: int
    global_batch: int
    cluster: str = ""


def shares_are_even(layers: Any, tokens: Any, heads: Any, samples: Any) -> bool:
    """The even-split rule of ``Plan.is_even`` on bare share sequences (None: not set): layers,
    heads and samples may differ by one (a remainder, on the first parts as ``even_split`` puts it:
    4/5/5/5/5 layers is a choice, 5/5/5/5/4 the split), tokens not at all (CP chunks are equal)."""
    for v in (layers, heads, samples):
        if v and (max(v) - min(v) > 1 or any(a < b for a, b in zip(v, v[1:], strict=False))):
            return False
    return not tokens or max(tokens) == min(tokens)


def stored_plan_is_even(plan: dict[str, Any]) -> bool:
    """``Plan.is_even`` on a stored plan dict (its shares resolved), without parsing the plan (the
    search's baseline scan and the dashboard's rows, whose old plans may no longer validate)."""
    if plan.get("stages") and len({r.get("tp") for st in plan["stages"] for r in st.get("replicas") or ()}) > 1:
        return False  # per-stage degrees: no even split of one mesh (stages.is_uniform's rule)
    sh = plan.get("shares") or {}
    return shares_are_even(sh.get("layers"), sh.get("tokens"), sh.get("heads"), sh.get("samples"))


def even_split(total: int, parts: int) -> list[int]:
    """``total`` into ``parts`` integers differing by at most one, larger ones first."""
    q, r = divmod(total, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def expert_groups(degrees: Degrees, dim: str, world: int | None = None) -> list[list[int]]:
    """Every ``dim`` group (``ep``, ``etp`` or ``edp``) of the expert mesh, ordered by first rank:
    inside each pipeline stage's block of ranks, etp innermost, then ep, then edp (Megatron-Core's
    expert mesh folded onto the attention ranks)."""
    sizes = {"etp": degrees.etp, "ep": degrees.ep, "edp": degrees.edp}
    order = ("edp", "ep", "etp")
    n = sizes[dim]
    stride = 1
    for d in order[order.index(dim) + 1:]:
        stride *= sizes[d]
    world = degrees.world if world is None else world
    return [[r + i * stride for i in range(n)] for r in range(world) if (r // stride) % n == 0]


def mesh_groups(degrees: Degrees, dim: str, world: int | None = None) -> list[list[int]]:
    """Every ``dim`` group of the mesh ``degrees`` spans over ranks ``0 .. world - 1`` (default:
    ``degrees.world``), ordered by first rank (``Plan.all_groups``; ``autotune.dims.groups``)."""
    return dims.groups(degrees, dim, world)


# ---- the plan JSON's parts, read and checked field by field (autotune.plan._plan_from_dict) ----
def _int_list(v: Any, field: str) -> tuple[int, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise InputError(f"expected a list of integers, got {v!r}", field=field)
    return tuple(v)


def _degrees_from(d: dict) -> Degrees:
    """``degrees`` (1 for each dimension left out; all 1 for a per-stage plan that names none)."""
    deg = d.get("degrees")
    if deg is None and d.get("stages") is not None:
        deg = {}  # a per-stage plan's degrees are its stages' envelope
    if not isinstance(deg, dict):
        raise InputError(f"missing required field (a mapping of {', '.join(DIMS)})", field="degrees")
    F.reject_unknown(deg, set(dims.WRITTEN), "degrees")
    return Degrees(**{k: F.get_int(deg, k, f"degrees.{k}", default=1) for k in dims.WRITTEN})


def _shares_from(d: dict) -> Shares:
    """``shares``: lists of integers for layers, tokens, heads and samples, each optional."""
    sh = d.get("shares") or {}
    if not isinstance(sh, dict):
        raise InputError(f"expected a mapping, got {sh!r}", field="shares")
    names = [f.name for f in dataclasses.fields(Shares)]
    F.reject_unknown(sh, set(names), "shares")
    return Shares(**{k: _int_list(sh.get(k), f"shares.{k}") for k in names})


def _uses_from(v: Any) -> tuple[int, ...] | None:
    """``uses``: node counts per node group (checked against the pool when the plan is resolved)."""
    u = _int_list(v, "uses")
    if u is not None and (not u or any(x < 0 for x in u)):
        raise InputError(f"expected a node count >= 0 per node group, got {v!r}", field="uses")
    return u


def _placement_from(pl: Any) -> tuple[Placement, ...]:
    if not isinstance(pl, list):
        raise InputError("expected a list of {rank, node, device}", field="placement")
    items = []
    for i, e in enumerate(pl):
        if not isinstance(e, dict):
            raise InputError(f"expected a mapping, got {e!r}", field=f"placement[{i}]")
        F.reject_unknown(e, {"rank", "node", "device"}, f"placement[{i}]")
        items.append(Placement(rank=F.get_int(e, "rank", f"placement[{i}].rank", minimum=0),
                               node=F.get_int(e, "node", f"placement[{i}].node", minimum=0),
                               device=F.get_int(e, "device", f"placement[{i}].device", minimum=0)))
    return tuple(sorted(items, key=lambda x: x.rank))


def _workload_from(w: Any) -> Workload:
    if not isinstance(w, dict):
        raise InputError(f"expected a mapping, got {w!r}", field="workload")
    F.reject_unknown(w, {"model", "seq_len", "global_batch", "cluster"}, "workload")
    return Workload(model=F.get_str(w, "model", "workload.model"),
                    seq_len=F.get_int(w, "seq_len", "workload.seq_len"),
                    global_batch=F.get_int(w, "global_batch", "workload.global_batch"),
                    cluster=str(w.get("cluster") or ""))
