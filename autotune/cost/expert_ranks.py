"""Each EP rank of a MoE layer priced on its own: its experts, its expected routed tokens, its device.

With uneven expert shares (``Shares.experts``) on a mixed cluster the EP ranks of one group differ in
what they hold and how fast they compute it, and the combine all-to-all waits for the slowest:

* EP rank q holding ``e_q`` of the E experts receives, of the N tokens the group routes (``top_k``
  copies each, balanced routing), ``N * top_k * e_q / E`` copies on average, and at the pace-setting
  draw ``imbalance(e_q)`` times that (``moe_imbalance.py``: mean plus the expected maximum of the
  group's ``ep`` normal deviations).
* Its expert GEMMs run at its own device's grouped-GEMM rate at ``received_q / e_q`` tokens per
  expert (``grouped_gemm.py``): a device twice as fast given twice the experts takes as long.
* In the dispatch rank q sends each peer j the copies of its tokens for j's experts, ``tokens_q *
  top_k * e_j / E``, and receives from each peer ``tokens_j * top_k * e_q / E`` (at its imbalance):
  a rank holding more experts receives more from every peer, and its peers send it more. The pairs
  inside a node move over its links, the others over the network, each part paced by the rank that
  sends or receives the most over it (``exchange_split``; ``expert_dispatch.py`` prices the parts).
* The layer's pace is the slowest rank's expert compute (``pace``).

Under even shares on one device type every rank is the same, and this is the busiest-rank pricing
the layer had before (``moe_layers.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autotune.cost import flex_dispatch as FD
from autotune.cost import grouped_gemm as GG
from autotune.cost import moe_imbalance as MI


@dataclass(frozen=True)
class RankLoad:
    """One EP rank's routed work in one MoE layer and micro-batch."""

    share: int
    """Experts it holds."""
    imbalance: float
    """Its pace-setting load over its mean load (>= 1)."""
    received: float
    """Token copies its experts process (after the etp gather), at that load."""


def loads(moe: Any, ep: int, etp: int, tokens: float, shares: Sequence[int]) -> tuple[RankLoad, ...]:
    """Every EP rank's load: ``tokens`` each of the group's ``ep * etp`` ranks routes, ``shares``
    the experts of each EP rank."""
    routed = ep * etp * tokens
    out = []
    for e in shares:
        imb = MI.imbalance(moe, ep, routed, e)
        out.append(RankLoad(share=e, imbalance=imb, received=routed * moe.top_k * e / moe.experts * imb))
    return tuple(out)


def expert_seconds(rates: Any, model: Any, load: RankLoad, width: float, bpe: int) -> float:
    """Forward seconds of one EP rank's routed experts (grouped GEMMs and activation), uncalibrated."""
    return (GG.mlp_gemm_time(rates, model, load.received, width, load.share)
            + GG.activation_time(rates, model, load.received, width, bpe))


def pace(seconds: Sequence[float]) -> int:
    """The EP rank the layer waits for: the one whose experts take longest (first of equals)."""
    return max(range(len(seconds)), key=lambda q: (seconds[q], -q))


def exchange_split(moe: Any, routed: Sequence[float], rank_loads: Sequence[RankLoad],
                   nodes: Sequence[int], flex: bool = False) -> tuple[float, float]:
    """(inside a node, across nodes): the token copies the rank moving the most over each sends or
    receives in one direction of the dispatch (the combine moves them back), from the per-pair volumes
    (module docstring); ``routed[q]`` the tokens EP rank q routes (0: an expert-only rank),
    ``nodes[q]`` its node. Summed per node, so O(ep) (O(ep x nodes) under flex). ``flex``: the DeepEP dispatcher, one network
    copy per remote node hit and the NVLink forwards inside it (``flex_dispatch.py``)."""
    if len(rank_loads) <= 1:
        return 0.0, 0.0
    k, n_exp = moe.top_k, moe.experts
    node_shares: dict[int, float] = {}
    node_routed: dict[int, float] = {}
    for r, t, nd in zip(rank_loads, routed, nodes, strict=True):
        node_shares[nd] = node_shares.get(nd, 0.0) + r.share
        node_routed[nd] = node_routed.get(nd, 0.0) + t
    all_shares, all_routed = sum(node_shares.values()), sum(node_routed.values())
    node_ranks = Counter(nodes) if flex else None  # once, not per rank: the loop stays O(ep x nodes)
    intra = inter = 0.0
    for r, t, nd in zip(rank_loads, routed, nodes, strict=True):
        send = t * k / n_exp  # copies per expert of a peer
        recv = k * r.share / n_exp * r.imbalance  # copies per token a peer routes
        s_in, r_in = send * (node_shares[nd] - r.share), recv * (node_routed[nd] - t)
        s_out, r_out = send * (all_shares - node_shares[nd]), recv * (all_routed - node_routed[nd])
        if flex:
            s_in, r_in, s_out, r_out = _flex_volumes(moe, r, t, nd, node_shares, node_routed, node_ranks,
                                                     (s_in, r_in, r_out))
        intra, inter = max(intra, s_in, r_in), max(inter, s_out, r_out)
    return intra, inter


def _flex_volumes(moe: Any, r: RankLoad, t: float, nd: int, node_shares: dict[int, float],
                  node_routed: dict[int, float], node_ranks: Counter,
                  a2a: tuple[float, float, float]) -> tuple[float, float, float, float]:
    """(NVLink send, NVLink receive, network send, network receive) of one EP rank under flex, from the
    all-to-all's (NVLink send, NVLink receive, network receive) of the same rank (``flex_dispatch.py``):
    it sends each token once to the same-index rank of every remote node its experts hit, receives
    from the same-index rank of each remote node (that node's routed tokens over its ranks) the tokens
    hitting its own node, at its pace-setting load, and forwards over NVLink what it received for its
    node's other ranks' experts, as they forward to it what they received for its own."""
    s_in, r_in, r_out_a2a = a2a
    remote = [node_shares[m] for m in node_shares if m != nd]
    s_out = t * FD.remote_node_copies(moe.experts, moe.top_k, remote)
    from_peers = sum(node_routed[m] / node_ranks[m] for m in node_shares if m != nd)
    r_out = from_peers * FD.node_hit(moe.experts, moe.top_k, node_shares[nd]) * r.imbalance
    fwd = FD.forwarded(r_out_a2a, r.share, node_shares[nd])
    return s_in + fwd, r_in + fwd, s_out, r_out
