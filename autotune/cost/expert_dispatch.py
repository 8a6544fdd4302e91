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
