"""Time a CPU layer profile as a trial's rank runs: beside the other ranks, each doing the same work.

A local trial runs ``world`` ranks, one thread each, on the machine's cores at once; they share the
last-level cache, the memory bandwidth and whatever the host does with a busy socket. A layer
profile timed in one process, the other cores idle, sees none of it. ``twins(model, sweep, n)`` runs
``n`` helper processes that repeat the same sweep (same pieces, shapes and precision, one thread
each) while the caller times it, so what the caller measures (on its thread clock) is its share of
a machine busy with its own kind of work, as in the trial. On a machine already loaded by other
work the difference is small (the other cores were busy anyway: side by side at load 12, block and
head of ``small`` in bf16 at micro-batch 4 took 92.0 ms alone and 92.6 ms beside a twin); on a quiet
one it is the contention the trial's ranks cause each other.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections.abc import Iterator
from typing import Any

READY_TIMEOUT_S = 120.0
"""Seconds to wait for the helpers to build their pieces (imports, weights) before timing alone."""


def _twin(model: Any, sweep: Any, ready: Any, stop: Any) -> None:
    import torch

    from profilers.pieces import Piece

    torch.set_num_threads(1)
    from profilers.layers import DTYPES

    dtype = getattr(torch, DTYPES[sweep.dtype])
    pieces = [Piece(pc, model, t, b, s, "cpu", dtype, ep=e, etp=et) for pc, t, b, s, e, et in sweep.keys()]
    ready.release()
    while not stop.is_set():
        for p in pieces:
            p.fwd_bwd()
            if stop.is_set():
                return


def _wait_ready(procs: list[Any], ready: Any) -> int:
    """How many of ``procs`` said they are ready within ``READY_TIMEOUT_S``; a helper that died
    first (it cannot build its pieces) is not waited for."""
    up, deadline = 0, time.monotonic() + READY_TIMEOUT_S
    while up < len(procs) and time.monotonic() < deadline:
        if ready.acquire(timeout=0.5):
            up += 1
        elif up + sum(p.exitcode is not None for p in procs) >= len(procs):
            break
    return up


@contextlib.contextmanager
def twins(model: Any, sweep: Any, n: int) -> Iterator[int]:
    """Inside: ``n`` helper processes repeat ``sweep``'s pieces forward and backward (yields how many
    came up in time; 0 when ``n`` < 1). They are stopped and joined on the way out."""
    if n < 1:
        yield 0
        return
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Semaphore(0), ctx.Event()
    procs = [ctx.Process(target=_twin, args=(model, sweep, ready, stop), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    up = _wait_ready(procs, ready)
    try:
        yield up
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=30.0)
            if p.is_alive():  # a piece longer than the wait: this helper only, by its own handle
                p.terminate()
                p.join()
