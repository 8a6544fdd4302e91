"""``apply --launch``: the torchrun command of each node that runs a plan with autotune's own runtime,
and running one of them here.

The printed line is the command: a dry run prints it and writes nothing; a real launch runs that
very text through ``bash -c``, so the two cannot drift apart. Everything the ranks need travels on
the line itself (the trial as JSON, shell-quoted), so nothing has to be copied to the nodes first.

Several nodes meet through torchrun's c10d rendezvous at ``"${MASTER_ADDR}":"${MASTER_PORT:-29500}"``
(double quotes: the shell expands the variables, the host of node-rank 0 and a free port there;
``${MASTER_ADDR:?...}`` stops with a message where it is unset). c10d numbers the nodes in the order they join, but the study's
cluster decides which node holds which ranks: each line carries ``--node-rank K`` for our entry
(``python -m autotune.runtime.launcher``), which makes local rank ``j`` of that node the global rank
``K * nproc + j`` (autotune.runtime.launcher.torchrun_main). The plan's placement says which
physical device holds each rank, so node-rank ``k`` gets the ranks ``[k*n, (k+1)*n)`` and, on
GPUs, ``CUDA_VISIBLE_DEVICES`` listing the placed devices in local rank order. A placement that
does not give every node a contiguous block of ranks cannot be launched this way and is refused.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.errors import InputError, WorkError
from autotune.export.common import ExportContext, node_blocks
from autotune.plan import Plan

ENTRY_MODULE = "autotune.runtime.launcher"
DEFAULT_PORT = 29500
ADDR_REF = '"${MASTER_ADDR:?set MASTER_ADDR to the host of node-rank 0}"'
"""How a line names the rendezvous host: a shell variable each node sets, expanded by the shell."""
PORT_REF = f'"${{MASTER_PORT:-{DEFAULT_PORT}}}"'
"""and its port: ``MASTER_PORT`` where set, else torchrun's default."""


@dataclass
class NodeCommand:
    node: int
    """Physical node index (cluster order)."""
    node_rank: int
    argv: list[str]
    """The command's words; ``ENDPOINT`` stands for the rendezvous host and port (see ``shell``)."""
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """The line a user pastes: every word shell-quoted except the rendezvous host variable."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + " ".join(_word(a) for a in self.argv)


def _word(arg: str) -> str:
    if arg != ENDPOINT:
        return shlex.quote(arg)
    return f"{ADDR_REF}:{PORT_REF}"


ENDPOINT = "{addr}:{port}"
"""The rendezvous endpoint word in ``argv``; ``shell`` writes it with the two variables."""


def commands(plan: Plan, ctx: ExportContext, out: str | Path, *, steps: int = 5, warmup: int = 2, seed: int = 0,
             timeout_s: float = 600.0, run_id: str = "autotune", data: dict[str, Any] | None = None) -> list[NodeCommand]:
    """One torchrun command per node the plan uses, in node-rank order. ``data``: a checked token
    file (autotune.runtime.data.prepare_data), found at the same path on every host."""
    blocks, why = node_blocks(plan)
    if why:
        raise InputError(f"cannot launch with torchrun: {why}", field="placement")
    nproc = len(blocks[0][1])
    gpu = any(getattr(g.device, "kind", "cpu") != "cpu" for g in getattr(ctx.cluster, "groups", ()))
    trial = json.dumps({**payload(plan, ctx, steps=steps, warmup=warmup, seed=seed, timeout_s=timeout_s),
                        **({"data": data} if data else {})}, separators=(",", ":"), sort_keys=True)
    out_cmds = []
    for k, (node, devs) in enumerate(blocks):
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devs))} if gpu and (
            len(blocks) > 1 or devs != list(range(nproc))) else {}
        if len(blocks) == 1:
            rdzv = ["--standalone", "--nnodes", "1"]
        else:
            rdzv = ["--nnodes", str(len(blocks)), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", ENDPOINT, "--rdzv-id", run_id]
        out_cmds.append(NodeCommand(node=node, node_rank=k, env=env, argv=[
            "torchrun", *rdzv, "--nproc-per-node", str(nproc), "-m", ENTRY_MODULE,
            "--node-rank", str(k), "--out", str(out), "--trial", trial]))
    return out_cmds


def payload(plan: Plan, ctx: ExportContext, *, steps: int, warmup: int, seed: int, timeout_s: float) -> dict[str, Any]:
    """The runtime's trial payload (the same keys ``autotune.runtime.trial.run_trial`` sends)."""
    return {"plan": plan.replace(placement=None).to_dict(), "model": ctx.model.to_dict(), "seq_len": ctx.seq_len,
            "global_batch": ctx.global_batch, "steps": steps, "warmup": warmup, "seed": seed,
            "emulate_slowdown": {}, "timeout_s": timeout_s}


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
        timeout_s: float, nodes: int = 1) -> dict[str, Any]:
    """Run one node's printed line here (``bash -c``) and summarise the ranks' reports as ``trial``
    does (step time: median over measured steps of the slowest rank's time; with several nodes,
    this node's ranks, which wait for the others at every step's closing barrier)."""
    from autotune.runtime.launcher import read_results

    n = world // nodes
    mine = range(cmd.node_rank * n, (cmd.node_rank + 1) * n)
    out.mkdir(parents=True, exist_ok=True)
    for r in mine:  # this node's earlier results; another node may share the folder
        for f in (out / f"result-{r}.pt", out / f"failure-{r}.pt"):
            f.unlink(missing_ok=True)
    # this environment's torchrun; its ranks watch their agent, so a killed torchrun leaves none behind
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    proc = _run_line(cmd.shell(), env, out, mine, timeout_s + 60, cmd.node)
    res = read_results(out, world, ranks=mine)
    if res.failure is not None:
        f = res.failure
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or ["no output"]
        raise WorkError(f"node {cmd.node} (node-rank {cmd.node_rank}): torchrun exited with code {proc.returncode}; "
                        f"rank {f['rank']} failed ({f['kind']}): {f['message']}"
                        + ("" if "left no result" not in f["message"] else f"; last line: {tail[0]}"))
    reports = sorted(res.results or [], key=lambda r: r["rank"])
    per_step = [max(rep["step_times"][i] for rep in reports) for i in range(steps)]
    step = statistics.median(per_step)
    return {"returncode": proc.returncode, "node": cmd.node, "node_rank": cmd.node_rank,
            "ranks": [rep["rank"] for rep in reports], "step_time_s": step,
            "tokens_per_s": global_batch * seq_len / step if step > 0 else 0.0,
            "peak_memory_bytes": [rep["peak_memory_bytes"] for rep in reports],
            "losses": reports[0]["losses"]}


AGENT_GRACE_S = 15.0
"""How long torchrun may take to exit once every rank of this node has reported: an agent whose
rendezvous store lived on a host that died can wait minutes for it; the result is known by then."""


def _run_line(line: str, env: dict[str, str], out: Path, mine: range, limit_s: float,
              node: int) -> subprocess.CompletedProcess:
    """``bash -c line`` in a session of its own, ended (with its torchrun agent; the ranks watch their
    agent and follow it) at ``limit_s``, on Ctrl-C, or ``AGENT_GRACE_S`` after every rank of this
    node has left a result or a failure."""
    import signal
    import tempfile
    import time

    logs = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # a pipe left unread could fill up
    proc = subprocess.Popen(["bash", "-c", line], env=env, stdout=logs[0], stderr=logs[1], text=True,
                            start_new_session=True)
    end, reported_at = time.monotonic() + limit_s, None
    try:
        while proc.poll() is None:
            if reported_at is None and all((out / f"result-{r}.pt").exists() or (out / f"failure-{r}.pt").exists()
                                           for r in mine):
                reported_at = time.monotonic()
            if time.monotonic() > end:
                raise WorkError(f"node {node}: torchrun did not finish within {limit_s:g} s")
            if reported_at is not None and time.monotonic() - reported_at > AGENT_GRACE_S:
                break
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()
    texts = []
    for f in logs:
        f.seek(0)
        texts.append(f.read())
        f.close()
    return subprocess.CompletedProcess(proc.args, proc.returncode, texts[0], texts[1])
