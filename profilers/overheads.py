"""Fixed per-call costs of eager PyTorch on CPU, measured so the cost model need not assume them.

On a few CPU cores the shapes of a local trial are small enough that a call's fixed cost rivals
its work (``autotune/cost/compute.py``, "CPU"): oneDNN packs a GEMM's operands on every call, and
every elementwise operator pays dispatch, allocation and its autograd node. The cost model prices
them as ``gemm_call_s`` per GEMM call and ``op_s`` per elementwise operator
(``DeviceSpec.profile["overheads"]``); this module says which points measure them and fits them.

- **GEMM calls** (sample kind ``gemm_call``): transformer-shaped products with m = 128 tokens and
  k/n = 64..256 (1-17 MFLOP), the sizes of the ``tiny``/``small`` trial models, where the call
  cost dominates. ``gemm_call_s[dtype]`` = median over the smallest ``CALL_POINTS`` of
  (time - FLOPs / large-GEMM rate), clamped at 0. They are their own kind, not ``gemm`` points:
  the cost model interpolates the ``gemm`` rates by size and adds ``gemm_call_s`` on top, so a
  small point in both would count the call cost twice.
- **Elementwise operator** (sample kind ``op``): a multiply at ``OP_ELEMS`` sizes in the trial
  dtype (bf16 where the CPU has native bf16, as ``autotune/runtime`` trains, else fp32) with
  autograd recording, as the model issues it in training; ``op_s`` = the fixed part of its time
  (the intercept of time against elements: dispatch, allocation, the autograd node). The cost
  model prices an operator's bytes separately (``memory_time``), so the whole time of one size
  would count them twice. benchmarks/bench_validate.py, the same 24 trials re-priced (median
  leave-one-out; cross-model tiny/small held out): the old default 6 us 8.3% (9.5% / 8.3%), the
  32k-element time 8 us 8.7% (12.1% / 10.0%), the intercept ~2 us 7.5% (5.5% / 5.6%).

The sync terms (``sync_call_s``, ``sync_skew``: waits at a blocking collective inside a block)
are not measured here: they need two ranks drifting apart over a block's compute, which the
profile's back-to-back link rounds do not reproduce; the cost model keeps its defaults for them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from profilers.fits import affine_fit

CALL_GEMM_M = 128
CALL_GEMM_KN = ((64, 64), (64, 192), (128, 128), (128, 384), (256, 256))
"""(k, n) of the call-cost GEMMs (m = ``CALL_GEMM_M``): QKV-, projection- and MLP-like products of
hidden 64..256; 1 to 17 MFLOP."""
CALL_POINTS = 3
"""Smallest points the per-call cost is the median of (one noisy point cannot set it)."""
OP_ELEMS = (4096, 32768)
"""Elements of the timed multiplies: the activations of ``tiny`` (128 x 64 = 8k) and ``small``
(256 x 256 = 64k) trials lie around and between them."""


def call_gemm_shapes(device: str) -> tuple[tuple[int, int, int], ...]:
    """(m, k, n) of the call-cost GEMMs (CPU only: on a GPU the call cost hides behind the stream)."""
    if device.startswith("cuda"):
        return ()
    return tuple((CALL_GEMM_M, k, n) for k, n in CALL_GEMM_KN)


def op_points(device: str) -> tuple[int, ...]:
    """Element counts of the timed elementwise operator (CPU only)."""
    return () if device.startswith("cuda") else OP_ELEMS


LAUNCH_OPS = 200
"""Tiny kernels issued back to back per timed call of the launch points (``launch_fns``)."""


def launch_fns(device: str) -> list[tuple[str, Callable[[], object]]]:
    """(name, call) of the eager host-time points (CUDA only; sample kind ``launch``): ``LAUNCH_OPS``
    tiny kernels back to back whose GPU work (~2 us) is below the host's time to issue them, so the
    stream's time over the call is the host's: an add, a small matmul and a layer norm, the ops
    benchmarks/gpu_gemm.py's ``launch_rows`` times (H200: 10.7, 20.3, 18.4 us). Their median per
    kernel is the profile's ``kernel_host_s``, which prices the runtime's host time per kernel on this
    GPU (autotune/cost/compute.py ``rates_for``) in place of the catalogue's ``EAGER_HOST_S``."""
    if not device.startswith("cuda"):
        return []
    import torch

    x = torch.zeros(256, device=device)
    w = torch.zeros(64, 64, device=device)
    ops = (("add_", lambda: x.add_(1.0)), ("small_matmul", lambda: w @ w),
           ("layer_norm", lambda: torch.nn.functional.layer_norm(w, (64,))))

    def loop(op):
        def run():
            for _ in range(LAUNCH_OPS):
                op()
        return run

    return [(name, loop(op)) for name, op in ops]


def fit_overheads(samples: list[dict], gemm: dict[str, dict]) -> dict:
    """``{"gemm_call_s": {dtype: s}, "op_s": s, "op": {dtype, name, elems, s, per_element_s}}`` from one rank's ``gemm_call`` and
    ``op`` samples (keys absent when not measured); ``gemm`` is the rank's GEMM fit, whose best
    rate prices the calls' FLOPs."""
    out: dict = {}
    calls: dict[str, float] = {}
    for dt in sorted({s["params"]["dtype"] for s in samples if s["kind"] == "gemm_call"}):
        pts = sorted((s for s in samples if s["kind"] == "gemm_call" and s["params"]["dtype"] == dt),
                     key=lambda s: s["work"])
        rate = (gemm.get(dt) or {}).get("best_flops_per_s") or max(s["work"] / s["timing"]["median_s"] for s in pts)
        excess = [s["timing"]["median_s"] - s["work"] / rate for s in pts[:CALL_POINTS]]
        calls[dt] = max(0.0, statistics.median(excess))
    if calls:
        out["gemm_call_s"] = calls
    launches = [s["timing"]["median_s"] / s["params"]["ops"] for s in samples if s["kind"] == "launch"]
    if launches:  # eager host seconds per tiny kernel (launch_fns): the median over the ops
        out["kernel_host_s"] = statistics.median(launches)
    ops = [s for s in samples if s["kind"] == "op"]
    if ops:
        # time = op_s + elems * per-element seconds (least squares; one size: its whole time)
        f = affine_fit([s["work"] for s in ops], [s["timing"]["median_s"] for s in ops])
        p = ops[0]["params"]
        out["op_s"] = max(0.0, f["alpha_s"]) if len({s["work"] for s in ops}) > 1 else ops[0]["timing"]["median_s"]
        out["op"] = {"dtype": p["dtype"], "name": p["op"], "elems": sorted(s["work"] for s in ops),
                     "s": [s["timing"]["median_s"] for s in sorted(ops, key=lambda s: s["work"])],
                     "per_element_s": 1.0 / f["rate"] if f["rate"] and f["rate"] != float("inf") else 0.0}
    return out
