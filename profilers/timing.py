"""Timing discipline for every micro-benchmark: warm-up, rounds of repeats, median and spread.

- Warm-up calls are run and thrown away (allocator, thread pool, gloo connection set-up, cuBLAS
  heuristics all happen on the first calls).
- Each repeat is timed on its own: CUDA events on GPU (``Event.elapsed_time`` measures the stream,
  not the host), ``time.perf_counter`` after a synchronisation on CPU.
- We report the median (robust to a preempted repeat on a shared machine) and the spread as the
  relative inter-quartile range ``(p75 - p25) / median``. A result whose spread exceeds
  ``max_spread`` gets one more round of repeats; if still above, it is kept but flagged
  ``unstable`` so the store and the CLI show it rather than hide it.
- An emulated slower device (``autotune.runtime.emulation``) idles after each repeat; the idle is part of
  the timed interval, so the figures are those of the emulated device.

Rounds (``Meter``): the profile sweeps take their repeats in several interleaved rounds over the
whole sweep rather than all at once per point, and report the **median of the round medians**. On a
shared machine the noise comes in bursts (another process takes a core for a few hundred ms, and
while it does a woken gloo thread waits for the next 4 ms scheduler tick); a burst then spoils one
round of every point instead of every repeat of one point, and a median over rounds discards it.
The spread is still the relative IQR of *all* repeats pooled, so a point that varies is flagged.

Clock (``Meter(clock=...)``): ``wall`` (``perf_counter``), ``cuda`` (events), or ``thread``: the
calling thread's CPU time (``time.thread_time``, CLOCK_THREAD_CPUTIME_ID). The CPU compute sweep
uses ``thread`` when the rank runs torch on one thread (every op then runs on the calling thread):
the time another process holds the core is not the device's, and on a shared 2-core machine it was
the main reason two profiles disagreed (bench_profile.py). The wall-clock median is kept next to it
(``wall_median_s``), so a profile taken on a loaded machine shows how loaded it was.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from autotune.runtime.emulation import SlowdownEmulator

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
    rounds: list[float] = field(default_factory=list)
    """Median of each round (``Meter``); ``median_s`` is their median. Empty for a single ``time_fn`` run."""
    per_round: list[int] = field(default_factory=list)
    """Repeats in each round, in order: ``samples`` is their concatenation."""
    clock: str = "wall"
    """What ``samples`` measure: ``wall``, ``cuda`` (events) or ``thread`` (the thread's CPU time)."""
    wall_median_s: float = 0.0
    """Median of the wall-clock time of the same repeats (equals ``median_s``'s clock unless ``thread``)."""

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


def median_of_rounds(rounds: list[list[float]], max_spread: float = DEFAULT_MAX_SPREAD, warmup: int = 0) -> Timing:
    """``median_s`` = median of the per-round medians; quartiles, spread and the flag from all repeats
    pooled (relative to that median), so a burst that spoils one round is discarded but still shows."""
    rounds = [r for r in rounds if r]
    if not rounds:
        raise ValueError("no samples")
    pooled = [x for r in rounds for x in r]
    meds = [statistics.median(r) for r in rounds]
    t = summarize(pooled, max_spread, warmup)
    t.median_s = statistics.median(meds)
    t.spread = (t.p75_s - t.p25_s) / t.median_s if t.median_s > 0 else 0.0
    t.unstable = t.spread > max_spread
    t.rounds = meds
    t.per_round = [len(r) for r in rounds]
    return t


class Meter:
    """Repeats of one benchmark point taken in rounds (see the module doc).

    ``warm(n)`` runs ``n`` untimed calls and returns the fastest one's seconds (an estimate of the
    call's cost for sizing the rounds); ``take(n)`` times one round of ``n`` calls after one untimed
    call (the other points of the sweep ran in between and evicted this one's operands from cache);
    ``timing()`` summarises every round so far. CPU: ``perf_counter`` around each call, ``sync``
    called before the clock is read; CUDA: events, as ``time_fn``.
    """

    def __init__(self, fn: Callable[[], object], *, device: str = "cpu",
                 emulator: SlowdownEmulator | None = None, sync: Callable[[], None] | None = None,
                 max_spread: float = DEFAULT_MAX_SPREAD, clock: str = "wall"):
        self.fn, self.device, self.emulator, self.sync, self.max_spread = fn, device, emulator, sync, max_spread
        self.cuda = _cuda_available(device)
        if clock not in ("wall", "thread"):
            raise ValueError(f"clock must be wall or thread, got {clock!r}")
        self.clock = "cuda" if self.cuda else clock
        self.warmup = 0
        self._rounds: list[list[float]] = []
        self._idle: list[float] = []
        self._wall: list[float] = []

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        elif self.sync is not None:
            self.sync()

    def _once(self) -> float:
        """Seconds of one call on this meter's clock (the wall time of it goes to ``_last_wall``)."""
        if self.clock == "thread":
            w0, c0 = time.perf_counter(), time.thread_time()
            self.fn()
            self._sync()
            c1, w1 = time.thread_time(), time.perf_counter()
            self._last_wall = w1 - w0
            return c1 - c0
        if self.cuda:
            import torch

            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            self.fn()
            end.record()
            end.synchronize()
            self._last_wall = start.elapsed_time(end) / 1e3  # ms -> s
            return self._last_wall
        t0 = time.perf_counter()
        self.fn()
        self._sync()
        self._last_wall = time.perf_counter() - t0
        return self._last_wall

    def warm(self, n: int) -> float:
        best = float("inf")
        for _ in range(n):
            best = min(best, self._once())
        self.warmup += n
        return best if n else 0.0

    def take(self, n: int, rewarm: bool = True) -> list[float]:
        if rewarm:
            self._once()
        out = []
        for _ in range(n):
            kernel = self._once()
            extra = self.emulator.after(kernel) if self.emulator is not None else 0.0
            out.append(kernel + extra)
            self._wall.append(self._last_wall + extra)
            self._idle.append(extra)
        self._rounds.append(out)
        return out

    def timing(self) -> Timing:
        t = median_of_rounds(self._rounds, self.max_spread, self.warmup)
        t.emulated_s = statistics.median(self._idle) if self._idle else 0.0
        t.clock = self.clock
        t.wall_median_s = statistics.median(self._wall) if self._wall else t.median_s
        return t


def repeats_for(call_s: float, target_s: float, lo: int, hi: int) -> int:
    """Repeats per round so that a round of a point lasts about ``target_s``: many for calls of
    microseconds (each repeat is cheap and noisy), at least ``lo`` for slow ones."""
    if not call_s or call_s <= 0:
        return hi
    return max(lo, min(hi, int(round(target_s / call_s))))
