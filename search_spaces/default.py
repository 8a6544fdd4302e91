"""The default space: all five degrees, micro-batching, schedule, recomputation, ZeRO, sequence
parallelism, placement of device types onto mesh coordinates and uneven shares along every dimension.

Parameters (one fixed distribution per name for the whole study, so TPE models each consistently):

* ``tp_exp``, ``pp_exp``, ``cp_exp``, ``hp_exp``: index into the sorted divisors of the device count
  (for tp: of the gcd of devices per node, so tp stays inside a node); for a power-of-two count the
  index is the exponent. ``dp`` is what is left; a product that does not divide the devices is
  rejected as infeasible (divisibility), as the issue asks, rather than re-parametrised.
* ``mbs_exp``: micro-batch size 2**e; ``schedule`` (every schedule ``autotune.schedules`` registers;
  its module says which virtual stages and micro-batch counts it runs), ``vpp_exp`` (virtual stages
  2**e where the schedule offers several, e.g. interleaved 1F1B); ``recompute``; ``zero_stage``; ``sp`` (Megatron sequence parallelism).
* ``placement``: ``node`` puts ranks on devices in node order (the plan default, what Megatron and
  torchtitan do); ``pp``/``dp``/``cp``/``hp`` sort devices fastest first and enumerate ranks with that
  dimension outermost (tp innermost, so tp groups stay on one node), so each index of that
  dimension sits on one device type as far as the counts allow.
* ``{layers,tokens,heads,samples}_speed`` in [0, 1.5], ``{layers,samples}_mem`` in [0, 1],
  ``layers_tilt`` in [-2, 2]: the uneven shares, from a balanced start (search_spaces/_balance.py):
  share_i ~ speed_i**speed * memory_i**mem with speed the slowest rank holding index i; 0 is the
  even split, 1 the speed-balanced one; the LM head's work counts on the last stage.
* HelixPipe (``schedule helixpipe``): ``helix_folds`` (1 or 2) and ``attention_speed`` in [0, 1.5], the
  rotating attention's shares per pipeline rank ~ speed**attention_speed (0: the published rotation,
  L/p each); its layers are always L/p per rank.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from autotune import dims
from autotune.divisibility import degree_problems
from autotune.plan import (
    HELIX_FOLDS,
    MESH_ORDER,
    RECOMPUTE,
    SCHEDULES,
    Degrees,
    Placement,
    Plan,
    PlanError,
    Shares,
)
from autotune.schedules import get_schedule
from autotune.stages import STAGED_SCHEDULES
from search_spaces import _balance as B
from search_spaces import _disaggregated as _DG
from search_spaces import _fill, _recipe, _stages
from search_spaces.base import Infeasible, SearchContext, family_of

NAME = "default"
INNER = dims.MESH_ORDER[-1]
"""The innermost dimension (tp): sampled among the divisors of the devices per node, so it stays in one."""
REMAINDER = dims.WRITTEN_FIRST
"""The dimension the devices left over go to (dp): no knob of its own."""
DEGREE_KNOBS = (INNER, *(n for n in dims.MESH_ORDER[:-1] if n != REMAINDER and not dims.dimension(n).folds))
"""Every sampled degree (``<name>_exp``), innermost first, then in mesh order: tp, pp, cp, hp."""
PLACEMENTS = ("node", *dims.MESH_ORDER[:-1])
"""Node order, or the devices sorted fastest first along one dimension outermost (every one but the
innermost, tp, whose groups stay on one node)."""
MAX_MBS = 16
SHARE_FLOATS = {"layers_speed": (0.0, 1.5), "tokens_speed": (0.0, 1.5), "heads_speed": (0.0, 1.5),
                "samples_speed": (0.0, 1.5), "layers_mem": (0.0, 1.0), "samples_mem": (0.0, 1.0),
                "attention_speed": (0.0, 1.5)}
EXPERT_FLOATS = {"experts_speed": (0.0, 1.5)}
"""A MoE model's expert shares per EP rank ~ (slowest device holding that EP index)**experts_speed:
0 even, 1 proportional to each EP rank's expert throughput (a knob of MoE studies only, as ep_exp, so
a dense model's study is as before)."""
SHARE_KNOBS = (*SHARE_FLOATS, *EXPERT_FLOATS, "layers_tilt")
"""The knobs that shape uneven shares: each starts with its share's name (``_idle_knobs``)."""
STAGE_MODES = ("uniform", "program")
"""``stages``: one mesh for the whole model, or per-stage device groups and degrees chosen by the stage
program (search_spaces/_stages.py) for the point's micro-batch size, schedule, recomputation and ZeRO."""
PROGRAM_KNOBS = ("mbs_exp", "schedule", "vpp_exp", "recompute", "zero_stage", "stage_rank")
"""What a per-stage point's plan depends on (``DefaultSpace._staged``): the program chooses the rest."""
STAGE_RANK = "stage_rank"
"""Which of the program's plans for a per-stage point's knobs (0 the fastest, then the runners-up:
``_stages.best_plans``); idle on a one-mesh point. A climb through a per-stage point prices its
runners-up as moves, so they are trials of the study and its report lists them."""
GRID_LIMIT = 1_000_000  # points; priced directly (no sampler), ~1 ms each at 32 devices


def _virtual_stages(sched: Any, pp: int, vpp_exp: int) -> int:
    """The schedule's virtual stages for the sampled ``vpp_exp``: 2**e where it offers that count,
    else its first choice (one stage per rank for most; two for a V)."""
    choices = sched.virtual_stage_choices(pp)
    return 2 ** vpp_exp if 2 ** vpp_exp in choices else choices[0]


def space(ctx: SearchContext) -> DefaultSpace:
    return DefaultSpace(ctx)


class _Shape(NamedTuple):
    """What a point's degrees and schedule decide (``DefaultSpace._shape``)."""

    deg: Degrees
    fam: str
    schedule: str
    sched: Any
    vs: int
    folds: int
    sp: bool
    zero: int
    mbs: int


class _Units(NamedTuple):
    """The units the shares are counted in (``DefaultSpace._units``)."""

    unit: int
    min_units: int
    granule: int


class DefaultSpace:
    name = NAME

    def __init__(self, ctx: SearchContext):
        self.ctx = ctx
        c = ctx.cluster
        self.n = c.num_devices
        self.divs = B.divisors(self.n)
        dpn = math.gcd(*[g.devices_per_node for g in c.groups])
        self.tp_divs = B.divisors(dpn)
        self.mbs_max_exp = int(math.log2(max(1, min(MAX_MBS, ctx.global_batch))))
        self._speeds = np.asarray(ctx.speeds, dtype=float)
        self._mem = np.asarray(ctx.memories, dtype=float)
        # fastest first, then node order: each node is one device type, so nodes stay whole
        self._fast_order = np.array(sorted(range(self.n), key=lambda i: (-ctx.speeds[i], i)), dtype=np.int64)
        self._coords_cache: dict[tuple[int, ...], np.ndarray] = {}
        self._minima_cache: dict[tuple[Any, str, str], tuple[np.ndarray, np.ndarray]] = {}
        self._staged_cache: dict[tuple, Plan | Infeasible] = {}
        self._option_cache: dict[tuple, Any] = {}
        self._price: Callable[[Plan], Any] | None = None  # the search's pricing (``price_with``)
        self._place_cache: dict[tuple[Degrees, str], tuple[np.ndarray, tuple[Placement, ...]]] = {}
        m = ctx.model
        self._head_layers = m.head_flops_fwd() / (m.layer_matmul_flops_fwd()
                                                  + m.layer_attention_flops_fwd(ctx.seq_len))
        # a MoE model's expert degrees (a dense model has no such knobs, so its study is as before):
        # ep among the device count's divisors that divide the experts, etp inside a node dividing
        # each expert's width; whether they fold onto a stage's ranks is checked per point (_shape)
        self.moe = getattr(m, "moe", None)
        self.ep_divs = [d for d in self.divs if self.moe is not None and self.moe.experts % d == 0] or [1]
        self.etp_divs = [d for d in self.tp_divs if self.moe is not None and self.moe.expert_ffn_hidden % d == 0] or [1]
        self.share_floats = {**SHARE_FLOATS, **(EXPERT_FLOATS if self.moe is not None else {})}
        """Every float share knob of this study (the expert shares' on a MoE model)."""
        self.disaggregates = _DG.applies(self.moe, ctx.heterogeneous)
        """Whether the study has HeterMoE's ``disaggregate`` knob (``_disaggregated.py``)."""
        self.recipe = _recipe.knobs(ctx, self.moe, self.ep_divs)
        """The recipe knobs of this study and their choices (``_recipe.py``: MoE models, the target's own)."""

    # ---- the distributions ------------------------------------------------------------------
    def distributions(self) -> dict[str, Any]:
        from optuna.distributions import CategoricalDistribution as Cat
        from optuna.distributions import FloatDistribution as Flt
        from optuna.distributions import IntDistribution as Int

        k = len(self.divs) - 1
        d: dict[str, Any] = {
            **{f"{n}_exp": Int(0, (len(self.tp_divs) if n == INNER else k + 1) - 1) for n in DEGREE_KNOBS},
            "mbs_exp": Int(0, self.mbs_max_exp), "schedule": Cat(SCHEDULES), "vpp_exp": Int(1, 2),
            "recompute": Cat(RECOMPUTE), "zero_stage": Int(0, 3), "sp": Cat((False, True)),
            "placement": Cat(PLACEMENTS), "layers_tilt": Int(-2, 2), "helix_folds": Cat(HELIX_FOLDS),
            "stages": Cat(STAGE_MODES), STAGE_RANK: Int(0, _stages.KEEP - 1),
        }
        for name, (lo, hi) in self.share_floats.items():
            d[name] = Flt(lo, hi)
        if self.moe is not None:
            d["ep_exp"], d["etp_exp"] = Int(0, len(self.ep_divs) - 1), Int(0, len(self.etp_divs) - 1)
        if self.disaggregates:
            d[_DG.KNOB] = Cat((False, True))
        for name, choices in self.recipe.items():
            d[name] = Cat(choices)
        return d

    def params(self, *, mbs: int = 1, schedule: str = "1f1b", vpp: int = 2, recompute: str = "none", zero: int = 0,
               sp: bool = False, placement: str = "node", balance: float = 0.0, tilt: int = 0, folds: int = 1,
               stages: str = "uniform", ep: int = 1, etp: int = 1, rank: int = 0, recipe: dict[str, Any] | None = None,
               **degrees: int) -> dict[str, Any]:
        """The parameter dict of a plan given by its degrees (``tp=2, pp=4``: each knob's dimension,
        1 where not given; dp is what is left) and options (for baselines and tests); ``recipe``: the
        values of the study's recipe knobs (``_recipe.py``), each off where not given."""
        unknown = set(degrees) - set(DEGREE_KNOBS)
        if unknown:
            raise TypeError(f"params() takes the degrees {', '.join(DEGREE_KNOBS)}, not {', '.join(sorted(unknown))}")
        p = {**{f"{n}_exp": (self.tp_divs if n == INNER else self.divs).index(degrees.get(n, 1)) for n in DEGREE_KNOBS},
             "mbs_exp": int(math.log2(mbs)), "schedule": schedule,
             "vpp_exp": int(math.log2(vpp)), "recompute": recompute, "zero_stage": zero, "sp": sp,
             "placement": placement, "layers_tilt": tilt, "helix_folds": folds, "stages": stages, STAGE_RANK: rank}
        for name in self.share_floats:
            p[name] = balance if name.endswith("_speed") else 0.0
        if self.moe is not None:
            p["ep_exp"], p["etp_exp"] = self.ep_divs.index(ep), self.etp_divs.index(etp)
        if self.disaggregates:
            p[_DG.KNOB] = False
        for name in self.recipe:
            p[name] = (recipe or {}).get(name, _recipe.OFF[name])
        return p

    # ---- params -> plan ---------------------------------------------------------------------
    def build(self, p: dict[str, Any]) -> Plan | Infeasible:
        """The point ``p`` as a resolved Plan (``_build``), with the study's gradient reduction (the
        user's choice, ``--grad-reduce``: no knob, ``_recipe.py``)."""
        got = self._build(p)
        if isinstance(got, Infeasible) or self.ctx.grad_reduce == got.grad_reduce:
            return got
        return got.replace(grad_reduce=self.ctx.grad_reduce)

    def _build(self, p: dict[str, Any]) -> Plan | Infeasible:
        """The point ``p`` as a resolved Plan, or the Infeasible limit that rules it out. The cheap
        limits come first (the degrees and schedule, then the batch and sequence units): most points
        of a grid or a hill climb that are no plan fail there, before the placement and the shares
        are computed."""
        if p.get(_DG.KNOB):  # HeterMoE's expert-only ranks: one plan shape of its own
            return _DG.build(self.ctx, self.moe, self._speeds, p)
        if p.get("stages", "uniform") == "program":
            if self.moe is not None:  # the stage program prices dense blocks only
                return Infeasible("divisibility", "per-stage plans of a MoE model are not priced", "per-stage")
            return self._staged(p)
        shape = self._shape(p)
        if isinstance(shape, Infeasible):
            return shape
        units = self._units(shape)
        if isinstance(units, Infeasible):
            return units
        return self._plan(p, shape, units)

    def price_with(self, price: Callable[[Plan], Any]) -> None:
        """Price the stage program's plans exactly as the search does (``price``: a plan -> its
        Estimate, the search's Evaluator.price): a search with its own estimator (documents, an API
        caller's) chooses each knob set's stages and runners-up by the price it ranks them by.
        The replica options the program screens first stay priced by the plain estimate."""
        self._price = price
        self._staged_cache.clear()

    def _staged(self, p: dict[str, Any]) -> Plan | Infeasible:
        """A per-stage plan (autotune/stages.py) for the knobs of point ``p``: the stage program
        (search_spaces/_stages.py) chooses the device groups, each stage's tp, dp and the layer split;
        the degrees, placement and share parameters of ``p`` do not apply. One program run per knob
        set (memoised: the sampler and the polish meet the same knobs again); ``stage_rank`` picks
        the fastest plan or a runner-up."""
        schedule = p["schedule"]
        vs = 2 ** p["vpp_exp"] if schedule == "interleaved_1f1b" else 1
        key = (p["mbs_exp"], schedule, vs, p["recompute"], int(p["zero_stage"]))
        hit = self._staged_cache.get(key)
        if hit is None:
            price = self._price
            got = _stages.best_plans(self.ctx, mbs=2 ** p["mbs_exp"], schedule=schedule, vs=vs,
                                     recompute=p["recompute"], zero=int(p["zero_stage"]), cache=self._option_cache,
                                     estimator=None if price is None else lambda plan, *_a, **_k: price(plan))
            if isinstance(got, str):
                kind, _, why = got.partition(": ")
                got = Infeasible(kind, why, "per-stage")
            hit = self._staged_cache[key] = got
        if isinstance(hit, Infeasible):
            return hit
        rank = int(p.get(STAGE_RANK, 0))
        if rank >= len(hit):
            return Infeasible("divisibility", f"the stage program found {len(hit)} distinct plans for these knobs, "
                                              f"no stage_rank({rank})", "per-stage")
        return hit[rank]

    def _shape(self, p: dict[str, Any]) -> _Shape | Infeasible:
        """Degrees, schedule and the per-plan switches of point ``p``, checked by the plan's own rules."""
        model = self.ctx.model
        knobs = {n: (self.tp_divs if n == INNER else self.divs)[p[f"{n}_exp"]] for n in DEGREE_KNOBS}
        inner = math.prod(knobs.values())
        if self.n % inner:
            return Infeasible("divisibility", "*".join(f"{n}({v})" for n, v in knobs.items())
                              + f" = {inner} does not divide devices({self.n})", "")
        ep, etp = (self.ep_divs[p["ep_exp"]], self.etp_divs[p["etp_exp"]]) if self.moe is not None else (1, 1)
        deg = Degrees(**{REMAINDER: self.n // inner}, **knobs, ep=ep, etp=etp)
        pp, tp = deg.pp, deg.tp
        fam = family_of(deg)
        if deg.stage_ranks % (ep * etp):
            return Infeasible("divisibility", f"ep({ep})*etp({etp}) does not divide a stage's ranks "
                                              f"dp*cp*hp*tp = {deg.stage_ranks}", fam)
        schedule = p["schedule"] if pp > 1 else "1f1b"
        folds = int(p.get("helix_folds", 1)) if len(get_schedule(schedule).fold_choices) > 1 else 1
        sched = get_schedule(schedule).for_plan(Plan(schedule=schedule, helix_folds=folds))
        vs = _virtual_stages(sched, pp, p["vpp_exp"])
        if sched.check_shape(pp, vs):
            return Infeasible("divisibility", "; ".join(sched.check_shape(pp, vs)), fam)
        bad = degree_problems(deg, model, self.n, vs)  # the plan's own rules (autotune/divisibility.py)
        if bad:
            return Infeasible("divisibility", bad[0][1], fam)
        return _Shape(deg=deg, fam=fam, schedule=schedule, sched=sched, vs=vs, folds=folds,
                      sp=bool(p["sp"]) and tp > 1, zero=int(p["zero_stage"]) if dims.shard_size(deg) > 1 else 0,
                      mbs=2 ** p["mbs_exp"])

    def _units(self, sh: _Shape) -> _Units | Infeasible:
        """The batch and sequence units the shares are counted in: samples in micro-batches times the
        schedule's multiple k (counts per replica a multiple of k, at least ``min_units`` of them),
        tokens in the CP token granule."""
        ctx, deg, pp, mbs, fam = self.ctx, sh.deg, sh.deg.pp, sh.mbs, sh.fam
        if ctx.global_batch % mbs:
            return Infeasible("batch", f"global_batch({ctx.global_batch}) not divisible by micro_batch_size({mbs})", fam)
        k = sh.sched.microbatch_multiple(pp, sh.vs) if pp > 1 else 1
        unit = mbs * k
        min_units = -(-sh.sched.min_microbatches(pp, sh.vs) // k) if pp > 1 else 1
        if ctx.global_batch % unit:
            return Infeasible("batch", f"global_batch({ctx.global_batch}) not divisible by micro_batch_size({mbs})"
                                       f"*{k} for {sh.schedule} with pp({pp})", fam)
        if ctx.global_batch // unit < deg.dp * min_units:
            return self._too_few_samples(sh, unit, min_units)
        granule = Plan(degrees=deg, cp_layout="zigzag", sequence_parallel=sh.sp).token_granule()
        if ctx.seq_len % granule:
            return Infeasible("divisibility", f"seq_len({ctx.seq_len}) not divisible by {granule} "
                                              f"(zigzag cp({deg.cp}) x hp({deg.hp}){' x tp' if sh.sp else ''})", fam)
        return _Units(unit=unit, min_units=min_units, granule=granule)

    def _too_few_samples(self, sh: _Shape, unit: int, min_units: int) -> Infeasible:
        return Infeasible("batch", f"global_batch({self.ctx.global_batch}) gives dp({sh.deg.dp}) replicas fewer "
                                   f"than {min_units * unit} samples each (micro_batch_size {sh.mbs}, {sh.schedule} "
                                   f"with pp({sh.deg.pp}))", sh.fam)

    def _plan(self, p: dict[str, Any], sh: _Shape, u: _Units) -> Plan | Infeasible:
        """The shares of point ``p`` (each weighted by the speed and memory of the devices along its
        dimension), the placement, and the plan resolved."""
        ctx, model, deg, vs = self.ctx, self.ctx.model, sh.deg, sh.vs
        dev_of_rank, placement = self._placement(deg, p["placement"])

        def along(dim: str, sp_key: str, mem_key: str | None = None) -> np.ndarray:
            s, m = self._minima(deg, p["placement"], dim)
            return B.weights(s, m, float(p[sp_key]), float(p[mem_key]) if mem_key else 0.0)

        # samples: units of mbs (x pp for interleaved, which needs counts divisible by pp)
        samples = B.proportional_split(ctx.global_batch // u.unit, along("dp", "samples_speed", "samples_mem"),
                                       u.min_units)
        if samples is None:
            return self._too_few_samples(sh, u.unit, u.min_units)
        tokens = B.proportional_split(ctx.seq_len // u.granule, along("cp", "tokens_speed"), 1)
        heads = B.proportional_split(model.heads // deg.tp, along("hp", "heads_speed"), 1)
        layers, attention = self._layers(p, sh, along)
        experts = self._experts(p, sh, dev_of_rank)
        if tokens is None or heads is None or layers is None or experts is False:
            return Infeasible("divisibility", "a share cannot give every index at least one unit", sh.fam)
        plan = Plan(
            degrees=deg, micro_batch_size=sh.mbs, schedule=sh.schedule, virtual_stages=vs, recompute=p["recompute"],
            helix_folds=sh.folds, helix_attention=attention,
            zero_stage=sh.zero, sequence_parallel=sh.sp, cp_layout="zigzag", dtype=ctx.dtype,
            **_recipe.plan_fields(p, deg.ep),
            shares=Shares(layers=tuple(layers), tokens=tuple(t * u.granule for t in tokens), heads=tuple(heads),
                          samples=tuple(s * u.unit for s in samples), experts=experts),
            placement=placement)
        try:
            return plan.resolve(model, ctx.cluster, ctx.seq_len, ctx.global_batch)
        except PlanError as e:
            return Infeasible("divisibility", e.message, sh.fam)

    def _layers(self, p: dict[str, Any], sh: _Shape, along: Any) -> tuple[Any, tuple[int, ...] | None]:
        """Layers per model chunk (weighted by the speed and memory of each chunk's pipeline rank, the
        last chunk lightened by the head, then tilted), and HelixPipe's attention shares (L/p layers
        on every rank; the rotating attention shared by speed)."""
        pp, vs, n_layers = sh.deg.pp, sh.vs, self.ctx.model.layers
        if get_schedule(sh.schedule).places_attention:
            a = B.proportional_split(n_layers, along("pp", "attention_speed"), 1)
            return B.proportional_split(n_layers, np.ones(pp), 1), (
                tuple(a) if a is not None and len(set(a)) > 1 else None)
        lw = along("pp", "layers_speed", "layers_mem")
        chunk_w = np.array([lw[sh.sched.stage_rank(j, pp, vs)] for j in range(pp * vs)])
        offset = None
        if float(p["layers_speed"]) > 0 and pp > 1:
            offset = np.zeros(pp * vs)
            offset[-1] = self._head_layers * min(1.0, float(p["layers_speed"]))
        layers = B.proportional_split(n_layers, chunk_w, 1, offset)
        return (None if layers is None else B.tilt(layers, int(p["layers_tilt"]))), None

    def _experts(self, p: dict[str, Any], sh: _Shape, dev_of_rank: np.ndarray) -> tuple[int, ...] | None | bool:
        """The routed experts of each EP rank: ~ (slowest speed holding that EP index)**experts_speed
        (every rank of a stage's expert mesh at EP index q holds the same experts, so q runs at the pace
        of its slowest device); None (the plan's even default) where that is even; False where some
        rank would get none."""
        deg = sh.deg
        if self.moe is None or deg.ep == 1 or float(p.get("experts_speed", 0.0)) == 0.0:
            return None
        key = (deg, p["placement"], "experts")
        w = self._minima_cache.get(key)
        if w is None:
            ep_index = (np.arange(deg.world) % deg.stage_ranks) % (deg.ep * deg.etp) // deg.etp
            w = self._minima_cache[key] = (B.index_minimum(self._speeds[dev_of_rank], ep_index[:, None], 0, deg.ep),
                                           np.ones(deg.ep))
        got = B.proportional_split(self.moe.experts, B.weights(w[0], w[1], float(p["experts_speed"]), 0.0), 1)
        if got is None:
            return False
        return None if len(set(got)) == 1 and self.moe.experts % deg.ep == 0 else tuple(got)

    def _minima(self, deg: Degrees, how: str, dim: str) -> tuple[np.ndarray, np.ndarray]:
        """(slowest speed, least memory) per index of mesh dimension ``dim`` under the layout and
        placement: the same for every point of one layout, so computed once per layout."""
        key = (deg, how, dim)
        out = self._minima_cache.get(key)
        if out is None:
            dev_of_rank = self._placement(deg, how)[0]
            mesh = tuple(getattr(deg, d) for d in MESH_ORDER)
            coords, ax = self._coords(mesh), MESH_ORDER.index(dim)
            out = self._minima_cache[key] = (B.index_minimum(self._speeds[dev_of_rank], coords, ax, mesh[ax]),
                                             B.index_minimum(self._mem[dev_of_rank], coords, ax, mesh[ax]))
        return out

    def _coords(self, mesh: tuple[int, ...]) -> np.ndarray:
        c = self._coords_cache.get(mesh)
        if c is None:
            c = self._coords_cache[mesh] = B.coords_array(mesh)
        return c

    def _placement(self, deg: Degrees, how: str) -> tuple[np.ndarray, tuple[Placement, ...]]:
        """Device index of every rank and the plan's placement entries, cached: a grid or a hill climb
        builds each layout many times, and one shared (frozen) tuple per layout lets ``Plan.resolve``
        check it once (its placement check is memoised per tuple object)."""
        key = (deg, how)
        out = self._place_cache.get(key)
        if out is None:
            dev_of_rank = self._placement_uncached(deg, how)
            devs = self.ctx.cluster.devices
            out = self._place_cache[key] = (dev_of_rank, tuple(
                Placement(rank=r, node=devs[int(i)].node, device=devs[int(i)].local)
                for r, i in enumerate(dev_of_rank)))
        return out

    def _placement_uncached(self, deg: Degrees, how: str) -> np.ndarray:
        if how == "node" or not self.ctx.heterogeneous and how == "pp":
            return np.arange(self.n)
        mesh = tuple(getattr(deg, d) for d in MESH_ORDER)
        coords = self._coords(mesh)
        order = [how] + [d for d in MESH_ORDER if d not in (how, "tp")] + ["tp"]
        cols = [coords[:, MESH_ORDER.index(d)] for d in order]
        ranks_in_order = np.lexsort(tuple(reversed(cols)))  # first key outermost
        dev_of_rank = np.empty(self.n, dtype=np.int64)
        dev_of_rank[ranks_in_order] = self._fast_order
        return dev_of_rank

    # ---- baselines, grid, neighbours -------------------------------------------------------
    def _degree_tuples(self) -> list[tuple[int, int, int, int]]:
        out = []
        for tp in self.tp_divs:
            for pp in self.divs:
                for cp in self.divs:
                    if self.n % (tp * pp * cp):
                        continue
                    for hp in self.divs:
                        if self.n % (tp * pp * cp * hp) == 0:
                            out.append((tp, pp, cp, hp))
        return out

    def baselines(self) -> list[tuple[str, dict[str, Any]]]:
        """Even splits in node order, the plans people write by hand:

        * ``megatron``: every tp x pp x dp, without, with selective and with full recomputation,
          distributed optimizer (ZeRO-1) when dp > 1 (Megatron-LM's defaults);
        * ``megatron+cp``: tp over the node, context parallelism across (Megatron-LM's CP);
        * ``cp`` (ring attention over all devices), ``ulysses`` (all heads spread, dp over the rest) and
          every ``cp+ulysses`` mix with cp x hp = devices (HexiSeq's baselines), with ZeRO-3 as
          DeepSpeed-Ulysses runs them, selective or full recomputation."""
        out: list[tuple[str, dict[str, Any]]] = []
        heads, layers = self.ctx.model.heads, self.ctx.model.layers
        for tp in self.tp_divs:
            for pp in self.divs:
                if self.n % (tp * pp) == 0 and pp <= layers:
                    dp = self.n // (tp * pp)
                    for rc in RECOMPUTE:
                        for ep, etp in self._start_experts(self.n // pp):
                            for recipe in self._recipes(ep):
                                out.append(("megatron" if ep == 1 else "megatron-moe",
                                            self.params(tp=tp, pp=pp, recompute=rc, zero=1 if dp > 1 else 0, ep=ep,
                                                        etp=etp, sp=tp > 1 and self.moe is not None, recipe=recipe)))
        tp_max = max(t for t in self.tp_divs if heads % t == 0 and self.ctx.model.kv_heads % t == 0)
        for cp in self.divs:
            if cp > 1 and self.n % (tp_max * cp) == 0:
                dp = self.n // (tp_max * cp)
                out.append(("megatron+cp", self.params(tp=tp_max, cp=cp, recompute="selective",
                                                       zero=1 if dp > 1 else 0)))
        hp_max = max(h for h in self.divs if h <= heads)
        seq_fams = [("cp", self.n, 1), ("ulysses", 1, hp_max)]
        seq_fams += [("cp+ulysses", self.n // h, h) for h in self.divs if 1 < h <= heads and h < self.n]
        for name, cp, hp in seq_fams:
            if cp * hp <= 1:
                continue
            for rc in ("selective", "full"):
                out.append((name, self.params(cp=cp, hp=hp, recompute=rc, zero=3)))
        # No speed-balanced copies on a mixed cluster: they were starts for the search before it had
        # its own (``starts``: one speed-balanced start per layout, grown to the micro-batch memory
        # allows); the copies doubled the baselines (OPT-350M 8+8: 96 -> 48 prices), and without them
        # the best plans of benchmarks/bench_search.py's setups and quality instances are the same.
        return out

    def distinct_placements(self, deg: Degrees) -> list[str]:
        """The placements that put the ranks of ``deg`` on different devices (the first of each):
        e.g. on one node of one device type every placement is the node order, and a dimension of
        degree 1 sorted outermost is the same as the next one. Equal placements give equal plans."""
        out, seen = [], set()
        hows = PLACEMENTS
        if not self.ctx.heterogeneous:  # identical devices: only which ranks share a node matters
            hows = ("node", "dp", "cp", "hp") if self.ctx.cluster.num_nodes > 1 else ("node",)
        for how in hows:
            key = self._placement(deg, how)[0].tobytes()
            if key not in seen:
                seen.add(key)
                out.append(how)
        return out

    def _recipes(self, ep: int) -> list[dict[str, Any]]:
        """A MoE baseline's recipe knobs: off, and also every option the study
        has on (the all-to-all overlap and all three graph scopes, as the Megatron-Bridge recipes run)."""
        on = {n: c[-1] for n, c in self.recipe.items() if n not in _recipe.EP_KNOBS or ep > 1}
        return [{}, on] if on else [{}]

    def _recipe_grid(self, ep: int) -> list[dict[str, Any]]:
        """Every combination of the study's recipe knobs that can change a plan with ``ep``."""
        names = [n for n in self.recipe if n not in _recipe.EP_KNOBS or ep > 1]
        return [dict(zip(names, c, strict=True)) for c in itertools.product(*(self.recipe[n] for n in names))]

    def expert_choices(self, stage_ranks: int) -> list[tuple[int, int]]:
        """(ep, etp) pairs that fold onto a stage of ``stage_ranks`` ranks ([(1, 1)] for a dense model)."""
        return [(e, t) for e in self.ep_divs for t in self.etp_divs if stage_ranks % (e * t) == 0]

    def _grid_iter(self):
        for tp, pp, cp, hp in self._degree_tuples():
            for ep, etp in self.expert_choices(self.n // pp):
                yield from self._grid_layout(tp, pp, cp, hp, ep, etp)
        if self.moe is None:  # the stage program prices dense blocks only
            yield from self._staged_grid()
        if self.disaggregates:
            yield from _DG.grid(self.params, self.mbs_max_exp)

    def _grid_layout(self, tp: int, pp: int, cp: int, hp: int, ep: int, etp: int):
        """Every point of one layout of degrees."""
        het = self.ctx.heterogeneous
        dp = self.n // (tp * pp * cp * hp)
        deg = Degrees(dp=dp, pp=pp, cp=cp, hp=hp, tp=tp, ep=ep, etp=etp)
        scheds = [("1f1b", 2)] if pp == 1 else [("1f1b", 2)] + [
            (name, vs if vs > 1 else 2) for name in SCHEDULES if name != "1f1b"
            for vs in get_schedule(name).virtual_stage_choices(pp)]
        zeros = [0] if dp * cp * hp == 1 else [0, 1, 2, 3]
        sps = [False] if tp == 1 else [False, True]
        places = self.distinct_placements(deg)
        balances = [0.0, 1.0] if (het or pp > 1) else [0.0]
        scheds = [(n, v, f) for n, v in scheds for f in get_schedule(n).fold_choices]
        recipes = self._recipe_grid(ep)
        for mbs_e in range(self.mbs_max_exp + 1):
            for (sched, vpp, f), rc, z, sp, pl, bal, rec in itertools.product(scheds, RECOMPUTE, zeros, sps, places,
                                                                              balances, recipes):
                yield self.params(tp=tp, pp=pp, cp=cp, hp=hp, mbs=2 ** mbs_e, schedule=sched, vpp=vpp,
                                  recompute=rc, zero=z, sp=sp, placement=pl, balance=bal, folds=f, ep=ep, etp=etp,
                                  recipe=rec)

    def _staged_grid(self):
        """The per-stage points: one per knob set the stage program takes."""
        for mbs_e in range(self.mbs_max_exp + 1):
            for sched in STAGED_SCHEDULES:
                for vpp in ((2, 4) if sched == "interleaved_1f1b" else (2,)):
                    for rc, z, k in itertools.product(RECOMPUTE, (0, 1), range(_stages.KEEP)):
                        yield self.params(mbs=2 ** mbs_e, schedule=sched, vpp=vpp, recompute=rc, zero=z,
                                          stages="program", rank=k)

    def grid_size(self, limit: int = GRID_LIMIT) -> int:
        """Points of the grid, counted up to ``limit`` + 1."""
        n = 0
        for _ in self._grid_iter():
            n += 1
            if n > limit:
                break
        return n

    def grid_points(self):
        """Every discrete combination, lazily (see grid())."""
        return self._grid_iter()

    def grid(self) -> list[dict[str, Any]]:
        """Every discrete combination (options that do not apply to a layout and placements that
        repeat another are left out), shares even (0) or speed-balanced (1); see grid_size first."""
        return list(self._grid_iter())

    def starts(self) -> list[dict[str, Any]]:
        """One balanced start per degree layout (the issue: for each discrete choice, start the shares
        from a balanced split and let the search refine them): micro-batch 1, 1F1B, selective
        recomputation, ZeRO-1 where parameters are replicated, sequence parallelism with tp, shares
        speed-balanced, the devices sorted along the outermost dimension in use on a mixed cluster.
        ``memory_fallback(p)`` is the same layout with the least memory, for a start that does not fit."""
        out = []
        het = self.ctx.heterogeneous
        for tp, pp, cp, hp in self._degree_tuples():
            dp = self.n // (tp * pp * cp * hp)
            deg = Degrees(dp=dp, pp=pp, cp=cp, hp=hp, tp=tp)
            place = "node"
            if het:
                place = next((d for d in PLACEMENTS[1:] if getattr(deg, d) > 1), "node")
            for ep, etp in self._start_experts(self.n // pp):
                out.append(self.params(tp=tp, pp=pp, cp=cp, hp=hp, recompute="selective",
                                       zero=1 if dp * cp * hp > 1 else 0, sp=tp > 1, placement=place, balance=1.0,
                                       ep=ep, etp=etp))
        if self.moe is None:  # the stage program's plan for the same knobs, with and without recomputation
            out += [self.params(recompute=rc, zero=1, stages="program") for rc in ("none", "selective")]
        if self.disaggregates:
            out.append({**self.params(recompute="selective", zero=1, balance=1.0), _DG.KNOB: True})
        return out

    def _start_experts(self, stage_ranks: int) -> list[tuple[int, int]]:
        """A MoE layout's starts: no expert parallelism, the widest EP inside a node, the widest EP over
        the stage (etp 1: each expert whole on its rank, what Megatron-Core recommends first);
        [(1, 1)] for a dense model."""
        if self.moe is None:
            return [(1, 1)]
        dpn = self.tp_divs[-1]
        eps = [e for e, t in self.expert_choices(stage_ranks) if t == 1]
        return sorted({(1, 1), (max(e for e in eps if e <= dpn), 1), (max(eps), 1)})

    def filled_starts(self, p: dict[str, Any], attrs: dict[str, Any]) -> list[dict[str, Any]]:
        """Start ``p``, priced and fitting at micro-batch 1 (``attrs``), at the largest micro-batch its
        memory and pipeline leave room for (``_fill``: read from its breakdown), then half that."""
        plan, rows = attrs.get("plan") or {}, (attrs.get("breakdown") or {}).get("ranks")
        samples = min((plan.get("shares") or {}).get("samples") or [self.ctx.global_batch])
        mbs = _fill.largest_micro_batch(rows, samples, (plan.get("degrees") or {}).get("pp", 1), 2 ** self.mbs_max_exp)
        e = int(math.log2(mbs))
        return [{**p, "mbs_exp": x} for x in (e, e - 1) if x > p["mbs_exp"]]

    @staticmethod
    def memory_fallback(p: dict[str, Any]) -> dict[str, Any]:
        return {**p, "recompute": "full", "zero_stage": 3, "mbs_exp": 0}

    def neighbours(self, p: dict[str, Any]) -> list[dict[str, Any]]:
        """Moves of one parameter: every other value of the degrees, micro-batch size, ZeRO stage and
        the categories (each has a handful; the best is rarely one step away: ZeRO-1 -> 3 where 2 is
        worse), layer tilt +-1, share exponents +-0.05/0.25 and the even (0) and balanced (1) anchors,
        all share exponents at once to 0 or 1, and a factor traded between two degrees.

        A climb keeps its ``stages`` mode: the polish has a seed of each (``phases._seeds``), and a
        one-mesh start moved onto the stage program in one step stops in the program's optimum,
        which its own seed reaches anyway (measured: five of eight seeds did, the one-mesh optimum
        was missed). A per-stage point moves only the knobs the program takes (``PROGRAM_KNOBS``):
        the others do not change its plan."""
        dists = self.distributions()
        program = p.get("stages", "uniform") == "program"
        if program and STAGE_RANK not in p:  # a trial of a study made before runners-up: the fastest
            p = {**p, STAGE_RANK: 0}
        idle = set() if program else self._idle_knobs(p)
        out = []
        for name, dist in dists.items():
            if name == "stages" or program and name not in PROGRAM_KNOBS or name in idle:
                continue
            v = p[name]
            cands: list[Any] = []
            if hasattr(dist, "choices"):
                cands = [c for c in dist.choices if c != v]
            elif name == "layers_tilt":
                cands = [x for x in (v - 1, v + 1) if dist.low <= x <= dist.high]
            elif isinstance(v, int) and not isinstance(v, bool):
                cands = [x for x in range(dist.low, dist.high + 1) if x != v]
            else:  # coarse and fine steps, and the two anchors: even (0) and speed-balanced (1)
                steps = {min(dist.high, max(dist.low, round(v + dv, 4))) for dv in (-0.25, -0.05, 0.05, 0.25)}
                cands = sorted((steps | {0.0, 1.0}) - {v})
            for c in cands:
                out.append({**p, name: c})
                if name == "schedule":
                    out += self._with_virtual_stages(p, c, dists["vpp_exp"])
        if program:
            return out
        for anchor in (0.0, 1.0):
            q = {**p, **{k: anchor for k in self.share_floats if k.endswith("_speed")}}
            if q != p:
                out.append(q)
        out += self._trades(p)
        return out

    def _idle_knobs(self, p: dict[str, Any]) -> set[str]:
        """The knobs whose value cannot change the plan of point ``p``: the shares of a dimension of
        degree 1 (one index takes the whole), a schedule without a pipeline, sequence parallelism
        without tp, ZeRO with nothing to shard over. A move of one only builds ``p``'s own plan
        again: it costs no price, but a quarter of the points a 32-device search built were such
        repeats (1,628 -> 1,240 on OPT-350M 16+16 without them, the same trials)."""
        if p.get(_DG.KNOB):
            return _DG.idle(self.distributions())
        sh = self._shape(p)
        if isinstance(sh, Infeasible):
            return {STAGE_RANK}
        d, idle = sh.deg, {STAGE_RANK}
        for name, share in dims.SHARES:  # one index takes the whole share: its knobs do nothing
            if getattr(d, name) == 1:
                idle |= {k for k in SHARE_KNOBS if k.startswith(share + "_")}
        if d.pp == 1:
            idle |= {"attention_speed", "schedule", "vpp_exp"}
        elif not get_schedule(sh.schedule).places_attention:
            idle.add("attention_speed")
        if len(get_schedule(sh.schedule).fold_choices) <= 1:
            idle.add("helix_folds")
        if d.tp == 1:
            idle.add("sp")
        if dims.shard_size(d) == 1:
            idle.add("zero_stage")
        if d.ep == 1:
            idle |= set(_recipe.EP_KNOBS)
        return idle

    def _with_virtual_stages(self, p: dict[str, Any], schedule: str, vpp: Any) -> list[dict[str, Any]]:
        """A move to ``schedule`` with each other virtual-stage count it offers at this pp: one
        move, not two (``vpp_exp`` alone does nothing under a schedule of one count, so a climb from
        1F1B never reaches interleaved 1F1B with 4 chunks where 2 chunks are worse)."""
        offered = get_schedule(schedule).virtual_stage_choices(self.divs[p["pp_exp"]])
        if len(offered) < 2:
            return []
        return [{**p, "schedule": schedule, "vpp_exp": e} for e in range(vpp.low, vpp.high + 1)
                if e != p["vpp_exp"] and 2 ** e in offered]

    def memory_repairs(self, p: dict[str, Any]) -> list[dict[str, Any]]:
        """Point ``p`` (a move that would be faster but does not fit) with one knob turned towards
        less memory: a higher ZeRO stage, heavier recomputation, or half the micro-batch. The
        polish prices these only for such moves, so a move that needs memory relief is not lost
        (interleaved 1F1B with 4 chunks fits 4 H100 at 16k only with ZeRO-3)."""
        out = [{**p, "zero_stage": z} for z in range(p["zero_stage"] + 1, 4)]
        rc = RECOMPUTE.index(p["recompute"])
        out += [{**p, "recompute": r} for r in RECOMPUTE[rc + 1:]]
        if p["mbs_exp"] > 0:
            out.append({**p, "mbs_exp": p["mbs_exp"] - 1})
        if p.get("moe_a2a_overlap"):  # full recomputation only without the overlap (Megatron-Core's rule)
            out.append({**p, "moe_a2a_overlap": False, "recompute": "full"})
        return out

    def _trades(self, p: dict[str, Any]) -> list[dict[str, Any]]:
        """Trade a factor between two dimensions (dp is derived, so a single move changes dp too)."""
        exps = {"tp_exp": len(self.tp_divs) - 1, "pp_exp": len(self.divs) - 1, "cp_exp": len(self.divs) - 1,
                "hp_exp": len(self.divs) - 1}
        return [{**p, a: p[a] + 1, b: p[b] - 1} for a, b in itertools.permutations(exps, 2)
                if p[a] < exps[a] and p[b] > 0]

    def pair_moves(self, p: dict[str, Any]) -> list[dict[str, Any]]:
        """Moves of two coupled parameters at once, for a plan no single move improves: memory couples
        recomputation, ZeRO stage and micro-batch size (one alone may not fit where the pair is
        faster), and a degree change shifts the samples per replica, so with it the micro-batch size."""
        return self.knob_pairs(p) + self.degree_pairs(p)

    def pair_movesets(self) -> list[Any]:
        """``pair_moves`` as two move sets, the ~26 pairs of the memory knobs before the ~200 of a
        degree with the micro-batch size or placement: a climb step stops at the first set with an
        improving move (``phases.run_polish``), and the knob pairs make most of the late gains
        (measured on issue 26's mixed clusters: a step of the first set prices ~25 plans, of both ~100)."""
        return [self.knob_pairs, self.degree_pairs]

    def knob_pairs(self, p: dict[str, Any]) -> list[dict[str, Any]]:
        """Two of recomputation, ZeRO stage and micro-batch size at once; a recipe knob with the
        recomputation (the all-to-all overlap rules out full recomputation: a climb with it on never
        reaches full recomputation one knob at a time)."""
        out = [{**p, name: c, "recompute": rc} for name, choices in self.recipe.items() for c in choices
               for rc in RECOMPUTE if c != p.get(name) and rc != p["recompute"]]
        for rc, z in itertools.product(RECOMPUTE, range(4)):
            if rc != p["recompute"] and z != p["zero_stage"]:
                out.append({**p, "recompute": rc, "zero_stage": z})
        for m in range(self.mbs_max_exp + 1):
            if m == p["mbs_exp"]:
                continue
            for rc in RECOMPUTE:
                if rc != p["recompute"]:
                    out.append({**p, "mbs_exp": m, "recompute": rc})
            for z in range(4):
                if z != p["zero_stage"]:
                    out.append({**p, "mbs_exp": m, "zero_stage": z})
        return out

    def degree_pairs(self, p: dict[str, Any]) -> list[dict[str, Any]]:
        """A degree move with another micro-batch size or placement (none for a per-stage point: its
        degrees are the program's)."""
        if p.get("stages", "uniform") == "program":
            return []
        out = []
        degree_moves = [q for q in self.neighbours(p) if any(q[k] != p[k] for k in
                                                              ("tp_exp", "pp_exp", "cp_exp", "hp_exp"))]
        for q in degree_moves:
            for m in range(self.mbs_max_exp + 1):
                if m != p["mbs_exp"]:
                    out.append({**q, "mbs_exp": m})
            for pl in PLACEMENTS:
                if pl != p["placement"]:
                    out.append({**q, "placement": pl})
        return out
