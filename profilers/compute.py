"""Compute micro-benchmarks of one device: GEMM sweep, causal attention, memory.

- **GEMM**: ``(m, k) @ (k, n)`` at the shapes a transformer layer runs: m = tokens in a
  micro-batch, k/n = hidden, 3*hidden (fused QKV), 4*hidden (MLP up) and back. FLOPs = 2*m*n*k.
- **Attention**: ``scaled_dot_product_attention(q, k, v, is_causal=True)`` forward, then backward,
  over sequence lengths and head dims, B=1. Causal FLOPs (FlashAttention-2 paper, Dao 2023, sec.
  on FLOPs): forward ``4*b*h*s^2*d / 2`` (QK^T and PV, half the square masked), backward 2.5x
  forward (five matmuls instead of two).
- **Memory**: capacity and what is free now (``/proc/meminfo`` or ``cuda.mem_get_info``), and a
  copy bandwidth (read + write of a large tensor: 2 * bytes per copy).

Each sweep point is timed by ``profilers.timing.time_fn``; every point becomes a sample row, and
``fit_compute`` turns them into the fits the cost model reads (docs/contracts.md "Profiles").
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from profilers.emulation import SlowdownEmulator
from profilers.fits import affine_fit
from profilers.timing import time_fn

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class ComputePlan:
    """Which points to measure (``quick`` trims every sweep so `--quick` stays within seconds)."""

    gemm_tokens: tuple[int, ...]
    gemm_hidden: tuple[int, ...]
    gemm_dtypes: tuple[str, ...]
    attn_seq: tuple[int, ...]
    attn_head_dims: tuple[int, ...]
    attn_heads: int
    attn_dtype: str
    copy_bytes: int
    warmup: int
    repeats: int
    max_gemm_flops: float
    """Skip GEMMs larger than this (a 2-core CPU runs ~65 GFLOP/s fp32 per core)."""
    max_attn_flops: float = float("inf")
    """Skip attention points whose forward + backward FLOPs exceed this."""
    retry: bool = True
    """Re-measure an unstable point once (off in --quick: on a loaded machine it doubles the time)."""
    retry_budget_s: float = 20.0
    """No more re-measuring once the sweep has run this long (keeps a loaded machine near the target)."""
    started: list = field(default_factory=list, compare=False)

    def may_retry(self) -> bool:
        if not self.started:
            self.started.append(time.perf_counter())
        return self.retry and time.perf_counter() - self.started[0] < self.retry_budget_s


def compute_plan(device: str, quick: bool) -> ComputePlan:
    cuda = device.startswith("cuda")
    if cuda:
        return ComputePlan(
            gemm_tokens=(2048,) if quick else (1024, 4096, 8192), gemm_hidden=(1024, 4096) if quick else
            (1024, 2048, 4096, 8192), gemm_dtypes=("bf16",) if quick else ("bf16", "fp16", "fp32"),
            attn_seq=(1024, 4096) if quick else (1024, 2048, 4096, 8192, 16384), attn_head_dims=(128,) if quick
            else (64, 128), attn_heads=16, attn_dtype="bf16", copy_bytes=1 << 30, warmup=3, repeats=10,
            max_gemm_flops=1e13, retry=not quick)
    # CPU: sized so that --quick measures in ~2 s and the default in ~15 s on 2 idle cores (a loaded
    # machine doubles that: unstable points are re-measured once).
    return ComputePlan(
        gemm_tokens=(256,) if quick else (512,),
        gemm_hidden=(256, 512) if quick else (256, 512, 1024),
        gemm_dtypes=("fp32", "bf16"),
        attn_seq=(256, 512) if quick else (256, 512, 1024, 2048),
        attn_head_dims=(64,) if quick else (64, 128),
        attn_heads=4, attn_dtype="fp32", copy_bytes=(32 if quick else 128) << 20,
        warmup=1 if quick else 2, repeats=3 if quick else 7, max_gemm_flops=2.2e9 if quick else 4.3e9,
        max_attn_flops=4e9, retry=not quick)


def gemm_shapes(plan: ComputePlan) -> list[tuple[int, int, int]]:
    """(m, k, n) of a layer's matmuls: QKV (h -> 3h), out-proj (h -> h), MLP up (h -> 4h), down (4h -> h)."""
    shapes = []
    for m in plan.gemm_tokens:
        for h in plan.gemm_hidden:
            for k, n in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)):
                if 2.0 * m * n * k <= plan.max_gemm_flops and (m, k, n) not in shapes:
                    shapes.append((m, k, n))
    return shapes


def attention_points(plan: ComputePlan) -> list[tuple[int, int]]:
    """(head_dim, seq) pairs within the FLOP cap."""
    return [(d, s) for d in plan.attn_head_dims for s in plan.attn_seq
            if sum(attention_flops(1, plan.attn_heads, s, d)) <= plan.max_attn_flops]


def attention_flops(b: int, h: int, s: int, d: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of causal attention: fwd 4bhs^2d/2, bwd 2.5 x fwd."""
    fwd = 4.0 * b * h * s * s * d / 2.0
    return fwd, 2.5 * fwd


Progress = Callable[[str], None]


def measure_gemm(plan: ComputePlan, device: str, emu: SlowdownEmulator | None, tick: Progress) -> list[dict]:
    import torch

    rows = []
    for dt in plan.gemm_dtypes:
        dtype = getattr(torch, DTYPES[dt])
        for m, k, n in gemm_shapes(plan):
            a = torch.randn(m, k, device=device).to(dtype)
            b = torch.randn(k, n, device=device).to(dtype)
            t = time_fn(lambda a=a, b=b: torch.mm(a, b), device=device, warmup=plan.warmup,
                        repeats=plan.repeats, emulator=emu, retry=plan.may_retry())
            flops = 2.0 * m * n * k
            rows.append({"kind": "gemm", "params": {"dtype": dt, "m": m, "k": k, "n": n},
                         "work": flops, "timing": t.to_dict(),
                         "metrics": {"flops": flops, "flops_per_s": flops / t.median_s}})
            tick(f"gemm {dt} {m}x{k}x{n}")
    return rows


def measure_attention(plan: ComputePlan, device: str, emu: SlowdownEmulator | None, tick: Progress) -> list[dict]:
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, DTYPES[plan.attn_dtype])
    rows = []
    for d, s in attention_points(plan):
        q, k, v = (torch.randn(1, plan.attn_heads, s, d, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(1, plan.attn_heads, s, d, device=device, dtype=dtype)
        out_holder: dict = {}

        def fwd(q=q, k=k, v=v, out_holder=out_holder):
            out_holder["o"] = F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd(q=q, k=k, v=v, grad=grad):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(grad)
            q.grad = k.grad = v.grad = None

        tf = time_fn(fwd, device=device, warmup=plan.warmup, repeats=plan.repeats, emulator=emu, retry=plan.may_retry())
        tfb = time_fn(fwd_bwd, device=device, warmup=plan.warmup, repeats=plan.repeats, emulator=emu, retry=plan.may_retry())
        f_fwd, f_bwd = attention_flops(1, plan.attn_heads, s, d)
        bwd_s = max(tfb.median_s - tf.median_s, 1e-9)
        params = {"dtype": plan.attn_dtype, "batch": 1, "heads": plan.attn_heads, "seq": s, "head_dim": d}
        rows.append({"kind": "attention_fwd", "params": params, "work": f_fwd, "timing": tf.to_dict(),
                     "metrics": {"flops": f_fwd, "flops_per_s": f_fwd / tf.median_s}})
        rows.append({"kind": "attention_fwd_bwd", "params": params, "work": f_fwd + f_bwd,
                     "timing": tfb.to_dict(),
                     "metrics": {"flops": f_fwd + f_bwd, "flops_per_s": (f_fwd + f_bwd) / tfb.median_s,
                                 "bwd_s": bwd_s, "bwd_flops_per_s": f_bwd / bwd_s}})
        tick(f"attention d={d} s={s}")
    return rows


def memory_capacity(device: str) -> dict[str, float]:
    """Total and currently free bytes of the device's memory."""
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return {"capacity_bytes": float(total), "available_bytes": float(free)}
    total = float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    avail = total
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = float(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return {"capacity_bytes": total, "available_bytes": avail}


def measure_memory(plan: ComputePlan, device: str, emu: SlowdownEmulator | None, tick: Progress) -> list[dict]:
    import torch

    src = torch.empty(plan.copy_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device=device, warmup=plan.warmup, repeats=plan.repeats, emulator=emu, retry=plan.may_retry())
    moved = 2.0 * plan.copy_bytes  # one read + one write per byte copied
    cap = memory_capacity(device)
    tick("memory")
    return [{"kind": "memory_copy", "params": {"bytes": plan.copy_bytes}, "work": moved, "timing": t.to_dict(),
             "metrics": {"bandwidth_bytes_per_s": moved / t.median_s, **cap}}]


def run_compute(device: str, quick: bool, emu: SlowdownEmulator | None, tick: Progress) -> list[dict]:
    plan = compute_plan(device, quick)
    plan.may_retry()  # start the retry budget's clock
    return (measure_gemm(plan, device, emu, tick) + measure_attention(plan, device, emu, tick)
            + measure_memory(plan, device, emu, tick))


def compute_steps(device: str, quick: bool) -> int:
    """How many progress ticks ``run_compute`` makes (for the progress bar's total)."""
    plan = compute_plan(device, quick)
    return len(plan.gemm_dtypes) * len(gemm_shapes(plan)) + len(attention_points(plan)) + 1


def fit_compute(samples: list[dict]) -> dict:
    """Fits of one rank's compute samples, in the shape docs/contracts.md "Profiles" documents."""
    gemm: dict[str, dict] = {}
    for dt in sorted({s["params"]["dtype"] for s in samples if s["kind"] == "gemm"}):
        pts = [s for s in samples if s["kind"] == "gemm" and s["params"]["dtype"] == dt]
        pts.sort(key=lambda s: s["work"])
        f = affine_fit([s["work"] for s in pts], [s["timing"]["median_s"] for s in pts])
        gemm[dt] = {"points": [[s["work"], s["metrics"]["flops_per_s"]] for s in pts],
                    "peak_flops_per_s": f["rate"], "overhead_s": f["alpha_s"], "r2": f["r2"],
                    "best_flops_per_s": max(s["metrics"]["flops_per_s"] for s in pts)}
    attention: dict = {}
    fwd = [s for s in samples if s["kind"] == "attention_fwd"]
    both = {(s["params"]["head_dim"], s["params"]["seq"]): s for s in samples if s["kind"] == "attention_fwd_bwd"}
    if fwd:
        p0 = fwd[0]["params"]
        by_hd: dict[str, dict] = {}
        for d in sorted({s["params"]["head_dim"] for s in fwd}):
            rows = sorted((s for s in fwd if s["params"]["head_dim"] == d), key=lambda s: s["params"]["seq"])
            pts, fw, fs, bw, bs = [], [], [], [], []
            for s in rows:
                fb = both[(d, s["params"]["seq"])]
                f_s = s["timing"]["median_s"]
                b_s = fb["metrics"]["bwd_s"]
                pts.append([s["params"]["seq"], f_s, b_s])
                fw.append(s["work"])
                fs.append(f_s)
                bw.append(fb["work"] - s["work"])
                bs.append(b_s)
            ffit, bfit = affine_fit(fw, fs), affine_fit(bw, bs)
            by_hd[str(d)] = {"points": pts,
                             "fwd": {"flops_per_s": ffit["rate"], "overhead_s": ffit["alpha_s"], "r2": ffit["r2"]},
                             "bwd": {"flops_per_s": bfit["rate"], "overhead_s": bfit["alpha_s"], "r2": bfit["r2"]}}
        attention = {"dtype": p0["dtype"], "batch": p0["batch"], "heads": p0["heads"], "causal": True,
                     "flops": "fwd = 2*batch*heads*seq^2*head_dim (causal), bwd = 2.5 * fwd",
                     "by_head_dim": by_hd}
    memory: dict = {}
    for s in samples:
        if s["kind"] == "memory_copy":
            memory = {k: s["metrics"][k] for k in ("capacity_bytes", "available_bytes", "bandwidth_bytes_per_s")}
    return {"gemm": gemm, "attention": attention, "memory": memory}
