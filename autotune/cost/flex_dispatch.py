"""The flex token dispatcher (Megatron-Core ``--moe-token-dispatcher-type flex`` with DeepEP,
``Plan.moe_dispatcher``): how many copies of a token cross the network, and how many NVLink forwards.

The all-to-all dispatcher sends a token once per routed expert, so of its ``top_k`` copies the
``top_k * S_remote / E`` for the experts in other nodes all cross the network. DeepEP's internode
dispatch (DeepSeek-V3 report, arXiv 2412.19437 section 3.2.2: a token goes over InfiniBand to the
GPU of the same in-node index on each target node, which forwards it over NVLink to the GPUs holding
its experts) sends it across the network once per remote NODE that holds at least one of its
experts, and the forwards stay inside that node; the combine
mirrors it (reduced inside the node first, one copy back per node).

Expected network copies per token, uniform routing (the top-k experts a uniformly random k-subset of
the E experts, as ``moe_imbalance.py`` assumes): node m holding ``S_m`` experts is missed with
probability C(E - S_m, k) / C(E, k) (hypergeometric: all k picks among the other E - S_m), so by
linearity of expectation the number of distinct remote nodes hit is

    sum over remote nodes m of  1 - C(E - S_m, k) / C(E, k)          (``remote_node_copies``)

The NVLink forwards (``forwarded``) are counted per expert copy as the all-to-all counts its pairs
inside a node (an upper bound where two of a token's experts sit on one rank). Kernel counts and host
time stay the all-to-all dispatcher's (``export/megatron.MOE_DISPATCHER``): the flex dispatcher's
kernels were not counted from its code.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb


def node_hit(experts: int, top_k: int, held: float) -> float:
    """Probability that a token's ``top_k`` distinct experts, uniform over ``experts``, include at
    least one of the ``held`` experts of a node (``held`` a whole number of experts)."""
    s = int(round(held))
    if s <= 0:
        return 0.0
    return 1.0 - comb(experts - s, top_k) / comb(experts, top_k)


def remote_node_copies(experts: int, top_k: int, remote_shares: Sequence[float]) -> float:
    """Expected network copies of one token under flex: the distinct remote nodes among its top-k
    experts, ``remote_shares`` the experts each other node of the EP group holds (module docstring)."""
    return sum(node_hit(experts, top_k, s) for s in remote_shares)


def forwarded(received_remote: float, share: float, node_share: float) -> float:
    """NVLink copies a rank forwards (and, by symmetry of the layout, receives forwarded) in one
    direction: of the expert copies that reached its node for it from the network
    (``received_remote``: what the all-to-all would have sent it across), the part for its node's other
    ranks' experts, ``(node_share - share) / node_share``."""
    if node_share <= 0:
        return 0.0
    return received_remote * (node_share - share) / node_share
