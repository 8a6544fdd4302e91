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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.errors import InputError, WorkError
from autotune.export.common import ExportContext, node_blocks
from autotune.plan import Plan
from autotune.runtime.launcher import LaunchResult

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
    # a plan on a subset of a pool places ranks on the subset's nodes: name the pool's (its hosts)
    from autotune.specs.pool import pool_nodes

    physical = pool_nodes(ctx.cluster, plan.uses) if plan.uses is not None else None
    for k, (sub_node, devs) in enumerate(blocks):
        node = physical[sub_node] if physical is not None else sub_node
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
        timeout_s: float, nodes: int = 1, line: str | None = None, remote: list[RemoteLine] | None = None
        ) -> dict[str, Any]:
    """Run one node's printed line here (``bash -c``) and summarise the ranks' reports as ``trial``
    does (step time: median over measured steps of the slowest rank's time; with several nodes,
    this node's ranks, which wait for the others at every step's closing barrier). ``line``: the
    text to run instead of ``cmd.shell()`` (``--hosts``: with the rendezvous variables in front);
    ``remote``: the other nodes' lines, started from here through a remote shell (autotune.hostfile)."""
    res, proc = run_node(cmd, out, world=world, nodes=nodes, timeout_s=timeout_s, line=line, remote=remote)
    if res.failure is not None:
        raise WorkError(failure_text(cmd, res.failure, proc))
    reports = sorted(res.results or [], key=lambda r: r["rank"])
    per_step = [max(rep["step_times"][i] for rep in reports) for i in range(steps)]
    step = statistics.median(per_step)
    return {"returncode": proc.returncode, "node": cmd.node, "node_rank": cmd.node_rank,
            "ranks": [rep["rank"] for rep in reports], "step_time_s": step,
            "tokens_per_s": global_batch * seq_len / step if step > 0 else 0.0,
            "peak_memory_bytes": [rep["peak_memory_bytes"] for rep in reports],
            "losses": reports[0]["losses"], "grad_norms": reports[0]["grad_norms"]}


@dataclass(frozen=True)
class RemoteLine:
    """Another node's line, started from here (``--hosts``): it runs that node's ranks over there."""
    node: int
    node_rank: int
    host: str
    line: str


def failure_text(cmd: NodeCommand, failure: dict[str, Any], proc: subprocess.CompletedProcess) -> str:
    """The one line that says which node reports what."""
    tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or ["no output"]
    return (f"node {cmd.node} (node-rank {cmd.node_rank}): torchrun exited with code {proc.returncode}; "
            f"rank {failure['rank']} failed ({failure['kind']}): {failure['message']}"
            + ("" if "left no result" not in failure["message"] else f"; last line: {tail[0]}"))


def node_ranks(cmd: NodeCommand, world: int, nodes: int) -> range:
    n = world // nodes
    return range(cmd.node_rank * n, (cmd.node_rank + 1) * n)


def run_node(cmd: NodeCommand, out: Path, *, world: int, nodes: int, timeout_s: float, line: str | None = None,
             remote: list[RemoteLine] | None = None, poll: Callable[[], None] | None = None
             ) -> tuple[LaunchResult, subprocess.CompletedProcess]:
    """Run this node's line (and ``remote`` lines) until they end, and read this node's ranks'
    results or their earliest failure. ``poll`` runs every round (it raises to stop everything: a
    peer node that is gone). A remote line that fails by itself (an unreachable host) is the
    failure reported, naming its node and host."""
    from autotune.runtime.launcher import read_results

    mine = node_ranks(cmd, world, nodes)
    out.mkdir(parents=True, exist_ok=True)
    for r in mine:  # this node's earlier results; another node may share the folder
        for f in (out / f"result-{r}.pt", out / f"failure-{r}.pt"):
            f.unlink(missing_ok=True)
    # this environment's torchrun; its ranks watch their agent, so a killed torchrun leaves none behind
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    lines = [line or cmd.shell(), *(r.line for r in remote or [])]
    def reported() -> bool:
        return all((out / f"result-{r}.pt").exists() or (out / f"failure-{r}.pt").exists() for r in mine)

    procs, codes = run_lines(lines, env, timeout_s + 60, f"node {cmd.node}: torchrun", poll=poll, reported=reported)
    res = read_results(out, world, ranks=mine)
    for r, p, code in zip(remote or [], procs[1:], codes[1:], strict=True):
        if code not in (0, None):
            last = (p.stderr or p.stdout or "").strip().splitlines()[-1:] or ["no output"]
            raise WorkError(f"node {r.node} (node-rank {r.node_rank}, host {r.host}): its line exited with code "
                            f"{code}; last line: {last[0]}")
    return res, procs[0]


AGENT_GRACE_S = 15.0
"""How long torchrun may take to exit once every rank of this node has reported: an agent whose
rendezvous store lived on a host that died can wait minutes for it; the result is known by then."""


class ShellLine:
    """``bash -c LINE`` in a session of its own, seen as ``launcher.supervise`` sees a process: the
    session (bash, torchrun; the ranks watch torchrun and follow it) is what ``terminate``/``kill`` end."""

    def __init__(self, line: str, env: dict[str, str]):
        import tempfile

        self.logs = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # a pipe left unread could fill
        self.popen = subprocess.Popen(["bash", "-c", line], env=env, stdout=self.logs[0], stderr=self.logs[1],
                                      text=True, start_new_session=True)
        self.pid = self.popen.pid
        self.sentinel = os.pidfd_open(self.pid)  # readable once the process has exited
        self._done: subprocess.CompletedProcess | None = None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self) -> None:
        import signal

        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self._signal(signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def finish(self) -> subprocess.CompletedProcess:
        """Reap, end what is left of the session, and hand back the output (the same on every call)."""
        if self._done is None:
            self.kill()  # the session's leftovers (a torchrun whose bash has gone)
            self.popen.wait()
            os.close(self.sentinel)
            texts = []
            for f in self.logs:
                f.seek(0)
                texts.append(f.read())
                f.close()
            self._done = subprocess.CompletedProcess(self.popen.args, self.popen.returncode, texts[0], texts[1])
        return self._done


def run_lines(lines: list[str], env: dict[str, str], limit_s: float, what: str, *,
              poll: Callable[[], None] | None = None, reported: Callable[[], bool] | None = None
              ) -> tuple[list[subprocess.CompletedProcess], list[int | None]]:
    """Run ``lines`` (``ShellLine``) under the one supervisor (``launcher.supervise``): until all have
    ended; or one failed and ``AGENT_GRACE_S`` passed; or ``reported()`` (every rank of this node
    has left its result) and ``AGENT_GRACE_S`` passed; or ``limit_s`` (a WorkError: "``what`` did not
    finish");
    or Ctrl-C, or ``poll`` raising. Then everything still running is ended. Returns each line's
    output and its exit code as it was before anything was stopped (None: still running then)."""
    from autotune.runtime.launcher import supervise

    procs: list[ShellLine] = []
    try:
        for line in lines:
            procs.append(ShellLine(line, env))
        timed_out, codes = supervise(procs, timeout_s=limit_s, grace_s=AGENT_GRACE_S, failed=reported, poll=poll)
    finally:
        done = [p.finish() for p in procs]
    if timed_out:
        raise WorkError(f"{what} did not finish within {limit_s:g} s")
    return done, codes
