"""Emulated heterogeneity: make one rank behave as a device FACTOR times slower.

After each measured kernel that took ``t`` seconds the rank idles ``(FACTOR - 1) * t`` more, so
from outside it looks like a device that needed ``FACTOR * t``. Idling (sleep) rather than spinning
keeps the shared cores free for the other ranks, which is what a slower *separate* device would do.
The runtime (issue 5) reuses ``emulate_delay`` and ``SlowdownEmulator`` so `trial` and `profile`
emulate alike; every result made with a factor > 1 is labelled ``emulated``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

# time.sleep overshoots by ~50-100 us on Linux; sleep until this close, then spin to the deadline.
_SPIN_S = 5e-4


def emulate_delay(seconds: float) -> None:
    """Idle for ``seconds`` (precise to ~10 us: sleep most of it, spin the last half millisecond)."""
    if not seconds or seconds <= 0 or not math.isfinite(seconds):
        return
    deadline = time.perf_counter() + seconds
    if seconds > _SPIN_S:
        time.sleep(seconds - _SPIN_S)
    while time.perf_counter() < deadline:
        pass


class SlowdownEmulator:
    """``SlowdownEmulator(2.0)``: after a kernel of ``t`` s, idle ``t`` s more.

    Use ``emu.after(elapsed_s)`` when you timed the kernel yourself, or ``with emu.kernel(sync):``
    around it (``sync`` is called before the clock is read, e.g. ``torch.cuda.synchronize``).
    ``emulated_s`` accumulates the idle time added, so a caller can report it separately.
    """

    def __init__(self, factor: float = 1.0):
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1.0):
            raise ValueError(f"slowdown factor must be a finite number >= 1, got {factor!r}")
        self.factor = float(factor)
        self.emulated_s = 0.0

    @property
    def active(self) -> bool:
        return self.factor > 1.0

    def extra(self, elapsed_s: float) -> float:
        """Idle time owed for a kernel of ``elapsed_s`` seconds."""
        return max(0.0, (self.factor - 1.0) * elapsed_s)

    def after(self, elapsed_s: float) -> float:
        """Idle for the extra time a kernel of ``elapsed_s`` owes; returns that extra time."""
        extra = self.extra(elapsed_s)
        if extra > 0:
            emulate_delay(extra)
            self.emulated_s += extra
        return extra

    @contextmanager
    def kernel(self, sync=None) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if sync is not None:
                sync()
            self.after(time.perf_counter() - t0)

    def __enter__(self) -> SlowdownEmulator:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.after(time.perf_counter() - self._t0)


def parse_slowdown(items: list[str] | None) -> dict[int, float]:
    """``["1=2.0"]`` -> ``{1: 2.0}`` (the CLI's ``--emulate-slowdown``); delegates to the shared parser."""
    return parse_emulation(items)


def parse_emulation(items: list[str] | None) -> dict[int, float]:
    """``["1=2.0"]`` -> {1: 2.0}; bad items are input errors naming the option."""
    from autotune.errors import InputError

    out: dict[int, float] = {}
    for item in items or []:
        rank, sep, factor = item.partition("=")
        try:
            r, f = int(rank), float(factor)
        except ValueError:
            r, f = -1, 0.0
        if not sep or r < 0 or not (f >= 1.0 and math.isfinite(f)):
            raise InputError(f"expected RANK=FACTOR with RANK >= 0 and FACTOR >= 1, got {item!r}",
                             field="--emulate-slowdown")
        out[r] = f
    return out
