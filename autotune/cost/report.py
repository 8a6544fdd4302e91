"""The estimate's answer: per-rank rows, ``predicted`` and the ``breakdown`` (docs/contracts.md
"Cost model") from the rank costs, the replicas' simulations and the DP exposure."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from autotune.cost import layers as LY
from autotune.cost import moe_steps as MS
from autotune.cost.compute import cached_rates
from autotune.cost.context import StepContext
from autotune.cost.memory import TERM_NAMES
from autotune.cost.pipeline_parallel import bubble_fraction
from autotune.plan_parts import compute_dtype
from autotune.units import fmt_bytes

ROW_KEYS = ("compute_s", "tp_comm_s", "cp_comm_s", "hp_comm_s", "pp_comm_s", "dp_comm_s", "exposed_comm_s",
            "dp_exposed_s", "optimizer_s", "bubble_s")


class RankRows(list):
    """An estimate's per-rank rows (``rank_rows``): each a copy of its template (``templates``, the
    row with ``rank`` None, shared by the ranks of one tp group context) with its rank set, never
    changed after. ``encoded`` writes the list's JSON from each template's once: a search stores
    the rows of every trial near its best, and encoding them row by row was ~60% of a trial's JSON
    at 16 devices."""

    templates: list[dict[str, Any] | None]
    _json: str | None = None

    def encoded(self, encode: Callable[[Any], str]) -> str:
        """``encode(list(self))``'s text (``encode``: a compact JSON encoder), each template encoded once."""
        if self._json is None:
            tails: dict[int, str] = {}
            parts = []
            for row, tmpl in zip(self, self.templates, strict=True):
                r = None if row is None else row["rank"]
                if tmpl is None or type(r) is not int:
                    parts.append(encode(row))
                    continue
                tail = tails.get(id(tmpl))
                if tail is None:  # '{"rank":null' then the template's other keys, in the row's order
                    tail = tails[id(tmpl)] = encode(tmpl)[len('{"rank":null'):]
                parts.append('{"rank":' + str(r) + tail)
            self._json = "[" + ",".join(parts) + "]"
        return self._json


class RankValues(list):
    """One figure per rank (``predicted``'s ``memory_bytes`` and ``capacity_bytes``): a few distinct
    values, each repeated over the ranks of a tp group and of equal groups. ``encoded`` writes the
    list's JSON from each distinct value's text: the C encoder's float repr of 2,048 values per trial
    was ~0.7 of its ~1 ms plan JSON at 1,024 devices (a search stores ~850). Filled by ``rank_rows``,
    never changed after."""

    _json: str | None = None

    def encoded(self, encode: Callable[[Any], str]) -> str:
        """``encode(list(self))``'s text (``encode``: a compact JSON encoder), each value encoded once."""
        if self._json is None:
            # one text per value is the encoder's own only where equal values write alike: floats
            # (1 == 1.0 == True would share a key), and no negative zero (-0.0 == 0.0)
            if all(type(x) is float and (x or math.copysign(1.0, x) > 0) for x in self):
                text = {x: encode(x) for x in set(self)}
                self._json = "[" + ",".join([text[x] for x in self]) + "]"
            else:
                self._json = encode(list(self))
        return self._json


def rank_rows(s: StepContext, groups: list, exposed_of: dict, step: float, per_rank: bool = True
              ) -> tuple[list, list, list, list, Any]:
    """(memory, capacity, row per rank, peak memory per stage, infeasible reason or None). Without
    ``per_rank`` the rows are each rank's template (``RankRows.templates``: its row with ``rank``
    None), not copies: what the stage rows and the breakdown read of them, for an estimate that
    drops its per-rank rows (``estimate``'s ``rows_up_to``): 1,024 copies were a tenth of an
    estimate at 1,024 devices, which a search then threw away."""
    world = s.plan.world
    memory, capacity, rows = RankValues([0.0] * world), RankValues([0.0] * world), RankRows([None] * world)
    rows.templates = [None] * world
    infeasible = None
    templates: dict[tuple[int, float], dict[str, Any]] = {}
    stage_mem = [0.0] * s.pp
    for r0, dp_i, ctx, c in groups:
        spec, pp_i = c.spec, ctx.pp_index
        exposed = exposed_of[(dp_i, id(c))]
        tmpl = templates.get((id(c), exposed))
        if tmpl is None:
            own = c.busy + exposed + c.optimizer
            # "rank" first, as every row has it: a row is a copy of its template with its rank set
            # (dict.copy: a quarter of the time of {"rank": r, **tmpl} over 1,024 ranks)
            tmpl = templates[(id(c), exposed)] = {
                "rank": None, "stage": pp_i, "device": spec.name, "compute_s": c.compute_s, "comm_s": c.comm_s,
                "tp_comm_s": c.tp_comm_s, "cp_comm_s": c.cp_comm_s, "hp_comm_s": c.hp_comm_s,
                "pp_comm_s": c.pp_comm_s, "dp_comm_s": c.dp_comm_s,
                "exposed_comm_s": c.exposed_in_ops, "dp_exposed_s": exposed, "optimizer_s": c.optimizer,
                "bubble_s": max(0.0, step - own), "memory_bytes": c.memory_total,
                "capacity_bytes": spec.memory_bytes, "memory": c.memory_terms,
                **({"moe": c.moe} if c.moe is not None else {})}
        total = c.memory_total
        tp = ctx.step.tp  # a per-stage plan's cells differ in tp
        end = r0 + tp
        memory[r0:end] = [total] * tp
        capacity[r0:end] = [spec.memory_bytes] * tp
        rows.templates[r0:end] = [tmpl] * tp
        if per_rank:
            for r in range(r0, end):
                row = rows[r] = tmpl.copy()
                row["rank"] = r
        if total > stage_mem[pp_i]:
            stage_mem[pp_i] = total
        if total > spec.memory_bytes and infeasible is None:
            terms = c.memory_terms
            worst_term = max(TERM_NAMES, key=lambda k: terms[k])
            infeasible = (f"rank {r0} ({spec.name}) memory {fmt_bytes(total)} > {fmt_bytes(spec.memory_bytes)}: "
                          f"{worst_term} {fmt_bytes(terms[worst_term])}")
    return memory, capacity, rows if per_rank else rows.templates, stage_mem, infeasible


def predicted_figures(s: StepContext, groups: list, sims: list, step: float, memory: list, capacity: list,
                      infeasible: Any) -> tuple[dict[str, Any], float, float]:
    """(``predicted``, model FLOPs per step, cluster peak FLOP/s)."""
    tokens_step = float(s.global_batch) * s.seq_len
    flops: dict[int, float] = {}  # one catalogue lookup per spec object; the sum keeps group order
    for *_, c in groups:
        if id(c.spec) not in flops:
            flops[id(c.spec)] = c.spec.flops(compute_dtype(s.dtype))  # MFU under FP8: of the bf16 peak
    peak = sum(ctx.step.tp * flops[id(c.spec)] for _, _, ctx, c in groups)  # each group (or cell) its own tp
    model_flops = s.model.model_flops_per_token(s.seq_len) * tokens_step
    return {
        "step_time_s": step,
        "tokens_per_s": tokens_step / step if step > 0 else math.inf,
        "mfu": model_flops / (step * peak) if step > 0 and peak > 0 else 0.0,
        "memory_bytes": memory,
        "capacity_bytes": capacity,
        "feasible": infeasible is None,
        "infeasible_reason": infeasible,
        "bubble_fraction": bubble_fraction(sims, s.pp),
    }, model_flops, peak


def _first_ranks(groups: list) -> dict[tuple[int, int], int]:
    first_rank: dict[tuple[int, int], int] = {}
    for r0, dp_i, _, c in groups:
        first_rank.setdefault((dp_i, id(c)), r0)
    return first_rank


def stage_rows(s: StepContext, groups: list, sims: list, per_rep_stage: dict, rows: list, stage_end: list,
               stage_mem: list) -> list[dict[str, Any]]:
    """One row per pipeline stage, from the rank that paces it in the replica that ends it last."""
    p, dp = s.pp, s.dp
    first_rank = _first_ranks(groups)
    stages = []
    for st in range(p):
        pace = max(range(dp), key=lambda d: sims[d].rank_finish[st])
        slow = max(per_rep_stage[(pace, st)].values(), key=lambda c: c.busy)
        pr = first_rank[(pace, id(slow))]
        r = rows[pr]
        sim = sims[pace]
        stages.append({
            "stage": st, "layers": [s.plan.shares.layers[j] for j in s.chunks[st]],
            "devices": sorted({c.spec.name for d in range(dp) for c in per_rep_stage[(d, st)].values()}),
            "pacing_replica": pace, "pacing_rank": pr, "microbatches": sim.m,
            "fwd_s": [sim.fwd[j] for j in s.chunks[st]], "bwd_s": [sim.bwd[j] for j in s.chunks[st]],
            "compute_s": r["compute_s"], "tp_comm_s": r["tp_comm_s"], "cp_comm_s": r["cp_comm_s"],
            "hp_comm_s": r["hp_comm_s"], "pp_comm_s": r["pp_comm_s"], "dp_comm_s": r["dp_comm_s"],
            "exposed_comm_s": r["exposed_comm_s"], "dp_exposed_s": r["dp_exposed_s"], "optimizer_s": r["optimizer_s"],
            "pipeline_s": sim.rank_finish[st], "bubble_s": sim.makespan - sim.rank_busy[st],
            "bubble_fraction": sim.bubble_fraction(st), "end_s": stage_end[st], "memory_bytes": stage_mem[st],
        })
    return stages


def breakdown(s: StepContext, groups: list, sims: list, stages: list, rows: list, stage_end: list, step: float,
              model_flops: float, peak: float) -> dict[str, Any]:
    """The ``breakdown`` without its timeline: seconds per step of the rank that ends the step last
    (what the search compares), the FLOPs, the stages and every rank's row."""
    crit = max(range(s.pp), key=lambda st: stage_end[st])
    cr = rows[stages[crit]["pacing_rank"]]
    specs = {id(c.spec): c.spec for *_, c in groups}
    hd = s.model.head_dim
    return {
        "step_time_s": step,
        "pipeline_s": max(sim.makespan for sim in sims),
        "critical_rank": stages[crit]["pacing_rank"],
        **{k: cr[k] for k in ROW_KEYS},
        "schedule": s.plan.schedule,
        "flops": {"model_per_step": model_flops,
                  "hardware_per_step": s.model.hardware_flops_per_token(s.seq_len, s.recompute)
                  * (float(s.global_batch) * s.seq_len),
                  "cluster_peak_per_s": peak},
        "stages": stages,
        "ranks": rows,
        "throughput_source": sorted(f"{sp_.name}: {cached_rates(sp_, s.dtype, hd, s.kernels).source}" for sp_ in specs.values()),
        # what priced each compute term per device type: a layer profile, else the kernel curves or
        # the datasheet (autotune/cost/layers.py)
        "compute_source": _compute_sources(groups),
        **_activation_sources(groups),
        **({"notes": notes} if (notes := LY.precision_notes(s.cluster, s.model, s.dtype)) else {}),
        # the runtime whose kernels priced the datasheet GPUs (cost/kernels.py; --target picks it)
        "runtime": _runtime(s.kernels),
        **({"moe": _moe(s, cr)} if s.experts is not None else {}),
        "timeline": None,
    }


def _moe(s: StepContext, row: dict[str, Any]) -> dict[str, Any]:
    """The MoE terms of the rank that ends the step (per step, seconds; bytes per rank): its router,
    the host time of the MoE layers' own kernels and synchronisations (``moe_host_s``), routed experts (busiest EP rank, ``imbalance`` its load over the even share), the token
    exchange (all of it, and what compute does not hide), the expert gradients' reduction over edp,
    the expert states and dispatch buffers in its memory."""
    x, m = s.experts, s.model
    t, mem = row["moe"], row["memory"]
    return {"experts": m.moe.experts, "top_k": m.moe.top_k, "ep": x.ep, "etp": x.etp, "edp": x.edp,
            "experts_per_rank": list(x.shares), "moe_layers_on_rank": int(t["moe_layers"]),
            "router_s": t["router_s"], "moe_host_s": t["moe_host_s"], "experts_s": t["experts_s"], "ep_comm_s": t["ep_comm_s"],
            "ep_exposed_s": t["ep_exposed_s"], "expert_grad_sync_s": t["expert_grad_sync_s"],
            "imbalance": t["imbalance"], "tokens_per_expert": t["tokens_per_expert"], "overlap": x.overlap,
            "ep_crosses_nodes": t["ep_inter_peers"] > 0,
            "expert_states_bytes": mem["expert_weights"] + mem["expert_gradients"] + mem["expert_optimizer"],
            "dispatch_buffers_bytes": mem["dispatch_buffers"], "active_params": m.active_params(),
            "total_params": m.total_params()}


def _runtime(kernels: Any) -> dict[str, Any]:
    from autotune.cost.kernels import RUNTIME

    k = kernels or RUNTIME
    return {"name": k.name, "host_s_per_kernel": k.host_s, "kernels_per_block_fwd": k.block_fwd,
            "kernels_head_fwd": k.head_fwd, "source": k.source}


def _compute_sources(groups: list) -> dict[str, dict[str, str]]:
    """What priced each compute term per device type (its first tp group, as ``rank.rank_cost``
    priced it)."""
    out: dict[str, dict[str, str]] = {}
    for _, _, ctx, _ in groups:
        if ctx.spec.name not in out:
            out[ctx.spec.name] = LY.rank_sources(ctx)
            if ctx.step.experts is not None and (steps := MS.source(ctx)) is not None:
                out[ctx.spec.name][LY.MOE_PIECE] = steps  # the MoE layers priced from their steps
    return out


def _activation_sources(groups: list) -> dict[str, Any]:
    """``{"activation_source": {device: how}}`` where a layer profile measured the activation bytes
    (``layers.measured_activations``); nothing otherwise (every other estimate's breakdown keeps its
    keys)."""
    out: dict[str, str] = {}
    unmeasured: set[int] = set()  # device specs without activation bytes: None for every group on them
    for _, _, ctx, _ in groups:
        spec = ctx.spec
        if spec.name not in out and id(spec) not in unmeasured:
            if not LY.measures_activations(spec, ctx.step.model, ctx.step.dtype):
                unmeasured.add(id(spec))
                continue
            got = LY.activation_scale(ctx)
            if got is not None:
                out[spec.name] = got[1]
    return {"activation_source": out} if out else {}


def timeline(s: StepContext, groups: list, sims: list, per_rep_stage: dict, exposed_of: dict) -> list[dict]:
    """Gantt events of the replica that ends its pipeline last (one representative rank per
    stage) and each stage's exposed DP sync after the pipeline."""
    p, dp = s.pp, s.dp
    first_rank = _first_ranks(groups)
    pace = max(range(dp), key=lambda d: sims[d].makespan)
    reps = [first_rank[(pace, id(max(per_rep_stage[(pace, st)].values(), key=lambda c: c.busy)))]
            for st in range(p)]
    events = sims[pace].events(s.plan.schedule, reps)
    for st in range(p):
        exposed = max(exposed_of[(pace, cid)] for cid in per_rep_stage[(pace, st)])
        start = max(sim.rank_finish[st] for sim in sims)
        if exposed > 0:
            events.append({"stage": st, "rank": reps[st], "kind": "comm", "comm": "dp", "microbatch": None,
                           "start": start, "end": start + exposed})
    return events
