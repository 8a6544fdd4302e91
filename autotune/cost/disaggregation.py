"""HeterMoE's disaggregation priced (``Plan.disaggregate``; Wu et al., "HeterMoE", arXiv 2504.03871).

The plan's DP replicas with samples (the attention ranks) run everything but the routed experts of
other ranks: attention, the shared experts, the router, the dense layers, embedding and head; the
replicas whose ``shares.samples`` entry is 0 (the expert-only ranks, older GPUs) hold routed experts
only. One EP group spans every rank (ep == dp, ``plan_checks._disaggregation_problems``), each EP rank
holding ``shares.experts[q]`` experts.

Per MoE layer and micro-batch (forward; the backward alike with twice the GEMM work, and with full
recomputation the forward's attention, dispatch, experts and combine again):

* ``a``: an attention rank's block less its routed experts and exchange (the uniform price's MoE
  block, ``rank.moe_block``, without its routed-expert and exchange terms);
* ``e_q``: EP rank q's routed experts at its share and its device (``expert_ranks.expert_seconds``),
  the group routing the attention ranks' tokens only: N = attention ranks x tokens each;
* ``x``: one all-to-all (dispatch; the combine moves as much back): attention rank q sends its
  copies for others' experts and receives from the other attention ranks, an expert-only rank sends
  nothing in the dispatch and receives from every attention rank (``expert_ranks.exchange_split``:
  the pairs inside a node over its links, the others over the network).

One micro-batch alone walks the chain ``a + x + max_q e_q + x`` per layer. HeterMoE's zebra overlap
keeps two micro-batches in flight: the expert-only ranks compute micro-batch i's experts while the
attention ranks run micro-batch i+1's attention. ``zebra_seconds`` schedules the two micro-batches'
tasks over the model's MoE layers on three resources (attention ranks, expert-only ranks, network),
earliest start first; per micro-batch and layer that is at least the larger of half the chain and
each resource's load (``overlapped_period``, the bound it meets where one resource is saturated). An
odd micro-batch count runs its last one alone.

The step is then the uniform model's: every replica, the expert-only ones too, runs the attention
ranks' micro-batch count of these slots (``pipeline_parallel``'s simulation, dp gradient exposure,
optimizer, memory rows and figures as for any plan); each rank's ``moe`` row holds its own routed
experts' seconds, the exchange, and as exposed what of its slots it does not compute (exchange and
waiting for the other side). Not priced apart: the dense gradients' ring still counts the
expert-only replicas, and their memory the dense weights and one micro-batch's activations (both
overstate them); the attention ranks keep a second micro-batch's activations (the one in flight).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autotune.cost import expert_dispatch as XD
from autotune.cost import expert_ranks as ER
from autotune.cost import moe_layers as ML
from autotune.cost import rank as RK


@dataclass(frozen=True)
class LayerParts:
    """Seconds of one MoE layer and micro-batch, forward or backward, as the overlap combines them."""

    attention: float
    """The busiest attention rank's block less the routed experts and exchange."""
    attention_load: float
    """The busiest attention rank: its attention plus its own routed experts."""
    expert_only: float
    """The slowest expert-only rank's routed experts."""
    experts: float
    """The slowest EP rank's routed experts (what one micro-batch alone waits for)."""
    exchange: float
    """The all-to-alls of the pass (dispatch and combine; twice that under full recomputation's backward)."""


def chain(p: LayerParts) -> float:
    """One micro-batch alone through one layer: attention, dispatch, the slowest EP rank's experts, combine."""
    return p.attention + p.exchange + p.experts


def overlapped_period(p: LayerParts) -> float:
    """A lower bound of the seconds per micro-batch and layer with two micro-batches in flight: half
    the chain, each resource's load (attention ranks, expert-only ranks, network). ``zebra_seconds``
    reaches it where one resource is saturated; where the attention ranks' own experts must wait for
    the dispatch the schedule leaves gaps."""
    return max(0.5 * chain(p), p.attention_load, p.expert_only, p.exchange)


def zebra_seconds(p: LayerParts, layers: int, microbatches: int) -> float:
    """Seconds for ``microbatches`` micro-batches (1 or 2) to pass ``layers`` MoE layers together, as
    HeterMoE interleaves them: per micro-batch and layer the attention on the attention ranks (A),
    the dispatch on the network (N, half the exchange), the routed experts on A (their own share) and
    on the expert-only ranks (B) at once, the combine on N; each resource runs one task at a time,
    and the task that can start first goes first (earliest start; ties: the earlier layer, then the
    earlier micro-batch). One micro-batch alone: ``layers * chain``."""
    own = p.attention_load - p.attention
    template = (("A", p.attention, ()), ("N", 0.5 * p.exchange, (0,)), ("A", own, (1,)), ("B", p.expert_only, (1,)),
                ("N", 0.5 * p.exchange, (2, 3)))
    free = {"A": 0.0, "B": 0.0, "N": 0.0}
    layer = [0] * microbatches  # the layer each micro-batch is in, its tasks' ends there, and where it entered
    ends: list[dict[int, float]] = [{} for _ in range(microbatches)]
    entered = [0.0] * microbatches
    while any(x < layers for x in layer):
        best = None
        for i in range(microbatches):
            if layer[i] >= layers:
                continue
            for j, (res, dur, deps) in enumerate(template):
                if j in ends[i] or any(d not in ends[i] for d in deps):
                    continue
                start = max([free[res], entered[i]] + [ends[i][d] for d in deps])
                key = (start, layer[i], i, j)
                if best is None or key < best[0]:
                    best = (key, res, start + dur)
        (_, _, i, j), res, end = best
        ends[i][j] = free[res] = end
        if len(ends[i]) == len(template):  # the combine is in: the next layer's attention may start
            layer[i], entered[i], ends[i] = layer[i] + 1, end, {}
    return max(entered)


def slot_seconds(p: LayerParts, layers: int, microbatches: int) -> float:
    """Mean seconds per micro-batch through ``layers`` MoE layers over ``microbatches``: pairs
    interleaved (``zebra_seconds``), an odd last one alone."""
    pairs, alone = divmod(microbatches, 2)
    return (pairs * zebra_seconds(p, layers, 2) + alone * zebra_seconds(p, layers, 1)) / max(microbatches, 1)


def _parts(ctxs: list[Any], attention: tuple[bool, ...]) -> tuple[LayerParts, LayerParts, dict[str, float]]:
    """(forward, backward) parts of one MoE layer and the attention ranks' other work per micro-batch."""
    a0 = ctxs[0]
    s, x, m = a0.step, a0.step.experts, a0.step.model
    e, full = m.moe, RK.reruns_moe_forward(s)
    n = ML.tokens_in(a0)
    n_attn = sum(attention)
    loads = ER.loads(e, x.ep, 1, n * n_attn / x.ep, x.shares)
    peers = a0.expert_peers or ((a0.rates, a0.cf),) * x.ep
    width = e.expert_ffn_hidden
    secs = [cf * ER.expert_seconds(r, m, ld, width, s.bpe) for (r, cf), ld in zip(peers, loads, strict=True)]
    # an expert-only rank routes nothing: it sends nothing in the dispatch, receives from the attention ranks
    copies = ER.exchange_split(e, tuple(n if a else 0.0 for a in attention), loads, a0.expert_links.ep_nodes,
                               flex=x.flex)
    a2a, _ = XD.exchange_times(a0.collectives, a0.expert_links, etp=1, split=copies, hidden=m.hidden,
                               bpe=s.bpe, received=max(ld.received for ld in loads))
    one_way = a0.mf * a2a
    att_f = att_b = 0.0
    for ctx in ctxs:  # the attention ranks' MoE blocks less their routed experts and exchange
        bm, t = RK.moe_block(ctx)[:2]
        g = t.experts_s / 3.0  # the uniform price's routed experts (forward), taken out again
        att_f = max(att_f, bm.layer_f - g - bm.ep_f)
        att_b = max(att_b, bm.layer_b - (3.0 if full else 2.0) * g - bm.ep_b)
    own = max(secs[q] for q in range(x.ep) if attention[q])
    only = max((secs[q] for q in range(x.ep) if not attention[q]), default=0.0)
    rb = 3.0 if full else 2.0  # the backward's GEMMs (twice the forward's), plus the recomputed forward
    fwd = LayerParts(attention=att_f, attention_load=att_f + own, expert_only=only, experts=max(secs),
                     exchange=2.0 * one_way)
    bwd = LayerParts(attention=att_b, attention_load=att_b + rb * own, expert_only=rb * only,
                     experts=rb * max(secs), exchange=(4.0 if full else 2.0) * one_way)
    return fwd, bwd, {"expert_s": secs, "exchange_copies": copies}


def overlapped(s: Any, groups: list[tuple[int, int, Any, Any]]) -> tuple[Any, list, dict[str, Any]]:
    """The step context and (first rank, DP index, context, cost) groups of a disaggregated plan as
    the uniform estimate simulates them: every replica runs the attention ranks' micro-batch count
    of slots, each slot the attention ranks' other work plus each MoE layer's overlapped seconds;
    and the terms for the breakdown."""
    m_att = max(s.microbatches)
    attention = tuple(mb > 0 for mb in s.microbatches)  # tp == 1: EP rank q of each group is replica g * ep + q
    att_ctx = [ctx for _, d, ctx, _ in groups if attention[d]]
    fwd, bwd, extra = _parts(att_ctx, attention[:s.experts.ep])
    n_moe = int(sum(s.experts.chunk_moe_layers[0]))
    slot_f, slot_b = slot_seconds(fwd, n_moe, m_att), slot_seconds(bwd, n_moe, m_att)
    # the attention ranks' other work per micro-batch: their uniform chunk less its MoE layers
    other = max(sum(c.fwd) + sum(c.bwd) - n_moe * _uniform_layer(ctx) for _, d, ctx, c in groups if attention[d])
    f = other * 0.5 + slot_f  # the other work split evenly over the passes (only their sum is used)
    b = other * 0.5 + slot_b
    done: dict[int, Any] = {}
    out = []
    for r0, d, ctx, c in groups:
        new = done.get(id(c))
        if new is None:
            mem_terms = dict(c.memory_terms)
            if attention[d]:  # a second micro-batch in flight
                mem_terms["activations"] = 2.0 * mem_terms["activations"]
            # compute: the attention ranks' other work and MoE layers' attention and own experts, the
            # expert-only ranks' experts; the rest of each slot is exchange or waiting on the other side
            comp = m_att * (other + n_moe * (fwd.attention_load + bwd.attention_load) if attention[d]
                            else n_moe * (fwd.expert_only + bwd.expert_only))
            own = (fwd.attention_load - fwd.attention + bwd.attention_load - bwd.attention if attention[d]
                   else fwd.expert_only + bwd.expert_only)
            exposed = max(0.0, m_att * (f + b) - comp)
            moe = None if c.moe is None else {**c.moe, "experts_s": m_att * n_moe * own, "ep_exposed_s": exposed,
                                               "ep_comm_s": m_att * n_moe * (fwd.exchange + bwd.exchange)}
            new = done[id(c)] = dataclasses.replace(
                c, fwd=(f,), bwd=(b,), busy=m_att * (f + b), wgt=None if c.wgt is None else (0.0,),
                compute_s=comp, exposed_in_ops=exposed, moe=moe,
                comm_s=c.dp_comm_s + m_att * n_moe * (fwd.exchange + bwd.exchange),
                memory_terms=mem_terms, memory_total=c.memory_total + mem_terms["activations"]
                - c.memory_terms["activations"])
        out.append((r0, d, ctx, new))
    s2 = dataclasses.replace(s, microbatches=(m_att,) * len(s.microbatches))
    terms = {"attention_ranks": sum(attention), "expert_only_ranks": len(attention) - sum(attention),
             "microbatches": m_att, "moe_layers": n_moe,
             "forward": {**dataclasses.asdict(fwd), "chain": chain(fwd), "bound": overlapped_period(fwd),
                         "per_layer": slot_f / n_moe},
             "backward": {**dataclasses.asdict(bwd), "chain": chain(bwd), "bound": overlapped_period(bwd),
                          "per_layer": slot_b / n_moe},
             "other_s": other, "step_unoverlapped_s": m_att * (other + n_moe * (chain(fwd) + chain(bwd))), **extra}
    return s2, out, terms


def _uniform_layer(ctx: Any) -> float:
    """One MoE layer's forward plus backward seconds per micro-batch in the uniform price of ``ctx``."""
    bm = RK.moe_block(ctx)[0]
    return bm.layer_f + bm.layer_b
