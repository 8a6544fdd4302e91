"""Small hand-made clusters and models for the cost-model tests: ideal links and memory
(bandwidth 1e30) so that one term at a time can be checked against a hand formula."""

from __future__ import annotations

from autotune.specs import ClusterSpec, DeviceSpec, Link, ModelSpec, NodeGroup

HUGE = 1e30

# GPT-style shapes (GeLU, f = 4h, kv = h) so Korthikanti et al.'s sbh(34 + 5as/h) applies as printed
GELU = ModelSpec(name="gelu-test", layers=4, hidden=256, heads=8, kv_heads=8, ffn_hidden=1024, vocab=512,
                 activation="gelu")


def device(name="X", peak=1e12, frac=0.5, memory=1e15, mem_bw=HUGE, kind="cuda", profile=None, peak_flops=None,
           **kw) -> DeviceSpec:
    return DeviceSpec(name=name, kind=kind, peak_flops=peak_flops or {"bf16": peak, "fp32": peak / 2},
                      memory_bytes=memory,
                      memory_bandwidth=mem_bw, intra_node_bandwidth=HUGE, achievable_fraction=frac,
                      profile=profile, **kw)


def cluster(*groups, inter_bw=HUGE, inter_lat=0.0, name="test") -> ClusterSpec:
    """groups: (count, devices_per_node, DeviceSpec, intra bandwidth, intra latency)."""
    gs = tuple(NodeGroup(count=c, devices_per_node=n, device=d, intra_node=Link(bandwidth=bw, latency=lat))
               for c, n, d, bw, lat in groups)
    return ClusterSpec(name=name, groups=gs, inter_node=Link(bandwidth=inter_bw, latency=inter_lat, kind="inter"))


def one_node(n=1, dev=None, bw=HUGE, lat=0.0) -> ClusterSpec:
    return cluster((1, n, dev or device(), bw, lat))
