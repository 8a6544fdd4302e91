"""``estimate(plan, model, cluster, seq_len, global_batch)``: step time, tokens/s, MFU, memory per
rank and the reasons, from first principles (compute.py, comm.py, memory.py, pipeline.py).

How the pieces fit:

1. Resolve the plan (PlanError when it does not fit the model or the cluster).
2. For every tensor-parallel group (its ranks share a node, hence a device type, and do identical
   work) price one block per micro-batch: GEMMs, causal attention on its CP shard and heads,
   elementwise traffic, TP collectives (not overlapped, as in Megatron), Ulysses all-to-alls before
   and after attention (uneven head splits pace the exchange), CP ring passes of K/V overlapped with
   the attention of the block already received (ring attention: only the excess is exposed), ZeRO-3
   parameter gathers overlapped with the block's compute; recomputation adds its forward work to
   backward. Calibration factors (``validate``) multiply compute and communication per device type.
3. A pipeline stage of one DP replica runs at the pace of its slowest rank (its TP/CP/HP ranks
   synchronise every block); the schedule is simulated per replica over these stage times and the
   p2p times between stages (pipeline.py), with each replica's own micro-batch count.
4. DP gradient synchronisation (all-reduce, or reduce-scatter + all-gather with ZeRO) over the
   dp x cp x hp ranks holding the same parameters starts when every replica has finished; the
   reduce part overlaps with the last micro-batch's backward (Megatron ``overlap_grad_reduce``),
   the rest is exposed; then the optimizer step (memory-bound Adam: ~30 bytes moved per parameter).
5. Memory per rank (memory.py) against the device's capacity; over capacity is infeasible and the
   reason names the largest term.

Speed: everything is computed once per TP group (ranks/tp of them), stage times and simulations are
shared between identical replicas, and the cluster lookups are cached (comm.Topology). The Gantt
``timeline`` (one representative rank per stage, of the pacing replica) costs a few hundred small
dicts; pass ``timeline=False`` to skip it when only the figures are needed (the search can).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autotune.cost import comm as C
from autotune.cost.compute import (
    DTYPE_BYTES,
    Rates,
    causal_keys,
    head_compute,
    layer_compute,
    rates_for,
    ring_blocks,
)
from autotune.cost.memory import layer_activation_bytes, model_states, reserve
from autotune.cost.pipeline import peak_in_flight, simulate_cached
from autotune.plan import Plan
from autotune.schedules import schedule_of
from autotune.units import fmt_bytes

ADAM_BYTES_PER_PARAM = 30.0
"""Adam step traffic per parameter: reads 16-bit weight and grad, fp32 master, m, v (16 B), writes
weight, master, m, v (14 B)."""

TERM_NAMES = ("weights", "gradients", "optimizer", "activations", "logits", "reserve")


@dataclass
class Estimate:
    """What the cost model says about one plan."""

    plan: Plan
    """The resolved plan with ``predicted`` set."""
    predicted: dict[str, Any]
    breakdown: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "predicted": self.predicted, "breakdown": self.breakdown}


_RATES: dict[tuple[int, str, int], tuple[Any, Rates]] = {}


def _rates(spec: Any, dtype: str, head_dim: int) -> Rates:
    key = (id(spec), dtype, head_dim)
    hit = _RATES.get(key)
    if hit is None or hit[0] is not spec:
        if len(_RATES) > 256:
            _RATES.clear()
        hit = _RATES[key] = (spec, rates_for(spec, dtype, head_dim))
    return hit[1]


def _stage_params(model: Any, plan: Plan, pp_i: int, lp: float, emb: float, head: float) -> float:
    """Parameters held by pipeline rank ``pp_i`` before tp sharding (lp: one block's)."""
    n_chunks = len(plan.shares.layers)
    mine = plan.stages_of_rank(pp_i)
    params = sum(plan.layers_of_stage(pp_i)) * lp
    if 0 in mine:
        params += emb
    if n_chunks - 1 in mine:  # the last chunk: final norm and LM head
        params += head
        if model.tied_embeddings and 0 not in mine:
            params += model.vocab * model.hidden  # a copy of the tied embedding on the last stage
    return params


def estimate(plan: Plan, model: Any, cluster: Any, seq_len: int, global_batch: int, *,
             calibration: dict[str, dict[str, float]] | None = None, timeline: bool = False) -> Estimate:
    """Predict one training step of ``plan`` (resolved here; PlanError when it does not fit).

    ``timeline=True`` also fills ``breakdown["timeline"]`` with the simulated events (None
    otherwise); ``calibration`` is ``{device type: {"compute": f, "comm": f}}`` from ``validate``."""
    rp = plan.resolve(model, cluster, seq_len, global_batch)
    deg = rp.degrees
    p, dp, cp, hp, tp = deg.pp, deg.dp, deg.cp, deg.hp, deg.tp
    v = rp.virtual_stages
    n_chunks = p * v
    sched = schedule_of(rp)
    chunks_of = [rp.stages_of_rank(s) for s in range(p)]  # the schedule's placement
    world = deg.world
    topo = C.topology(cluster)
    index = topo.index
    devs = [index[(e.node, e.device)] for e in rp.placement]
    node_of = topo.node_of
    cdevs = cluster.devices
    dtype, bpe = rp.dtype, DTYPE_BYTES[rp.dtype]
    mbs = rp.micro_batch_size
    tokens, heads, samples = rp.shares.tokens, rp.shares.heads, rp.shares.samples
    zig = rp.cp_layout == "zigzag" and cp > 1
    sp = rp.sequence_parallel and tp > 1
    recompute, zero = rp.recompute, rp.zero_stage
    cal = calibration or {}
    h, hd = model.hidden, model.head_dim
    heads_tp = model.heads // tp
    kv_ratio = model.kv_heads / model.heads
    blk = dp * cp * hp * tp  # ranks per pipeline stage
    shard_n = dp * cp * hp  # ranks holding the same parameters
    mb_of = [s // mbs for s in samples]

    # Ulysses all-to-all: the busiest rank sends its tokens of the others' heads or receives the
    # others' tokens of its own heads (uneven head shares pace the exchange).
    a2a_heads = max((hp - 1) * max(heads), heads_tp - min(heads)) if hp > 1 else 0
    cp_max_tokens = max(tokens)
    keysums = [causal_keys(tokens, i, zig, seq_len) for i in range(cp)]
    # the ring's blocks are priced one kernel call each on CPU only: skip the O(cp^2) list elsewhere
    blocks = [ring_blocks(tokens, i, zig, seq_len) for i in range(cp)] \
        if cp > 1 and any(g.device.kind == "cpu" for g in cluster.groups) else [None] * cp
    lp = float(model.layer_params())
    emb, head = float(model.embedding_params()), float(model.head_params())
    stage_params = [(_stage_params(model, rp, i, lp, emb, head), lp) for i in range(p)]
    dp_links = [topo.group_link([devs[i * blk + k * tp] for k in range(shard_n)]) for i in range(p)]

    def hops_of(pp_i: int) -> Any:
        """Per chunk of pipeline rank pp_i: (link of its sends, sends forward, sends backward). A
        rank's sends are priced on the link to the rank holding the next chunk (the previous one
        where the next sits on the same rank: the turn of a V); the last chunk's on the link to
        the next pipeline rank (so the looped schedules price as they always did)."""
        rank_of = [sched.stage_rank(j, p, v) for j in range(n_chunks)]
        peers = []
        for j in chunks_of[pp_i]:
            fwd_out = j < n_chunks - 1 and rank_of[j + 1] != pp_i
            bwd_out = j > 0 and rank_of[j - 1] != pp_i
            q = rank_of[j + 1] if fwd_out else ((pp_i + 1) % p if j == n_chunks - 1 or not bwd_out else rank_of[j - 1])
            peers.append((q, fwd_out, bwd_out))

        def links(r0: int) -> tuple:
            d0 = devs[r0]
            return tuple((topo.node_link(node_of[d0], node_of[devs[r0 + (q - pp_i) * blk]]), f, b)
                         for q, f, b in peers)
        return links

    pp_links = [hops_of(i) if p > 1 else (lambda r0: ((C._SELF, False, False),) * v) for i in range(p)]

    # ---- per tensor-parallel group --------------------------------------------------------------
    # groups[g] = (first rank, pp index, dp index, cost); a tp group sits inside one node (Plan
    # validation), so one device type and one link serve all its ranks
    group_cache: dict[tuple, dict[str, Any]] = {}
    link_cache: dict[tuple[str, int], Any] = {}
    groups: list[tuple[int, int, int, dict[str, Any]]] = []
    for g in range(world // tp):
        r0 = g * tp
        x = g
        hp_i = x % hp
        x //= hp
        cp_i = x % cp
        x //= cp
        dp_i = x % dp
        pp_i = x // dp
        d0 = devs[r0]
        spec = cdevs[d0].spec
        tp_link = topo.node_link(node_of[d0], node_of[d0]) if tp > 1 else C._SELF
        hp_link = cp_link = C._SELF
        if hp > 1:
            hp_base = r0 - hp_i * tp
            hp_link = link_cache.get(("hp", hp_base))
            if hp_link is None:
                hp_link = link_cache[("hp", hp_base)] = topo.group_link([devs[hp_base + k * tp] for k in range(hp)])
        if cp > 1:
            cp_base = r0 - cp_i * hp * tp
            cp_link = link_cache.get(("cp", cp_base))
            if cp_link is None:
                cp_link = link_cache[("cp", cp_base)] = topo.group_link(
                    [devs[cp_base + k * hp * tp] for k in range(cp)])
        pp_link = pp_links[pp_i](r0)
        m_d = mb_of[dp_i]
        # links come from the topology's caches, so their identity names them
        key = (pp_i, cp_i, hp_i, id(spec), id(tp_link), id(hp_link), id(cp_link), tuple(id(x[0]) for x in pp_link), m_d)
        cost = group_cache.get(key)
        if cost is None:
            cost = group_cache[key] = _group_cost(
                rp, model, spec, cal.get(spec.name) or {}, pp_i=pp_i, cp_i=cp_i, hp_i=hp_i, m_d=m_d,
                tp_link=tp_link, hp_link=hp_link, cp_link=cp_link, pp_link=pp_link, dp_link=dp_links[pp_i],
                dtype=dtype, bpe=bpe, seq_len=seq_len, keysum=keysums[cp_i], blocks=blocks[cp_i], a2a_heads=a2a_heads,
                cp_max_tokens=cp_max_tokens, stage_params=stage_params[pp_i], kv_ratio=kv_ratio, hd=hd, h=h,
                sp=sp, recompute=recompute, zero=zero, shard_n=shard_n, n_chunks=n_chunks)
            cost["spec"] = spec
        groups.append((r0, pp_i, dp_i, cost))

    # ---- pipeline per replica: a stage runs at its slowest rank's pace ----------------------------
    # distinct costs per (replica, stage): identical tp groups share one cost object
    per_rep_stage: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for _, pp_i, dp_i, cost in groups:
        per_rep_stage.setdefault((dp_i, pp_i), {})[id(cost)] = cost
    # (zero-bubble schedules also take the weight-gradient part of each backward: wgt)
    sims = []
    split = sched.splits_backward
    for d in range(dp):
        fwd, bwd, p2p = [0.0] * n_chunks, [0.0] * n_chunks, [0.0] * max(n_chunks - 1, 0)
        wgt = [0.0] * n_chunks
        for s in range(p):
            for c in per_rep_stage[(d, s)].values():
                cf_, cb_, cw_, cp_ = c["fwd"], c["bwd"], c["wgt"], c["p2p"]
                for ci, j in enumerate(chunks_of[s]):
                    if cf_[ci] > fwd[j]:
                        fwd[j] = cf_[ci]
                    if cb_[ci] > bwd[j]:
                        bwd[j] = cb_[ci]
                        wgt[j] = cw_[ci]  # of the slowest backward: I = bwd - wgt stays >= 0
                    if j < n_chunks - 1 and cp_[ci] > p2p[j]:
                        p2p[j] = cp_[ci]
        sims.append(simulate_cached(sched, p, v, mb_of[d], tuple(fwd), tuple(bwd), tuple(p2p),
                                    tuple(wgt) if split else None))

    # DP sync starts when every replica of the stage is done; then the optimizer step
    step = 0.0
    stage_end = []
    exposed_of: dict[tuple[int, int], float] = {}  # (replica, id(cost)) -> exposed DP seconds
    for s in range(p):
        done = max(sim.rank_finish[s] for sim in sims)
        worst = 0.0
        for d in range(dp):
            window = sims[d].bwd[chunks_of[s][0]]  # the last micro-batch's backward of the first chunk
            for cid, c in per_rep_stage[(d, s)].items():
                exposed = max(0.0, c["dp_overlappable"] - window) + c["dp_exposed_fixed"]
                exposed_of[(d, cid)] = exposed
                worst = max(worst, exposed + c["optimizer"])
        stage_end.append(done + worst)
        step = max(step, done + worst)

    # ---- memory and per-rank rows ---------------------------------------------------------------
    memory, capacity, rows = [0.0] * world, [0.0] * world, [None] * world
    infeasible = None
    templates: dict[tuple[int, float], dict[str, Any]] = {}
    stage_mem = [0.0] * p
    for r0, pp_i, dp_i, c in groups:
        spec = c["spec"]
        exposed = exposed_of[(dp_i, id(c))]
        tmpl = templates.get((id(c), exposed))
        if tmpl is None:
            own = c["busy"] + exposed + c["optimizer"]
            tmpl = templates[(id(c), exposed)] = {
                "stage": pp_i, "device": spec.name, "compute_s": c["compute_s"], "comm_s": c["comm_s"],
                "tp_comm_s": c["tp_comm_s"], "cp_comm_s": c["cp_comm_s"], "hp_comm_s": c["hp_comm_s"],
                "pp_comm_s": c["pp_comm_s"], "dp_comm_s": c["dp_comm_s"],
                "exposed_comm_s": c["exposed_in_ops"], "dp_exposed_s": exposed, "optimizer_s": c["optimizer"],
                "bubble_s": max(0.0, step - own), "memory_bytes": c["memory_total"],
                "capacity_bytes": spec.memory_bytes, "memory": c["memory_terms"]}
        total = c["memory_total"]
        for r in range(r0, r0 + tp):
            memory[r] = total
            capacity[r] = spec.memory_bytes
            rows[r] = {"rank": r, **tmpl}
        if total > stage_mem[pp_i]:
            stage_mem[pp_i] = total
        if total > spec.memory_bytes and infeasible is None:
            terms = c["memory_terms"]
            worst_term = max(TERM_NAMES, key=lambda k: terms[k])
            infeasible = (f"rank {r0} ({spec.name}) memory {fmt_bytes(total)} > {fmt_bytes(spec.memory_bytes)}: "
                          f"{worst_term} {fmt_bytes(terms[worst_term])}")

    tokens_step = float(global_batch) * seq_len
    peak = tp * sum(c["spec"].flops(dtype) for _, _, _, c in groups)
    model_flops = model.model_flops_per_token(seq_len) * tokens_step
    predicted = {
        "step_time_s": step,
        "tokens_per_s": tokens_step / step if step > 0 else math.inf,
        "mfu": model_flops / (step * peak) if step > 0 and peak > 0 else 0.0,
        "memory_bytes": memory,
        "capacity_bytes": capacity,
        "feasible": infeasible is None,
        "infeasible_reason": infeasible,
        "bubble_fraction": _bubble_fraction(sims, step, p),
    }

    # ---- breakdown ------------------------------------------------------------------------------
    first_rank = {}
    for r0, _, dp_i, c in groups:
        first_rank.setdefault((dp_i, id(c)), r0)
    stages = []
    for s in range(p):
        pace = max(range(dp), key=lambda d: sims[d].rank_finish[s])
        slow = max(per_rep_stage[(pace, s)].values(), key=lambda c: c["busy"])
        pr = first_rank[(pace, id(slow))]
        r = rows[pr]
        sim = sims[pace]
        stages.append({
            "stage": s, "layers": list(rp.layers_of_stage(s)),
            "devices": sorted({c["spec"].name for d in range(dp) for c in per_rep_stage[(d, s)].values()}),
            "pacing_replica": pace, "pacing_rank": pr, "microbatches": sim.m,
            "fwd_s": [sim.fwd[j] for j in chunks_of[s]], "bwd_s": [sim.bwd[j] for j in chunks_of[s]],
            "compute_s": r["compute_s"], "tp_comm_s": r["tp_comm_s"], "cp_comm_s": r["cp_comm_s"],
            "hp_comm_s": r["hp_comm_s"], "pp_comm_s": r["pp_comm_s"], "dp_comm_s": r["dp_comm_s"],
            "exposed_comm_s": r["exposed_comm_s"], "dp_exposed_s": r["dp_exposed_s"], "optimizer_s": r["optimizer_s"],
            "pipeline_s": sim.rank_finish[s], "bubble_s": sim.makespan - sim.rank_busy[s],
            "bubble_fraction": sim.bubble_fraction(s), "end_s": stage_end[s], "memory_bytes": stage_mem[s],
        })
    crit = max(range(p), key=lambda s: stage_end[s])
    cr = rows[stages[crit]["pacing_rank"]]
    specs = {id(c["spec"]): c["spec"] for c in group_cache.values()}
    breakdown: dict[str, Any] = {
        # seconds per step of the rank that ends the step last (what the search compares)
        "step_time_s": step,
        "pipeline_s": max(sim.makespan for sim in sims),
        "critical_rank": stages[crit]["pacing_rank"],
        **{k: cr[k] for k in ("compute_s", "tp_comm_s", "cp_comm_s", "hp_comm_s", "pp_comm_s", "dp_comm_s",
                              "exposed_comm_s", "dp_exposed_s", "optimizer_s", "bubble_s")},
        "schedule": rp.schedule,
        "flops": {"model_per_step": model_flops,
                  "hardware_per_step": model.hardware_flops_per_token(seq_len, recompute) * tokens_step,
                  "cluster_peak_per_s": peak},
        "stages": stages,
        "ranks": rows,
        "throughput_source": sorted(f"{sp_.name}: {_rates(sp_, dtype, hd).source}" for sp_ in specs.values()),
        "timeline": None,
    }
    if timeline:
        pace = max(range(dp), key=lambda d: sims[d].makespan)
        reps = [first_rank[(pace, id(max(per_rep_stage[(pace, s)].values(), key=lambda c: c["busy"])))]
                for s in range(p)]
        events = sims[pace].events(None, reps)
        for s in range(p):
            exposed = max(exposed_of[(pace, cid)] for cid in per_rep_stage[(pace, s)])
            start = max(sim.rank_finish[s] for sim in sims)
            if exposed > 0:
                events.append({"stage": s, "rank": reps[s], "kind": "comm", "comm": "dp", "microbatch": None,
                               "start": start, "end": start + exposed})
        breakdown["timeline"] = events
    predicted_plan = rp.replace(predicted=predicted)
    return Estimate(plan=predicted_plan, predicted=predicted, breakdown=breakdown)


def _bubble_fraction(sims: list[Any], step: float, p: int) -> float:
    """Idle share of the pipeline (fill, drain, waiting for a slower stage), averaged over stages and
    replicas, of the pipeline's makespan."""
    distinct: dict[int, list] = {}  # identical replicas share one (cached) simulation
    for sim in sims:
        distinct.setdefault(id(sim), [sim, 0])[1] += 1
    total = sum(n * sum(sim.bubble_fraction(s) for s in range(p)) for sim, n in distinct.values())
    return total / (len(sims) * p) if sims else 0.0


def _group_cost(rp: Plan, model: Any, spec: Any, cal: dict[str, float], *, pp_i: int, cp_i: int, hp_i: int,
                m_d: int, tp_link: Any, hp_link: Any, cp_link: Any, pp_link: Any, dp_link: Any, dtype: str,
                bpe: int, seq_len: int, keysum: float, blocks: Any, a2a_heads: int, cp_max_tokens: int,
                stage_params: tuple[float, float], kv_ratio: float, hd: int, h: int, sp: bool, recompute: str,
                zero: int, shard_n: int, n_chunks: int) -> dict[str, Any]:
    """Per-micro-batch chunk times, per-step terms and memory of one TP group's ranks."""
    deg = rp.degrees
    p, cp, hp, tp = deg.pp, deg.cp, deg.hp, deg.tp
    v = rp.virtual_stages
    cf, mf = float(cal.get("compute", 1.0)), float(cal.get("comm", 1.0))
    rates = _rates(spec, dtype, hd)
    K = C.collectives_for(spec)  # measured gloo table on a profiled CPU, else the alpha-beta formulas
    mbs = rp.micro_batch_size
    s_c = rp.shares.tokens[cp_i]
    tok = mbs * s_c / hp  # tokens this rank holds outside attention
    heads_local = rp.shares.heads[hp_i]
    kept, full_none, scores = layer_activation_bytes(
        model, micro_batch=mbs, tokens_local=s_c / hp, cp_tokens=s_c, seq_len=seq_len, heads_local=heads_local, tp=tp,
        sequence_parallel=sp, recompute=recompute, act_bytes=bpe, fused_attention=spec.fused_attention())
    # elementwise traffic over the sbh tensors; the softmax over the scores is part of the attention
    # kernel's throughput (fused attention never writes the s^2 scores to memory)
    lc = layer_compute(model, rates, tokens=tok, tp=tp, heads_local=heads_local, keysum=keysum, block_seq=s_c, blocks=blocks,
                       micro_batch=mbs, act_bytes=full_none - scores)

    # communication of one block, one micro-batch (Korthikanti et al. 2022 section 4.2.2: with
    # sequence parallelism each all-reduce becomes an all-gather plus a reduce-scatter)
    act = bpe * tok * h
    if tp > 1:
        one = K.all_gather(tp_link, tp, act) + K.reduce_scatter(tp_link, tp, act) if sp else K.all_reduce(
            tp_link, tp, act)
        tp_f = tp_b = 2.0 * one * mf
    else:
        tp_f = tp_b = 0.0
    if hp > 1:  # Q, K, V to head shards before attention, the context back after it
        unit = bpe * (mbs * s_c / hp) * hd * a2a_heads
        hp_f = hp_b = mf * (K.all_to_all(hp_link, hp, unit * (1.0 + 2.0 * kv_ratio)) + K.all_to_all(hp_link, hp, unit))
    else:
        hp_f = hp_b = 0.0
    if cp > 1:  # cp - 1 ring passes of the largest shard's K and V (backward also dK, dV)
        kv_bytes = bpe * mbs * cp_max_tokens * 2.0 * hd * heads_local * kv_ratio
        pass_f, pass_b = mf * K.p2p(cp_link, kv_bytes), mf * K.p2p(cp_link, 2.0 * kv_bytes)
        cp_raw_f, cp_raw_b = (cp - 1) * pass_f, (cp - 1) * pass_b
        cp_f = (cp - 1) * max(0.0, pass_f - cf * lc.attn_fwd / cp)
        cp_b = (cp - 1) * max(0.0, pass_b - cf * lc.attn_bwd / cp)
    else:
        cp_raw_f = cp_raw_b = cp_f = cp_b = 0.0
    params_stage, layer_params = stage_params
    params_local = params_stage / tp
    grad_bytes = bpe * params_local
    z3_f = z3_b = 0.0
    if zero >= 3 and shard_n > 1:  # FSDP gathers each block's weights in forward and again in backward
        gather = mf * K.all_gather(dp_link, shard_n, bpe * layer_params / tp)
        z3_f = max(0.0, gather - cf * lc.fwd)
        z3_b = max(0.0, gather - cf * lc.bwd)
    comp_f, comp_b = cf * lc.fwd, cf * lc.bwd
    # blocking communication calls per micro-batch and layer (fwd, bwd), for the CPU sync term
    # (the ring: cp - 1 K/V passes forward; backward cp - 1 K/V passes and cp dK/dV passes)
    calls_f = (4 if sp else 2) * (tp > 1) + 2 * (hp > 1) + (cp - 1)
    calls_b = calls_f + cp * (cp > 1) + (calls_f if recompute == "full" else 0)
    if recompute == "full":
        comp_b += comp_f
        tp_b += tp_f
        hp_b += hp_f
        cp_b += cp_f
        cp_raw_b += cp_raw_f
    elif recompute == "selective":
        comp_b += cf * lc.attn_fwd
    # CPU: each blocking collective inside a block also waits for the rank that drifted behind
    # (compute.CPU_SYNC_*); charged to the dimension that synchronises, as the runtime's comm clock does
    sync_f = sync_b = 0.0
    if rates.cpu and calls_f:
        sync_f = mf * (calls_f * rates.sync_call_s + rates.sync_skew * comp_f)
        sync_b = mf * (calls_b * rates.sync_call_s + rates.sync_skew * comp_b)
        if tp > 1:
            tp_f, tp_b = tp_f + sync_f, tp_b + sync_b
        elif hp > 1:
            hp_f, hp_b = hp_f + sync_f, hp_b + sync_b
        else:
            cp_f, cp_b = cp_f + sync_f, cp_b + sync_b
            cp_raw_f, cp_raw_b = cp_raw_f + sync_f, cp_raw_b + sync_b
    layer_f = comp_f + tp_f + hp_f + cp_f + z3_f
    layer_b = comp_b + tp_b + hp_b + cp_b + z3_b

    chunk_layers = rp.layers_of_stage(pp_i)
    fwd, bwd = [], []
    head_f, head_b = head_compute(model, rates, tokens=tok, tp=tp)
    emb_tp = K.all_reduce(tp_link, tp, act) * mf if tp > 1 and not sp else (
        K.reduce_scatter(tp_link, tp, act) * mf if tp > 1 else 0.0)
    head_tp_f = head_tp_b = 0.0
    if tp > 1 and rates.cpu:
        # CPU (where each call costs ~0.2 ms): the vocab-parallel loss's two all-reduces (the max,
        # then sum-exp and target logit) and the LM head's entry (all-gather forward with sp, the
        # input gradient's all-reduce / reduce-scatter backward). GPU figures leave them out: they
        # are microseconds there, beside milliseconds of blocks.
        head_tp_f = mf * (K.all_reduce(tp_link, tp, 4.0 * tok) + K.all_reduce(tp_link, tp, 8.0 * tok)
                          + (K.all_gather(tp_link, tp, act) if sp else 0.0))
        head_tp_b = mf * (K.reduce_scatter(tp_link, tp, act) if sp else K.all_reduce(tp_link, tp, act))

    # the weight-gradient part of a backward (W, which zero-bubble schedules run apart): one GEMM of
    # the forward's size per weight matrix (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", table
    # 1: W = 24bsh^2 = the forward's GEMM FLOPs); the input-gradient part (I) keeps the other GEMM,
    # attention's backward, the elementwise work, recomputation and every collective
    layer_w = cf * lc.gemm_fwd
    head_w = cf * (head_b - head_f)  # the LM head's weight GEMM
    wgt = []
    comp_total = tp_total = hp_total = cp_raw_total = exposed_ops = 0.0
    for j, n_layers in zip(rp.stages_of_rank(pp_i), chunk_layers, strict=True):
        f, b = n_layers * layer_f, n_layers * layer_b
        w = n_layers * layer_w + (head_w if j == n_chunks - 1 else 0.0)
        comp = n_layers * (comp_f + comp_b)
        tpc = n_layers * (tp_f + tp_b)
        if j == 0:  # embedding lookup and its tp reduction (vocab-parallel embedding)
            f += cf * rates.memory_time(act) + emb_tp
            comp += cf * rates.memory_time(act)
            tpc += emb_tp
        if j == n_chunks - 1:
            f += cf * head_f + head_tp_f
            b += cf * head_b + head_tp_b
            comp += cf * (head_f + head_b)
            tpc += head_tp_f + head_tp_b
        fwd.append(f)
        bwd.append(b)
        wgt.append(w)
        comp_total += comp
        tp_total += tpc
        hp_total += n_layers * (hp_f + hp_b)
        cp_raw_total += n_layers * (cp_raw_f + cp_raw_b)
        exposed_ops += tpc + n_layers * (hp_f + hp_b + cp_f + cp_b + z3_f + z3_b)
    # Megatron scatter/gather: 1/tp per rank; per chunk, priced on the link of its sends (see hops_of)
    p2p_c = [mf * K.p2p(link, act / tp) if p > 1 else 0.0 for link, _, _ in pp_link]
    pp_sends = 0.0
    for t, (_, fwd_out, bwd_out) in zip(p2p_c, pp_link, strict=True):
        pp_sends += (t if fwd_out else 0.0) + (t if bwd_out else 0.0)

    # DP gradient synchronisation over the ranks holding the same parameters
    if shard_n > 1:
        if zero == 0:
            overl, fixed = mf * K.all_reduce(dp_link, shard_n, grad_bytes), 0.0
        elif zero in (1, 2):
            overl = mf * K.reduce_scatter(dp_link, shard_n, grad_bytes)
            fixed = mf * K.all_gather(dp_link, shard_n, grad_bytes)  # updated weights back to every rank
        else:
            overl, fixed = mf * K.reduce_scatter(dp_link, shard_n, grad_bytes), 0.0
    else:
        overl = fixed = 0.0
    dp_raw = overl + fixed
    if zero >= 3 and shard_n > 1:
        dp_raw += m_d * sum(chunk_layers) * 2.0 * mf * K.all_gather(dp_link, shard_n, bpe * layer_params / tp)
    opt = cf * rates.memory_time(ADAM_BYTES_PER_PARAM * params_local / (shard_n if zero >= 1 else 1))

    # memory
    states = model_states(params_local, dtype, zero, shard_n, layer_params / tp)
    inflight, last_inflight = peak_in_flight(schedule_of(rp), p, v, m_d, pp_i, tuple(chunk_layers))
    acts = kept * inflight + (full_none - kept if recompute != "none" else 0.0)
    logits = 0.0
    if n_chunks - 1 in rp.stages_of_rank(pp_i):
        logits = mbs * s_c / hp * model.vocab / tp * (bpe + 4.0) * last_inflight
    alloc = states["weights"] + states["gradients"] + states["optimizer"] + acts + logits
    res = reserve(spec, alloc)
    terms = {**states, "activations": acts, "logits": logits, "reserve": res,
             "activation_per_layer_microbatch": kept, "layers_microbatches_in_flight": inflight}
    busy_ops = m_d * (sum(fwd) + sum(bwd))
    return {
        "fwd": fwd, "bwd": bwd, "wgt": wgt, "p2p": p2p_c,
        "compute_s": m_d * comp_total, "tp_comm_s": m_d * tp_total, "hp_comm_s": m_d * hp_total,
        "cp_comm_s": m_d * cp_raw_total, "pp_comm_s": m_d * pp_sends, "dp_comm_s": dp_raw,
        "comm_s": m_d * (tp_total + hp_total + cp_raw_total + pp_sends) + dp_raw,
        "exposed_in_ops": m_d * exposed_ops, "busy": busy_ops,
        "dp_overlappable": overl, "dp_exposed_fixed": fixed, "optimizer": opt,
        "memory_total": alloc + res, "memory_terms": terms,
    }
