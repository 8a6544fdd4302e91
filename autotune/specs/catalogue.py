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

FRAMEWORK_RESERVE = {"cuda": 2.0 * GiB, "rocm": 2.0 * GiB, "cpu": 0.0}
CUDA_CONTEXT_BYTES = 552402944
"""The CUDA context with PyTorch's kernels loaded, before any tensor: 0.51 GiB measured on an H200
(benchmarks/gpu_gemm.py, 2026-12-04: mem_get_info's free before and after); part of FRAMEWORK_RESERVE."""
ATTENTION_IMPLS = ("fused", "materialized")
"""Bytes per device the training framework holds before the model's first tensor: the CUDA context
with PyTorch's kernels loaded (~0.5-1 GiB: PyTorch notes "CUDA memory management"), NCCL's
communicator buffers (NCCL_BUFFSIZE 4 MiB x channels x peers: ~0.3-1 GiB per communicator on 8
GPUs, several communicators for tp/pp/dp) and cuBLAS/cuDNN workspaces; 2-3 GB is what the
peer-planner simulator of issue 18 reserved. The allocator's fragmentation is the separate
``RESERVE_FRACTION`` of autotune/cost/memory.py. Override per node group in a cluster file."""


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One kind of accelerator (or the local CPU) as the cost model sees it."""

    name: str
    """Catalogue name (``H100-SXM``) or ``profile:ID``."""
    kind: str
    """``cuda``, ``rocm`` or ``cpu``: which runtime backend drives it."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per dtype (``bf16``, ``fp16``, ``fp32`` (TF32 tensor cores where the device
    has them), ``fp32-strict`` (IEEE fp32, no tensor cores), ``fp8`` (FP8 tensor cores, E4M3/E5M2
    inputs with a per-tensor or per-block scale applied outside the tensor core: Hopper, Ada, Blackwell,
    CDNA3), ``mxfp8`` (MX-format FP8 with 1x32 block scales applied inside the tensor core: Blackwell
    only)); a dtype missing is unsupported. Which of them a plan's ``dtype`` runs its GEMMs at is
    ``autotune.plan_parts.gemm_peak``."""
    memory_bytes: float
    """Memory capacity in bytes, as the device reports it (``nvidia-smi``'s total in MiB) where
    ``memory_source`` cites that report; else the product name's decimal gigabytes. The CUDA context
    and the framework's buffers come off it as ``framework_reserve``."""
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
    """End-to-end fraction of peak a training step reaches (the flat rate of devices without an SM
    count, and the search's quick upper bound); not a GEMM ceiling: ``gemm_ceiling`` is that."""
    memory_source: str = ""
    """Where ``memory_bytes`` comes from (empty: the datasheet, as ``source`` says)."""
    gemm_ceiling: dict[str, float] = field(default_factory=dict, compare=False, hash=False)
    """Per dtype, the fraction of dense peak a large, well-shaped GEMM reaches through cuBLAS /
    hipBLASLt (measured, ``gemm_source`` says where); the size-aware datasheet model prices every
    GEMM from it, with its tile and wave losses on top. A dtype missing: ``GEMM_CEILING_DEFAULT``."""
    gemm_source: str = ""
    """Where ``gemm_ceiling``'s figures come from."""
    sustained_clock: float = 0.0
    """Clock a long training run sustains at the power limit, as a fraction of the boost clock the
    peaks are quoted at (a short GEMM benchmark runs at boost; hours of training do not); 0:
    ``SUSTAINED_CLOCK_DEFAULT``. ``sustained_source`` says where it comes from."""
    sustained_source: str = ""
    provenance: str = "datasheet"
    """``datasheet``, ``measured`` (a profile) or ``derived`` (read from the OS)."""
    source: str = ""
    """Where the numbers come from."""
    profile: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    """For ``measured`` devices: the profile's fits (see profilers/), read by the cost model."""
    sm_count: int = 0
    """Streaming multiprocessors (NVIDIA) or compute units (AMD) that GEMM tiles are spread over
    (wave quantisation in the size-aware datasheet model); 0 when unknown (CPU, profiles)."""
    framework_reserve_bytes: float | None = None
    """Memory the framework holds on the device beyond the model: CUDA/ROCm context, NCCL buffers,
    cuBLAS workspaces; None: ``FRAMEWORK_RESERVE`` of its kind. A cluster file may override it per
    node group (``framework_reserve: 3GB``)."""
    attention_impl: str = ""
    """How the target runtime runs attention: ``fused`` (flash / memory-efficient kernels keep the
    log-sum-exp per query, never the s x s scores) or ``materialized`` (the scores are stored for
    backward); empty: fused on cuda/rocm (PyTorch SDPA, Transformer Engine), materialized on CPU
    (the math kernel). A cluster file may override it per node group (``attention: materialized``)."""
    flash_attention: bool = True
    """Whether a fused attention runs FlashAttention-2-class kernels (FlashAttention-2, cuDNN's and
    Transformer Engine's fused attention, PyTorch SDPA's flash backend: compute capability 8.0 and
    later, the FlashAttention README's "Ampere, Ada, or Hopper"). False on Volta: there PyTorch SDPA's
    fused attention is the memory-efficient (xformers / CUTLASS) kernel, which keeps the same
    log-sum-exp memory but runs at the speed of the materialised attention
    (``datasheet.SizeModel.attention`` says how it is priced and from what)."""

    layer_profiles: tuple[dict[str, Any], ...] = field(default=(), compare=False, hash=False)
    """Per-layer profiles measured on this device (``profilers/layers.py`` documents, or imported from
    other planners' files), attached by a cluster file's ``layer_profile: layers:ID``; the cost
    model prices a block, the head and the embedding from them where the model and dtype match
    (``autotune/cost/layers.py``)."""

    def sustained(self) -> tuple[float, str]:
        """(fraction of the boost clock sustained in training, source)."""
        if self.sustained_clock:
            return self.sustained_clock, self.sustained_source
        return SUSTAINED_CLOCK_DEFAULT, SUSTAINED_CLOCK_DEFAULT_SOURCE

    def gemm_fraction(self, dtype: str) -> tuple[float, str]:
        """(ceiling, source) of a large GEMM at ``dtype`` (``gemm_ceiling``, else the stand-in)."""
        if dtype in self.gemm_ceiling:
            return self.gemm_ceiling[dtype], self.gemm_source
        if dtype == "fp32-strict":
            return SGEMM_CEILING_DEFAULT, SGEMM_CEILING_DEFAULT_SOURCE
        return GEMM_CEILING_DEFAULT, GEMM_CEILING_DEFAULT_SOURCE

    def framework_reserve(self) -> float:
        """Bytes the framework holds on this device (the named ``framework_reserve`` memory term)."""
        if self.framework_reserve_bytes is not None:
            return float(self.framework_reserve_bytes)
        return FRAMEWORK_RESERVE.get(self.kind, 0.0)

    def fused_attention(self) -> bool:
        return (self.attention_impl or ("materialized" if self.kind == "cpu" else "fused")) == "fused"

    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise InputError(f"device {self.name} has no {dtype} support (has {', '.join(self.peak_flops)})",
                             field="dtype")
        return self.peak_flops[dtype]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d.get("profile") is None:
            d.pop("profile", None)
        d["layer_profiles"] = [f"layers:{lp.get('id')}" for lp in self.layer_profiles]
        return d


def _gpu(name: str, bf16: float, fp16: float, tf32: float, fp32: float, mem: float, mem_bw: float, intra: float,
         interconnect: str, pcie: float, nic: float, source: str, frac: float = 0.6, kind: str = "cuda",
         sms: int = 0, gemm: tuple[dict[str, float], str] = ({}, ""),
         clock: tuple[float, str] = (0.0, ""), fp8: float = 0.0, mx: bool = False, flash: bool = True) -> DeviceSpec:
    """A datasheet entry. ``tf32``: dense TF32 (or AMD's TF32/XF32 matrix) tensor peak, 0 when the
    device has none; ``fp32``: the non-tensor-core FP32 peak. Plan dtype ``fp32`` prices ``tf32`` where
    there is one: fp32 training on Ampere and later runs its GEMMs on tensor cores in TF32 (Megatron's
    and Hugging Face's ``--tf32``, torch's ``set_float32_matmul_precision("high")``, which the runtime
    sets for ``fp32``); issue 18 measured A100:V100 at ~3.4x in fp32, the TF32 ratio, not the 1.24x of
    the CUDA-core peaks. ``fp32-strict`` is always the non-tensor-core peak (IEEE fp32 GEMMs).
    ``fp8``: dense FP8 tensor peak (0: no FP8 tensor cores); ``mx``: the tensor cores apply MX block
    scales themselves (Blackwell), so MXFP8 runs at the FP8 peak; ``flash``: FlashAttention-2-class
    kernels exist (``DeviceSpec.flash_attention``; False before compute capability 8.0)."""
    peak = {"fp16": fp16 * T, "fp32": (tf32 or fp32) * T, "fp32-strict": fp32 * T}
    if bf16:
        peak["bf16"] = bf16 * T
    if fp8:
        peak["fp8"] = fp8 * T
    if mx:
        peak["mxfp8"] = fp8 * T
    return DeviceSpec(name=name, kind=kind, peak_flops=peak, memory_bytes=mem, memory_bandwidth=mem_bw,
                      intra_node_bandwidth=intra, interconnect=interconnect, pcie_bandwidth=pcie,
                      nic_bandwidth=nic, achievable_fraction=frac, source=source, sm_count=sms,
                      gemm_ceiling=dict(gemm[0]), gemm_source=gemm[1], sustained_clock=clock[0],
                      sustained_source=clock[1], flash_attention=flash)


A100_CLOCK = (0.88, "fitted (grid 0.80-0.93) on three published A100 bf16 runs, MosaicML's MPT-7B on 8 and MPT-30B "
                    "on 8 A100-80GB and MPT-13B on 32 A100-40GB (benchmarks/bench_published.py --fit: median error "
                    "1.4%); below the 1305 of 1410 MHz (0.926) NVIDIA rates A100 HPL at (G. Lockwood, 'Peak "
                    "FLOPS'), as bf16 tensor-core GEMMs draw more power than HPL's fp64 ones")
HOPPER_CLOCK = (0.705 / 0.780, "measured on an H200 by benchmarks/gpu_gemm.py on 2026-12-04: a 16384^3 bf16 GEMM "
                               "(12.6 ms a call, long enough to reach the power limit) ran at 0.705 of peak against "
                               "0.780 at 8192^3")
SUSTAINED_CLOCK_DEFAULT = 0.91
SUSTAINED_CLOCK_DEFAULT_SOURCE = ("no measurement for this device: 0.91, between the A100's 0.926 (HPL clock) and "
                                  "the H200's measured 0.904")

SGEMM_CEILING_DEFAULT = 0.85
SGEMM_CEILING_DEFAULT_SOURCE = ("IEEE fp32 on CUDA cores: cuBLAS SGEMM reaches ~14 of V100's 15.7 TFLOPS (NVIDIA V100 "
                                "whitepaper's SGEMM figure), sustained")
GEMM_CEILING_DEFAULT = 0.80
GEMM_CEILING_DEFAULT_SOURCE = ("no published large-GEMM measurement for this device and precision: 0.80, the median "
                               "of the measured NVIDIA entries (A100 0.87, H100 0.80, H200 0.78, A100 PCIe 0.81); "
                               "run `autotune profile` on it for its own figure")
_MAMF = ("Bekman, ML Engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison "
         "table' (BF16, mean of 100 matmuls at the best shape found)")
_BLACKWELL = ("NVIDIA GB200 NVL72 and HGX B200 technical specifications ('Individual Blackwell GPU Specifications'; "
              "the sparse figures the table gives, halved for dense)")
_H200 = "measured on an H200 by benchmarks/gpu_gemm.py on 2026-12-04 (benchmarks/data/h200/h200_gemm.json, best square GEMM)"


def _ceil(bf16: float, source: str, tf32: float | None = None, strict: float | None = None) -> tuple[dict[str, float], str]:
    """A large-GEMM ceiling per dtype: bf16 = fp16 (the same tensor-core rate), TF32 (``fp32``) and
    IEEE fp32 (``fp32-strict``) only where measured."""
    d = {"bf16": bf16, "fp16": bf16}
    if tf32 is not None:
        d["fp32"] = tf32
    if strict is not None:
        d["fp32-strict"] = strict
    return d, source


A100_SXM_GEMM = _ceil(0.869, f"{_MAMF}: A100 SXM 271.2 of 312 TFLOPS (torch 2.6.0+cu126)")
A100_PCIE_GEMM = _ceil(0.811, f"{_MAMF}: A100 PCIe 252.9 of 312 TFLOPS (torch 2.5.1+cu124)")
H100_GEMM = _ceil(0.803, f"{_MAMF}: H100 SXM 794.5 of 989 TFLOPS (torch 2.7.0+cu126)")
HOPPER_OTHER_GEMM = _ceil(0.803, f"{_MAMF}: H100 SXM's 0.803 (same Hopper tensor cores and cuBLAS kernels; "
                                 "no published figure for this part)")
H200_GEMM = _ceil(0.780, f"{_H200}: bf16 771.7 of 989.4 TFLOPS (0.780) at 8192^3; TF32 0.797; IEEE fp32 0.796",
                  tf32=0.797, strict=0.796)
MI300X_GEMM = _ceil(0.514, f"{_MAMF}: MI300X 668.4 of 1300 TFLOPS (torch 2.5.1 ROCm 6.3, TunableOp)")


# achievable_fraction: the end-to-end share of peak a training step reaches (~0.5-0.6 on A100/H100,
# consumer/PCIe parts a little lower): the flat rate of a device without an SM count and the search's
# quick bound, never a GEMM's ceiling (gemm=, the measured large-GEMM fraction, is that).
# Columns: bf16, fp16, tf32 (dense tensor-core TF32, 0 = none), fp32 (non-tensor-core) TFLOPS.
# Memory variants of one chip are separate entries (same compute, their own capacity and bandwidth).
CATALOGUE: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        _gpu("H100-SXM", 989, 989, 494.7, 67, 80 * GB, 3.35e12, 450 * GB, "NVLink 4", 64 * GB, 50 * GB,
             "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOPS BF16 dense, 1979 FP8 dense (3958 sparse), "
             "494.7 TF32 dense, 67 FP32, 80GB HBM3 3.35TB/s, NVLink 900GB/s bidirectional, PCIe Gen5; ConnectX-7 "
             "400Gb/s per GPU in DGX H100; 132 SMs (NVIDIA H100 whitepaper)", sms=132, gemm=H100_GEMM,
             clock=HOPPER_CLOCK, fp8=1979),
        _gpu("H100-PCIe", 756, 756, 378, 51, 80 * GB, 2.0e12, 300 * GB, "NVLink bridge", 64 * GB, 25 * GB,
             "NVIDIA H100 datasheet (PCIe): 756 TFLOPS BF16 dense, 1513 FP8 dense (3026 sparse), 378 TF32 dense, "
             "51 FP32, 80GB HBM2e 2TB/s, NVLink bridge 600GB/s bidirectional, PCIe Gen5 128GB/s bidirectional; "
             "114 SMs", frac=0.55, sms=114, gemm=HOPPER_OTHER_GEMM, clock=HOPPER_CLOCK, fp8=1513),
        _gpu("H100-NVL", 835, 835, 417.5, 60, 94 * GB, 3.9e12, 300 * GB, "NVLink bridge", 64 * GB, 25 * GB,
             "NVIDIA H100 NVL datasheet: 835 TFLOPS BF16 dense (1671 sparse), 1670.5 FP8 dense (3341 sparse), "
             "417.5 TF32 dense, 60 FP32, 94GB HBM3 3.9TB/s, NVLink bridge 600GB/s bidirectional, PCIe Gen5; 132 "
             "SMs", frac=0.55, sms=132, gemm=HOPPER_OTHER_GEMM, clock=HOPPER_CLOCK, fp8=1670.5),
        _gpu("H200", 989, 989, 494.7, 67, 141 * GB, 4.8e12, 450 * GB, "NVLink 4", 64 * GB, 50 * GB,
             "NVIDIA H200 datasheet (SXM): 989 TFLOPS BF16 dense, 1979 FP8 dense (3958 sparse), 494.7 TF32 "
             "dense, 67 FP32, 141GB HBM3e 4.8TB/s, NVLink 900GB/s bidirectional; 132 SMs", sms=132,
             gemm=H200_GEMM, clock=HOPPER_CLOCK, fp8=1979),
        _gpu("H800", 989, 989, 494.7, 67, 80 * GB, 3.35e12, 200 * GB, "NVLink 4 (8 links)", 64 * GB, 50 * GB,
             "NVIDIA H800 SXM5 product specification: the H100 SXM5's compute (989 TFLOPS BF16 dense, 1979 FP8 "
             "dense, 494.7 TF32 dense, 67 FP32, 80GB HBM3 3.35TB/s, 132 SMs) with NVLink cut to 400GB/s "
             "bidirectional; DeepSeek-V3 technical report (arXiv 2412.19437) sections 3.1-3.2: 8 H800 per "
             "node over NVLink/NVSwitch, InfiniBand between nodes, 50GB/s IB and 160GB/s NVLink achieved per "
             "GPU", sms=132, gemm=HOPPER_OTHER_GEMM, clock=HOPPER_CLOCK, fp8=1979),
        _gpu("H20", 148, 148, 74, 44, 96 * GB, 4.0e12, 450 * GB, "NVLink 4", 64 * GB, 50 * GB,
             "NVIDIA H20 product brief: 148 TFLOPS BF16 dense, 296 FP8 dense, 74 TF32 dense, 44 FP32, 96GB HBM3 "
             "4.0TB/s, NVLink 900GB/s bidirectional; 78 SMs", frac=0.7, sms=78, gemm=HOPPER_OTHER_GEMM,
             clock=HOPPER_CLOCK, fp8=296),
        _gpu("B200", 2250, 2250, 1100, 75, 180 * GB, 7.7e12, 900 * GB, "NVLink 5", 64 * GB, 50 * GB,
             f"{_BLACKWELL}: HGX B200 column, per GPU 4.5 PFLOPS FP16/BF16 and 9 PFLOPS FP8 (MXFP8) with "
             "sparsity (2250 and 4500 TFLOPS dense), 2.2 PFLOPS TF32 sparse (1100 dense), 75 TFLOPS FP32, "
             "180GB HBM3E 7.7TB/s, fifth-generation NVLink 1.8TB/s bidirectional; 8x ConnectX-7 400Gb/s in DGX "
             "B200 (50GB/s per GPU); 148 SMs (NVIDIA Blackwell architecture technical brief)", sms=148,
             fp8=4500, mx=True),
        _gpu("GB200", 2500, 2500, 1250, 80, 186 * GB, 8.0e12, 900 * GB, "NVLink 5 (NVL72)", 450 * GB, 50 * GB,
             f"{_BLACKWELL}: GB200 NVL72 column, per Blackwell GPU 5 PFLOPS FP16/BF16 and 10 PFLOPS FP8 "
             "(MXFP8) with sparsity (2500 and 5000 TFLOPS dense), 2.5 PFLOPS TF32 sparse (1250 dense), 80 TFLOPS "
             "FP32, 186GB HBM3E 8TB/s, fifth-generation NVLink 1.8TB/s bidirectional to all 72 GPUs of the rack "
             "(a cluster file writes the rack, or the NVLink segment a job is given, as one node: "
             "devices_per_node up to 72); NVLink-C2C 900GB/s bidirectional to its Grace CPU (the host link); "
             "ConnectX-7 400Gb/s per GPU between racks; 148 SMs as B200", sms=148, fp8=5000, mx=True),
        _gpu("A100-40GB", 312, 312, 156, 19.5, 40 * GB, 1.555e12, 300 * GB, "NVLink 3", 32 * GB, 25 * GB,
             "NVIDIA A100 datasheet (SXM4 40GB): 312 TFLOPS BF16 dense, 156 TF32 dense, 19.5 FP32, 40GB HBM2 "
             "1.555TB/s, NVLink 600GB/s bidirectional, PCIe Gen4; HDR 200Gb/s per GPU in DGX A100; 108 SMs "
             "(NVIDIA A100 whitepaper)", sms=108, gemm=A100_SXM_GEMM, clock=A100_CLOCK),
        _gpu("A100-80GB", 312, 312, 156, 19.5, 80 * GB, 2.039e12, 300 * GB, "NVLink 3", 32 * GB, 25 * GB,
             "NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOPS BF16 dense, 156 TF32 dense, 19.5 FP32, 80GB HBM2e "
             "2.039TB/s, NVLink 600GB/s bidirectional; 108 SMs", sms=108, gemm=A100_SXM_GEMM, clock=A100_CLOCK),
        _gpu("A100-PCIe-40GB", 312, 312, 156, 19.5, 40 * GB, 1.555e12, 32 * GB, "PCIe Gen4", 32 * GB, 25 * GB,
             "NVIDIA A100 datasheet (PCIe 40GB): 312 TFLOPS BF16 dense, 156 TF32 dense, 19.5 FP32, 40GB HBM2 "
             "1.555TB/s, PCIe Gen4 64GB/s bidirectional (no NVLink bridge assumed); 108 SMs", frac=0.55, sms=108,
             gemm=A100_PCIE_GEMM, clock=A100_CLOCK),
        _gpu("A100-PCIe-80GB", 312, 312, 156, 19.5, 80 * GB, 1.935e12, 300 * GB, "NVLink bridge", 32 * GB,
             25 * GB, "NVIDIA A100 datasheet (PCIe 80GB): 312 TFLOPS BF16 dense, 156 TF32 dense, 19.5 FP32, 80GB "
             "HBM2e 1.935TB/s, NVLink bridge 600GB/s bidirectional for 2 GPUs; 108 SMs", frac=0.55, sms=108,
             gemm=A100_PCIE_GEMM, clock=A100_CLOCK),
        _gpu("L40S", 362, 362, 183, 91.6, 48 * GB, 864 * GB, 32 * GB, "PCIe Gen4", 32 * GB, 12.5 * GB,
             "NVIDIA L40S datasheet: 362 TFLOPS BF16 dense (733 sparse), 733 FP8 dense (1466 sparse), 183 TF32 "
             "dense, 91.6 FP32, 48GB GDDR6 864GB/s, PCIe Gen4 x16, no NVLink; 142 SMs", frac=0.5, sms=142,
             fp8=733),
        _gpu("L4", 121, 121, 60, 30.3, 24 * GB, 300 * GB, 32 * GB, "PCIe Gen4", 32 * GB, 6.25 * GB,
             "NVIDIA L4 datasheet: 121 TFLOPS BF16 dense (242 sparse), 60 TF32 dense, 30.3 FP32, 24GB GDDR6 "
             "300GB/s, PCIe Gen4 x16; 58 SMs", frac=0.5, sms=58),
        _gpu("A10", 125, 125, 62.5, 31.2, 24 * GB, 600 * GB, 32 * GB, "PCIe Gen4", 32 * GB, 6.25 * GB,
             "NVIDIA A10 datasheet: 125 TFLOPS BF16 dense (250 sparse), 62.5 TF32 dense, 31.2 FP32, 24GB GDDR6 "
             "600GB/s, PCIe Gen4 x16; 72 SMs", frac=0.5, sms=72),
        _gpu("A40", 149.7, 149.7, 74.8, 37.4, 48 * GB, 696 * GB, 56.25 * GB, "NVLink bridge", 32 * GB, 12.5 * GB,
             "NVIDIA A40 datasheet: 149.7 TFLOPS FP16/BF16 tensor dense (299.4 sparse), 74.8 TF32 dense, 37.4 "
             "FP32, 48GB GDDR6 696GB/s, NVLink bridge 112.5GB/s bidirectional for 2 GPUs, PCIe Gen4 x16; 84 SMs "
             "(GA102); HeterMoE's (arXiv 2504.03871) newer GPU", frac=0.5, sms=84),
        _gpu("RTX-4090", 165, 165, 82.6, 82.6, 24 * GB, 1008 * GB, 32 * GB, "PCIe Gen4", 32 * GB, 3.125 * GB,
             "NVIDIA Ada Lovelace whitepaper (RTX 4090): 165.2 TFLOPS BF16 dense with FP32 accumulate, 82.6 "
             "TF32 dense, 82.6 FP32, 24GB GDDR6X 1008GB/s, PCIe Gen4, no NVLink; 128 SMs", frac=0.5, sms=128),
        _gpu("V100", 0, 125, 0, 15.7, 32 * GB, 900 * GB, 150 * GB, "NVLink 2", 16 * GB, 12.5 * GB,
             "NVIDIA V100 datasheet (SXM2 32GB): 125 TFLOPS FP16 tensor, no BF16, no TF32 (fp32 is 15.7 "
             "TFLOPS on CUDA cores), 32GB HBM2 900GB/s, NVLink 300GB/s bidirectional; 80 SMs (Volta "
             "whitepaper); compute capability 7.0, no FlashAttention-2", frac=0.5, sms=80, flash=False),
        _gpu("V100-16GB", 0, 125, 0, 15.7, 16 * GB, 900 * GB, 150 * GB, "NVLink 2", 16 * GB, 12.5 * GB,
             "NVIDIA V100 datasheet (SXM2 16GB): 125 TFLOPS FP16 tensor, no BF16, no TF32 (fp32 15.7 TFLOPS "
             "on CUDA cores), 16GB HBM2 900GB/s, NVLink 300GB/s bidirectional; 80 SMs; compute capability 7.0, no "
             "FlashAttention-2", frac=0.5, sms=80, flash=False),
        _gpu("V100-PCIe-16GB", 0, 112, 0, 14, 16 * GB, 900 * GB, 16 * GB, "PCIe Gen3", 16 * GB, 12.5 * GB,
             "NVIDIA V100 datasheet (PCIe 16GB): 112 TFLOPS FP16 tensor, no BF16, no TF32, 14 FP32, 16GB HBM2 "
             "900GB/s, PCIe Gen3 32GB/s bidirectional; 80 SMs; compute capability 7.0, no FlashAttention-2", frac=0.45,
             sms=80, flash=False),
        _gpu("MI300X", 1307, 1307, 653.7, 163.4, 192 * GB, 5.3e12, 448 * GB, "Infinity Fabric", 64 * GB, 50 * GB,
             "AMD Instinct MI300X datasheet: 1307.4 TFLOPS BF16 dense, 2614.9 FP8 dense, 653.7 TF32 dense, "
             "163.4 FP32 matrix, 192GB HBM3 5.3TB/s, 7 Infinity Fabric links 896GB/s aggregate bidirectional; "
             "304 CUs", frac=0.45, kind="rocm", sms=304, gemm=MI300X_GEMM, fp8=2614.9),
    )
}

MiB = 2.0**20
REPORTED_MIB: dict[str, tuple[int, str]] = {
    "H100-SXM": (81559, "NVIDIA H100 80GB HBM3"),
    "H100-NVL": (95830, "NVIDIA H100 NVL"),
    "H200": (143771, "NVIDIA H200"),
    "A100-40GB": (40960, "NVIDIA A100-SXM4-40GB"),
    "A100-80GB": (81920, "NVIDIA A100-SXM4-80GB"),
    "A100-PCIe-40GB": (40960, "NVIDIA A100-PCIE-40GB"),
    "L40S": (46068, "NVIDIA L40S"),
    "L4": (23034, "NVIDIA L4"),
    "RTX-4090": (24564, "NVIDIA GeForce RTX 4090"),
    "V100": (32768, "Tesla V100-SXM2-32GB"),
    "V100-16GB": (16160, "Tesla V100-SXM2-16GB"),
    "V100-PCIe-16GB": (16160, "Tesla V100-PCIE-16GB"),
}
"""Memory as the device reports it: ``nvidia-smi``'s total in MiB (``| 0MiB / 81920MiB |``), read from
public nvidia-smi tables in many GitHub repositories (found with the project's code search, 2026-12-04);
on the H200 of benchmarks/gpu_gemm.py torch's ``mem_get_info`` total was 143,156 MiB of these 143,771. Entries not here
(H100-PCIe, H20, A100-PCIe-80GB, A10, MI300X) keep their datasheet's decimal gigabytes: no report
was found. What a framework can then use is this total less ``framework_reserve`` (the CUDA
context, 0.53 GiB on the H200 run, NCCL buffers, workspaces)."""

for _name, (_mib, _label) in REPORTED_MIB.items():
    CATALOGUE[_name] = dataclasses.replace(
        CATALOGUE[_name], memory_bytes=_mib * MiB,
        memory_source=f"nvidia-smi total {_mib}MiB ({_label}), against the datasheet's "
                      f"{CATALOGUE[_name].memory_bytes / GB:g}GB")

ALIASES: dict[str, str] = {
    "V100-32GB": "V100", "V100-SXM2-32GB": "V100", "V100-SXM2-16GB": "V100-16GB",
    "H100-80GB": "H100-SXM", "H100-94GB": "H100-NVL", "A100-SXM4-40GB": "A100-40GB",
    "A100-SXM4-80GB": "A100-80GB", "H200-141GB": "H200",
}
"""Other names users write for a catalogue entry (memory-variant spellings); ``V100`` is the SXM2
32GB part, as it always was here."""


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
        name="CPU", kind="cpu", peak_flops={"fp32": fp32, "fp32-strict": fp32, "bf16": fp32, "fp16": fp32},
        memory_bytes=mem / devices, memory_bandwidth=20 * GB / devices, intra_node_bandwidth=1.0 * GB,
        intra_node_latency=50e-6, interconnect="loopback (gloo)", pcie_bandwidth=20 * GB, nic_bandwidth=1.0 * GB,
        achievable_fraction=0.25, provenance="derived",
        source=f"/proc/cpuinfo: {cores} cores x {mhz:.0f} MHz x {_cpu_flops_per_cycle(flags)} FP32 FLOP/cycle "
               f"/ {devices} workers; RAM from sysconf; gloo loopback ~1 GB/s (measured on 2-core machines; run `autotune profile` for this one)",
    )


def device_from_catalogue(name: str, field: str | None = None) -> DeviceSpec:
    if name in CATALOGUE:
        return CATALOGUE[name]
    lowered = {k.lower(): v for k, v in CATALOGUE.items()}
    lowered.update({k.lower(): CATALOGUE[v] for k, v in ALIASES.items()})
    if name.lower() in lowered:
        return lowered[name.lower()]
    if name.upper() == "CPU":
        return local_cpu()
    raise InputError(f"unknown device type {name!r}" + suggest(name, [*CATALOGUE, "CPU"]), field=field)
