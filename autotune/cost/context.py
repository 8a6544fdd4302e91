"""What one estimate knows, resolved once: the step (plan, workload, cluster) and each rank's place.

``StepContext`` holds what every rank shares: the resolved plan's degrees and knobs, the model, the
cluster's topology, and the per-dimension facts that do not depend on a rank (micro-batches per
replica, each CP shard's causal work, the parameters of each pipeline stage, the DP group's link).
``RankContext`` is one tensor-parallel group's view (its ranks share a node, hence a device type and
links, and do identical work): its mesh coordinates (``Plan.coords``), device, throughput and
collective models, calibration factors, the links of each group it belongs to and its shares
(tokens, heads, micro-batches, layers). The per-dimension modules (``tensor_parallel``,
``context_parallel``, ``ulysses``, ``data_parallel``, ``pipeline_parallel``, ``memory``,
``compute``) are functions of a ``RankContext``.

Later per-stage degrees (each pipeline stage its own device group with its own TP and DP, Ulysses
groups of different sizes) change only how ``tp_groups`` enumerates groups and fills a context's
degrees: the dimension modules read degrees from the context they are given (``docs/architecture.md``).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache
from types import MappingProxyType
from typing import Any

from autotune import dims
from autotune.cost import comm as C
from autotune.cost import data_parallel as DP
from autotune.cost import mesh_links
from autotune.cost import recompute_modules as RMOD
from autotune.cost import ulysses as U
from autotune.cost.collectives import collectives_for
from autotune.cost.compute import DTYPE_BYTES, Rates, cached_rates, causal_keys
from autotune.cost.expert_layout import expert_step
from autotune.cost.ring import ring_blocks
from autotune.cost.windows import window_work
from autotune.plan import Degrees, Plan
from autotune.schedules import schedule_of
from autotune.specs.cluster import Link


@dataclass(frozen=True)
class StepContext:
    """The plan and workload of one estimate, shared by every rank."""

    plan: Plan
    """The resolved plan (shares, placement and micro-batch count filled in)."""
    model: Any
    cluster: Any
    topo: C.Topology
    seq_len: int
    global_batch: int
    calibration: Mapping[str, Mapping[str, float]]
    dtype: str
    bpe: int
    """Bytes per element of the compute dtype."""
    degrees: Degrees
    """The degrees this step is priced at (a per-stage plan's cell: the envelope at the cell's tp);
    each dimension reads as an attribute of its own, ``step.tp`` (``_dimension_properties``)."""
    v: int
    """Virtual stages (model chunks) per pipeline rank."""
    n_chunks: int
    mbs: int
    zigzag: bool
    sp: bool
    """Sequence parallelism in effect (tp > 1)."""
    recompute: str
    """What the block count and the block's backward take (``recompute_modules.block_recompute``: named
    modules without ``core_attn`` keep the scores, as ``none``)."""
    recompute_modules: tuple[str, ...]
    """``Plan.recompute_modules`` (``cost/recompute_modules.py`` prices them)."""
    zero: int
    shard_n: int
    """Ranks holding the same parameters (``dims.shard_size``: dp * cp * hp), the ZeRO and
    gradient-sync group."""
    devs: tuple[int, ...]
    """Cluster device index of every rank."""
    microbatches: tuple[int, ...]
    """Micro-batches of each DP replica."""
    kv_ratio: float
    a2a_heads: int
    """Heads the busiest Ulysses rank exchanges (``ulysses.busiest_heads``)."""
    cp_max_tokens: int
    keysums: tuple[float, ...]
    """Causal (query, key) pairs of each CP shard (``compute.causal_keys``)."""
    ring: tuple[Any, ...]
    """Each CP shard's ring blocks (``ring.ring_blocks``; None without cp): priced one call each on
    CPU, and as the squares a materialised attention computes on an unprofiled GPU (datasheet.py)."""
    stage_params: tuple[tuple[float, float, float], ...]
    """(parameters of the pipeline rank before tp sharding, one block's, those outside its blocks)
    per pipeline rank."""
    dp_links: tuple[Link, ...]
    """The slowest link of each pipeline rank's parameter-sharing (dp x cp x hp) group."""
    schedule: Any = None
    """The plan's pipeline schedule (``autotune.schedules.schedule_of``): placement and order."""
    chunks: tuple[tuple[int, ...], ...] = ()
    """Model chunks of each pipeline rank (the schedule's placement), in model order."""
    hop_peers: tuple[tuple[tuple[int, bool, bool], ...], ...] = ()
    """Per pipeline rank, per chunk: (peer pipeline rank whose link prices its sends, sends
    forward, sends backward); see ``_hop_peers``."""
    group_links: tuple[tuple[Any, tuple, Links], ...] = ()
    """(DeviceSpec, placement key, links) of every tp group in rank order (``_mesh_links``)."""
    kernels: Any = None
    """The runtime's per-kernel costs (``kernels.KernelCosts``; None: autotune's own runtime),
    read through each rank's ``rates`` and, for whose model states they are, by ``memory``."""
    doc_work: Any = None
    """With document masks: one drawn step's attention work per DP replica and CP shard
    (``cost/documents.DocWork``), replacing ``keysums`` and ``ring``; None: whole causal windows."""
    experts: Any = None
    """A MoE model's expert layout (``expert_layout.ExpertStep``); None for a dense model."""
    grad_reduce: str = "fp32"
    """``Plan.grad_reduce``: the precision gradients are kept and reduced in under 16-bit compute."""
    moments: str = "fp32"
    """``Plan.moments``: the precision Adam's moments are kept in (``memory.state_bytes_per_param``)."""

    @cached_property
    def cost_token(self) -> int:
        """The values of STEP_INPUTS as one number (equal values, equal numbers), for the rank-cost
        memo's key (``RankContext.cost_key``)."""
        return _step_token(tuple(getattr(self, f) for f in STEP_INPUTS))


def _dimension_properties(cls: type) -> type:
    """Each declared dimension (``autotune/dims.py``) as a read-only attribute of the step, its
    degree in ``step.degrees``: the dimension modules read ``ctx.step.tp`` and a new declaration
    needs no new field here."""
    for name in dims.NAMES:  # attrgetter reads the degree in C (a lambda was a Python call per read)
        setattr(cls, name, property(operator.attrgetter(f"degrees.{name}"), doc=dims.dimension(name).doc))
    return cls


_dimension_properties(StepContext)


def step_context(plan: Plan, model: Any, cluster: Any, seq_len: int, global_batch: int,
                 calibration: Mapping[str, Mapping[str, float]] | None, kernels: Any = None) -> StepContext:
    """Resolve ``plan``, a mesh of its degrees (PlanError when it does not fit), and gather what every
    rank shares; a per-stage plan is ``cost/stages.py``'s, and ``cost/steps.py`` is the one place that
    tells the two apart. ``kernels``: the runtime's per-kernel costs (``kernels.KernelCosts``; None:
    autotune's own)."""
    rp = plan.resolve(model, cluster, seq_len, global_batch)
    d = rp.degrees
    topo = C.topology(cluster)
    devs = _devices(topo, rp.placement)
    tokens, zig = rp.shares.tokens, rp.cp_layout == "zigzag" and d.cp > 1
    shard_n = dims.shard_size(d)
    sched = schedule_of(rp)
    # the schedule's placement, asked once per estimate (Plan.stages_of_rank asks the registry each call)
    chunks = tuple(sched.stages_of_rank(i, d.pp, rp.virtual_stages) for i in range(d.pp))
    hop_peers = _hop_peers(sched, d.pp, rp.virtual_stages, chunks)
    moe = getattr(model, "moe", None) is not None
    dp_links, group_links = _mesh_links(topo, devs, d, rp.virtual_stages, hop_peers, moe)
    return StepContext(
        plan=rp, model=model, cluster=cluster, topo=topo, seq_len=seq_len, global_batch=global_batch,
        calibration=calibration or {}, dtype=rp.dtype, bpe=DTYPE_BYTES[rp.dtype],
        degrees=d, v=rp.virtual_stages, n_chunks=d.pp * rp.virtual_stages,
        mbs=rp.micro_batch_size, zigzag=zig, sp=rp.sequence_parallel and d.tp > 1, recompute=RMOD.block_recompute(rp.recompute, rp.recompute_modules),
        recompute_modules=rp.recompute_modules, zero=rp.zero_stage, shard_n=shard_n, devs=devs,
        microbatches=tuple(s // rp.micro_batch_size for s in rp.shares.samples),
        kv_ratio=model.kv_heads / model.heads,
        a2a_heads=U.busiest_heads(d.hp, rp.shares.heads, model.heads // d.tp),
        cp_max_tokens=max(tokens),
        keysums=shard_keysums(tokens, zig, seq_len), ring=shard_rings(tokens, zig, seq_len),
        stage_params=DP.stage_params(model, rp, chunks),
        dp_links=dp_links, schedule=sched, chunks=chunks, hop_peers=hop_peers, group_links=group_links,
        kernels=kernels, experts=expert_step(rp, model, chunks, kernels), grad_reduce=rp.grad_reduce,
        moments=rp.moments)


@lru_cache(maxsize=1024)
def shard_keysums(tokens: tuple[int, ...], zigzag: bool, seq_len: int) -> tuple[float, ...]:
    """Causal (query, key) pairs of each CP shard of ``tokens`` (``compute.causal_keys``), once per
    layout: each shard's sums the tokens before it, so cp shards cost O(cp^2) per estimate."""
    return tuple(causal_keys(tokens, i, zigzag, seq_len) for i in range(len(tokens)))


@lru_cache(maxsize=1024)
def shard_rings(tokens: tuple[int, ...], zigzag: bool, seq_len: int) -> tuple[Any, ...]:
    """Each CP shard's ring blocks (``ring.ring_blocks``; None for one shard), once per layout."""
    n = len(tokens)
    return tuple(ring_blocks(tokens, i, zigzag, seq_len) if n > 1 else None for i in range(n))


_DEVICES: dict[tuple[int, int], tuple[C.Topology, tuple, tuple[int, ...]]] = {}


def _devices(topo: C.Topology, placement: tuple) -> tuple[int, ...]:
    """Cluster device index of every rank, memoised per (topology object, placement object): both
    are immutable, the entry holds them so their ids are not reused while cached, and every plan
    resolved with the node-order placement shares one placement object (``plan.py``)."""
    key = (id(topo), id(placement))
    hit = _DEVICES.get(key)
    if hit is None or hit[0] is not topo or hit[1] is not placement:
        if len(_DEVICES) > 4096:  # one entry per layout and placement the search builds
            _DEVICES.clear()
        hit = _DEVICES[key] = (topo, placement, tuple(topo.index[(e.node, e.device)] for e in placement))
    return hit[2]


def _hop_peers(sched: Any, p: int, v: int, chunks: tuple[tuple[int, ...], ...]) -> tuple:
    """Per pipeline rank, per chunk j: (peer, sends forward, sends backward). A chunk sends its
    output to the rank of chunk j + 1 and its input gradient to that of j - 1 unless they sit on the
    same rank (the turn of a V). Its sends are priced on the link to the rank of the next chunk; where
    that is local, to the previous one's; the last chunk's on the link to the next pipeline rank, so
    the looped schedules price as they always did."""
    n = p * v
    rank_of = [sched.stage_rank(j, p, v) for j in range(n)]
    out = []
    for s in range(p):
        row = []
        for j in chunks[s]:
            fwd_out = j < n - 1 and rank_of[j + 1] != s
            bwd_out = j > 0 and rank_of[j - 1] != s
            q = rank_of[j + 1] if fwd_out else ((s + 1) % p if j == n - 1 or not bwd_out else rank_of[j - 1])
            row.append((q, fwd_out, bwd_out))
        out.append(tuple(row))
    return tuple(out)


class _LinksDoc:
    """The slowest link of each group a rank belongs to (``comm._SELF`` for a group of one): one field
    per declared dimension (``autotune/dims.py``; ``pp``: to the next pipeline rank, the last stage's
    to the first; ``dp``: the ring of the pipeline rank's parameter-sharing group, dp x cp x hp), and:

    ``pp_hops``: per chunk of the rank, (link its sends are priced on, sends forward, sends
    backward), from the schedule's placement (``StepContext.hop_peers``).
    ``hop_tps``: per-stage plans whose hops change tp: per chunk, (tp of the next chunk's stage, tp of
    the previous chunk's stage), the rank's own tp past either end (``cost/stages.py``; what
    ``pipeline_parallel.hop_bytes`` counts copies with); empty where every hop keeps the tp.
    ``dp_tp``: per-stage plans whose stage's replicas differ in tp: the smallest tp of the rank's
    stage (the gradient reduction moves parameters / dp_tp, ``data_parallel.step_transfers``); 0 otherwise.
    ``experts``: a MoE plan's expert groups' links (``expert_layout.ExpertLinks``; the expert mesh's
    dimensions, ep and etp, fold onto these ranks); None for a dense model."""

    __slots__ = ()


_LINKS_FIELDS = (*dims.MESH_ORDER, "pp_hops", "hop_tps", "dp_tp", "experts")


def _links_hash(self: Any) -> int:
    """The dataclass's hash (of its fields' tuple), computed once per object: the rank-cost memo's key
    holds a rank's links by value (``RankContext.place_token``), and hashing its nested links again for
    every tp group of every estimate was a tenth of an estimate at 1,024 devices."""
    h = self.__dict__.get("_hash")
    if h is None:
        h = self.__dict__["_hash"] = hash(tuple(getattr(self, f) for f in _LINKS_FIELDS))
    return h


def _links_state(self: Any) -> dict[str, Any]:
    """Pickled without the kept hash: a string's hash differs between processes (PYTHONHASHSEED)."""
    return {k: v for k, v in self.__dict__.items() if k != "_hash"}


Links = dataclasses.make_dataclass(
    "Links", [*((n, Link, dataclasses.field(default=C._SELF)) for n in dims.MESH_ORDER),
              ("pp_hops", tuple, dataclasses.field(default=())), ("hop_tps", tuple, dataclasses.field(default=())),
              ("dp_tp", int, dataclasses.field(default=0)), ("experts", Any, dataclasses.field(default=None))],
    bases=(_LinksDoc,), frozen=True, namespace={"__module__": __name__, "__doc__": _LinksDoc.__doc__,
                                                "__hash__": _links_hash, "__getstate__": _links_state})


@dataclass(frozen=True)
class RankContext:
    """One tensor-parallel group's place in the step (its ranks do identical work)."""

    step: StepContext
    coords: Mapping[str, int]
    """Mesh coordinates (``Plan.coords``) of the first group with this context; the groups sharing
    it share its pipeline rank (``pp_index``) and CP index, and may differ in their DP index
    (``tp_groups`` gives each its own) and in hp indexes of equal heads (``tp_groups``)."""
    spec: Any
    """The DeviceSpec its ranks run on."""
    rates: Rates
    collectives: Any
    """``comm.FORMULAS`` or a profiled CPU's ``cpu.GlooTable``."""
    cf: float
    """Calibration factor on compute and memory-bound time for this device type."""
    mf: float
    """Calibration factor on communication time for this device type."""
    links: Links
    tokens: int
    """Tokens of its CP shard."""
    heads: int
    """Query heads it attends (after tp and hp)."""
    microbatches: int
    """Micro-batches its DP replica runs."""
    layers: tuple[int, ...]
    """Layers of each model chunk on its pipeline rank."""
    params: float
    """Parameters of its pipeline rank before tp sharding."""
    layer_params: float
    """Parameters of one block before tp sharding."""
    rest_params: float
    """Parameters of its pipeline rank outside its blocks (embedding, final norm, head) before tp."""
    keysum: float
    ring: Any
    tokens_local: float
    """Tokens it holds outside attention, over its micro-batch: mbs * tokens / hp."""
    hidden_bytes: float
    """One block's input activation on this rank: bytes per element * tokens_local * hidden."""
    expert_peers: Any = None
    """A MoE rank's EP group: (rates, compute calibration factor) of each EP rank's device
    (``_expert_peers``; one object per distinct group, compared by identity); None for a dense model."""
    attn_seq: float | None = None
    """With documents: the length the attention kernels run at (the pair-weighted mean document
    piece, ``cost/documents.py``); None: the CP shard (``tokens``)."""
    window: Any = None
    """Its sliding-window layers' work (``windows.WindowWork``); None for a model without windows."""

    @property
    def block_seq(self) -> float:
        """The sequence length attention is priced at (kernel efficiency): the shard, or the documents'."""
        return self.tokens if self.attn_seq is None else self.attn_seq

    @property
    def pp_index(self) -> int:
        return self.coords["pp"]

    @property
    def expert_links(self) -> Any:
        """The links of its expert groups (``Links.experts``)."""
        return self.links.experts

    def with_work(self, step: StepContext, coords: Mapping[str, int], keysum: float, ring: Any,
                  attn_seq: float | None) -> RankContext:
        """This context as another DP replica of its place sees it in a step of documents: ``step`` (a
        drawn step of the same estimate), the replica's ``coords`` and its attention work
        (``DOC_INPUTS``), everything else this context's. A copy of the instance's fields, not a call
        of ``__init__`` (a search builds hundreds of thousands). It keeps a computed ``place_token``:
        every input that names is this context's."""
        new = object.__new__(RankContext)
        d = new.__dict__
        d.update(self.__dict__)
        d.update(step=step, coords=coords, keysum=keysum, ring=ring, attn_seq=attn_seq)
        return new

    @cached_property
    def place_token(self) -> int:
        """``cost_key`` less the attention work (``DOC_INPUTS``) as one number: equal keys, equal
        numbers (the objects by identity, the values by equality; a number is never reused). The
        rank-cost memo's key is this with the work (``rank.rank_cost_memo``), so a replica copied
        from its template (``with_work``) costs a lookup of four values, not of its whole key."""
        s = self.step
        objs = (s.model, s.schedule, self.spec, self.rates, self.collectives, self.expert_peers)
        return _place_token(objs, (s.cost_token, *_PLACE_VALUES(self)))

    def cost_key(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """(objects, values): everything ``cost.rank.rank_cost`` reads from this context and its
        step. Two contexts with equal keys have equal rank costs, so a search prices each tp group
        it has seen once across all the plans it prices (``rank.rank_cost_memo``). The objects
        (STEP_OBJECTS, RANK_OBJECTS) are compared by identity, the values by equality; the step's
        values are one interned number per estimate (``StepContext.cost_token``), so the key hashes
        them once, not once per tp group. tests/unit/test_rank_cost_key.py runs ``rank_cost`` on
        proxies that record every attribute read, over plans of every schedule, CPU and GPU
        clusters, measured layers and calibration, and fails when it reads anything not named here."""
        s = self.step
        return ((s.model, s.schedule, self.spec, self.rates, self.collectives, self.expert_peers),
                (s.cost_token, *(getattr(self, f) for f in RANK_INPUTS)))


STEP_INPUTS = ("a2a_heads", "bpe", "chunks", "cp", "cp_max_tokens", "dtype", "experts", "grad_reduce", "hp", "kernels",
               "kv_ratio",
               "mbs", "microbatches", "moments", "n_chunks", "pp", "recompute",
               "recompute_modules", "seq_len", "shard_n", "sp", "tp", "v", "zero")
"""The StepContext fields ``rank_cost`` reads by value (``RankContext.cost_key``)."""
STEP_OBJECTS = ("model", "schedule")
"""The StepContext fields ``rank_cost`` reads, compared by identity."""
RANK_INPUTS = ("attn_seq", "block_seq", "cf", "mf", "heads", "hidden_bytes", "keysum", "layer_params", "layers", "links", "microbatches",
               "params", "pp_index", "rest_params", "ring", "tokens", "tokens_local", "window")
"""The RankContext fields ``rank_cost`` reads by value; ``step`` it reads through STEP_INPUTS and
STEP_OBJECTS."""
RANK_OBJECTS = ("spec", "rates", "collectives", "expert_peers")
"""The RankContext fields ``rank_cost`` reads, compared by identity. (Links are compared by value:
equal links of other layouts and placements are where most repeats come from.)"""

DOC_INPUTS = ("attn_seq", "block_seq", "keysum", "ring")
"""The RANK_INPUTS a step of documents gives each DP replica its own of (``RankContext.with_work``;
``block_seq`` follows ``attn_seq``)."""
PLACE_INPUTS = tuple(f for f in RANK_INPUTS if f not in DOC_INPUTS)
"""The RANK_INPUTS a replica shares with its place (``RankContext.place_token``)."""
_PLACE_VALUES = operator.attrgetter(*PLACE_INPUTS)
"""The PLACE_INPUTS of a context as one tuple (read in C: a generator of getattr was most of the token)."""

_PLACE_TOKENS: dict[tuple, tuple[tuple[Any, ...], int]] = {}


def _place_token(objs: tuple[Any, ...], values: tuple[Any, ...]) -> int:
    """One number per (objects by identity, values); the entry holds the objects, so their ids are not
    reused while it is cached, and a number is never given twice (``_NEXT_TOKEN``)."""
    key = (tuple(map(id, objs)), values)
    hit = _PLACE_TOKENS.get(key)
    if hit is None or not all(map(operator.is_, hit[0], objs)):
        if len(_PLACE_TOKENS) > 100_000:
            _PLACE_TOKENS.clear()
        hit = _PLACE_TOKENS[key] = (objs, next(_NEXT_TOKEN))
    return hit[1]


_STEP_TOKENS: dict[tuple, int] = {}
_NEXT_TOKEN = itertools.count()  # never restarts: a token is never reused for other values


def _step_token(values: tuple) -> int:
    tok = _STEP_TOKENS.get(values)
    if tok is None:
        if len(_STEP_TOKENS) > 100_000:
            _STEP_TOKENS.clear()
        tok = _STEP_TOKENS[values] = next(_NEXT_TOKEN)
    return tok



_MESH_LINKS: dict[tuple, tuple[C.Topology, tuple, tuple]] = {}


def _mesh_links(topo: C.Topology, devs: tuple[int, ...], d: Degrees, v: int, hop_peers: tuple, moe: bool = False
                ) -> tuple[tuple, tuple]:
    """(dp link of each pipeline rank, (DeviceSpec, placement key, ``Links``) of every tp group).
    The placement key tells apart groups at different mesh coordinates along pp/cp/hp, on another
    device type or other links (``ReplicaTemplates`` adds the micro-batches); groups of one key share
    one Links object, and so do groups of equal links at any coordinates (``tp_groups`` merges by it). Memoised per (topology object, devices, degrees, virtual stages, hop peers): a
    pure function of them (links and specs are the topology's and cluster's own objects, so the
    identities in the keys come out the same), and the search resolves plan after plan of one mesh
    onto the same devices; the entry holds the topology, so its id is not reused while cached."""
    key = (id(topo), devs, d, v, hop_peers, moe)
    hit = _MESH_LINKS.get(key)
    if hit is None or hit[0] is not topo:
        if len(_MESH_LINKS) > 4096:  # 128 devices: ~260 layouts x 5 placements
            _MESH_LINKS.clear()
        dp_links, groups = mesh_links.build(topo, devs, d, v, hop_peers, moe, Links, _tp_group_coords(d))
        hit = _MESH_LINKS[key] = (topo, dp_links, groups)
    return hit[1], hit[2]


@lru_cache(maxsize=512)
def _tp_group_coords(degrees: Degrees) -> tuple[tuple[int, Mapping[str, int]], ...]:
    """(first rank, ``Plan.coords``) of every tp group of a mesh, read-only, memoised per degrees
    (the search prices many plans of the same degrees)."""
    plan = Plan(degrees=degrees)
    return tuple((r0, MappingProxyType(plan.coords(r0))) for r0 in range(0, degrees.world, degrees.tp))


def tp_groups(s: StepContext, replicas: ReplicaTemplates | None = None) -> list[tuple[int, int, RankContext]]:
    """(first rank, DP index, context) of every tensor-parallel group in rank order. Groups that see
    the same step share one context object, so the cost of each is computed once: the same pipeline
    rank, CP index, device type, links (one object per value, ``_mesh_links``) and micro-batches, and
    hp indexes of equal heads (``_equal_classes``): DP replicas of equal shares on equal devices, and
    the hp ranks of an even split. They are merged before their contexts are built: at 1,024 devices
    an estimate had ~613 tp groups and ~381 contexts keyed by coordinate, of which ~78 distinct
    (the rank-cost memo's keys). A merged group's context carries the coordinates of the first group
    of its kind: what reads a context reads its pipeline rank (``pp_index``) and CP index, never its
    hp index. (CP indexes are not merged: two shards of one layout differ in their causal work or,
    zigzag, in the order of their ring blocks, which the attention's price sums in.) With documents (``s.doc_work``) every replica has its own attention work,
    so its own context (``ReplicaTemplates``: pass one per estimate, its drawn steps share it); a
    uniform work (``DocWork.uniform``: a summarised step) is one context per place, as without
    documents (through ``replicas`` when given: the summary's two works share its templates)."""
    plan, cal = s.plan, s.calibration
    if s.doc_work is not None and (replicas is not None or not s.doc_work.uniform):
        return (replicas or ReplicaTemplates()).groups(s)
    hps = _equal_classes(plan.shares.heads)
    contexts: dict[tuple, RankContext] = {}
    out = []
    for (r0, c), (pp, dp, cp, hp), (spec, _, links) in zip(_tp_group_coords(plan.degrees), _tp_group_index(plan.degrees),
                                                           s.group_links, strict=True):
        m_d = s.microbatches[dp]
        key = (pp, cp, hps[hp], id(spec), id(links), m_d)
        ctx = contexts.get(key)
        if ctx is None:
            ctx = contexts[key] = _rank_context(s, c, spec, links, m_d, cal.get(spec.name) or {})
        out.append((r0, dp, ctx))
    return out


@lru_cache(maxsize=512)
def _tp_group_index(degrees: Degrees) -> tuple[tuple[int, int, int, int], ...]:
    """(pp, dp, cp, hp) index of every tp group of a mesh (``_tp_group_coords``'s, as plain ints: what
    ``tp_groups`` keys its merge by, read per group of every estimate)."""
    return tuple((c["pp"], c["dp"], c["cp"], c["hp"]) for _, c in _tp_group_coords(degrees))


@lru_cache(maxsize=1024)
def _equal_classes(values: tuple) -> tuple[int, ...]:
    """Per index of ``values``, the first index holding an equal value (a class per distinct value)."""
    first: dict[Any, int] = {}
    return tuple(first.setdefault(x, i) for i, x in enumerate(values))


class ReplicaTemplates:
    """The tp groups of an estimate's steps of documents. The steps differ only in their work
    (``StepContext.doc_work``), so which groups share a context (same place, micro-batches and DP
    index: with documents replicas differ; a uniform work: same place and micro-batches) and each
    place's context (a template: ``_rank_context``, with its ``place_token``) are found once, at the
    first step; every step then copies each template per replica (or per place, a uniform work)
    with its attention work (``RankContext.with_work``). One object serves steps of one kind."""

    def __init__(self) -> None:
        self.layout: list[tuple[int, int, int]] = []
        """(first rank, DP index, index of its context in ``uniques``) per tp group, in rank order."""
        self.uniques: list[tuple[RankContext, int, int, Mapping[str, int]]] = []
        """(template, DP index, CP index, coordinates of its first group) per distinct context."""

    def groups(self, s: StepContext) -> list[tuple[int, int, RankContext]]:
        if not self.layout:
            self._find(s)
        w = s.doc_work
        ctxs = [t.with_work(s, c, w.keysums[d][cp], w.ring[d][cp], w.attn_seq[d][cp])
                for t, dp, cp, c in self.uniques for d in (0 if w.uniform else dp,)]
        return [(r0, dp, ctxs[i]) for r0, dp, i in self.layout]

    def _find(self, s: StepContext) -> None:
        cal = s.calibration
        templates: dict[tuple, RankContext] = {}
        index: dict[tuple, int] = {}
        for (r0, c), (spec, place, links) in zip(_tp_group_coords(s.plan.degrees), s.group_links, strict=True):
            m_d = s.microbatches[c["dp"]]
            key = (place, m_d) if s.doc_work.uniform else (place, m_d, c["dp"])
            i = index.get(key)
            if i is None:
                t = templates.get((place, m_d))
                if t is None:
                    t = templates[(place, m_d)] = _rank_context(s, c, spec, links, m_d, cal.get(spec.name) or {})
                    _ = t.place_token  # computed once here, so every copy carries it
                i = index[key] = len(self.uniques)
                self.uniques.append((t, c["dp"], c["cp"], c))
            self.layout.append((r0, c["dp"], i))


def _rank_context(s: StepContext, c: Mapping[str, int], spec: Any, links: Links, m_d: int,
                  cal: Mapping[str, float]) -> RankContext:
    tokens = s.plan.shares.tokens[c["cp"]]
    tok = s.mbs * tokens / s.hp
    w = s.doc_work
    d = 0 if w is None or w.uniform else c["dp"]  # a uniform work holds one replica's, every replica's
    params, layer_params, rest = s.stage_params[c["pp"]]
    return _new_rank_context(
        step=s, coords=c, spec=spec, rates=cached_rates(spec, s.dtype, s.model.head_dim, s.kernels),
        collectives=collectives_for(spec), cf=float(cal.get("compute", 1.0)), mf=float(cal.get("comm", 1.0)),
        links=links, tokens=tokens, heads=s.plan.shares.heads[c["hp"]], microbatches=m_d,
        layers=tuple(s.plan.shares.layers[j] for j in s.chunks[c["pp"]]),  # Plan.layers_of_stage
        params=params, layer_params=layer_params, rest_params=rest,
        keysum=s.keysums[c["cp"]] if w is None else w.keysums[d][c["cp"]],
        ring=s.ring[c["cp"]] if w is None else w.ring[d][c["cp"]],
        attn_seq=None if w is None else w.attn_seq[d][c["cp"]],
        window=window_work(s, c["cp"], s.chunks[c["pp"]]),
        tokens_local=tok, hidden_bytes=s.bpe * tok * s.model.hidden,
        expert_peers=None if links.experts is None else _expert_peers(s, links.experts.ep_devices))


_RANK_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RankContext)
                  if f.default is not dataclasses.MISSING}


def _new_rank_context(**fields: Any) -> RankContext:
    """``RankContext(**fields)`` without the frozen dataclass's ``__init__`` (one ``object.__setattr__``
    per field: half of building a context, and an estimate at 1,024 devices builds hundreds): the same
    instance dictionary, each field given or its default; a missing or unknown field raises as
    ``__init__`` would."""
    if fields.keys() - _RANK_FIELDS or _RANK_REQUIRED - fields.keys():
        return RankContext(**fields)  # raises TypeError naming the field
    new = object.__new__(RankContext)
    new.__dict__.update(_RANK_DEFAULTS, **fields)
    return new


_RANK_FIELDS = frozenset(f.name for f in dataclasses.fields(RankContext))
_RANK_REQUIRED = _RANK_FIELDS - _RANK_DEFAULTS.keys()

_PEERS: dict[tuple, tuple] = {}


def _expert_peers(s: StepContext, names: tuple[str, ...]) -> tuple:
    """(rates, compute calibration) of each EP rank's device type ``names``, one tuple object per
    distinct content (the rank-cost memo compares it by identity, as it does ``rates``)."""
    specs = {d.spec.name: d.spec for d in s.cluster.devices}
    peers = tuple((cached_rates(specs[n], s.dtype, s.model.head_dim, s.kernels),
                   float((s.calibration.get(n) or {}).get("compute", 1.0))) for n in names)
    key = tuple((id(r), cf) for r, cf in peers)
    hit = _PEERS.get(key)
    if hit is None or any(a is not b[0] for a, b in zip((r for r, _ in hit), peers, strict=True)):
        if len(_PEERS) > 1024:
            _PEERS.clear()
        hit = _PEERS[key] = peers
    return hit
