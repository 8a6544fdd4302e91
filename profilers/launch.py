"""Start the ranks of a local profile; ``autotune.runtime.launcher.supervise``, the supervisor of
every autotune launch, watches them and ends them all on a fault.

Plain ``multiprocessing`` spawn (what ``torch.multiprocessing.spawn`` uses underneath, ~1.5x faster
to start than torchrun here, torch-cpu-facts) so that the parent never imports torch: on a loaded
2-core machine that import alone takes seconds. The parent polls: a rank that raises writes its
error to ``rank{R}.err`` and exits 1, a rank that dies exits with its own code; either way every
other rank is terminated. A rank that hangs is caught by the process-group timeout in its peers
or, failing that, by our own deadline, after which every process still alive is killed. Either
way the caller gets a ``WorkError`` and nothing was written to the database.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.errors import InputError, WorkError

ProgressCb = Callable[[int, int, str], None]


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch (seconds on a loaded machine) when no GPU
    device node exists: the ranks import torch anyway, the parent need not."""
    if not any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")):
        return False
    import torch

    return torch.cuda.is_available()


def default_nproc(kind: str) -> int:
    """One rank per GPU, or one per CPU core (with one rank there are no links to measure)."""
    if kind == "cuda":
        import torch

        return torch.cuda.device_count()
    return os.cpu_count() or 1


def check_request(device: str, nproc: int | None) -> str:
    """Resolve ``auto`` and refuse what this machine cannot host (InputError, exit 2)."""
    if device not in ("auto", "cpu", "cuda"):
        raise InputError(f"expected auto, cpu or cuda, got {device!r}", field="--device")
    if nproc is None:
        nproc = 1
    if nproc < 1:
        raise InputError(f"must be >= 1, got {nproc}", field="--nproc")
    has_cuda = device != "cpu" and _cuda_available()
    if device == "cuda" and not has_cuda:
        raise InputError("CUDA was requested but torch.cuda.is_available() is false "
                         f"(torch {_torch_version()}); use --device cpu", field="--device")
    kind = "cuda" if device == "cuda" or (device == "auto" and has_cuda) else "cpu"
    if kind == "cuda":
        import torch

        n = torch.cuda.device_count()
        if nproc > n:
            raise InputError(f"{nproc} ranks but this machine has {n} CUDA device(s); one rank per GPU",
                             field="--nproc")
    else:
        cores = os.cpu_count() or 1
        if nproc > cores:
            raise InputError(f"{nproc} ranks but this machine has {cores} CPU core(s); CPU profiling gives "
                             "each rank at least one core, so use --nproc <= " + str(cores), field="--nproc")
    return kind


def _read_progress(path: Path, seen: int, cb: ProgressCb | None) -> int:
    if cb is None or not path.exists():
        return seen
    lines = path.read_text(encoding="utf-8").splitlines()
    for line in lines[seen:]:
        parts = line.split("\t")
        if len(parts) == 3:
            cb(int(parts[0]), int(parts[1]), parts[2])
    return len(lines)


# Exit codes that mean "stopped because of someone else": raised (1) or terminated by join (SIGTERM/KILL).
_SECONDARY = (None, 0, 1, -signal.SIGTERM, -signal.SIGKILL)


def _clean(text: str) -> str:
    """The last line of a rank's error, without gloo's ``[file.cc:123]`` source tags (which would also
    be read as rich markup by the CLI's error line)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    line = re.sub(r"\[[^\]]*\]", "", lines[-1] if lines else "error").replace("[", "(").replace("]", ")")
    return re.sub(r"\s+", " ", line).strip()[:240]


def _explain(codes: list[int | None], errors: dict[int, str], timeout_s: float) -> str:
    """One line naming the rank at fault: a rank that died by itself beats the peers that lost it."""
    died = [i for i, c in enumerate(codes) if c not in _SECONDARY]
    if died:
        return f"rank {died[0]} died (exit code {codes[died[0]]})"
    if not errors:
        bad = next((i for i, c in enumerate(codes) if c not in (None, 0)), 0)
        return f"rank {bad} died (exit code {codes[bad]})"
    rank = min(errors)
    text = _clean(errors[rank])
    low = text.lower()
    if "timed out" in low or "timeout" in low:
        return f"a rank hung: rank {rank} got no answer within {timeout_s:g} s ({text})"
    if "closed by peer" in low or "connection reset" in low:
        return f"a peer of rank {rank} went away ({text})"
    return f"rank {rank} failed: {text}"


PORT_TRIES = 3
"""Launches of a local profile when the rendezvous port was taken between ``free_port`` choosing it
and rank 0 binding it (another launch on the machine: a test worker beside this one), as trials do
(``runtime.launcher.launch``)."""


class _PortClash(WorkError):
    """A launch whose rank 0 found its rendezvous port taken: worth another port."""


def launch_local(kind: str, nproc: int, *, quick: bool, emulate: dict[int, float] | None = None,
                 timeout_s: float = 60.0, progress: ProgressCb | None = None) -> dict[str, Any]:
    """Run ``nproc`` ranks on this machine; return rank 0's result dict (see profilers.worker). A
    rendezvous port taken by someone else is retried on another (``PORT_TRIES`` launches in all)."""
    bad = [r for r in (emulate or {}) if r >= nproc]
    if bad:
        raise InputError(f"rank {bad[0]} does not exist with --nproc {nproc}", field="--emulate-slowdown")
    attempt = 1
    while True:
        try:
            return _launch_once(kind, nproc, quick=quick, emulate=emulate, timeout_s=timeout_s, progress=progress)
        except _PortClash as e:
            if attempt == PORT_TRIES:
                raise WorkError(f"{e} (the rendezvous port was taken {PORT_TRIES} times)") from None
            attempt += 1


def _launch_once(kind: str, nproc: int, *, quick: bool, emulate: dict[int, float] | None, timeout_s: float,
                 progress: ProgressCb | None) -> dict[str, Any]:
    """One launch of ``launch_local`` on a fresh port."""
    import multiprocessing as mp

    from autotune.runtime.launcher import PORT_CLASH, stop_all, supervise
    from profilers.worker import _spawn_entry, free_port

    with tempfile.TemporaryDirectory(prefix="autotune-profile-") as tmp:
        out = Path(tmp)
        cfg = {"device": kind, "quick": quick, "timeout_s": timeout_s, "out": str(out),
               "progress": str(out / "progress.tsv"), "emulate": {str(k): v for k, v in (emulate or {}).items()},
               "port": free_port(), "local_world": nproc}
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_spawn_entry, args=(r, nproc, cfg), name=f"profile-rank-{r}", daemon=True)
                 for r in range(nproc)]
        # The peers' own process-group timeout normally fires first; this is the backstop.
        limit = timeout_s * 3 + 60
        seen = [0]

        def poll() -> None:
            seen[0] = _read_progress(out / "progress.tsv", seen[0], progress)

        for p in procs:
            try:
                p.start()
            except BaseException:
                stop_all(procs)
                raise
        # grace 0.3 s: let the peers that lost a rank write their errors too
        timed_out, codes = supervise(procs, timeout_s=limit, grace_s=0.3, poll=poll)
        if timed_out:
            alive = [i for i, c in enumerate(codes) if c is None]
            raise WorkError(f"profile failed: rank(s) {alive} hung (not finished within {limit:.0f} s); "
                            "all ranks were stopped and nothing was stored")
        if any(c != 0 for c in codes):
            errors = {r: (out / f"rank{r}.err").read_text(encoding="utf-8")
                      for r in range(nproc) if (out / f"rank{r}.err").exists()}
            kind_of = _PortClash if any(m in e.lower() for e in errors.values() for m in PORT_CLASH) else WorkError
            raise kind_of(f"profile failed: {_explain(codes, errors, timeout_s)}; all ranks were "
                          "stopped and nothing was stored")
        res = out / "result.json"
        if not res.exists():
            raise WorkError("profile failed: rank 0 wrote no result")
        return json.loads(res.read_text(encoding="utf-8"))


def node_command(nnodes: int, nproc: int, kind: str, *, quick: bool, timeout_s: float, out: str | Path,
                 run_id: str = "autotune-profile", node_rank: int | None = None):
    """This node's torchrun line of a profile across ``nnodes`` hosts: c10d rendezvous at
    ``"${MASTER_ADDR}":"${MASTER_PORT:-29500}"`` (autotune.export.launch's convention), ``nproc``
    ranks of ``python -m profilers.worker`` here. The same line runs on every node; with
    ``node_rank`` the ranks are numbered by it (node-rank 0 holds rank 0 and stores the profile)."""
    from autotune.export.launch import ENDPOINT, NodeCommand

    place = ["--node-rank", str(node_rank)] if node_rank is not None else []
    argv = ["torchrun", "--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", ENDPOINT,
            "--rdzv-id", run_id, "--nproc-per-node", str(nproc), "-m", "profilers.worker", *place, "--out", str(out),
            "--device", kind, "--timeout", f"{timeout_s:g}", *(["--quick"] if quick else [])]
    return NodeCommand(node=-1 if node_rank is None else node_rank, node_rank=-1 if node_rank is None else node_rank,
                       argv=argv)


def launch_node(nnodes: int, kind: str, nproc: int, *, quick: bool, timeout_s: float = 60.0,
                node_rank: int | None = None, remote: list[Any] | None = None,
                prefix: str = "") -> dict[str, Any] | None:
    """Run this node's part of a multi-node profile (``node_command`` through bash, so what runs is
    the printed line); returns the whole result on the node that got rank 0, None on the others.
    ``remote`` (``--hosts``): the other nodes' lines (autotune.export.launch.RemoteLine), started
    from here and watched with this node's; ``prefix``: what this node's line starts with there
    (``export MASTER_ADDR=... &&``)."""
    import sys

    from autotune.export.launch import run_lines

    with tempfile.TemporaryDirectory(prefix="autotune-profile-") as tmp:
        cmd = node_command(nnodes, nproc, kind, quick=quick, timeout_s=timeout_s, out=tmp, node_rank=node_rank)
        env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
        limit = timeout_s * 3 + 120  # rendezvous, then the ranks' own process-group timeouts
        try:
            procs, codes = run_lines([prefix + cmd.shell(), *(r.line for r in remote or [])], env, limit,
                                     "profile failed: this node's ranks")
        except WorkError as e:
            raise WorkError(f"{e.args[0]}; nothing was stored") from None
        for r, p, code in zip(remote or [], procs[1:], codes[1:], strict=True):
            if code not in (0, None):
                raise WorkError(f"profile failed on node-rank {r.node_rank} ({r.host}): its line exited with code "
                                f"{code} ({_clean(p.stderr or p.stdout or 'no output')}); nothing was stored")
        proc = procs[0]
        if proc.returncode != 0:
            raise WorkError(f"profile failed on this node: torchrun exited with code {proc.returncode} "
                            f"({_clean(proc.stderr or proc.stdout or 'no output')}); nothing was stored")
        res = Path(tmp) / "result.json"
        return json.loads(res.read_text(encoding="utf-8")) if res.exists() else None
