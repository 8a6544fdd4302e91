"""Where a Mixture-of-Experts plan's experts are, resolved once per estimate (``ExpertStep``), and the
links of each rank's expert groups (``ExpertLinks``).

Expert parallelism folds onto the attention's ranks (Megatron-Core "parallel folding"): within a
pipeline stage the dp*cp*hp*tp ranks are also edp*ep*etp expert ranks, etp innermost, then ep, then
edp (``autotune.plan.expert_groups``). An EP group's ranks sit ``etp`` apart, so it stays inside a
node while ep*etp <= devices per node and crosses the network beyond: its all-to-all then moves part
of its bytes over NVLink and part over the NICs, which ``ExpertLinks`` keeps apart
(``expert_dispatch.py`` prices each part on its own link).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.cost import comm as C
from autotune.specs.cluster import Link

MOE_OVERLAPS = ("none", "shared_experts", "a2a_1f1b")
"""What runs beside the token all-to-all: nothing, the shared experts' MLP (Megatron-Core
``--moe-shared-expert-overlap``; the runtime's ``KernelCosts.moe_overlap``), or another micro-batch's
layer (``Plan.moe_a2a_overlap``, Megatron-Core ``--overlap-moe-expert-parallel-comm``: it replaces
the shared-expert overlap, which Megatron-Core refuses beside it)."""


@dataclass(frozen=True)
class ExpertStep:
    """The expert layout of one estimate (None on a dense model's ``StepContext``)."""

    ep: int
    etp: int
    edp: int
    shares: tuple[int, ...]
    """Routed experts each EP rank holds."""
    chunk_moe_layers: tuple[tuple[int, ...], ...]
    """Per pipeline rank, per model chunk it holds (``StepContext.chunks`` order): its MoE layers."""
    overlap: str
    """What the target runtime overlaps the all-to-all with (``MOE_OVERLAPS``)."""
    graphed: tuple[str, ...] = ()
    """The parts of each layer captured in CUDA graphs (``Plan.cuda_graph_scope``)."""
    flex: bool = False
    """The flex (DeepEP) token dispatcher (``Plan.moe_dispatcher``; ``flex_dispatch.py``)."""

    @property
    def busiest_share(self) -> int:
        """Experts of the EP rank holding the most (on one device type, the one every MoE layer waits
        for: the all-to-all and the combine synchronise the EP group; ``expert_ranks.py``)."""
        return max(self.shares)


def expert_step(plan: Any, model: Any, chunks: tuple[tuple[int, ...], ...], kernels: Any) -> ExpertStep | None:
    """The expert layout of a resolved ``plan`` of ``model`` (None for a dense model)."""
    if getattr(model, "moe", None) is None:
        return None
    d = plan.degrees
    starts = [0]
    for n in plan.shares.layers:
        starts.append(starts[-1] + n)
    moe_in_chunk = [sum(model.is_moe_layer(i) for i in range(starts[j], starts[j + 1]))
                    for j in range(len(plan.shares.layers))]
    return ExpertStep(ep=d.ep, etp=d.etp, edp=d.edp, shares=tuple(plan.shares.experts),
                      chunk_moe_layers=tuple(tuple(moe_in_chunk[j] for j in mine) for mine in chunks),
                      overlap=moe_overlap(plan, kernels), graphed=tuple(plan.cuda_graph_scope),
                      flex=plan.moe_dispatcher == "flex")


def moe_overlap(plan: Any, kernels: Any) -> str:
    """What runs beside the all-to-all of ``plan`` under the target's ``kernels`` (``MOE_OVERLAPS``): the
    a2a overlap where the plan sets it; else the target's own, less the shared-expert overlap under the
    flex dispatcher (Megatron-Core's TransformerConfig: "moe_shared_expert_overlap only works with alltoall
    token dispatcher"). The Megatron exporter writes ``--moe-shared-expert-overlap`` by this."""
    if plan.moe_a2a_overlap:
        return "a2a_1f1b"
    overlap = getattr(kernels, "moe_overlap", "none") if kernels is not None else "none"
    if overlap == "shared_experts" and plan.moe_dispatcher != "alltoall":
        return "none"
    return overlap


@dataclass(frozen=True)
class ExpertLinks:
    """The links of one rank's expert groups."""

    ep_intra: Link
    """To the EP peers inside its node."""
    ep_intra_n: int
    """EP peers inside its node (itself excluded)."""
    ep_inter: Link
    """To the slowest EP peer in another node."""
    ep_inter_n: int
    """EP peers in other nodes."""
    etp: Link
    edp: Link
    """The ring the expert gradients are reduced over (``Topology.ring_link``)."""
    ep_index: int = 0
    """Its EP rank (which entry of ``Shares.experts`` it holds)."""
    ep_devices: tuple[str, ...] = ()
    """The device type of each EP rank of its group (at its etp index): each prices its own experts
    (``expert_ranks.py``)."""
    ep_nodes: tuple[int, ...] = ()
    """The node of each EP rank of its group (at its etp index): which pairs of the all-to-all stay on
    the node's links and which cross the network (``expert_ranks.exchange_split``)."""


_SELF_LINKS = ExpertLinks(ep_intra=C._SELF, ep_intra_n=0, ep_inter=C._SELF, ep_inter_n=0, etp=C._SELF, edp=C._SELF)


def expert_links(topo: C.Topology, devs: tuple[int, ...], d: Any, r0: int) -> ExpertLinks:
    """The expert groups' links of the rank ``r0`` (the first rank of a tp group) of a plan with
    degrees ``d`` whose ranks run on the devices ``devs``."""
    n = d.ep * d.etp
    if d.ep == 1 and d.etp == 1 and d.edp == 1:
        return _SELF_LINKS
    blk = d.stage_ranks
    base, local = r0 - r0 % blk, r0 % blk
    edp_i, rest = divmod(local, n)
    ep_i, etp_i = divmod(rest, d.etp)
    ep_ranks = [base + edp_i * n + q * d.etp + etp_i for q in range(d.ep)]
    node = topo.node_of[devs[r0]]
    inside = [r for r in ep_ranks if r != r0 and topo.node_of[devs[r]] == node]
    outside = [r for r in ep_ranks if topo.node_of[devs[r]] != node]
    inter = C._SELF
    if outside:
        inter = min((topo.node_link(node, topo.node_of[devs[r]]) for r in outside),
                    key=lambda lk: (lk.bandwidth, -lk.latency))
    etp_link = topo.group_link([devs[base + edp_i * n + ep_i * d.etp + k] for k in range(d.etp)])
    edp_link = topo.ring_link([devs[base + k * n + rest] for k in range(d.edp)]) if d.edp > 1 else C._SELF
    specs = topo.cluster.devices
    return ExpertLinks(ep_intra=topo.node_link(node, node) if inside else C._SELF, ep_intra_n=len(inside),
                       ep_inter=inter, ep_inter_n=len(outside), etp=etp_link, edp=edp_link, ep_index=ep_i,
                       ep_devices=tuple(specs[devs[r]].spec.name for r in ep_ranks),
                       ep_nodes=tuple(topo.node_of[devs[r]] for r in ep_ranks))
