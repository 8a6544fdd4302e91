"""Token dispatch and combine of a MoE layer over the EP group (all-to-all), and the expert-TP
collectives around the experts.

Each rank holds ``tokens`` tokens entering the MoE layer (its sequence-parallel slice) and sends one
copy of each to each of its ``top_k`` experts: ``tokens * top_k * hidden`` elements, of which the
share for its own experts stays and the rest goes to each peer in proportion to the experts it holds
(``expert_ranks.exchange_split``: the volume of every pair of EP ranks, so uneven shares move more
to and from the ranks holding more). The busiest rank receives ``imbalance`` times its mean
(``moe_imbalance.py``), so the exchange is paced by that. The peers inside the node are reached over
NVLink and those in other nodes over the network at the same time; the slower of the two parts sets
the time (``ExpertLinks``: each part on its own link, the pairs' nodes in ``ep_nodes``). With etp > 1 the EP rank's etp ranks gather
the received tokens (all-gather) before the experts and reduce-scatter their partial outputs after,
inside the etp group (Megatron-Core's expert tensor parallelism). The combine moves the same bytes
back. Forward: dispatch + combine; backward: the same again (the gradients take the reverse routes).

Overlap, per target runtime (``KernelCosts.moe_overlap``): Megatron-Core runs the shared experts
beside the dispatch and combine (``--moe-shared-expert-overlap``), so only the part of the exchange
longer than the shared experts' compute is exposed; torchtitan, DeepSpeed and autotune's runtime
wait for each exchange.

Overlap across micro-batches (``Plan.moe_a2a_overlap``, Megatron-Core's
``--overlap-moe-expert-parallel-comm --delay-wgrad-compute``): in the steady state of its pipeline
schedule each forward chunk runs beside a backward chunk, layer by layer, the communication on a
second stream (megatron/core/models/common/model_chunk_schedule_plan.py,
``TransformerLayerSchedulePlan.run``)::

    comm stream:    combine_bwd       | dispatch_fwd -> dispatch_bwd     | combine_fwd
    compute stream: pre_dispatch_fwd  | mlp_bwd -> mlp_bwd_dw -> mlp_fwd | pre_dispatch_bwd

``paired_exposed`` follows the two streams op by op and keeps what of the pair is exchange beyond the
compute: with exchanges shorter than the compute beside them, none. The forwards of the warm-up and the backwards of the cool-down run alone, their exchange
exposed in full; ``paired_fraction`` counts the paired ones as Megatron schedules them.
"""

from __future__ import annotations

from typing import Any


def all_to_all_time(coll: Any, links: Any, intra_bytes: float, inter_bytes: float) -> float:
    """Seconds of one all-to-all in which the rank moving the most over its node's links sends or
    receives ``intra_bytes`` there, and the one moving the most over the network ``inter_bytes``
    (``expert_ranks.exchange_split``), each part on its own link (``links``: ``ExpertLinks``) at once."""
    intra = coll.all_to_all(links.ep_intra, links.ep_intra_n + 1, intra_bytes) if intra_bytes > 0 else 0.0
    inter = coll.all_to_all(links.ep_inter, links.ep_inter_n + 1, inter_bytes) if inter_bytes > 0 else 0.0
    return max(intra, inter)


def exchange_times(coll: Any, links: Any, *, etp: int, split: tuple[float, float], hidden: int, bpe: int,
                   received: float) -> tuple[float, float]:
    """(all-to-all seconds, expert-TP seconds) of one direction of one MoE layer (the dispatch; the
    combine is the same): ``split`` the token copies the busiest rank moves inside its node and across
    (``expert_ranks.exchange_split``), ``received`` the token copies the busiest EP rank's experts
    process (after the etp gather)."""
    a2a = all_to_all_time(coll, links, split[0] * hidden * bpe, split[1] * hidden * bpe)
    etp_t = coll.all_gather(links.etp, etp, received * hidden * bpe) if etp > 1 else 0.0
    return a2a, etp_t


def exposed(total: float, overlap: str, shared_compute: float) -> float:
    """The part of ``total`` exchange seconds (a layer's dispatch and combine, forward or backward)
    that the target runtime's compute (``shared_compute``: the shared experts' in that pass) does
    not hide (module docstring)."""
    if overlap == "shared_experts":
        return max(0.0, total - shared_compute)
    return total


def paired_exposed(one_way: float, attn_f: float, mlp_f: float, attn_b: float, mlp_b: float) -> float:
    """Exchange seconds beyond the compute of one (forward, backward) pair of a MoE layer under the
    cross-micro-batch overlap: the two streams of the module docstring, each op starting when its
    stream is free and its input is ready (the backward's experts need its combine's gradient, the
    forward's dispatch its attention, ...), as ``TransformerLayerSchedulePlan.run`` orders them; the
    next layer's pair starts when both streams are done. ``one_way``: one dispatch (a combine, and
    each of the backward's, as long); ``attn_*``: what runs before the dispatch (attention, router,
    permutation), ``mlp_*``: the experts between dispatch and combine."""
    c = one_way
    combine_b = c                                   # comm stream from 0; attn_f on the compute stream
    mlp_b_end = max(attn_f, combine_b) + mlp_b      # needs the combine's gradient
    dispatch_f = max(combine_b, attn_f) + c         # needs the forward's attention
    dispatch_b = max(dispatch_f, mlp_b_end) + c     # needs the backward's experts
    mlp_f_end = max(mlp_b_end, dispatch_f) + mlp_f  # needs the forward's dispatch
    combine_f = max(dispatch_b, mlp_f_end) + c      # needs the forward's experts
    attn_b_end = max(mlp_f_end, dispatch_b) + attn_b  # needs the backward's dispatch gradient
    return max(0.0, max(combine_f, attn_b_end) - (attn_f + mlp_f + attn_b + mlp_b))


def paired_fraction(pp: int, v: int, pp_rank: int, microbatches: int) -> float:
    """The share of a pipeline rank's forward chunks that run beside a backward under the overlap:
    Megatron-Core's warm-up (``schedules.get_pp_rank_microbatches``: (pp - rank - 1) * 2 + (v - 1) *
    pp forwards, plus one with ``overlap_moe_expert_parallel_comm``; without pipelining the first
    forward) runs alone, and as many backwards at the end."""
    total = microbatches * v
    if total <= 0:
        return 0.0
    warm = (pp - pp_rank - 1) * 2 + (v - 1) * pp + 1 if pp > 1 else 1
    return max(0, total - min(warm, total)) / total
