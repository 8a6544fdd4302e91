"""A device described inline in a cluster file, for GPUs the catalogue lacks (B200, say).

::

    nodes:
      - count: 2
        devices_per_node: 8
        device:
          name: B200                                   # required; shown as `user` everywhere
          peak_flops: {bf16: "2250TFLOP/s", fp16: "2250TFLOP/s", fp32: "75TFLOP/s"}   # dense, >= 1 dtype
          memory: "192GB"                              # capacity per device
          memory_bandwidth: "8TB/s"                    # HBM, per device
          intra_node_bandwidth: "900GB/s"              # optional: per device, per direction
          intra_node_latency: "3us"                    # optional
          nic_bandwidth: "50GB/s"                      # optional: per device, per direction (400Gbit/s)
          pcie_bandwidth: "64GB/s"                     # optional: host link per direction
          achievable_fraction: 0.6                     # optional: share of peak a large GEMM reaches
          kind: cuda                                   # optional: cuda (default), rocm or cpu
          interconnect: "NVLink 5"                     # optional label
          source: "NVIDIA B200 datasheet"              # optional: where the figures come from

Every figure carries its unit (``autotune.units``); the spec's ``provenance`` is ``user`` so an estimate
never mistakes these figures for a datasheet's or a profile's.
"""

from __future__ import annotations

from typing import Any

from autotune.errors import InputError
from autotune.specs import fields as F
from autotune.specs.catalogue import GB, DeviceSpec
from autotune.units import parse_bandwidth, parse_bytes, parse_flops, parse_time

KEYS = {"name", "peak_flops", "memory", "memory_bandwidth", "intra_node_bandwidth", "intra_node_latency",
        "nic_bandwidth", "pcie_bandwidth", "achievable_fraction", "kind", "interconnect", "source"}
DTYPES = ("bf16", "fp16", "fp32")
KINDS = ("cuda", "rocm", "cpu")


def device_from_mapping(d: dict[str, Any], field: str) -> DeviceSpec:
    """The DeviceSpec of an inline ``device:`` mapping; every bad value names its field."""
    F.reject_unknown(d, KEYS, field)
    name = F.get_str(d, "name", f"{field}.name")
    flops = F.get(d, "peak_flops", f"{field}.peak_flops")
    if not isinstance(flops, dict) or not flops:
        raise InputError("expected a mapping of dtype to peak FLOP/s, e.g. {bf16: \"2250TFLOP/s\"}",
                         field=f"{field}.peak_flops")
    F.reject_unknown(flops, set(DTYPES), f"{field}.peak_flops")
    peak = {k: parse_flops(v, field=f"{field}.peak_flops.{k}") for k, v in flops.items()}
    frac = F.get(d, "achievable_fraction", f"{field}.achievable_fraction", 0.6)
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 1:
        raise InputError(f"expected a fraction in (0, 1], got {frac!r}", field=f"{field}.achievable_fraction")
    pcie = parse_bandwidth(d["pcie_bandwidth"], f"{field}.pcie_bandwidth") if "pcie_bandwidth" in d else 32 * GB
    return DeviceSpec(
        name=name,
        kind=F.get_str(d, "kind", f"{field}.kind", "cuda", choices=KINDS),
        peak_flops=peak,
        memory_bytes=parse_bytes(F.get(d, "memory", f"{field}.memory"), field=f"{field}.memory"),
        memory_bandwidth=parse_bandwidth(F.get(d, "memory_bandwidth", f"{field}.memory_bandwidth"),
                                         field=f"{field}.memory_bandwidth"),
        # without NVLink figures the devices of a node talk over PCIe
        intra_node_bandwidth=(parse_bandwidth(d["intra_node_bandwidth"], f"{field}.intra_node_bandwidth")
                              if "intra_node_bandwidth" in d else pcie),
        intra_node_latency=(parse_time(d["intra_node_latency"], f"{field}.intra_node_latency")
                            if "intra_node_latency" in d else 3e-6),
        interconnect=F.get_str(d, "interconnect", f"{field}.interconnect",
                               "user" if "intra_node_bandwidth" in d else "PCIe"),
        pcie_bandwidth=pcie,
        nic_bandwidth=(parse_bandwidth(d["nic_bandwidth"], f"{field}.nic_bandwidth")
                       if "nic_bandwidth" in d else 25 * GB),
        achievable_fraction=float(frac),
        provenance="user",
        source=F.get_str(d, "source", f"{field}.source", "described in the cluster file"),
    )


def device_to_mapping(spec: DeviceSpec) -> dict[str, Any]:
    """The inline mapping that ``device_from_mapping`` reads back into ``spec`` (units on every figure)."""
    return {"name": spec.name, "kind": spec.kind,
            "peak_flops": {k: f"{v!r}FLOP/s" for k, v in spec.peak_flops.items()},
            "memory": f"{spec.memory_bytes!r}B", "memory_bandwidth": f"{spec.memory_bandwidth!r}B/s",
            "intra_node_bandwidth": f"{spec.intra_node_bandwidth!r}B/s",
            "intra_node_latency": f"{spec.intra_node_latency!r}s", "nic_bandwidth": f"{spec.nic_bandwidth!r}B/s",
            "pcie_bandwidth": f"{spec.pcie_bandwidth!r}B/s", "achievable_fraction": spec.achievable_fraction,
            "interconnect": spec.interconnect, "source": spec.source}
