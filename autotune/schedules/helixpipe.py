"""HelixPipe (Zhang et al. 2025, arXiv 2507.00394): the attention-parallel pipeline, in one place.

Every layer is cut in three: *pre-attention* (LN1, and the QKV weights shipped to the attention),
the parameter-free *attention* (QKV projection with the shipped weights, rotary, causal attention)
and *post-attention* (output projection, residual, LN2, MLP, residual). Parameter block ``j``
(``0 .. L``) is PostAttn(layer j-1) + PreAttn(layer j) and lives on pipeline rank ``j % p``; block 0
also holds the embedding, block L the final norm, the LM head and the loss, so rank 0 holds both
ends (L must be a multiple of p). One micro-batch is then a chain of ``2L + 1`` operations,
chain position ``k``::

    k = 2j      parameter block j     on rank  j % p
    k = 2i + 1  attention of layer i  on rank (i + 1 + d) % p     (layers 0-based)

where ``d`` is the micro-batch's *offset* inside its group of ``p * F`` micro-batches (F folds).
Offset 0 is an ordinary one-layer-per-stage pipeline (attention on the rank of the block that
follows it); the offsets rotate the attention, so the p micro-batches of a group run their
attention on p different ranks and every rank runs ``L/p`` attentions per micro-batch.

The order (two-fold, first in last out): micro-batch ``(group g, offset d, fold f)`` is delayed by
``d`` operations, so in a schedule of unit operations chain position ``k`` runs at ``d + k``; the F
folds run each operation back to back (innermost loop), so one fold's transfer overlaps the other's
compute; groups follow one another; every forward of the step comes first, then every backward in
the exact reverse order (time-reversal of a valid schedule is valid for the reversed data flow).
With unit operations the ranks interleave a run of p attentions and a run of p blocks without a
gap, whatever the ratio of attention to block time; the only loss is rank 0's extra block per
micro-batch (it holds both ends). ``rank_order`` is the one source of this order: the runtime
(``autotune/runtime/helix.py``) executes it, the cost model's simulation (``simulate``) times it.

Pure Python (no torch): the cost model imports it in the search's inner loop.
Pure Python (no torch). This module holds the order, placement and memory rules; the cost model's
side (the simulation that times ``rank_order``, each rank's operation prices, its memory) is
``autotune/cost/helixpipe.py`` and the runtime's is ``autotune/runtime/helix.py``: both ask this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any, NamedTuple

from autotune.schedules.base import B, F, Op, Schedule

FWD, BWD = 0, 1
FOLDS = (1, 2)
"""HelixPipe's fold counts (the fork's ``--num-fold``: two folds hide one another's transfers)."""
"""Operation kinds (the same numbers as torch.distributed.pipelining's F and B)."""


class HelixOp(NamedTuple):
    """One operation of one rank: ``kind`` (FWD, BWD) of chain position ``k`` on ``microbatch``."""

    kind: int
    k: int
    microbatch: int


# ---- placement ----------------------------------------------------------------------------------
def block_rank(j: int, p: int) -> int:
    """Pipeline rank of parameter block ``j`` (0 .. L)."""
    return j % p


def attention_rank(i: int, offset: int, p: int, shares: tuple[int, ...] | None = None) -> int:
    """Pipeline rank of layer ``i``'s attention (0-based) for a micro-batch at ``offset``.

    ``shares`` (the plan's ``helix_attention``; None: L/p each, the published rotation): how many of
    a micro-batch's L attentions each rank runs. The ranks take turns along a cycle of L slots in
    which rank r appears ``shares[r]`` times, spread evenly (``attention_slots``); the micro-batch at
    offset d starts d slots further on, as the published rotation does."""
    if shares is None:
        return (i + 1 + offset) % p
    slots = attention_slots(shares)
    return slots[(i + 1 + offset) % len(slots)]


@lru_cache(maxsize=256)
def attention_slots(shares: tuple[int, ...]) -> tuple[int, ...]:
    """A cycle of ``sum(shares)`` slots where rank r appears ``shares[r]`` times, evenly interleaved
    (smooth weighted round robin: each turn goes to the rank furthest behind its share)."""
    total = sum(shares)
    credit = [0] * len(shares)
    out = []
    for _ in range(total):
        for r, w in enumerate(shares):
            credit[r] += w
        best = max(range(len(shares)), key=lambda r: (credit[r], -r))
        credit[best] -= total
        out.append(best)
    return tuple(out)


def offset_of(mb: int, p: int, folds: int) -> int:
    """Offset ``d`` of micro-batch ``mb`` in its group (micro-batches are numbered group-major,
    then offset, then fold: ``mb = (g * p + d) * F + f``)."""
    return (mb // folds) % p


def chain_rank(k: int, mb: int, p: int, folds: int, shares: tuple[int, ...] | None = None) -> int:
    """Pipeline rank of chain position ``k`` of micro-batch ``mb``."""
    if k % 2 == 0:
        return block_rank(k // 2, p)
    return attention_rank(k // 2, offset_of(mb, p, folds), p, shares)


def is_block(k: int) -> bool:
    return k % 2 == 0


def blocks_of_rank(rank: int, p: int, layers: int) -> tuple[int, ...]:
    """Parameter blocks ``j`` held by pipeline rank ``rank`` (rank 0: 0, p, ..., L)."""
    return tuple(j for j in range(layers + 1) if block_rank(j, p) == rank)


def problems(p: int, layers: int, m: int, folds: int, shares: tuple[int, ...] | None = None) -> list[str]:
    """Why HelixPipe cannot run ``p`` ranks, ``layers`` layers, ``m`` micro-batches per replica."""
    out = []
    if p < 2:
        out.append(f"degrees.pp: helixpipe needs pp >= 2, got pp({p})")
    if layers % p:
        out.append(f"degrees.pp: helixpipe needs layers({layers}) divisible by pp({p}) (L/p one-layer "
                   "chunks per rank)")
    if m % (p * folds) or m < 1:
        out.append(f"num_microbatches: helixpipe needs micro-batches per replica divisible by "
                   f"pp({p})*helix_folds({folds}) = {p * folds}, got {m}")
    if shares is not None and (len(shares) != p or sum(shares) != layers or min(shares) < 0):
        out.append(f"helix_attention: {list(shares)} must give each of pp({p}) ranks its attentions per "
                   f"micro-batch (>= 0), adding up to layers({layers})")
    return out


# ---- order --------------------------------------------------------------------------------------
@lru_cache(maxsize=1024)
def rank_order(p: int, layers: int, m: int, folds: int, rank: int,
               shares: tuple[int, ...] | None = None) -> tuple[HelixOp, ...]:
    """Operations of pipeline rank ``rank`` in the order it runs them (see the module docstring).
    Any placement (``shares``) keeps it deadlock-free: every rank runs its operations in one global
    order (ideal start, then fold) that every dependency respects."""
    bad = problems(p, layers, m, folds, shares)
    if bad:
        raise ValueError("; ".join(bad))
    if shares is not None and len(set(shares)) > 1:
        fwd = list(_listed_forward(p, layers, m, folds, shares)[rank])
    else:
        group = p * folds
        keyed = []
        for mb in range(m):
            g, d, f = mb // group, offset_of(mb, p, folds), mb % folds
            for k in range(2 * layers + 1):
                if chain_rank(k, mb, p, folds, shares) == rank:
                    keyed.append(((g, d + k, f), k, mb))
        keyed.sort()
        fwd = [HelixOp(FWD, k, mb) for _, k, mb in keyed]
    return tuple(fwd) + tuple(HelixOp(BWD, op.k, op.microbatch) for op in reversed(fwd))


class _Ready:
    """One rank's ready operations for the list schedule: ``waiting`` by ready time, ``avail`` (those
    ready by the rank's next start) by priority, and ``avail_t`` their ready times, lazily deleted
    (``gone``), for the earliest ready time."""

    def __init__(self) -> None:
        import heapq

        self.hq = heapq
        self.waiting: list = []
        self.avail: list = []
        self.avail_t: list[float] = []
        self.gone: dict[float, int] = {}
        self.start = 0.0

    def push(self, item: tuple) -> None:
        self.hq.heappush(self.waiting, (item[1], item))

    def _earliest(self) -> float | None:
        h, gone, hq = self.avail_t, self.gone, self.hq
        while h and gone.get(h[0]):
            gone[h[0]] -= 1
            hq.heappop(h)
        cands = ([h[0]] if h else []) + ([self.waiting[0][0]] if self.waiting else [])
        return min(cands) if cands else None

    def next_start(self, free: float) -> float | None:
        """When this rank, free at ``free``, starts its next operation (None: nothing is ready);
        afterwards ``avail`` holds exactly the operations ready by then."""
        hq, mt = self.hq, self._earliest()
        if mt is None:
            return None
        at = max(free, mt)
        if at < self.start and any(it[1] > at for it in self.avail):  # an earlier operation arrived
            back = [it for it in self.avail if it[1] > at]
            self.avail = [it for it in self.avail if it[1] <= at]
            hq.heapify(self.avail)
            self.avail_t = [it[1] for it in self.avail]
            hq.heapify(self.avail_t)
            self.gone = {}
            for it in back:
                self.push(it)
        self.start = at
        while self.waiting and self.waiting[0][0] <= at:
            _, it = hq.heappop(self.waiting)
            hq.heappush(self.avail, it)
            hq.heappush(self.avail_t, it[1])
        return at

    def pop(self) -> tuple:
        item = self.hq.heappop(self.avail)
        self.gone[item[1]] = self.gone.get(item[1], 0) + 1
        return item


@lru_cache(maxsize=64)
def _listed_forward(p: int, layers: int, m: int, folds: int,
                    shares: tuple[int, ...]) -> tuple[tuple[HelixOp, ...], ...]:
    """Forward orders of every rank under uneven attention shares, by list scheduling: an operation
    of rank r takes ``1 / speed_r`` with the speed its share implies (``shares[r] / (L/p)``, a rank
    without attention at the slowest given speed), and a free rank runs, among the operations whose
    input is ready, the one the published order puts first (group, ideal start, fold). Unlike the
    group-major order this lets a rank start the next group while the last one's chain still runs:
    with uneven speeds one group no longer paces the ranks in lockstep.

    Each step changes the state of two ranks only (the one that ran, the one its output goes to), so
    only those two look again at their ready operations, kept in heaps: O(ops log ops), where
    scanning every ready operation of every rank each step took ~2 s at 512 micro-batches."""
    per = layers / p
    slow = min(x for x in shares if x > 0) / per
    dur = [1.0 / (x / per if x > 0 else slow) for x in shares]
    n, group = 2 * layers + 1, p * folds
    ready = [_Ready() for _ in range(p)]
    for mb in range(m):  # block 0 of every micro-batch is ready at 0
        ready[0].push(((mb // group, offset_of(mb, p, folds), mb % folds), 0.0, 0, mb))
    free = [0.0] * p
    starts = [ready[r].next_start(0.0) for r in range(p)]
    out: list[list[HelixOp]] = [[] for _ in range(p)]
    for _ in range(m * n):
        # the rank that can start something earliest runs its first-priority ready operation
        nxt = min(((t, r) for r, t in enumerate(starts) if t is not None), default=None)
        assert nxt is not None, "helixpipe list schedule stalled"
        at, r = nxt
        key, _, k, mb = ready[r].pop()
        out[r].append(HelixOp(FWD, k, mb))
        free[r] = at + dur[r]
        touched = [r]
        if k + 1 < n:
            nr = chain_rank(k + 1, mb, p, folds, shares)
            ready[nr].push(((key[0], offset_of(mb, p, folds) + k + 1, mb % folds), free[r], k + 1, mb))
            touched.append(nr)
        for x in touched:  # only these two ranks' state changed
            starts[x] = ready[x].next_start(free[x])
    return tuple(tuple(o) for o in out)


def all_orders(p: int, layers: int, m: int, folds: int,
               shares: tuple[int, ...] | None = None) -> tuple[tuple[HelixOp, ...], ...]:
    return tuple(rank_order(p, layers, m, folds, r, shares) for r in range(p))


def peer(op: HelixOp, p: int, layers: int, folds: int, shares: tuple[int, ...] | None = None) -> int | None:
    """Pipeline rank the output of ``op`` goes to (None at the ends of the chain)."""
    nxt = op.k + 1 if op.kind == FWD else op.k - 1
    if nxt < 0 or nxt > 2 * layers:
        return None
    return chain_rank(nxt, op.microbatch, p, folds, shares)


def source(op: HelixOp, p: int, layers: int, folds: int, shares: tuple[int, ...] | None = None) -> int | None:
    """Pipeline rank the input of ``op`` comes from (None: the data, or the loss)."""
    prev = op.k - 1 if op.kind == FWD else op.k + 1
    if prev < 0 or prev > 2 * layers:
        return None
    return chain_rank(prev, op.microbatch, p, folds, shares)


@lru_cache(maxsize=1024)
def in_flight(p: int, layers: int, m: int, folds: int, rank: int,
              shares: tuple[int, ...] | None = None) -> tuple[int, int]:
    """(most (block or attention) x micro-batch activations ``rank`` holds at once, most
    micro-batches whose logits it holds). ``rank_order`` runs every forward of a rank before its
    backwards, so both peaks are counts of its forwards, taken here without building the order (a
    list schedule of m x (2L + 1) operations under uneven shares: seconds in a search's hill climb):
    its blocks for every micro-batch, its attentions per micro-batch offset (the rotation depends
    on nothing else), the logits those of block L."""
    bad = problems(p, layers, m, folds, shares)
    if bad:
        raise ValueError("; ".join(bad))
    blocks = len(blocks_of_rank(rank, p, layers))
    per_offset = [0] * p  # micro-batches at each offset of their group
    for mb in range(m):
        per_offset[offset_of(mb, p, folds)] += 1
    attentions = sum(n * sum(1 for i in range(layers) if attention_rank(i, d, p, shares) == rank)
                     for d, n in enumerate(per_offset) if n)
    return m * blocks + attentions, (m if block_rank(layers, p) == rank else 0)


def plan_problems(plan, model) -> list[str]:
    """Why a helixpipe ``plan`` (resolved shares) cannot run ``model``: the schedule's shape rules
    and what its runtime does not compose with."""
    d = plan.degrees
    out = []
    if plan.virtual_stages != 1:
        out.append(f"virtual_stages: helixpipe places one-layer blocks itself, got virtual_stages({plan.virtual_stages})")
    if d.cp > 1 or d.hp > 1:
        out.append(f"degrees: helixpipe runs each attention whole on one rank; cp({d.cp}) and hp({d.hp}) must be 1")
    if plan.recompute == "selective":
        out.append("recompute: helixpipe keeps the attention output ('full' checkpoints the parameter blocks "
                   "without attention); 'selective' would recompute the attention it exists to keep")
    if plan.zero_stage > 1:  # its trainer drives autotune's own TrainOptimizer, not FSDP2
        out.append(f"zero_stage: the helixpipe runtime shards optimizer states only (ZeRO 0 or 1), "
                   f"got {plan.zero_stage}")
    layers = plan.shares.layers
    if layers is not None and len(set(layers)) > 1:
        out.append(f"shares.layers: helixpipe holds L/p layers on every rank, got {list(layers)}")
    counts = sorted({s_ // plan.micro_batch_size for s_ in plan.shares.samples or ()})
    for c in counts or [plan.num_microbatches or 0]:
        out += [x for x in problems(d.pp, model.layers, c, plan.helix_folds, plan.helix_attention) if x not in out]
    return out


# ---- the schedule module (autotune/schedules/base.py) --------------------------------------------
class HelixPipe(Schedule):
    """HelixPipe as the registry sees it; configured per plan with its folds (``for_plan``)."""

    name = "helixpipe"
    summary = ("HelixPipe: attention-parallel pipeline, two-fold first-in-last-out order, recomputation "
               "without attention (Zhang et al. 2025, arXiv 2507.00394)")
    chain = False
    fold_choices = FOLDS
    places_attention = True
    targets = {"megatron": "--attention-pipeline (HelixPipe's Megatron-LM fork)"}
    refusals = {
        "torchtitan": "schedule helixpipe: torchtitan's pipeline schedules run whole layers per stage; none "
                      "splits attention off the parameter blocks (HelixPipe needs its own fork of Megatron-LM)",
        "deepspeed": "schedule helixpipe: DeepSpeed's pipeline engine runs its own 1F1B schedule (TrainSchedule) "
                     "over whole layers, one stage per rank",
        "accelerate": "schedule helixpipe: Accelerate has no training pipeline schedule",
    }

    def __init__(self, folds: int = 1, layers: int | None = None, shares: tuple[int, ...] | None = None):
        self.folds, self.layers, self.shares = folds, layers, shares

    def for_plan(self, plan: Any) -> HelixPipe:
        layers = sum(plan.shares.layers) if plan.shares.layers is not None else None
        return HelixPipe(plan.helix_folds, layers, getattr(plan, "helix_attention", None))

    def options(self) -> tuple[Any, ...]:
        return (self.folds, self.layers, self.shares)

    def min_microbatches(self, pp: int, virtual_stages: int) -> int:
        return pp * self.folds

    def microbatch_multiple(self, pp: int, virtual_stages: int) -> int:
        return pp * self.folds

    def check_shape(self, pp: int, virtual_stages: int) -> list[str]:
        return []  # check_plan says it all (plan_problems: it needs the model's layers)

    def check_microbatches(self, pp: int, virtual_stages: int, counts: Sequence[int]) -> list[str]:
        return []

    def check_plan(self, plan: Any, model: Any) -> list[str]:
        return plan_problems(plan, model)

    def op_order(self, pp: int, virtual_stages: int, m: int, rank: int) -> tuple[Op, ...]:
        """``rank_order`` as ``Op``: ``stage`` is the chain position k (2j block j, 2i+1 attention i)."""
        if self.layers is None:
            raise ValueError("helixpipe's order needs the layer count: configure it with for_plan(resolved plan)")
        return tuple(Op(F if o.kind == FWD else B, o.k, o.microbatch)
                     for o in rank_order(pp, self.layers, m, self.folds, rank, self.shares))

    def in_flight(self, pp: int, virtual_stages: int, m: int, rank: int,
                  layers: tuple[int, ...]) -> tuple[int, int]:
        """(layer-micro-batches held: every micro-batch's L/p layers, first in last out; logits held)."""
        L = self.layers if self.layers is not None else sum(layers) * pp
        held, logits = in_flight(pp, L, m, self.folds, rank, self.shares)
        n_attn = sum(1 for k in range(1, 2 * L + 1, 2) if chain_rank(k, 0, pp, self.folds, self.shares) == rank)
        return m * n_attn, logits
