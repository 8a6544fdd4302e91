"""What ZeRO-2 and ZeRO-3 add to a CPU step: FSDP2's own work on the calling thread, per step and per micro-batch.

The runtime shards ZeRO-2/3 with torch FSDP2 (``autotune/runtime/sharding.py``). Around the layers a
layer profile times, every rank then also runs, on its own thread: the all-gather's copy-in (the fp32
shard cast to the compute dtype) and copy-out into the unsharded parameters; per micro-batch, FSDP2's
pre/post forward and backward hooks and, with gradient sync off, the cast of every low-precision
gradient into its fp32 accumulator (an add after the first micro-batch); in the last backward the
reduce-scatter's copy-in and the shard's gradient; under ZeRO-3 the gathers again in every forward
and backward; and the optimizer step over DTensor shards. The link model prices the collectives'
transfers (gloo's own threads); none of the rest was priced, and on ``small`` in bf16 a ZeRO-2 step
took ~45 ms of CPU more than its prediction where the plain dp plans were within 5% (issue 25).

A one-rank FSDP2 skips the all-gather and its copies (torch short-cuts world size 1), so this runs
what a trial runs: two spawned processes on gloo, one thread each, the stage's whole model (all
layers, tp 1), micro-batches of one short sequence (the terms scale with the parameters, not with
the tokens, so the layers' own compute stays small). Rank 0 times on its thread clock (the gloo
threads' transfers and the waits for the other rank are not counted, as the layers are not):

* the plain module (compute dtype, no optimizer) forward and backward, ``n`` micro-batches;
* the same on the FSDP2-sharded module under ``ShardedOptimizer``'s protocol (sync off, then on
  in the last backward), for ZeRO-2 and ZeRO-3, and the optimizer step apart;

each at ``n`` = 1 and ``n`` = ``MICROBATCHES_HI`` in alternating rounds (the median of each). The
sharded forward/backward less the plain one is ``a + b n``: ``a`` the per-step work (the gathers kept
over the step, the reduce-scatter's copies), ``b`` the per-micro-batch work (hooks, fp32
accumulation, ZeRO-3's gathers). Both are stored per parameter of the stage (they move whole
parameters or gradients), the step's update per parameter of the shard (AdamW runs on the shards).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

ROUNDS = 5
"""Timed rounds (after one thrown away), each every configuration at both micro-batch counts."""
MICROBATCHES_HI = 3
"""The larger micro-batch count of the two timed (1 and this) that split per step from per micro-batch."""
WORLD = 2
"""Ranks of the measured gradient group: the smallest FSDP2 runs its all-gather and reduce-scatter on."""
SEQ = 8
"""Tokens per micro-batch (one sequence): FSDP2's work does not depend on them."""
TIMEOUT_S = 300.0


def _fwd_bwd(module: Any, tokens: Any) -> None:
    y = module(tokens)
    y.float().sum().backward()


def _build(model: Any, dtype: str, rank: int) -> tuple[Any, dict[int, tuple[Any, Any]], Any]:
    """(plain module in ``dtype``, {zero stage: (FSDP2-sharded module, its ShardedOptimizer)}, tokens):
    the stage as the worker builds it, every layer, tp 1, sharded over all ``WORLD`` ranks."""
    import torch
    import torch.distributed as dist

    from autotune.runtime.mesh import Axis
    from autotune.runtime.model import Block, Layout, StageModel, build_on_meta, materialize
    from autotune.runtime.optimizer import ShardedOptimizer
    from autotune.runtime.sharding import shard_stage_modules
    from profilers.layers import DTYPES

    compute = getattr(torch, DTYPES[dtype])
    group = dist.new_group(list(range(WORLD)))
    axis = Axis(size=WORLD, index=rank, ranks=list(range(WORLD)), group=group)
    layout = Layout(tp=Axis(size=1, index=0, ranks=[rank], group=None))

    def stage(dt: Any) -> Any:
        return materialize(build_on_meta(lambda: StageModel(model, layout, list(range(model.layers)), True, True,
                                                            SEQ)), model, 0, torch.device("cpu"), dt)

    sharded = {}
    for z in (2, 3):  # fp32 masters, computed in ``dtype``, as the worker builds them
        m = stage(torch.float32)
        roots = shard_stage_modules([m], Block, axis, z, compute, torch.device("cpu"))
        sharded[z] = (m, ShardedOptimizer(roots, list(m.parameters()), dtype=dtype, zero_stage=z))
    return stage(compute), sharded, torch.randint(0, model.vocab, (1, SEQ))


def _rounds(plain: Any, sharded: dict[int, tuple[Any, Any]], tokens: Any) -> dict[str, float]:
    """Medians over ``ROUNDS`` of each configuration's thread seconds (``terms``' keys)."""

    def plain_step(n: int) -> float:
        c = time.thread_time()
        for _ in range(n):
            _fwd_bwd(plain, tokens)
            for p in plain.parameters():
                p.grad = None
        return time.thread_time() - c

    def sharded_step(z: int, n: int) -> tuple[float, float]:
        m, opt = sharded[z]
        c = time.thread_time()
        opt.begin_step()
        for i in range(n):
            if i == n - 1:
                opt.before_last_backward()
            _fwd_bwd(m, tokens)
        fb = time.thread_time() - c
        c = time.thread_time()
        opt.reduce_and_step(None)
        return fb, time.thread_time() - c

    runs: dict[str, list[float]] = {}
    for r in range(ROUNDS + 1):
        for n in (1, MICROBATCHES_HI):
            got = {f"plain{n}": plain_step(n)}
            for z in (2, 3):
                got[f"z{z}_{n}"], got[f"z{z}_update{n}"] = sharded_step(z, n)
            if r:  # the first round allocates buffers and AdamW's states
                for k, v in got.items():
                    runs.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in runs.items()}


def _rank(rank: int, model: Any, dtype: str, store_path: str, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # one thread, as a trial's rank runs
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        plain, sharded, tokens = _build(model, dtype, rank)
        medians = _rounds(plain, sharded, tokens)  # every rank: the collectives pair up
        if rank == 0:
            out.put({"medians": medians, "params": sum(p.numel() for p in plain.parameters()),
                     "local": sum(p.to_local().numel() for p in sharded[2][0].parameters())})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def terms(medians: dict[str, float], params: int, local: int) -> dict[str, Any]:
    """The stored rates from the medians of one run (``measure_fsdp``'s keys): per ZeRO stage
    ``step_s_per_param`` and ``microbatch_s_per_param`` (of the stage's parameters; below zero, what
    noise gives where a term is too small to see, stored as 0) and ``update_s_per_param`` (of the
    shard's parameters)."""
    hi = MICROBATCHES_HI
    out: dict[str, Any] = {}
    for z in (2, 3):
        lo_over = medians[f"z{z}_1"] - medians["plain1"]
        hi_over = medians[f"z{z}_{hi}"] - medians[f"plain{hi}"]
        per_mb = (hi_over - lo_over) / (hi - 1)
        per_step = lo_over - per_mb
        update = statistics.median([medians[f"z{z}_update1"], medians[f"z{z}_update{hi}"]])
        out[str(z)] = {"step_s_per_param": max(per_step, 0.0) / params,
                       "microbatch_s_per_param": max(per_mb, 0.0) / params,
                       "update_s_per_param": update / local}
    return out


def _result(q: Any, procs: list[Any]) -> dict[str, Any]:
    """Rank 0's report; a rank that died, or no report within ``TIMEOUT_S``, is an error, at once."""
    import queue

    end = time.monotonic() + TIMEOUT_S
    while time.monotonic() < end:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"FSDP2 cost measurement: a rank exited with code {dead[0]}") from None
    raise RuntimeError(f"FSDP2 cost measurement: no result within {TIMEOUT_S:.0f} s")


def measure_fsdp(model: Any, dtype: str) -> dict[str, Any]:
    """{"2": {...}, "3": {...}, "params", "world", "clock", "rounds"}: ``terms`` of ``model``'s whole
    stage in ``dtype``, from ``WORLD`` spawned gloo ranks (seconds of rank 0's thread clock)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fsdp-costs-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, model, dtype, store, q), daemon=True) for r in range(WORLD)]
        for p in procs:
            p.start()
        try:
            got = _result(q, procs)
        finally:
            for p in procs:
                p.join(timeout=30.0)
                if p.is_alive():  # a rank stuck in a collective: this helper only, by its own handle
                    p.terminate()
                    p.join()
    return {**terms(got["medians"], got["params"], got["local"]), "params": got["params"], "world": WORLD,
            "clock": "thread", "rounds": ROUNDS, "medians_s": got["medians"]}
