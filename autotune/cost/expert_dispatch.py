"""Token dispatch and combine of a MoE layer over the EP group (all-to-all), and the expert-TP
collectives around the experts.

Each rank holds ``tokens`` tokens entering the MoE layer (its sequence-parallel slice) and sends one
copy of each to each of its ``top_k`` experts: ``tokens * top_k * hidden`` elements, of which the
share for its own experts stays (1/ep of them under balanced routing) and the rest goes to the
``ep - 1`` peers equally. The busiest rank receives ``imbalance`` times its even share
(``moe_imbalance.py``), so the exchange is paced by that. The peers inside the node are reached over
NVLink and those in other nodes over the network at the same time; the slower of the two parts sets
the time (``ExpertLinks``: each part on its own link). With etp > 1 the EP rank's etp ranks gather
the received tokens (all-gather) before the experts and reduce-scatter their partial outputs after,
inside the etp group (Megatron-Core's expert tensor parallelism). The combine moves the same bytes
back. Forward: dispatch + combine; backward: the same again (the gradients take the reverse routes).

Overlap, per target runtime (``KernelCosts.moe_overlap``): Megatron-Core runs the shared experts
beside the dispatch and combine (``--moe-shared-expert-overlap``), so only the part of the exchange
longer than the shared experts' compute is exposed; torchtitan, DeepSpeed and autotune's runtime
wait for each exchange.
"""

from __future__ import annotations

from typing import Any


def all_to_all_time(coll: Any, links: Any, ep: int, send_bytes: float) -> float:
    """Seconds of one all-to-all in which a rank sends ``send_bytes`` in all (and receives as much),
    split evenly over its ``ep - 1`` peers, each part on its own link (``links``: ``ExpertLinks``)."""
    if ep <= 1 or send_bytes <= 0:
        return 0.0
    per_peer = send_bytes / (ep - 1)
    intra = coll.all_to_all(links.ep_intra, links.ep_intra_n + 1, per_peer * links.ep_intra_n)
    inter = coll.all_to_all(links.ep_inter, links.ep_inter_n + 1, per_peer * links.ep_inter_n)
    return max(intra, inter)


def exchange_times(coll: Any, links: Any, *, ep: int, etp: int, copies: float, hidden: int, bpe: int,
                   received: float) -> tuple[float, float]:
    """(all-to-all seconds, expert-TP seconds) of one direction of one MoE layer (the dispatch; the
    combine is the same): ``copies`` the token copies the rank moving the most sends or receives
    (``expert_ranks.exchange_copies``), ``received`` the token copies the busiest EP rank's experts
    process (after the etp gather)."""
    a2a = all_to_all_time(coll, links, ep, copies * hidden * bpe)
    etp_t = coll.all_gather(links.etp, etp, received * hidden * bpe) if etp > 1 else 0.0
    return a2a, etp_t


def exposed(total: float, overlap: str, shared_compute: float) -> float:
    """The part of ``total`` exchange seconds (a layer's dispatch and combine, forward or backward)
    that the target runtime's compute (``shared_compute``: the shared experts' in that pass) does
    not hide (module docstring)."""
    if overlap == "shared_experts":
        return max(0.0, total - shared_compute)
    return total
