"""Compute micro-benchmarks of one device: GEMM sweep, causal attention, memory.

- **GEMM**: ``(m, k) @ (k, n)`` at the shapes a transformer layer runs: m = tokens in a
  micro-batch, k/n = hidden, 3*hidden (fused QKV), 4*hidden (MLP up) and back. FLOPs = 2*m*n*k.
- **Attention**: ``scaled_dot_product_attention(q, k, v, is_causal=True)`` forward, then backward,
  over sequence lengths and head dims, B=1. Causal FLOPs (FlashAttention-2 paper, Dao 2023, sec.
  on FLOPs): forward ``4*b*h*s^2*d / 2`` (QK^T and PV, half the square masked), backward 2.5x
  forward (five matmuls instead of two).
- **Call costs** (CPU): small GEMMs (sample kind ``gemm_call``) and one elementwise operator
  (``op``), whose fixed per-call costs ``fit_compute`` reports as ``overheads``
  (``profilers.overheads``).
- **Memory**: capacity and what is free now (``/proc/meminfo`` or ``cuda.mem_get_info``), and a
  copy bandwidth (read + write of a large tensor: 2 * bytes per copy).

Each sweep point is timed by a ``profilers.timing.Meter`` in interleaved rounds over the whole sweep
(median of the round medians); every point becomes a sample row, and ``fit_compute`` turns them
into the fits the cost model reads (docs/contracts.md "Profiles"). A GEMM dtype the device has no
native kernel for is not measured; ``dtype_support`` says why, and the fits keep that reason
(``gemm_unsupported``) so the profile never drops a dtype silently.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from autotune.runtime.emulation import SlowdownEmulator
from autotune.specs.model import ATTENTION_BWD_FLOPS
from profilers.block_ref import fit_block_ref, ref_calls, ref_points, ref_shape
from profilers.dtypes import dtype_support, trial_dtype
from profilers.fits import affine_fit
from profilers.overheads import LAUNCH_OPS, call_gemm_shapes, fit_overheads, launch_fns, op_points
from profilers.timing import Meter, Timing, repeats_for

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
MIN_ROUNDS = 3
"""Fewest rounds a sweep takes even over its time budget (a median of three rounds still drops one
spoilt round)."""


@dataclass(frozen=True)
class ComputePlan:
    """Which points to measure and how often (``quick`` trims every sweep so `--quick` takes seconds)."""

    gemm_tokens: tuple[int, ...]
    gemm_hidden: tuple[int, ...]
    gemm_dtypes: tuple[str, ...]
    attn_seq: tuple[int, ...]
    attn_head_dims: tuple[int, ...]
    attn_heads: int
    attn_dtype: str
    copy_bytes: int
    warmup: int
    rounds: int
    """Interleaved rounds over the whole sweep (profilers.timing: the median of the round medians)."""
    round_s: float
    """Each point's repeats in one round last about this long (many repeats for small calls) ..."""
    min_repeats: int
    max_repeats: int
    """... but at least ``min_repeats`` and at most ``max_repeats`` per round."""
    long_call_s: float
    """A call at least this long gets a short warm-up and no untimed call before each round (its
    operands do not fit in cache anyway, and a re-warm would cost as much as a repeat)."""
    budget_s: float
    """The worker stops adding rounds (keeping at least ``MIN_ROUNDS``) once measuring has taken this
    long, so a loaded machine stays near the speed target with fewer rounds."""
    max_gemm_flops: float
    """Skip GEMMs larger than this (a 2-core CPU runs ~65 GFLOP/s fp32 per core)."""
    max_attn_flops: float = float("inf")
    """Skip attention points whose forward + backward FLOPs exceed this."""
    trial_attn_seq: tuple[int, ...] = ()
    trial_attn_head_dims: tuple[int, ...] = ()
    """Attention also measured at these shapes in the trial dtype (CPU: ``attention_trial``)."""
    cpu_attn_seq: tuple[int, ...] = ()
    cpu_attn_head_dims: tuple[int, ...] = ()
    """CPU: one-head calls at these lengths and head dims, in fp32 and the trial dtype, plus one call of
    ``cpu_attn_heads`` heads at the shortest: what ``cost/cpu_attention.fit_line`` needs (a per-call, a
    per-head, a per-query and a per-cell cost), stored as ``attention_cpu``."""
    cpu_attn_heads: int = 4


def compute_plan(device: str, quick: bool) -> ComputePlan:
    cuda = device.startswith("cuda")
    if cuda:
        return ComputePlan(
            gemm_tokens=(2048,) if quick else (1024, 4096, 8192), gemm_hidden=(1024, 4096) if quick else
            (1024, 2048, 4096, 8192), gemm_dtypes=("bf16",) if quick else ("bf16", "fp16", "fp32"),
            attn_seq=(1024, 4096) if quick else (1024, 2048, 4096, 8192, 16384), attn_head_dims=(128,) if quick
            else (64, 128), attn_heads=16, attn_dtype="bf16", copy_bytes=1 << 30, warmup=3,
            rounds=3 if quick else 5, round_s=0.01, min_repeats=3, max_repeats=20, long_call_s=0.005,
            budget_s=10.0 if quick else 45.0, max_gemm_flops=1e13)
    # CPU: sized (benchmarks/bench_profile.py) so that --quick measures in ~2 s and the default in ~15 s
    # on 2 idle cores, with enough rounds that two runs agree within 10% on a shared machine.
    return ComputePlan(
        gemm_tokens=(256,) if quick else (512,),
        gemm_hidden=(256, 512) if quick else (256, 512, 1024),
        gemm_dtypes=("fp32", "bf16", "fp16"),
        attn_seq=(256, 512) if quick else (256, 512, 1024, 2048),
        attn_head_dims=(64,) if quick else (64, 128),
        attn_heads=4, attn_dtype="fp32",
        # Also at the sequences and head dims the CPU trials run (tiny: seq 128, head_dim 8; small:
        # 256 and 32; CP halves them) in the trial dtype (bf16 where native: its CPU flash backward
        # is ~4x fp32's there). Stored as `attention_trial`: what an older profile's cost model reads
        # for a plan of that dtype; `attention_cpu` (below) supersedes both where present.
        trial_attn_seq=(64, 128, 256) if quick else (64, 128, 256, 512),
        trial_attn_head_dims=(32,) if quick else (32, 64),
        # 1,024 is past the kernel's last block-size change (768): its tiles are those of a 4k window
        cpu_attn_seq=(64, 160, 256, 1024) if quick else (64, 160, 256, 1024, 4096), cpu_attn_head_dims=(32, 64),
        copy_bytes=(32 if quick else 128) << 20,
        warmup=2 if quick else 3, rounds=5 if quick else 6, round_s=0.004 if quick else 0.02,
        min_repeats=2, max_repeats=12 if quick else 20, long_call_s=0.005,
        budget_s=4.5 if quick else 28.0,
        max_gemm_flops=2.2e9 if quick else 4.3e9, max_attn_flops=4e9)


def gemm_shapes(plan: ComputePlan) -> list[tuple[int, int, int]]:
    """(m, k, n) of a layer's matmuls: QKV (h -> 3h), out-proj (h -> h), MLP up (h -> 4h), down (4h -> h)."""
    shapes = []
    for m in plan.gemm_tokens:
        for h in plan.gemm_hidden:
            for k, n in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)):
                if 2.0 * m * n * k <= plan.max_gemm_flops and (m, k, n) not in shapes:
                    shapes.append((m, k, n))
    return shapes


def attention_points(plan: ComputePlan, trial: bool = False) -> list[tuple[int, int]]:
    """(head_dim, seq) pairs within the FLOP cap (``trial``: the trial-dtype set)."""
    dims, seqs = (plan.trial_attn_head_dims, plan.trial_attn_seq) if trial else (plan.attn_head_dims, plan.attn_seq)
    return [(d, s) for d in dims for s in seqs
            if sum(attention_flops(1, plan.attn_heads, s, d)) <= plan.max_attn_flops]


def cpu_attention_points(plan: ComputePlan, trial_dt: str) -> list[tuple[str, int, int, int]]:
    """(dtype, head_dim, seq, heads) of the CPU attention calls: one head at every length, and
    ``cpu_attn_heads`` at the shortest (separating a call's fixed cost from a head's), in fp32 and the
    trial dtype."""
    if not plan.cpu_attn_seq:
        return []
    dts = ["fp32"] + ([trial_dt] if trial_dt != "fp32" else [])
    shapes = [(s, 1) for s in plan.cpu_attn_seq] + [(min(plan.cpu_attn_seq), plan.cpu_attn_heads)]
    return [(dt, d, s, h) for dt in dts for d in plan.cpu_attn_head_dims for s, h in shapes]


def attention_flops(b: int, h: int, s: int, d: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of causal attention: fwd 4bhs^2d/2, bwd ``ATTENTION_BWD_FLOPS``
    (2.5) x fwd: the cost model's convention, so it prices a measured backward at its time."""
    fwd = 4.0 * b * h * s * s * d / 2.0
    return fwd, ATTENTION_BWD_FLOPS * fwd


Progress = Callable[[str], None]


@dataclass
class _Item:
    """One progress step of the sweep: its meters (attention has two) and how to make its row."""

    label: str
    meters: list[Meter]
    repeats: int
    row: Callable[[list[Timing]], list[dict]]
    rewarm: bool = True


class ComputeSweep:
    """One rank's compute sweep, measured in interleaved rounds.

    ``ComputeSweep(...)`` allocates every operand and warms every point (timing the warm-up to size
    the rounds), ``round()`` takes one round of repeats of every point in sweep order, ``rows()``
    turns all rounds into sample rows. The worker runs ``round()`` between barriers so all ranks
    compute at the same time (each rank is one equal share of the machine, as the runtime runs it).
    """

    def __init__(self, device: str, quick: bool, emu: SlowdownEmulator | None, tick: Progress):
        import torch

        self.plan = plan = compute_plan(device, quick)
        self.tick = tick
        self.items: list[_Item] = []
        dtypes, self.unsupported = dtype_support(device, plan.gemm_dtypes)
        # One torch thread on CPU: every op runs on this thread, so its CPU time is the op's time
        # without the slices another process took from the core (profilers.timing, "Clock").
        self.clock = "thread" if not device.startswith("cuda") and torch.get_num_threads() == 1 else "wall"

        self.device, self.emu = device, emu
        self._gemms(dtypes)
        self.trial_dtype = trial_dtype(device) if not device.startswith("cuda") else plan.attn_dtype
        self._ops()
        self._attention()
        if not device.startswith("cuda"):
            self._attention_cpu()
        self._references(dtypes)
        self._memory()

    def _add(self, label: str, fns: list[Callable[[], object]], row: Callable[[list[Timing]], list[dict]]) -> None:
        """Warm ``fns`` once, settle their warm-up and repeats by the call's time, keep them as one item."""
        plan, device, emu = self.plan, self.device, self.emu
        meters = [Meter(fn, device=device, emulator=emu, clock=self.clock) for fn in fns]
        call_s = sum(m.warm(1) for m in meters)  # first call: allocation, oneDNN primitive creation
        # A call of milliseconds settles in one more; a short one (operands in cache, allocator
        # and thread-pool effects comparable to the call) gets the plan's full warm-up.
        more = plan.warmup - 1 if call_s < plan.long_call_s else 1
        call_s = sum(m.warm(more) for m in meters) if more > 0 else call_s
        self.items.append(_Item(label, meters, repeats_for(call_s, plan.round_s, plan.min_repeats,
                                                            plan.max_repeats), row,
                                rewarm=call_s < plan.long_call_s))

    def _gemms(self, dtypes: list[str]) -> None:
        """The GEMM sweep, then (CPU) the per-call costs of the smallest GEMMs a trial runs."""
        import torch

        plan, device = self.plan, self.device
        # The GEMM sweep, then (CPU) the per-call costs: the smallest GEMMs a trial runs, their own kind
        # (profilers.overheads), and one elementwise operator below.
        for kind, shapes in (("gemm", gemm_shapes(plan)), ("gemm_call", call_gemm_shapes(device))):
            for dt in dtypes:
                dtype = getattr(torch, DTYPES[dt])
                for m, k, n in shapes:
                    a = torch.randn(m, k, device=device).to(dtype)
                    b = torch.randn(k, n, device=device).to(dtype)
                    flops = 2.0 * m * n * k

                    def gemm_row(ts, kind=kind, dt=dt, m=m, k=k, n=n, flops=flops):
                        return [{"kind": kind, "params": {"dtype": dt, "m": m, "k": k, "n": n}, "work": flops,
                                 "timing": ts[0].to_dict(),
                                 "metrics": {"flops": flops, "flops_per_s": flops / ts[0].median_s}}]

                    label = "gemm" if kind == "gemm" else "gemm call"
                    self._add(f"{label} {dt} {m}x{k}x{n}", [lambda a=a, b=b: torch.mm(a, b)], gemm_row)

    def _ops(self) -> None:
        """One elementwise operator's per-call cost (the trial's dtype); on CUDA, the eager host time per kernel."""
        import torch

        device = self.device
        for elems in op_points(device):
            odt = self.trial_dtype
            x = torch.randn(elems, device=device).to(getattr(torch, DTYPES[odt])).requires_grad_(True)
            y = torch.randn(elems, device=device).to(getattr(torch, DTYPES[odt]))

            def op_row(ts, elems=elems, odt=odt):
                return [{"kind": "op", "params": {"dtype": odt, "elems": elems, "op": "mul", "autograd": True},
                         "work": float(elems), "timing": ts[0].to_dict(), "metrics": {"op_s": ts[0].median_s}}]

            # With autograd recording (x requires grad), as the model's operators run in training.
            self._add(f"op mul {odt} {elems}", [lambda x=x, y=y: x * y], op_row)

        for name, fn in launch_fns(device):  # CUDA: the eager host time per kernel (profilers.overheads)

            def launch_row(ts, name=name):
                return [{"kind": "launch", "params": {"op": name, "ops": LAUNCH_OPS}, "work": float(LAUNCH_OPS),
                         "timing": ts[0].to_dict(), "metrics": {"host_s": ts[0].median_s / LAUNCH_OPS}}]

            self._add(f"launch {name} x{LAUNCH_OPS}", [fn], launch_row)

    def _attention(self) -> None:
        """Causal attention forward and forward + backward, at the plan's and the trial's dtype."""
        import torch
        import torch.nn.functional as F

        plan, device = self.plan, self.device
        attn_sets = [("attention", plan.attn_dtype, attention_points(plan)),
                     ("attention_trial", self.trial_dtype, attention_points(plan, trial=True))]
        for kind, adt, points in attn_sets:
            adtype = getattr(torch, DTYPES[adt])
            for d, s in points:
                q, k, v = (torch.randn(1, plan.attn_heads, s, d, device=device, dtype=adtype, requires_grad=True)
                           for _ in range(3))
                grad = torch.randn(1, plan.attn_heads, s, d, device=device, dtype=adtype)

                out_holder: dict = {}

                def fwd(q=q, k=k, v=v, out_holder=out_holder):
                    # With autograd on, as in training (the kernel keeps what backward needs).
                    out_holder["o"] = F.scaled_dot_product_attention(q, k, v, is_causal=True)

                def fwd_bwd(q=q, k=k, v=v, grad=grad):
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    o.backward(grad)
                    q.grad = k.grad = v.grad = None

                def attn_row(ts, d=d, s=s, kind=kind, adt=adt):
                    tf, tfb = ts
                    f_fwd, f_bwd = attention_flops(1, plan.attn_heads, s, d)
                    bwd_s = max(tfb.median_s - tf.median_s, 1e-9)
                    params = {"dtype": adt, "batch": 1, "heads": plan.attn_heads, "seq": s, "head_dim": d}
                    return [{"kind": f"{kind}_fwd", "params": params, "work": f_fwd, "timing": tf.to_dict(),
                             "metrics": {"flops": f_fwd, "flops_per_s": f_fwd / tf.median_s}},
                            {"kind": f"{kind}_fwd_bwd", "params": params, "work": f_fwd + f_bwd,
                             "timing": tfb.to_dict(),
                             "metrics": {"flops": f_fwd + f_bwd, "flops_per_s": (f_fwd + f_bwd) / tfb.median_s,
                                         "bwd_s": bwd_s, "bwd_flops_per_s": f_bwd / bwd_s}}]

                self._add(f"{kind} {adt} d={d} s={s}", [fwd, fwd_bwd], attn_row)

    def _attention_cpu(self) -> None:
        """CPU: SDPA calls as the runtime makes them (q, k, v views of a [batch, seq, heads, head_dim]
        projection), forward and forward + backward, for ``attention_cpu`` (``cost/cpu_attention.py``)."""
        import torch
        import torch.nn.functional as F

        for dt, d, s, h in cpu_attention_points(self.plan, self.trial_dtype):
            adtype = getattr(torch, DTYPES[dt])
            q, k, v = (torch.randn(1, s, h, d, dtype=adtype).transpose(1, 2).requires_grad_() for _ in range(3))
            grad = torch.randn(1, h, s, d, dtype=adtype)

            def fwd(q=q, k=k, v=v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            def fwd_bwd(q=q, k=k, v=v, grad=grad):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
                q.grad = k.grad = v.grad = None

            def row(ts, dt=dt, d=d, s=s, h=h):
                tf, tfb = ts
                return [{"kind": "attention_cpu", "params": {"dtype": dt, "head_dim": d, "seq": s, "heads": h},
                         "work": float(s), "timing": tfb.to_dict(),
                         "metrics": {"fwd_s": tf.median_s, "bwd_s": max(tfb.median_s - tf.median_s, 1e-9)}}]

            self._add(f"attention cpu {dt} d={d} s={s} h={h}", [fwd, fwd_bwd], row)

    def _references(self, dtypes: list[str]) -> None:
        """CPU: the runtime's own block and head at a reference shape, in every precision measured."""
        import torch

        device = self.device
        # CPU: the runtime's own block and head at a reference shape, in every precision measured
        # (profilers/block_ref.py): what the kernels above cost inside a trial's eager autograd
        for dt in dtypes if ref_points(device) else ():
            for piece, mbs in ref_points(device):
                fwd_fn, fwd_bwd_fn = ref_calls(piece, mbs, device, getattr(torch, DTYPES[dt]))

                def ref_row(ts, dt=dt, piece=piece, mbs=mbs):
                    tf, tfb = ts
                    return [{"kind": "block_ref", "params": {"dtype": dt, "piece": piece, "mbs": mbs,
                                                             "shape": ref_shape()},
                             "work": float(mbs), "timing": tfb.to_dict(),
                             "metrics": {"fwd_s": tf.median_s, "bwd_s": max(tfb.median_s - tf.median_s, 1e-9)}}]

                self._add(f"reference {piece} {dt} mbs {mbs}", [fwd_fn, fwd_bwd_fn], ref_row)

    def _memory(self) -> None:
        """Copy bandwidth (and the device's memory capacity)."""
        import torch

        plan, device = self.plan, self.device
        src = torch.empty(plan.copy_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
        dst = torch.empty_like(src)

        def mem_row(ts):
            moved = 2.0 * plan.copy_bytes  # one read + one write per byte copied
            return [{"kind": "memory_copy", "params": {"bytes": plan.copy_bytes}, "work": moved,
                     "timing": ts[0].to_dict(),
                     "metrics": {"bandwidth_bytes_per_s": moved / ts[0].median_s, **memory_capacity(device)}}]

        self._add("memory", [lambda: dst.copy_(src)], mem_row)

    def round(self) -> None:
        for it in self.items:
            for m in it.meters:
                m.take(it.repeats, rewarm=it.rewarm)
            self.tick(it.label)

    def rows(self) -> list[dict]:
        return [r for it in self.items for r in it.row([m.timing() for m in it.meters])]


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


def run_compute(device: str, quick: bool, emu: SlowdownEmulator | None, tick: Progress,
                between: Callable[[], None] | None = None) -> list[dict]:
    """The whole sweep on its own (``between`` runs before each round, e.g. a barrier)."""
    sweep = ComputeSweep(device, quick, emu, tick)
    for _ in range(sweep.plan.rounds):
        if between is not None:
            between()
        sweep.round()
    return sweep.rows()


def compute_steps(device: str, quick: bool, dtypes: int | None = None) -> int:
    """How many progress ticks the sweep makes (for the progress bar's total): one per point per round."""
    plan = compute_plan(device, quick)
    n = len(plan.gemm_dtypes) if dtypes is None else dtypes
    calls = n * len(call_gemm_shapes(device)) + len(op_points(device)) + n * len(ref_points(device))
    attn = len(attention_points(plan)) + len(attention_points(plan, trial=True))
    attn += len(cpu_attention_points(plan, trial_dtype(device))) if not device.startswith("cuda") else 0
    return plan.rounds * (n * len(gemm_shapes(plan)) + calls + attn + 1)


def fit_attention(samples: list[dict], kind: str = "attention") -> dict:
    """The ``attention`` fit (docs/contracts.md "Profiles") of the ``{kind}_fwd`` / ``{kind}_fwd_bwd``
    samples ({} without them)."""
    attention: dict = {}
    fwd = [s for s in samples if s["kind"] == f"{kind}_fwd"]
    both = {(s["params"]["head_dim"], s["params"]["seq"]): s for s in samples if s["kind"] == f"{kind}_fwd_bwd"}
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
                     "flops": f"fwd = 2*batch*heads*seq^2*head_dim (causal), bwd = {ATTENTION_BWD_FLOPS:g} * fwd",
                     "bwd_flops_factor": ATTENTION_BWD_FLOPS,
                     "by_head_dim": by_hd}
    return attention


def fit_compute(samples: list[dict], unsupported: dict[str, str] | None = None) -> dict:
    """Fits of one rank's compute samples, in the shape docs/contracts.md "Profiles" documents;
    ``unsupported`` ({dtype: reason}, from ``dtype_support``) is kept as ``gemm_unsupported``."""
    gemm: dict[str, dict] = {}
    for dt in sorted({s["params"]["dtype"] for s in samples if s["kind"] == "gemm"}):
        pts = [s for s in samples if s["kind"] == "gemm" and s["params"]["dtype"] == dt]
        pts.sort(key=lambda s: s["work"])
        f = affine_fit([s["work"] for s in pts], [s["timing"]["median_s"] for s in pts])
        gemm[dt] = {"points": [[s["work"], s["metrics"]["flops_per_s"]] for s in pts],
                    "peak_flops_per_s": f["rate"], "overhead_s": f["alpha_s"], "r2": f["r2"],
                    "best_flops_per_s": max(s["metrics"]["flops_per_s"] for s in pts)}
    attention = fit_attention(samples)
    memory: dict = {}
    for s in samples:
        if s["kind"] == "memory_copy":
            memory = {k: s["metrics"][k] for k in ("capacity_bytes", "available_bytes", "bandwidth_bytes_per_s")}
    # attention_trial: at the trial dtype and shapes (CPU); attention_cpu: the SDPA price by kernel tiles
    return {"gemm": gemm, "gemm_unsupported": dict(unsupported or {}), "attention": attention, "memory": memory,
            "attention_trial": fit_attention(samples, "attention_trial"), "overheads": fit_overheads(samples, gemm),
            "block_ref": fit_block_ref(samples), "attention_cpu": fit_attention_cpu(samples)}


def fit_attention_cpu(samples: list[dict]) -> dict:
    """``attention_cpu`` (docs/contracts.md "Profiles"): per dtype and head dim, the forward and
    backward ``cost/cpu_attention.Line`` through the ``attention_cpu`` samples, with the points and
    the largest relative error of the fit on them ({} without samples)."""
    from autotune.cost.cpu_attention import fit_line, kernel_cells

    groups: dict[tuple[str, int], list[tuple[int, int, float, float]]] = {}
    for s in samples:
        if s["kind"] == "attention_cpu":
            p = s["params"]
            groups.setdefault((p["dtype"], int(p["head_dim"])), []).append(
                (int(p["seq"]), int(p["heads"]), s["metrics"]["fwd_s"], s["metrics"]["bwd_s"]))
    out: dict[str, dict] = {}
    for (dt, d), pts in sorted(groups.items()):
        entry: dict = {"points": [list(p) for p in sorted(pts)]}
        worst = 0.0
        for name, col in (("fwd", 2), ("bwd", 3)):
            cells = [(p[0], kernel_cells(p[0], p[0], True), p[1], p[col]) for p in pts]
            line = fit_line(cells)
            entry[name] = {"call_s": line.call_s, "head_s": line.head_s, "tok_s": line.tok_s, "cell_s": line.cell_s}
            worst = max([worst] + [abs(line.at(q, c, h) / t - 1) for q, c, h, t in cells])
        entry["max_rel_err"] = worst
        out.setdefault(dt, {})[str(d)] = entry
    return out
