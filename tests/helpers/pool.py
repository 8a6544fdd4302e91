"""Worker processes kept for the test session: the parity tests' launches of one world size run in ONE
set of workers, started once by ``autotune.runtime.launcher.launch`` and fed job after job.

Why: a launch pays, on every rank, the interpreter, torch's import and autotune's, dynamo's import at
the first meta-device operation and the process group's set-up, about 4-5 s of CPU a rank; the
parity modules (tests/distributed) launched about twenty times at worlds 2-8, most of them at 4.
What they compare is unchanged: each job is the same target with the same payload, run by the same
``worker_entry`` on a default process group of the same world, one job after another (the targets
already run many plans one after another in one process, with the process groups of a rank set
kept for the process: autotune.runtime.mesh).

A job that raises on a rank ends the pool as a failed launch ends (the launcher's supervisor stops
every rank), and the call returns that failure with its traceback; the next call starts a new pool.
At most ``KEEP`` pools are alive at a time (the least recently used one is closed): an idle rank
holds a few hundred MB. The pools close after the last test of tests/distributed (tests/conftest.py)
and at the interpreter's exit; their ranks also watch this process and exit if it disappears
(launcher._watch_parent)."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from autotune.runtime.launcher import LaunchResult, launch, resolve_target

KEEP = 2
"""Pools alive at once: worlds 2 and 4 serve most parity modules."""
POLL_S = 0.05
"""How often an idle rank looks for the next job, and the caller for the results (a stat a round: an
idle rank costs about nothing, a job of seconds waits 25 ms more on average)."""
SESSION_S = 24 * 3600.0
"""The pool's launch timeout and default group's timeout: a job has its own (``run``'s timeout_s)."""


def serve(payload: dict[str, Any], rank: int, world: int, device) -> dict[str, int]:
    """Launcher target of a pool's ranks: run ``job-N.pt`` of the pool's folder (a target and its
    payload, or None to stop) for N = 0, 1, ..., writing ``result-N-RANK.pt``. A job that raises
    ends the rank with it (worker_entry records it, the launcher stops the others)."""
    folder = Path(payload["dir"])
    (folder / f"pid-{rank}").write_text(str(os.getpid()))
    n = 0
    while True:
        job_file = folder / f"job-{n}.pt"
        while not job_file.exists():
            time.sleep(POLL_S)
        job = torch.load(job_file, weights_only=False)
        if job is None:
            return {"jobs": n}
        result = resolve_target(job["target"])(job["payload"], rank, world, device)
        _save(result, folder / f"result-{n}-{rank}.pt")
        n += 1


def _save(obj: Any, path: Path) -> None:
    """Written under another name, then renamed: a reader never loads half a file."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class WorkerPool:
    """``world`` ranks on this machine's CPU serving jobs in a background launch."""

    def __init__(self, world: int):
        self.world = world
        self.dir = Path(tempfile.mkdtemp(prefix="autotune-pool-"))
        self.jobs = 0
        self.ended: LaunchResult | None = None
        self.thread = threading.Thread(target=self._launch, daemon=True, name=f"pool-{world}")
        self.thread.start()

    def _launch(self) -> None:
        self.ended = launch("helpers.pool:serve", {"dir": str(self.dir)}, self.world, timeout_s=SESSION_S,
                            device="cpu")

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def run(self, target: str, payload: Any, timeout_s: float) -> LaunchResult:
        """``target(payload, rank, world, device)`` on every rank: their results, or the failure that
        ended the pool (a rank's exception, or this call's timeout)."""
        n = self.jobs
        self.jobs += 1
        _save({"target": target, "payload": payload}, self.dir / f"job-{n}.pt")
        files = [self.dir / f"result-{n}-{r}.pt" for r in range(self.world)]
        deadline = time.monotonic() + timeout_s
        while not all(f.exists() for f in files):
            if not self.alive:
                return self._failure()
            if time.monotonic() > deadline:
                self._kill()
                return LaunchResult(results=None, failure={
                    "kind": "timeout", "rank": None, "message": f"the job did not finish within {timeout_s:g} s"})
            time.sleep(POLL_S)
        results = [torch.load(f, weights_only=False) for f in files]
        for f in files:
            f.unlink()
        return LaunchResult(results=results)

    def _failure(self) -> LaunchResult:
        self.thread.join()
        ended = self.ended
        if ended is not None and ended.failure is not None:
            return ended
        return LaunchResult(results=None, failure={"kind": "error", "rank": None,
                                                   "message": f"the pool of {self.world} ended: {ended}"})

    def _kill(self) -> None:
        for f in self.dir.glob("pid-*"):
            try:
                os.kill(int(f.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        self.thread.join(30)

    def close(self) -> None:
        if self.alive:
            _save(None, self.dir / f"job-{self.jobs}.pt")
            self.thread.join(60)
            if self.alive:
                self._kill()
        shutil.rmtree(self.dir, ignore_errors=True)


_POOLS: dict[int, WorkerPool] = {}
"""Alive pools by world, least recently used first."""


def run_in_pool(target: str, payload: Any, world: int, *, timeout_s: float) -> LaunchResult:
    """``launch(target, payload, world, device="cpu")`` on the session's pool of ``world`` ranks."""
    pool = _POOLS.pop(world, None)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.close()
        while len(_POOLS) >= KEEP:
            _POOLS.pop(next(iter(_POOLS))).close()
        pool = WorkerPool(world)
    _POOLS[world] = pool
    return pool.run(target, payload, timeout_s)


@atexit.register
def close_all() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()
