"""The per-rank entry point of `autotune profile`.

Locally the CLI starts ``nproc`` ranks with ``torch.multiprocessing`` spawn (``launch_local``);
across nodes run ``torchrun --nnodes ... -m profilers.worker --out DIR [--storage URL]``, which
reads RANK/WORLD_SIZE/LOCAL_RANK from the environment. Either way each rank:

1. joins the process group (gloo on CPU, NCCL on CUDA) with a timeout, so a hung peer turns into
   an exception instead of a hang;
2. on CPU takes ``cores // nproc`` threads and, when the ranks fit, pins itself (every thread,
   gloo's too) to its own ``cores // nproc`` cores: the machine split into equal workers, as the
   runtime runs it. Pinning is what makes gloo's loopback latency repeatable on a loaded host:
   unpinned, a woken receiver often waited for the next 4 ms scheduler tick behind another
   process (one-way latency 2 ms instead of 50 us, run to run); pinned it preempts it
   (benchmarks/bench_profile.py; ``AUTOTUNE_PROFILE_PIN=0`` turns it off to compare). gloo's
   socket loop thread moves to the next rank's cores for large messages (profilers.placement);
3. warms every compute and link point, then alternates rounds of its own device's sweep
   (``profilers.compute``, all ranks concurrently) with rounds of the link sweep
   (``profilers.links``) between barriers, so a burst of background load spoils one round of
   each point, which the median of the round medians discards; records its hostname;
4. sends everything to rank 0 (``gather_object``), which writes ``result.json`` atomically.

Nothing touches the database here: the caller stores the whole profile in one transaction after
every rank has finished, so a rank that dies or hangs leaves the database as it was.

Test hook: ``AUTOTUNE_PROFILE_FAULT=die:R`` or ``hang:R`` makes rank R exit (code 17) or sleep
forever when the links phase starts (``die:R:compute`` at the compute phase).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

from autotune.runtime.emulation import SlowdownEmulator
from profilers.placement import CommThreads, pin_cores

FAULT_ENV = "AUTOTUNE_PROFILE_FAULT"
SCHEMA_VERSION = 1


def _fault_hook(rank: int):
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    parts = spec.split(":")
    kind, who = parts[0], int(parts[1]) if len(parts) > 1 else 0
    phase = parts[2] if len(parts) > 2 else "p2p"
    fired = [False]

    def hook(where: str) -> None:
        if rank != who or where != phase or fired[0]:
            return
        fired[0] = True
        if kind == "die":
            os._exit(17)
        if kind == "hang":
            while True:
                time.sleep(3600)

    return hook


def fingerprint(device: str) -> dict[str, Any]:
    """What the profile was measured on: host, CPU model, cores, memory, GPUs."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    fp: dict[str, Any] = {"hostname": socket.gethostname(), "machine": platform.machine(),
                          "system": platform.system(), "cpu_model": cpu, "cpu_count": os.cpu_count(),
                          "memory_bytes": float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))}
    if device.startswith("cuda"):
        import torch

        fp["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return fp


def versions() -> dict[str, Any]:
    import torch

    from autotune import __version__

    v: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "autotune": __version__,
                         "cuda": torch.version.cuda}
    try:
        v["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except (RuntimeError, AttributeError) as e:  # a CUDA build without NCCL: the profile records why
        v["nccl"] = f"unavailable: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
    return v


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return fingerprint("cpu")["cpu_model"] or platform.machine()


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


def over_budget(done: int, elapsed_s: float, last_round_s: float, budget_s: float) -> bool:
    """Stop before round ``done + 1`` when another round like the last would end past the budget,
    but never before ``MIN_ROUNDS`` rounds."""
    from profilers.compute import MIN_ROUNDS

    return done >= MIN_ROUNDS and elapsed_s + last_round_s > budget_s


def _collect(mine: dict[str, Any], rank: int, world: int, kind: str, device: str, cfg: dict[str, Any],
             t_start: float) -> dict[str, Any] | None:
    """Every rank's figures gathered on rank 0 into the run's result (written to ``cfg["out"]`` when
    given); None on the other ranks."""
    import torch.distributed as dist

    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    result = None
    if rank == 0:
        assert gathered is not None
        result = {"schema_version": SCHEMA_VERSION, "world": world, "device": kind, "quick": bool(cfg["quick"]),
                  "hosts": [g["host"] for g in gathered], "ranks": gathered, "fingerprint": fingerprint(device),
                  "versions": versions(), "measure_s": time.perf_counter() - t_start,
                  "emulated": {str(g["rank"]): g["emulated_slowdown"] for g in gathered if g["emulated_slowdown"]}}
        if cfg.get("out"):
            _write_json(Path(cfg["out"]) / "result.json", result)
    return result


def _rounds(comp: Any, link: Any, phases: dict[str, float], t_start: float, flag_device: str) -> None:
    """The measuring rounds, compute then links in each, until every sweep is done or the time
    budget is spent; their seconds and count go into ``phases``. ``flag_device``: where the stop
    flag is reduced (the rank's GPU under NCCL)."""
    import torch
    import torch.distributed as dist

    phases["compute_rounds_s"] = phases["link_rounds_s"] = 0.0
    rounds, last = 0, 0.0
    for r in range(max(comp.plan.rounds, link.plan.rounds if link else 0)):
        # Every rank must take the same number of rounds (the links pair up call by call), so the
        # time budget is decided together: stop when any rank would overrun it (this all_reduce is
        # also the round's barrier).
        over = over_budget(r, time.perf_counter() - t_start, last, comp.plan.budget_s)
        # on the rank's device: NCCL reduces CUDA tensors only (a CPU tensor fails the one-GPU profile)
        flag = torch.tensor([1.0 if over else 0.0], device=flag_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            break
        rounds += 1
        t_round = t_phase = time.perf_counter()
        if r < comp.plan.rounds:
            comp.round()
        phases["compute_rounds_s"] += time.perf_counter() - t_phase
        dist.barrier()
        t_phase = time.perf_counter()
        if link is not None and r < link.plan.rounds:
            link.round()
        phases["link_rounds_s"] += time.perf_counter() - t_phase
        last = time.perf_counter() - t_round
    phases["rounds"] = rounds


def run_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Measure this rank; returns the whole result on rank 0 (None elsewhere).

    Longer than a screen: the process group, the core pinning, the sweeps and the phase clock are set
    up in the order torch.distributed and the pinned comm threads need (``_rounds`` measures,
    ``_collect`` gathers)."""
    import torch
    import torch.distributed as dist

    from profilers.compute import ComputeSweep, compute_steps
    from profilers.links import LinkSweep, link_steps

    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    kind = cfg["device"]
    device = f"cuda:{local_rank}" if kind == "cuda" else "cpu"
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
    local_world = max(1, int(cfg.get("local_world", world)))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = int(cfg.get("threads") or max(1, cores // local_world))
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pinned = pin_cores(local_rank, local_world, threads) if kind == "cpu" else None
    torch.set_num_threads(threads)
    backend = "nccl" if kind == "cuda" else "gloo"
    t_start = time.perf_counter()
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=_dt.timedelta(seconds=float(cfg["timeout_s"])),
                            **({"device_id": torch.device(device)} if kind == "cuda" else {}))
    progress = Path(cfg["progress"]) if rank == 0 and cfg.get("progress") else None
    # compute_steps counts every dtype of the plan; corrected below to those this device measures.
    total = [compute_steps(device, cfg["quick"]) + link_steps(world, device, cfg["quick"])]
    done = [0]

    def tick(what: str) -> None:
        done[0] += 1
        if progress is not None:
            with open(progress, "a", encoding="utf-8") as f:
                f.write(f"{done[0]}\t{total[0]}\t{what}\n")

    fault = _fault_hook(rank)
    factor = float({int(k): v for k, v in (cfg.get("emulate") or {}).items()}.get(rank, 1.0))
    emu = SlowdownEmulator(factor) if factor > 1.0 else None
    if fault is not None:
        fault("compute")
    dist.barrier()
    phases = {"start_s": time.perf_counter() - t_start}
    t_phase = time.perf_counter()
    comp = ComputeSweep(device, cfg["quick"], emu, tick)
    link = LinkSweep(rank, world, device, cfg["quick"], tick, fault) if world > 1 else None
    # After every process group exists: each gloo group starts its own socket loop thread.
    comm = CommThreads(allowed, local_rank, local_world, threads) if pinned else None
    if link is not None and comm is not None:
        link.place = comm.for_size
    total[0] = comp.plan.rounds * len(comp.items) + link_steps(world, device, cfg["quick"])
    dist.barrier()
    phases["compute_warm_s"] = time.perf_counter() - t_phase
    if link is not None:
        link.warm()
    phases["link_warm_s"] = time.perf_counter() - t_phase - phases["compute_warm_s"]
    _rounds(comp, link, phases, t_start, device if kind == "cuda" else "cpu")
    compute = comp.rows()
    links = link.rows() if link is not None else []
    mine = {"rank": rank, "local_rank": local_rank, "host": socket.gethostname(), "device": device,
            "device_name": device_name(device), "threads": threads, "pinned_cores": pinned,
            "comm_threads": comm.describe() if comm is not None else None,
            "unsupported": comp.unsupported, "phases_s": phases,
            "emulated_slowdown": factor if factor > 1.0 else None,
            "emulated_s": emu.emulated_s if emu else 0.0, "compute": compute, "links": links}
    result = _collect(mine, rank, world, kind, device, cfg, t_start)
    dist.barrier()
    dist.destroy_process_group()
    return result


def _spawn_entry(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """multiprocessing (spawn) target: set the rendezvous, run, report an error to the parent in
    ``rank{R}.err``, exit without atexit noise."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(cfg["port"])
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        run_rank(rank, world, cfg)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which stops every rank
        import traceback

        err = Path(cfg["out"]) / f"rank{rank}.err"
        err.write_text(f"{traceback.format_exc()}\n{type(e).__name__}: {e}\n", encoding="utf-8")
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Clean exit without running interpreter teardown (torch-cpu-facts: aborts at exit otherwise).
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """``torchrun ... -m profilers.worker --out DIR``: one rank of a multi-node profile."""
    p = argparse.ArgumentParser(prog="python -m profilers.worker")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--storage", default=None, help="store the profile from rank 0 (one transaction)")
    p.add_argument("--label", default=None)
    p.add_argument("--emulate-slowdown", action="append", default=None)
    p.add_argument("--node-rank", type=int, default=None,
                   help="this node's place: its local rank j is rank K * nproc + j (default: torchrun's, "
                        "the order the nodes joined in)")
    a = p.parse_args(argv)
    from autotune.runtime.emulation import parse_slowdown

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.node_rank is not None:  # node-rank 0 gets rank 0, whichever host joined first
        rank = a.node_rank * int(os.environ["LOCAL_WORLD_SIZE"]) + int(os.environ["LOCAL_RANK"])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"device": a.device, "quick": a.quick, "timeout_s": a.timeout, "out": str(out),
           "emulate": {str(k): v for k, v in parse_slowdown(a.emulate_slowdown).items()},
           "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", world))}
    result = run_rank(rank, world, cfg)
    if rank == 0 and a.storage and result is not None:
        from profilers.store import save_profile

        pid = save_profile(result, a.storage, label=a.label, nproc=world)
        print(json.dumps({"id": pid}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
