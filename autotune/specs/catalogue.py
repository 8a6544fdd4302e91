"""Device types with datasheet figures, each with its source.

Datasheet numbers are peaks; a ``DeviceSpec`` says where its numbers came from in ``provenance``
(``"datasheet"``, ``"measured"`` for a profile, ``"derived"`` for the local CPU read from the OS), so
a measured and a datasheet figure are never confused. Bandwidths are per device and per direction
(NVLink 900 GB/s bidirectional on H100 is 450 GB/s here), bytes/s; FLOP/s are dense (no sparsity).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from autotune.errors import InputError, suggest

GB = 1e9
GiB = 2.0**30
T = 1e12


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One kind of accelerator (or the local CPU) as the cost model sees it."""

    name: str
    """Catalogue name (``H100-SXM``) or ``profile:ID``."""
    kind: str
    """``cuda``, ``rocm`` or ``cpu``: which runtime backend drives it."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per dtype (``bf16``, ``fp16``, ``fp32``); a dtype missing is unsupported."""
    memory_bytes: float
    """Memory capacity in bytes."""
    memory_bandwidth: float
    """Memory bandwidth, bytes/s."""
    intra_node_bandwidth: float
    """Default device-to-device bandwidth inside a node (NVLink/xGMI, else PCIe), bytes/s per direction."""
    intra_node_latency: float = 3e-6
    """Default device-to-device latency inside a node, seconds."""
    interconnect: str = "PCIe"
    """Name of the intra-node interconnect (NVLink 4, PCIe Gen4, ...)."""
    pcie_bandwidth: float = 32 * GB
    """Host link, bytes/s per direction."""
    nic_bandwidth: float = 25 * GB
    """Typical NIC per device in a training node, bytes/s per direction."""
    achievable_fraction: float = 0.6
    """Fraction of peak a large transformer GEMM reaches without a profile (documented per entry)."""
    provenance: str = "datasheet"
    """``datasheet``, ``measured`` (a profile) or ``derived`` (read from the OS)."""
    source: str = ""
    """Where the numbers come from."""
    profile: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    """For ``measured`` devices: the profile's fits (see profilers/), read by the cost model."""

    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise InputError(f"device {self.name} has no {dtype} support (has {', '.join(self.peak_flops)})",
                             field="dtype")
        return self.peak_flops[dtype]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d.get("profile") is None:
            d.pop("profile", None)
        return d


def _gpu(name: str, bf16: float, fp16: float, fp32: float, mem: float, mem_bw: float, intra: float,
         interconnect: str, pcie: float, nic: float, source: str, frac: float = 0.6,
         kind: str = "cuda") -> DeviceSpec:
    peak = {"fp16": fp16 * T, "fp32": fp32 * T}
    if bf16:
        peak["bf16"] = bf16 * T
    return DeviceSpec(name=name, kind=kind, peak_flops=peak, memory_bytes=mem, memory_bandwidth=mem_bw,
                      intra_node_bandwidth=intra, interconnect=interconnect, pcie_bandwidth=pcie,
                      nic_bandwidth=nic, achievable_fraction=frac, source=source)


# fp32 here is the non-tensor-core FP32 peak (TF32 is not used for training math by default).
# achievable_fraction: ~0.6 of dense peak is what Megatron-LM reports for large GEMMs on A100/H100
# (Narayanan et al. 2021 report 52% MFU end to end on A100); consumer/PCIe parts a little lower.
CATALOGUE: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        _gpu("H100-SXM", 989, 989, 67, 80 * GB, 3.35e12, 450 * GB, "NVLink 4", 64 * GB, 50 * GB,
             "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOPS BF16 dense, 80GB HBM3 3.35TB/s, "
             "NVLink 900GB/s bidirectional, PCIe Gen5; ConnectX-7 400Gb/s per GPU in DGX H100"),
        _gpu("H100-PCIe", 756, 756, 51, 80 * GB, 2.0e12, 300 * GB, "NVLink bridge", 64 * GB, 25 * GB,
             "NVIDIA H100 datasheet (PCIe): 756 TFLOPS BF16 dense, 80GB HBM2e 2TB/s, NVLink bridge 600GB/s "
             "bidirectional, PCIe Gen5 128GB/s bidirectional", frac=0.55),
        _gpu("H200", 989, 989, 67, 141 * GB, 4.8e12, 450 * GB, "NVLink 4", 64 * GB, 50 * GB,
             "NVIDIA H200 datasheet (SXM): 989 TFLOPS BF16 dense, 141GB HBM3e 4.8TB/s, NVLink 900GB/s "
             "bidirectional"),
        _gpu("H20", 148, 148, 44, 96 * GB, 4.0e12, 450 * GB, "NVLink 4", 64 * GB, 50 * GB,
             "NVIDIA H20 product brief: 148 TFLOPS BF16 dense, 96GB HBM3 4.0TB/s, NVLink 900GB/s bidirectional",
             frac=0.7),
        _gpu("A100-40GB", 312, 312, 19.5, 40 * GB, 1.555e12, 300 * GB, "NVLink 3", 32 * GB, 25 * GB,
             "NVIDIA A100 datasheet (SXM4 40GB): 312 TFLOPS BF16 dense, 40GB HBM2 1.555TB/s, NVLink 600GB/s "
             "bidirectional, PCIe Gen4; HDR 200Gb/s per GPU in DGX A100"),
        _gpu("A100-80GB", 312, 312, 19.5, 80 * GB, 2.039e12, 300 * GB, "NVLink 3", 32 * GB, 25 * GB,
             "NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOPS BF16 dense, 80GB HBM2e 2.039TB/s, NVLink 600GB/s "
             "bidirectional"),
        _gpu("L40S", 362, 362, 91.6, 48 * GB, 864 * GB, 32 * GB, "PCIe Gen4", 32 * GB, 12.5 * GB,
             "NVIDIA L40S datasheet: 362 TFLOPS BF16 dense (733 sparse), 48GB GDDR6 864GB/s, PCIe Gen4 x16, "
             "no NVLink", frac=0.5),
        _gpu("L4", 121, 121, 30.3, 24 * GB, 300 * GB, 32 * GB, "PCIe Gen4", 32 * GB, 6.25 * GB,
             "NVIDIA L4 datasheet: 121 TFLOPS BF16 dense (242 sparse), 24GB GDDR6 300GB/s, PCIe Gen4 x16",
             frac=0.5),
        _gpu("A10", 125, 125, 31.2, 24 * GB, 600 * GB, 32 * GB, "PCIe Gen4", 32 * GB, 6.25 * GB,
             "NVIDIA A10 datasheet: 125 TFLOPS BF16 dense (250 sparse), 24GB GDDR6 600GB/s, PCIe Gen4 x16",
             frac=0.5),
        _gpu("RTX-4090", 165, 165, 82.6, 24 * GB, 1008 * GB, 32 * GB, "PCIe Gen4", 32 * GB, 3.125 * GB,
             "NVIDIA Ada Lovelace whitepaper (RTX 4090): 165.2 TFLOPS BF16 dense with FP32 accumulate, "
             "24GB GDDR6X 1008GB/s, PCIe Gen4, no NVLink", frac=0.5),
        _gpu("V100", 0, 125, 15.7, 32 * GB, 900 * GB, 150 * GB, "NVLink 2", 16 * GB, 12.5 * GB,
             "NVIDIA V100 datasheet (SXM2 32GB): 125 TFLOPS FP16 tensor, no BF16, 32GB HBM2 900GB/s, NVLink "
             "300GB/s bidirectional", frac=0.5),
        _gpu("MI300X", 1307, 1307, 163.4, 192 * GB, 5.3e12, 448 * GB, "Infinity Fabric", 64 * GB, 50 * GB,
             "AMD Instinct MI300X datasheet: 1307.4 TFLOPS BF16 dense, 192GB HBM3 5.3TB/s, 7 Infinity Fabric "
             "links 896GB/s aggregate bidirectional", frac=0.45, kind="rocm"),
    )
}


def _cpu_flops_per_cycle(flags: set[str]) -> int:
    """FP32 FLOPs per cycle per core: 2 FMA units x vector lanes x 2 (FMA counts as two)."""
    if "avx512f" in flags:
        return 64
    if "avx2" in flags and "fma" in flags:
        return 32
    if "asimd" in flags:  # aarch64 NEON: 2 x 128-bit FMA pipes
        return 16
    return 8


def local_cpu(devices: int = 1) -> DeviceSpec:
    """The local CPU split into ``devices`` equal workers, figures derived from the OS.

    Peak = cores x clock x FLOPs/cycle from /proc/cpuinfo, which is an upper bound nobody reaches
    with PyTorch on CPU; achievable_fraction 0.25 is what `benchmarks/` measured for fp32 GEMMs here
    (~130 GFLOP/s on 2 threads). Measure with ``autotune profile`` for real figures.
    """
    cores = max(1, os.cpu_count() or 1)
    mhz, flags = 2500.0, set()
    try:
        text = open("/proc/cpuinfo", encoding="utf-8").read()
        m = re.search(r"cpu MHz\s*:\s*([0-9.]+)", text)
        if m:
            mhz = float(m.group(1))
        m = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, re.M)
        if m:
            flags = set(m.group(1).split())
    except OSError:
        pass
    fp32 = cores * mhz * 1e6 * _cpu_flops_per_cycle(flags) / devices
    mem = 16 * GiB
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        mem = float(pages)
    except (ValueError, OSError, AttributeError):
        pass
    return DeviceSpec(
        name="CPU", kind="cpu", peak_flops={"fp32": fp32, "bf16": fp32, "fp16": fp32},
        memory_bytes=mem / devices, memory_bandwidth=20 * GB / devices, intra_node_bandwidth=1.0 * GB,
        intra_node_latency=50e-6, interconnect="loopback (gloo)", pcie_bandwidth=20 * GB, nic_bandwidth=1.0 * GB,
        achievable_fraction=0.25, provenance="derived",
        source=f"/proc/cpuinfo: {cores} cores x {mhz:.0f} MHz x {_cpu_flops_per_cycle(flags)} FP32 FLOP/cycle "
               f"/ {devices} workers; RAM from sysconf; gloo loopback ~1 GB/s (shared/torch-cpu-facts.md)",
    )


def device_from_catalogue(name: str, field: str | None = None) -> DeviceSpec:
    if name in CATALOGUE:
        return CATALOGUE[name]
    lowered = {k.lower(): v for k, v in CATALOGUE.items()}
    if name.lower() in lowered:
        return lowered[name.lower()]
    if name.upper() == "CPU":
        return local_cpu()
    raise InputError(f"unknown device type {name!r}" + suggest(name, [*CATALOGUE, "CPU"]), field=field)
