"""Where a CPU profile's threads run: each rank on its own cores, gloo's socket loop by message size.

``pin_cores``: every thread of a rank on its own ``threads`` cores (the machine split into equal
workers, as the runtime runs it). Unpinned, a woken receiver often waited for the next 4 ms
scheduler tick behind another process, and small-message latency varied run to run.

``CommThreads``: gloo moves bytes on its own thread (``gloo_tcp_loop``: epoll, then read/write of
the sockets) and hands them to the calling thread. Measured here with two ranks on two cores
(1 MiB ping-pong one-way, 300 repeats, three fresh process pairs each):

- loop thread on its rank's own core: 0.3 ms or 2-4 ms, bimodal (the hand-over waits a scheduler
  tick about half the time), p90/p10 ~10, medians 0.35 to 0.97 ms from one run to the next;
- loop thread on the *next* rank's cores: 0.35-0.39 ms, p90/p10 ~1.7, medians within 10%; the
  collectives at 1-4 MiB likewise (all_reduce 1 MiB p90/p10 13 -> 1.5);
- but a message of up to 64 KiB (one write, one read) is faster and steadier on its own core
  (8 B one-way 52 vs 71 us): there is no hand-over to wait for, and the wake-up stays on one core.

So the loop thread sits on its own core for small messages and on the next rank's for large ones,
switched before each message size of the link sweep (one ``sched_setaffinity`` per loop thread,
only when the side changes). ``AUTOTUNE_PROFILE_PIN=own`` keeps it on its own core throughout,
``AUTOTUNE_PROFILE_PIN=0`` pins nothing (to compare, benchmarks/bench_profile.py).
"""

from __future__ import annotations

import os

PIN_ENV = "AUTOTUNE_PROFILE_PIN"
COMM_THREADS = ("gloo_tcp_loop",)
"""Names (``/proc/self/task/*/comm``) of the threads that move a rank's bytes."""
SMALL_BYTES = 1 << 16
"""Messages up to this size keep the loop thread on its rank's own core."""


def _block(allowed: list[int], index: int, threads: int) -> list[int]:
    return allowed[index * threads:(index + 1) * threads]


def pin_cores(local_rank: int, local_world: int, threads: int) -> list[int] | None:
    """Pin every thread of this process to cores ``[local_rank * threads, +threads)`` of the cores
    it may use; None (nothing pinned) when the ranks do not fit or ``AUTOTUNE_PROFILE_PIN=0``."""
    if os.environ.get(PIN_ENV, "1") == "0" or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if local_world * threads > len(allowed):
        return None
    mine = _block(allowed, local_rank, threads)
    os.sched_setaffinity(0, mine)  # threads started from now on inherit it
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = []
    for tid in tids:  # threads torch started already
        try:
            os.sched_setaffinity(tid, mine)
        except OSError:
            pass
    return mine


def _comm_tids() -> list[int]:
    out = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
                if f.read().strip() in COMM_THREADS:
                    out.append(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return out


class CommThreads:
    """This rank's gloo loop threads, moved by message size (module doc).

    ``allowed``: the cores this process could use before ``pin_cores``. Build it after every
    process group exists (each gloo group starts its own loop thread). ``for_size(n)`` puts them
    where a message of ``n`` bytes is measured best; it does nothing with one local rank, with
    unpinned ranks or with ``AUTOTUNE_PROFILE_PIN=own|0``.
    """

    def __init__(self, allowed: list[int], local_rank: int, local_world: int, threads: int):
        mode = os.environ.get(PIN_ENV, "1")
        fits = local_world >= 2 and local_world * threads <= len(allowed)
        self.active = fits and mode not in ("0", "own") and hasattr(os, "sched_setaffinity")
        self.own = _block(allowed, local_rank, threads) if fits else []
        self.next = _block(allowed, (local_rank + 1) % local_world, threads) if fits else []
        self.tids = _comm_tids() if self.active else []
        self.side = "own"

    def for_size(self, nbytes: int) -> None:
        side = "own" if nbytes <= SMALL_BYTES else "next"
        if not self.active or side == self.side:
            return
        cores = self.own if side == "own" else self.next
        for tid in self.tids:
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:  # a thread that ended (its group destroyed)
                pass
        self.side = side

    def describe(self) -> dict:
        """What the stored profile records about it."""
        return {"names": list(COMM_THREADS), "threads": len(self.tids), "small_bytes": SMALL_BYTES,
                "small_cores": self.own, "large_cores": self.next if self.active else self.own,
                "active": self.active}
