"""``apply --launch``: the torchrun command that runs a plan with autotune's own runtime worker
(``python -m autotune.runtime.worker --job JOB --out DIR``, autotune/runtime/worker.py), and running it.

torchrun numbers ranks node by node: node-rank ``k`` with ``n`` processes holds global ranks
``[k*n, (k+1)*n)``, local rank ``j`` being global ``k*n + j``. The plan's placement says which
physical device holds each mesh rank, so the command for the node that holds ranks ``[k*n, ...)``
gets ``--node-rank k`` and, on GPUs, ``CUDA_VISIBLE_DEVICES`` listing the placed devices in local
rank order (the worker binds local rank j to visible device j). A placement that does not give
every node a contiguous block of ranks cannot be launched this way and is refused.

The job file and the results are the runtime's (``autotune.runtime.launcher.write_job`` /
``read_results``); under torchrun the worker initialises the process group from torchrun's environment.
"""

from __future__ import annotations

import os
import shlex
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.errors import InputError, WorkError
from autotune.export.common import ExportContext, node_blocks
from autotune.plan import Plan

WORKER_MODULE = "autotune.runtime.worker"
TRIAL_TARGET = "autotune.runtime.worker:trial_job"
DEFAULT_PORT = 29500


@dataclass
class NodeCommand:
    node: int
    """Physical node index (cluster order)."""
    node_rank: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + " ".join(shlex.quote(a) for a in self.argv)


def torchrun_argv() -> list[str]:
    """``torchrun`` of this Python environment (its console script, else ``python -m torch.distributed.run``)."""
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def commands(plan: Plan, ctx: ExportContext, job: str | Path, out: str | Path, *,
             master_addr: str | None = None, master_port: int = DEFAULT_PORT) -> list[NodeCommand]:
    """One torchrun command per node the plan uses, in node-rank order."""
    blocks, why = node_blocks(plan)
    if why:
        raise InputError(f"cannot launch with torchrun: {why}", field="placement")
    nproc = len(blocks[0][1])
    gpu = any(getattr(g.device, "kind", "cpu") != "cpu" for g in getattr(ctx.cluster, "groups", ()))
    tail = ["-m", WORKER_MODULE, "--job", str(job), "--out", str(out)]
    if len(blocks) == 1:
        node, devs = blocks[0]
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devs))} if gpu and devs != list(range(nproc)) else {}
        return [NodeCommand(node=node, node_rank=0, env=env,
                            argv=[*torchrun_argv(), "--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc),
                                  *tail])]
    addr = master_addr or os.environ.get("MASTER_ADDR") or "$MASTER_ADDR"
    out_cmds = []
    for k, (node, devs) in enumerate(blocks):
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devs))} if gpu else {}
        out_cmds.append(NodeCommand(node=node, node_rank=k, env=env, argv=[
            "torchrun", "--nnodes", str(len(blocks)), "--node-rank", str(k), "--nproc-per-node", str(nproc),
            "--master-addr", addr, "--master-port", str(master_port), *tail]))
    return out_cmds


def payload(plan: Plan, ctx: ExportContext, *, steps: int, warmup: int, seed: int, timeout_s: float) -> dict[str, Any]:
    """The runtime's trial payload (the same keys ``autotune.runtime.trial.run_trial`` sends)."""
    return {"plan": plan.replace(placement=None).to_dict(), "model": ctx.model.to_dict(), "seq_len": ctx.seq_len,
            "global_batch": ctx.global_batch, "steps": steps, "warmup": warmup, "seed": seed,
            "emulate_slowdown": {}, "timeout_s": timeout_s}


def write_job(path: Path, plan: Plan, ctx: ExportContext, *, steps: int = 5, warmup: int = 2, seed: int = 0,
              timeout_s: float = 600.0, device: str = "auto") -> None:
    """The runtime's torchrun job file (``autotune.runtime.launcher.write_job``), written all or nothing."""
    from autotune.runtime.launcher import write_job as runtime_write_job  # the runtime half: imports torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    runtime_write_job(tmp, TRIAL_TARGET, payload(plan, ctx, steps=steps, warmup=warmup, seed=seed,
                                                 timeout_s=timeout_s), device=device, pg_timeout_s=timeout_s)
    os.replace(tmp, path)


def check_runnable(plan: Plan, ctx: ExportContext) -> Plan:
    """What the runtime can run, checked before anything starts (autotune.runtime.trial.prepare
    when the runtime is there; it re-resolves the plan on local workers)."""
    try:
        from autotune.runtime.trial import prepare
    except ImportError as exc:
        raise WorkError(f"the runtime is not available in this build: {exc}") from None
    resolved, _, _ = prepare(plan, ctx.model, ctx.seq_len, ctx.global_batch, nproc=plan.world)
    return resolved


def run(cmd: NodeCommand, out: Path, *, world: int, seq_len: int, global_batch: int, steps: int,
        timeout_s: float) -> dict[str, Any]:
    """Run one node's command here and summarise the ranks' reports as ``trial`` does (step time:
    median over measured steps of the slowest rank's time)."""
    from autotune.runtime.launcher import read_results

    out.mkdir(parents=True, exist_ok=True)
    for f in list(out.glob("result-*.pt")) + list(out.glob("failure-*.pt")):
        f.unlink()
    env = {**os.environ, **cmd.env}
    try:
        proc = subprocess.run(cmd.argv, env=env, capture_output=True, text=True, timeout=timeout_s + 60)
    except subprocess.TimeoutExpired:
        raise WorkError(f"torchrun did not finish within {timeout_s + 60:g} s") from None
    res = read_results(out, world)
    if res.failure is not None:
        f = res.failure
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or ["no output"]
        raise WorkError(f"torchrun exited with code {proc.returncode}; rank {f['rank']} failed ({f['kind']}): "
                        f"{f['message']}" + ("" if f["kind"] != "error" or "left no result" not in f["message"]
                                             else f"; last line: {tail[0]}"))
    reports = sorted(res.results or [], key=lambda r: r["rank"])
    per_step = [max(rep["step_times"][i] for rep in reports) for i in range(steps)]
    step = statistics.median(per_step)
    return {"returncode": proc.returncode, "step_time_s": step,
            "tokens_per_s": global_batch * seq_len / step if step > 0 else 0.0,
            "peak_memory_bytes": [rep["peak_memory_bytes"] for rep in reports],
            "losses": reports[0]["losses"]}
