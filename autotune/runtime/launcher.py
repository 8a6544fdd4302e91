"""Launch a world of local worker processes and bring back their results or the first failure.

Local launch uses ``torch.multiprocessing`` (spawn) on a free port, retried on a port clash (as
nanotron's test helper does); the same ``worker_entry`` runs under torchrun (``python -m
autotune.runtime.worker``), so a multi-node trial needs no other code. Every failure ends every
process of the launch: an exception in a rank is written to ``DIR/failure-RANK.pt`` and the rank
exits at once; the launcher then kills the rest after a short grace, or kills all at the timeout.
Children also watch their parent and exit if it disappears, so nothing is orphaned.

Failures are classified ``oom`` (torch.OutOfMemoryError, MemoryError, "out of memory", or a rank
killed by SIGKILL without a word, which is what the kernel's OOM killer does), ``timeout`` and
``error``; the reported one is the earliest by wall clock (later ones are usually "Connection closed
by peer" echoes of it).
"""

from __future__ import annotations

import datetime
import importlib
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PORT_CLASH = ("address already in use", "eaddrinuse", "errno 98")
GRACE_S = 3.0


@dataclass
class LaunchResult:
    results: list[Any] | None
    """Per-rank return values of the target (None when the launch failed)."""
    failure: dict[str, Any] | None = None
    """{"kind": oom|error|timeout, "rank": int|None, "message": str}"""
    wall_s: float = 0.0
    attempts: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def write_job(path: str | Path, target: str, payload: Any, *, device: str = "auto",
              pg_timeout_s: float = 600.0) -> Path:
    """A job file for torchrun: ``torchrun --nnodes N --nproc-per-node G ... -m autotune.runtime.worker
    --job JOB --out DIR`` runs ``target(payload, rank, world, device)`` on every rank and writes
    ``DIR/result-RANK.pt`` (or ``DIR/failure-RANK.pt``); ``read_results(DIR, world)`` collects them."""
    import torch

    path = Path(path)
    torch.save({"target": target, "payload": payload, "port": None, "device": device,
                "pg_timeout_s": pg_timeout_s}, path)
    return path


def read_results(out_dir: str | Path, world: int, ranks: range | None = None) -> LaunchResult:
    """Results (or the earliest failure) a torchrun launch left in ``out_dir``: of every rank, or of
    ``ranks`` (those of one node of a multi-node launch)."""
    import torch

    out = Path(out_dir)
    ranks = ranks if ranks is not None else range(world)
    failures = [torch.load(f, weights_only=False) for f in out.glob("failure-*.pt")]
    if failures:
        first = min(failures, key=lambda x: x["time"])
        return LaunchResult(results=None, failure={k: first[k] for k in ("kind", "rank", "message")},
                            extra={"time": first["time"]})  # the earliest across nodes is the one reported
    missing = [r for r in ranks if not (out / f"result-{r}.pt").exists()]
    if missing:
        return LaunchResult(results=None, failure={"kind": "error", "rank": missing[0],
                                                   "message": f"rank {missing[0]} left no result"})
    return LaunchResult(results=[torch.load(out / f"result-{r}.pt", weights_only=False) for r in ranks])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def classify(exc: BaseException) -> str:
    import torch

    text = str(exc).lower()
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in text:
        return "oom"
    return "error"


def _watch_parent(parent: int) -> None:
    """Exit when the launching process is gone (its pid is no longer our parent)."""
    def loop() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(1.0)
    threading.Thread(target=loop, daemon=True).start()


def resolve_target(target: str):
    mod, _, fn = target.partition(":")
    return getattr(importlib.import_module(mod), fn)


def worker_entry(local_rank: int, job_path: str | dict[str, Any], out_dir: str, *, rank: int, world: int,
                 init_from_env: bool = False, parent: int | None = None) -> None:
    """Body of every rank: init the group, run the target, write the result, exit cleanly. ``job``
    is a job file (torch.save) or the job itself."""
    if parent is not None:
        _watch_parent(parent)
    out = Path(out_dir)
    try:
        import torch
        import torch.distributed as dist

        job = job_path if isinstance(job_path, dict) else torch.load(job_path, weights_only=False)
        device = _pick_device(job.get("device", "auto"), local_rank)
        from autotune.runtime.mesh import backend_for

        timeout = datetime.timedelta(seconds=float(job.get("pg_timeout_s", 600)))
        if init_from_env:  # under torchrun: its rendezvous store, our rank numbering
            dist.init_process_group(backend_for(device), rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend_for(device), rank=rank, world_size=world, timeout=timeout,
                                    init_method=f"tcp://127.0.0.1:{job['port']}")
        result = resolve_target(job["target"])(job["payload"], rank, world, device)
        torch.save(result, out / f"result-{rank}.pt")
        # clean exit (shared/torch-cpu-facts.md): barrier, destroy, os._exit
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a result
        try:
            import torch

            kind = classify(exc)
            msg = f"{type(exc).__name__}: {exc}".strip().splitlines()
            torch.save({"kind": kind, "rank": rank, "message": msg[0][:500] if msg else type(exc).__name__,
                        "time": time.time(), "traceback": traceback.format_exc()[-4000:]},
                       out / f"failure-{rank}.pt")
        finally:
            os._exit(1)
    os._exit(0)


def _pick_device(device: str, local_rank: int):
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _spawn_main(local_rank: int, world: int, job_path: str, out_dir: str, parent: int, threads: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch

    torch.set_num_threads(threads)
    worker_entry(local_rank, job_path, out_dir, rank=local_rank, world=world, parent=parent)


def launch(target: str, payload: Any, world: int, *, timeout_s: float = 300.0, device: str = "auto",
           threads: int | None = None, retries: int = 3) -> LaunchResult:
    """Run ``target(payload, rank, world, device)`` on ``world`` local processes."""
    import torch
    import torch.multiprocessing as mp

    threads = threads or max(1, (os.cpu_count() or 1) // world)
    t_start = time.perf_counter()
    last: LaunchResult | None = None
    for attempt in range(1, retries + 1):
        tmp = Path(tempfile.mkdtemp(prefix="autotune-trial-"))
        try:
            job = {"target": target, "payload": payload, "port": free_port(), "device": device,
                   "pg_timeout_s": timeout_s}
            job_path = tmp / "job.pt"
            torch.save(job, job_path)
            ctx = mp.get_context("spawn")
            procs = [ctx.Process(target=_spawn_main, args=(r, world, str(job_path), str(tmp), os.getpid(), threads),
                                 daemon=False) for r in range(world)]
            for p in procs:
                p.start()
            last = _supervise(procs, tmp, world, timeout_s)
            last.attempts = attempt
            last.extra["pids"] = [p.pid for p in procs]
            if last.failure is None or not any(s in last.failure["message"].lower() for s in PORT_CLASH):
                break
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    assert last is not None
    last.wall_s = time.perf_counter() - t_start
    return last


def supervise(procs: list[Any], *, timeout_s: float, grace_s: float = GRACE_S,
              failed: Callable[[], bool] | None = None,
              poll: Callable[[], None] | None = None) -> tuple[bool, list[int | None]]:
    """The one process supervisor of autotune's launches (trials here, profiles in profilers.launch, the
    torchrun lines of `apply --launch` and of a validation across hosts in autotune.export.launch).

    Waits until every process has exited; or until one has failed (a non-zero exit code, or
    ``failed()`` says so, e.g. a failure file) and ``grace_s`` has passed for its peers to record
    what they saw; or until ``timeout_s``. Then ends every process still alive (``stop_all``), so
    nothing outlives the launch. ``poll`` runs on every round (progress). Returns whether the
    timeout ended it, and the exit codes as they were before anything was stopped (None: still
    running then), which tell the processes that failed by themselves from those ended here."""
    import multiprocessing.connection

    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    timed_out = False
    codes: list[int | None] = []
    try:
        while True:
            if poll is not None:
                poll()
            codes = [p.exitcode for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if failed_at is None and (any(c not in (None, 0) for c in codes) or (failed is not None and failed())):
                failed_at = now
            if failed_at is not None and now - failed_at > grace_s:
                break
            if now > deadline:
                timed_out = True
                break
            multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.05)
    finally:
        codes = [p.exitcode for p in procs]
        stop_all(procs)
    return timed_out, codes


def stop_all(procs: list[Any], grace_s: float = 3.0) -> None:
    """SIGTERM every process still alive, SIGKILL those that have not gone after ``grace_s``, reap all.
    ``procs``: multiprocessing processes, or anything with their ``pid``, ``exitcode``, ``sentinel``,
    ``terminate``, ``kill`` and ``join`` (autotune.export.launch.ShellLine: a node's torchrun line)."""
    procs = [p for p in procs if p.pid is not None]  # a failed start() leaves later ranks unstarted
    for p in procs:
        if p.exitcode is None:
            with _suppress():
                p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            with _suppress():
                p.kill()  # SIGKILL (a process; a ShellLine's whole session)
            p.join(5)


def _supervise(procs, tmp: Path, world: int, timeout_s: float) -> LaunchResult:
    import torch

    timed_out, codes = supervise(procs, timeout_s=timeout_s, failed=lambda: any(tmp.glob("failure-*.pt")))
    failures = []
    for f in tmp.glob("failure-*.pt"):
        with _suppress():
            failures.append(torch.load(f, weights_only=False))
    if failures:
        first = min(failures, key=lambda x: x["time"])
        return LaunchResult(results=None, failure={k: first[k] for k in ("kind", "rank", "message")},
                            extra={"traceback": first.get("traceback", "")})
    if timed_out:
        return LaunchResult(results=None, failure={"kind": "timeout", "rank": None,
                                                   "message": f"the trial did not finish within {timeout_s:g} s"})
    for r, code in enumerate(codes):  # a rank that died by itself, not one stopped here
        if code not in (0, None) and not (tmp / f"result-{r}.pt").exists():
            sig = -code if code < 0 else None
            kind = "oom" if sig == signal.SIGKILL else "error"
            why = f"killed by signal {sig}" + (" (likely the out-of-memory killer)" if kind == "oom" else "") \
                if sig else f"exited with code {code}"
            return LaunchResult(results=None, failure={"kind": kind, "rank": r, "message": f"rank {r} {why}"})
    results = []
    for r in range(world):
        path = tmp / f"result-{r}.pt"
        if not path.exists():
            return LaunchResult(results=None, failure={"kind": "error", "rank": r,
                                                       "message": f"rank {r} exited without a result"})
        results.append(torch.load(path, weights_only=False))
    return LaunchResult(results=results)


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return True


TRIAL_TARGET = "autotune.runtime.worker:trial_job"


def torchrun_main(argv: list[str] | None = None) -> None:
    """The entry ``apply --launch`` lines run under torchrun: ``torchrun ... -m autotune.runtime.launcher
    --node-rank K --out DIR --trial JSON``. The study's cluster, not the order in which c10d lets the
    nodes join, decides the ranks: local rank ``j`` of node-rank ``K`` is global rank ``K * nproc + j``."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m autotune.runtime.launcher")
    ap.add_argument("--node-rank", type=int, required=True, help="this node's place in the plan's node order")
    ap.add_argument("--out", required=True, help="directory for the per-rank results")
    ap.add_argument("--trial", required=True, help="the trial payload as JSON (autotune.export.launch.payload)")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    env = os.environ
    local_rank, nproc, world = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"]), int(env["WORLD_SIZE"])
    payload = json.loads(args.trial)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    job = {"target": TRIAL_TARGET, "payload": payload, "port": None, "device": args.device,
           "pg_timeout_s": float(payload.get("timeout_s", 600.0))}
    # the torchrun agent is our parent: a node whose agent is killed must not leave ranks behind
    worker_entry(local_rank, job, args.out, rank=args.node_rank * nproc + local_rank, world=world,
                 init_from_env=True, parent=os.getppid())


if __name__ == "__main__":
    torchrun_main()
