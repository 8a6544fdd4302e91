"""Timing discipline for every micro-benchmark: warm-up, repeats, median and spread.

- Warm-up calls are run and thrown away (allocator, thread pool, gloo connection set-up, cuBLAS
  heuristics all happen on the first calls).
- Each repeat is timed on its own: CUDA events on GPU (``Event.elapsed_time`` measures the stream,
  not the host), ``time.perf_counter`` after a synchronisation on CPU.
- We report the median (robust to a preempted repeat on a shared machine) and the spread as the
  relative inter-quartile range ``(p75 - p25) / median``. A result whose spread exceeds
  ``max_spread`` gets one more round of repeats; if still above, it is kept but flagged
  ``unstable`` so the store and the CLI show it rather than hide it.
- An emulated slower device (``profilers.emulation``) idles after each repeat; the idle is part of
  the timed interval, so the figures are those of the emulated device.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from profilers.emulation import SlowdownEmulator

DEFAULT_MAX_SPREAD = 0.10


@dataclass
class Timing:
    """Seconds per call of one benchmark point."""

    samples: list[float] = field(default_factory=list)
    warmup: int = 0
    median_s: float = 0.0
    p25_s: float = 0.0
    p75_s: float = 0.0
    min_s: float = 0.0
    max_s: float = 0.0
    spread: float = 0.0
    """Relative inter-quartile range (p75 - p25) / median."""
    unstable: bool = False
    emulated_s: float = 0.0
    """Idle time added per call by the slowdown emulator (median), included in ``median_s``."""

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(samples: list[float], max_spread: float = DEFAULT_MAX_SPREAD, warmup: int = 0) -> Timing:
    """Median, quartiles and relative IQR of ``samples`` (statistics.quantiles, 'inclusive' method)."""
    if not samples:
        raise ValueError("no samples")
    s = sorted(samples)
    med = statistics.median(s)
    if len(s) >= 2:
        q = statistics.quantiles(s, n=4, method="inclusive")
        p25, p75 = q[0], q[2]
    else:
        p25 = p75 = s[0]
    spread = (p75 - p25) / med if med > 0 else 0.0
    return Timing(samples=list(samples), warmup=warmup, median_s=med, p25_s=p25, p75_s=p75, min_s=s[0],
                  max_s=s[-1], spread=spread, unstable=spread > max_spread)


def _cuda_available(device: str) -> bool:
    return device.startswith("cuda")


def time_fn(fn: Callable[[], object], *, device: str = "cpu", warmup: int = 2, repeats: int = 5,
            max_spread: float = DEFAULT_MAX_SPREAD, retry: bool = True,
            emulator: SlowdownEmulator | None = None, sync: Callable[[], None] | None = None) -> Timing:
    """Time ``fn`` ``repeats`` times after ``warmup`` untimed calls.

    ``sync`` is called before each clock read on CPU (e.g. a barrier-free no-op for compute, or
    nothing for blocking gloo calls); on CUDA the stream is synchronised and events are used.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    cuda = _cuda_available(device)
    if cuda:
        import torch

        def sync_dev() -> None:
            torch.cuda.synchronize()
    else:
        def sync_dev() -> None:
            if sync is not None:
                sync()

    for _ in range(warmup):
        fn()
    sync_dev()

    def one_round(n: int) -> tuple[list[float], list[float]]:
        out, idle = [], []
        for _ in range(n):
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                kernel = start.elapsed_time(end) / 1e3  # ms -> s
            else:
                t0 = time.perf_counter()
                fn()
                sync_dev()
                kernel = time.perf_counter() - t0
            extra = emulator.after(kernel) if emulator is not None else 0.0
            out.append(kernel + extra)
            idle.append(extra)
        return out, idle

    samples, idle = one_round(repeats)
    t = summarize(samples, max_spread, warmup)
    if t.unstable and retry:
        more, more_idle = one_round(repeats)
        samples += more
        idle += more_idle
        t = summarize(samples, max_spread, warmup)
    t.emulated_s = statistics.median(idle) if idle else 0.0
    return t
