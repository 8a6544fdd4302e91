"""What one GPU really reaches: GEMM throughput per precision and shape, attention, per-kernel host cost.

The cost model's GPU prices stand on three figures per device that datasheets do not give: the
fraction of dense peak a large GEMM reaches through cuBLAS (``gemm_fraction``), how that falls for the
small and skinny GEMMs of tensor-parallel shards, and the host time an eager framework spends per
kernel (``launch``). This script measures them on the GPU in front of it and prints one table, plus a
JSON file the catalogue cites:

- GEMMs ``(m, k) @ (k, n)`` in bf16, fp16, fp32 with TF32 tensor cores, strict fp32 and (Hopper and
  later, where torch has ``_scaled_mm``) fp8 e4m3; square sizes and the shapes of LLM blocks
  (tokens x hidden x 3*hidden, x ffn, ...); median of CUDA-event timings after warm-up.
- causal SDPA forward + backward (FlashAttention where torch picks it), as a fraction of peak with the
  backward counted at 2.5x the forward (the cost model's ``ATTENTION_BWD_FLOPS``).
- eager per-kernel host time: a loop of tiny kernels whose wall time is bound by the host (the
  kernels themselves take ~2 us), against the same kernels replayed from one CUDA graph.
- memory: what the device reports (``mem_get_info`` total in MiB, as nvidia-smi shows it) and what
  the CUDA context takes before any tensor is allocated.

    python benchmarks/gpu_gemm.py [--json FILE] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

# Dense (no sparsity) peaks in TFLOP/s per datasheet, by substring of torch.cuda.get_device_name().
PEAKS_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9, "fp8": 1978.9},  # H200 SXM datasheet
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9, "fp8": 1978.9},  # H100 SXM5 datasheet
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},                 # A100 datasheet
}

SQUARE = (1024, 2048, 4096, 8192, 16384)
# (m, k, n): m = tokens of a micro-batch (mbs x seq), k/n of Llama-style blocks and their tp shards.
LLM_SHAPES = (
    (8192, 4096, 12288), (8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096),   # 8B, tp1
    (8192, 8192, 10240), (8192, 8192, 3584), (8192, 3584, 8192),                          # 70B, tp8 shards
    (16384, 16384, 6144), (16384, 6656, 16384),                                            # 405B, tp8 shards
    (4096, 12288, 4608), (4096, 1536, 12288),                                              # 175B, tp8 shards
    (2048, 2048, 768), (2048, 2048, 8192), (1024, 1024, 4096),                             # small models
)


def _peak(name: str) -> dict[str, float]:
    for key, peaks in PEAKS_TFLOPS.items():
        if key in name:
            return peaks
    return {}


def _time_cuda(fn, iters: int, warmup: int) -> float:
    """Median seconds of ``fn`` over ``iters`` CUDA-event timed calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def gemm_rows(shapes: list[tuple[int, int, int]], precisions: list[str], iters: int) -> list[dict[str, Any]]:
    import torch

    peaks = _peak(torch.cuda.get_device_name(0))
    rows = []
    for prec in precisions:
        for m, k, n in shapes:
            torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
            if prec == "fp8":
                if not hasattr(torch, "_scaled_mm"):
                    continue
                a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
                b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
                one = torch.ones((), device="cuda")

                def fn(a=a, b=b, one=one):
                    return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            else:
                dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32,
                      "fp32": torch.float32}[prec]
                a = torch.randn(m, k, device="cuda", dtype=dt)
                b = torch.randn(k, n, device="cuda", dtype=dt)

                def fn(a=a, b=b):
                    return a @ b
            try:
                t = _time_cuda(fn, iters if prec != "fp32" else max(3, iters // 3), 3)
            except RuntimeError as e:  # an fp8 layout this build refuses: record why, go on
                rows.append({"precision": prec, "m": m, "k": k, "n": n, "error": str(e).splitlines()[0]})
                continue
            tf = 2 * m * k * n / t / 1e12
            rows.append({"precision": prec, "m": m, "k": k, "n": n, "time_s": t, "tflops": tf,
                         "fraction_of_peak": tf / peaks[prec] if prec in peaks else None})
            del a, b
    torch.backends.cuda.matmul.allow_tf32 = False
    return rows


def attention_rows(iters: int) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    peaks = _peak(torch.cuda.get_device_name(0))
    rows = []
    for seq in (2048, 4096, 8192, 16384):
        b, h, d = max(1, 16384 // seq), 32, 128
        q, k, v = (torch.randn(b, h, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        g = torch.randn(b, h, seq, d, device="cuda", dtype=torch.bfloat16)

        def fwd(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd(q=q, k=k, v=v, g=g):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

        t_f = _time_cuda(fwd, iters, 3)
        t_fb = _time_cuda(fwd_bwd, iters, 3)
        flops_f = 4 * b * h * seq * seq * d / 2  # causal: half the square
        rows.append({"seq": seq, "batch": b, "heads": h, "head_dim": d, "fwd_s": t_f, "fwd_bwd_s": t_fb,
                     "fwd_fraction": flops_f / t_f / 1e12 / peaks.get("bf16", float("nan")),
                     "fwd_bwd_fraction": 3.5 * flops_f / t_fb / 1e12 / peaks.get("bf16", float("nan"))})
    return rows


def launch_rows() -> dict[str, Any]:
    """Host time per eager kernel: tiny adds whose GPU time (~2 us) is below the host's issue time."""
    import torch

    x = torch.zeros(256, device="cuda")
    w = torch.zeros(64, 64, device="cuda")
    out: dict[str, Any] = {}
    for name, op in (("add_", lambda: x.add_(1.0)), ("small_matmul", lambda: w @ w),
                     ("layer_norm", lambda: torch.nn.functional.layer_norm(w, (64,)))):
        for _ in range(200):
            op()
        torch.cuda.synchronize()
        reps = []
        for _ in range(5):
            n = 5000
            t0 = time.perf_counter()
            for _ in range(n):
                op()
            torch.cuda.synchronize()
            reps.append((time.perf_counter() - t0) / n)
        out[f"eager_{name}_s"] = statistics.median(reps)
    # the same 100 adds replayed from a CUDA graph: what a compiled/graph-captured stack pays per kernel
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            x.add_(1.0)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(100):
            x.add_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    reps = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        reps.append((time.perf_counter() - t0) / 5000)
    out["graph_add_s"] = statistics.median(reps)
    return out


def memory_row() -> dict[str, Any]:
    import torch

    torch.cuda.init()
    free0, total = torch.cuda.mem_get_info()
    props = torch.cuda.get_device_properties(0)
    return {"device": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
            "total_bytes": total, "total_mib": total / 2**20, "free_after_context_bytes": free0,
            "context_bytes": total - free0, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cublas_workspace": None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and iterations (smoke test)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_gemm: no CUDA GPU is visible", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    mem = memory_row()  # first: the context alone, before any tensor
    iters = 5 if args.quick else 20
    shapes = [(s, s, s) for s in (SQUARE[:3] if args.quick else SQUARE)] + list(LLM_SHAPES[: 3 if args.quick else None])
    gemm = gemm_rows(shapes, ["bf16", "fp16", "tf32", "fp32", "fp8"], iters)
    attn = attention_rows(iters)
    launch = launch_rows()
    res = {"memory": mem, "gemm": gemm, "attention": attn, "launch": launch, "wall_s": time.perf_counter() - t0,
           "date": time.strftime("%Y-%m-%d")}
    print(f"{mem['device']}: {mem['sms']} SMs, {mem['total_mib']:.0f} MiB reported, context "
          f"{mem['context_bytes'] / 2**20:.0f} MiB; torch {mem['torch']}, CUDA {mem['cuda']}")
    print(f"{'prec':5} {'m':>6} {'k':>6} {'n':>6} {'TFLOP/s':>9} {'of peak':>8}")
    for r in gemm:
        if "error" in r:
            print(f"{r['precision']:5} {r['m']:6} {r['k']:6} {r['n']:6} error: {r['error'][:60]}")
            continue
        fr = f"{r['fraction_of_peak']:.3f}" if r["fraction_of_peak"] is not None else "n/a"
        print(f"{r['precision']:5} {r['m']:6} {r['k']:6} {r['n']:6} {r['tflops']:9.1f} {fr:>8}")
    for prec in ("bf16", "fp16", "tf32", "fp32", "fp8"):
        fr = [r["fraction_of_peak"] for r in gemm if r.get("precision") == prec and r.get("fraction_of_peak")
              and r["m"] * r["k"] * r["n"] >= 4096**3]
        if fr:
            print(f"{prec}: large GEMMs (>= 4096^3 MACs) median {statistics.median(fr):.3f} of peak, max {max(fr):.3f}")
    print("causal SDPA bf16 (head dim 128): seq, fwd fraction, fwd+bwd fraction")
    for r in attn:
        print(f"  {r['seq']:6} {r['fwd_fraction']:.3f} {r['fwd_bwd_fraction']:.3f}")
    print("host time per eager kernel: " + ", ".join(f"{k} {v * 1e6:.2f} us" for k, v in launch.items()))
    print(f"{res['wall_s']:.0f} s in all")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
