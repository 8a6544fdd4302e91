"""What a rank measures about itself while it trains: wall time inside torch.distributed calls
(``CommClock``, patched in this process only by ``install_comm_timing``), the stopwatches that time
regions (host time on CPU, CUDA events on GPU), the emulated slowdown of a slower device, and the
peak memory over a baseline. ``autotune/runtime/worker.py`` (the chain schedules' trainer) and
``autotune/runtime/helix.py`` (HelixPipe's) both read it.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import torch
import torch.distributed as dist

_COMM_FUNCS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single",
               "all_to_all_single", "all_to_all", "broadcast", "batch_isend_irecv", "send", "recv", "barrier")


class WallStopwatch:
    """Host time (CPU: an operator's work is done when its call returns). Spans are known at once."""

    deferred = False

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    @staticmethod
    def seconds(start: float, end: float) -> float:
        return end - start


class CudaStopwatch:
    """CUDA events recorded on the current (working) stream: a span is the stream's time between two
    points, read only after the step's one synchronisation (``CommClock.settle``), so nothing waits
    for the GPU inside the step and DDP bucket overlap and the CP ring's overlap really happen. A
    synchronous NCCL call makes the working stream wait for the NCCL stream, so its span is the
    communication the working stream sees (exposed); an async launch's span is ~0 and its ``wait``
    carries what the overlap did not hide."""

    deferred = True

    def __init__(self, event_type: Any = None) -> None:
        self.event_type = event_type or torch.cuda.Event

    def mark(self) -> Any:
        e = self.event_type(enable_timing=True)
        e.record()
        return e

    @staticmethod
    def seconds(start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3  # milliseconds


class CommClock:
    """Accumulates time inside communication calls and inside compute regions of one process."""

    def __init__(self) -> None:
        self.comm = 0.0
        self.compute = 0.0
        self.compute_cpu = 0.0
        """CPU seconds of this (main) thread in compute regions, communication inside them taken out:
        the clock ``profilers/layers.py`` times a layer with, so the two compare whatever else runs
        on the cores (a slice given to another process counts on the wall, not here)."""
        self.emulated = 0.0
        self.idle = 0.0
        self.slowdown = 1.0
        self._in_comm = False
        self._region_comm = 0.0
        self._region_comm_cpu = 0.0
        self._in_region = False
        self._region = 0
        self._comm_spans: list[tuple[Any, Any, int | None]] = []
        self._region_spans: list[tuple[Any, Any, int]] = []
        self.stopwatch: Any = WallStopwatch()
        """``WallStopwatch`` (CPU) or ``CudaStopwatch`` (CUDA: spans settled once per step)."""
        self.sync = _no_sync
        """Only for CUDA with an emulated slowdown: the emulation stands still on the host for a
        multiple of the measured compute, which needs that time at once, so regions and calls are
        then timed to completion with ``torch.cuda.synchronize``."""

    def reset(self) -> None:
        self.comm = self.compute = self.compute_cpu = self.emulated = self.idle = 0.0
        self._comm_spans, self._region_spans = [], []

    def wrap(self, fn):
        @functools.wraps(fn)
        def timed(*a, **k):
            if self._in_comm:
                return fn(*a, **k)
            self._in_comm = True
            self.sync()
            start = self.stopwatch.mark()
            cpu0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.sync()
                end = self.stopwatch.mark()
                if self._in_region:
                    self._region_comm_cpu += time.thread_time() - cpu0
                self._in_comm = False
                if self.stopwatch.deferred:
                    self._comm_spans.append((start, end, self._region if self._in_region else None))
                else:
                    dt = self.stopwatch.seconds(start, end)
                    self.comm += dt
                    if self._in_region:
                        self._region_comm += dt
        return timed

    def timed_call(self, fn, *a, **k):
        """Run ``fn`` timed as communication (waiting for an asynchronous collective)."""
        return self.wrap(fn)(*a, **k)

    @contextlib.contextmanager
    def compute_region(self):
        """Compute with the communication inside it taken out; then the emulated slowdown."""
        if self._in_region:  # nested (a chunk inside a timed step part): the outer region counts
            yield
            return
        self._in_region, self._region_comm, self._region_comm_cpu = True, 0.0, 0.0
        self._region += 1
        start = self.stopwatch.mark()
        cpu0 = time.thread_time()
        try:
            yield
        finally:
            self.sync()
            end = self.stopwatch.mark()
            self.compute_cpu += max(0.0, time.thread_time() - cpu0 - self._region_comm_cpu)
            self._in_region = False
            if self.stopwatch.deferred:
                self._region_spans.append((start, end, self._region))
            else:
                pure = max(0.0, self.stopwatch.seconds(start, end) - self._region_comm)
                self.compute += pure
                if self.slowdown > 1.0:
                    extra = (self.slowdown - 1.0) * pure
                    emulate_busy(extra)
                    self.emulated += extra

    def settle(self) -> None:
        """Turn the step's recorded spans into seconds (CUDA: after the step's synchronisation)."""
        inside: dict[int, float] = {}
        for start, end, region in self._comm_spans:
            dt = self.stopwatch.seconds(start, end)
            self.comm += dt
            if region is not None:
                inside[region] = inside.get(region, 0.0) + dt
        for start, end, region in self._region_spans:
            self.compute += max(0.0, self.stopwatch.seconds(start, end) - inside.get(region, 0.0))
        self._comm_spans, self._region_spans = [], []


def _no_sync() -> None:
    return None


def emulate_busy(seconds: float) -> None:
    """Stand still for ``seconds`` as a slower device would still be computing; the profiler's
    ``runtime.emulation`` is the profiler's too, so trial and profile emulate alike."""
    from autotune.runtime.emulation import emulate_delay

    emulate_delay(seconds)


_CLOCK = CommClock()
_INSTALLED = False


def clock() -> CommClock:
    """The process's clock (timing wrappers are installed by ``install_comm_timing``)."""
    return _CLOCK


def install_comm_timing() -> None:
    """Wrap torch.distributed's communication calls with the clock (worker processes only)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    for name in _COMM_FUNCS:
        if hasattr(dist, name):
            setattr(dist, name, _CLOCK.wrap(getattr(dist, name)))
    # the pipeline schedules wait for their p2p batches here (a torch without it fails loudly:
    # pipeline communication would otherwise go uncounted)
    from torch.distributed.pipelining import schedules

    schedules._wait_batch_p2p = _CLOCK.wrap(schedules._wait_batch_p2p)


# ---- memory -------------------------------------------------------------------------------------
def _proc_status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_memory(device: torch.device) -> int:
    """Start a peak-memory measurement; returns the baseline (bytes in use now), which the peak is
    reported over. CUDA: allocated bytes; CPU: the resident set, whose high-water mark ``VmHWM`` is
    reset to it by writing 5 to ``/proc/self/clear_refs`` (Linux)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_allocated(device))
    with contextlib.suppress(OSError):  # not Linux: the peak below is then the process's lifetime peak
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return _proc_status_bytes("VmRSS") or 0


def peak_memory(device: torch.device) -> int:
    """Absolute peak since ``reset_peak_memory`` (CUDA ``max_memory_allocated``; CPU ``VmHWM``)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
