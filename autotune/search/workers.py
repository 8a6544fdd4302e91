"""``--workers K``: K spawned processes run the sampler (or a slice of the grid) on one shared study.

Each worker has its own Workspace (its own batches and spill file) and pulls the others' trials
before each batch, so TPE learns from every process. Ctrl-C reaches the whole process group; the
parent also forwards SIGTERM to its own children, and each flushes what it has before it stops.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from autotune.errors import WorkError
from autotune.search.grid import run_grid
from autotune.search.options import SearchOptions, load_space
from autotune.search.phases import run_sampler
from autotune.search.pricing import Evaluator, default_estimator
from autotune.search.signals import request_stop
from autotune.search.spaces import build_space
from autotune.search.workspace import Workspace, make_sampler


def setup(model: Any, cluster: Any, seq_len: int, global_batch: int, opts: SearchOptions,
          estimator: Callable[..., Any] | None) -> tuple[Any, Any, Evaluator]:
    """The search context, the space built on it and an Evaluator (what every search process needs)."""
    from search_spaces.base import SearchContext

    ctx = SearchContext(model=model, cluster=cluster, seq_len=seq_len, global_batch=global_batch, dtype=opts.dtype,
                        target=opts.target, grad_reduce=opts.grad_reduce)
    space = build_space(load_space(opts.space), ctx, opts.space)
    return ctx, space, Evaluator(space, estimator or default_estimator(), target=opts.target)


def _to_monotonic(wall: float) -> float:
    return time.monotonic() + (wall - time.time())


def take_stop_signals() -> None:
    """A worker's handlers: SIGTERM and Ctrl-C ask it to flush and stop. A search started with Ctrl-C
    ignored (a background job: ``&``, nohup, some CI runners) keeps it ignored in its workers too, as
    the parent's Python does: else a group Ctrl-C stopped the workers while the parent went on and
    exited 0 without their trials."""
    signal.signal(signal.SIGTERM, request_stop)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # spawn's exec keeps an inherited ignore
        signal.signal(signal.SIGINT, request_stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by the parent around start()


def _worker(args: dict[str, Any]) -> None:
    """One of --workers K processes: the sampler (or a slice of the grid) on the shared study."""
    take_stop_signals()
    _ctx, space, ev = setup(args["model"], args["cluster"], args["seq_len"], args["global_batch"], args["opts"],
                            args["estimator"])
    opts: SearchOptions = args["opts"]
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ws = Workspace(args["name"], args["storage"], space.distributions(), make_sampler(opts.sampler, args["seed"]),
                   opts.batch_s, pull_each_batch=True)
    ev.prime(ws.rows)
    deadline = args["deadline_wall"] and _to_monotonic(args["deadline_wall"])
    try:
        if args.get("grid") is not None:
            g = args["grid"]
            points = itertools.islice(itertools.islice(space.grid_points(), g["limit"]), g["index"], None, g["of"])
            run_grid(ws, ev, points, deadline)
        else:
            run_sampler(ws, ev, args["n"], deadline)
    finally:
        ws.close()  # asked to stop or done: every finished trial is flushed


def _start(ctxm: Any, args: dict[str, Any]) -> Any:
    p = ctxm.Process(target=_worker, args=(args,), daemon=False)
    # The child inherits a blocked SIGINT (the mask survives fork and exec) and unblocks it once
    # _worker has its handler: a Ctrl-C while it imports then stops it cleanly, not in a traceback.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        p.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    return p


def run_workers(name: str, storage: str, model: Any, cluster: Any, seq_len: int, global_batch: int,
                opts: SearchOptions, estimator: Any, n_main: int, grid: dict | None, deadline: float | None) -> None:
    """Start ``opts.workers`` processes on study ``name`` and wait for them; a worker that fails is a
    WorkError (the trials every worker persisted are kept)."""
    ctxm = mp.get_context("spawn")
    k = opts.workers
    deadline_wall = time.time() + (deadline - time.monotonic()) if deadline else None
    procs = []
    for i in range(k):
        args = {"name": name, "storage": storage, "model": model, "cluster": cluster, "seq_len": seq_len,
                "global_batch": global_batch, "opts": opts, "estimator": estimator, "seed": opts.seed + 1 + i,
                "n": math.ceil(n_main / k), "grid": {**grid, "index": i, "of": k} if grid is not None else None,
                "deadline_wall": deadline_wall}
        procs.append(_start(ctxm, args))
    try:
        for p in procs:
            p.join()
    except KeyboardInterrupt:
        for p in procs:  # our own children: ask them to flush and stop
            if p.is_alive() and p.pid:
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            p.join(30)
        raise
    bad = [p.exitcode for p in procs if p.exitcode not in (0, None)]
    if bad:
        raise WorkError(f"{len(bad)} of {k} search workers exited with codes {bad}; their persisted trials are kept")
