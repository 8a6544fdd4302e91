"""The work `autotune profile` starts, given its options (profilers/options.py): check the request
(``profile_request``), measure and store a device profile (``run_profile``) or a model's layer
profile (``prepare_layers`` then ``run_layers``). Progress goes to a callback; nothing here prints
(autotune/commands/profile.py does)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autotune import machine_load
from autotune.errors import InputError
from profilers.options import LayerProfileOptions, ProfileOptions

Progress = Callable[[int, int | None, str], None]
"""(done, total, what) of the measuring, for a progress bar."""


@dataclass(frozen=True)
class ProfileRequest:
    """What a device profile runs, once checked: the device kind, ranks a host, hosts, and with
    ``hosts`` the other hosts' lines and this host's torchrun prefix."""

    kind: str
    nproc: int
    nnodes: int
    node_rank: int | None
    remote: list[Any] = field(default_factory=list)
    prefix: str = ""


@dataclass(frozen=True)
class Stored:
    pid: Any
    """The stored profile's id."""
    summary: dict[str, Any]
    """profilers.summary.summarize_profile of the stored profile."""
    wall_s: float


def hosts_request(hosts_file: str, nnodes: int, nproc: int | None, node_rank: int | None) -> tuple[int, int | None, int]:
    """``--hosts FILE``: as many nodes as hosts, the file's slots as ranks a host (all the same:
    torchrun runs one count a node), this host node-rank 0."""
    from autotune.hostfile import read_hosts

    hosts = read_hosts(hosts_file)
    if node_rank is not None:
        raise InputError("--hosts starts every node from node-rank 0 (this host); drop --node-rank",
                         field="--node-rank")
    if nnodes not in (1, len(hosts)):
        raise InputError(f"--nnodes {nnodes}, but the file lists {len(hosts)} host(s)", field="--hosts")
    slots = {h.slots for h in hosts if h.slots is not None}
    if len(slots) > 1 or (slots and nproc is not None and slots != {nproc}):
        got = sorted(slots | ({nproc} if nproc is not None else set()))
        raise InputError(f"a profile runs the same ranks on every host; the file and --nproc give {got}",
                         source=hosts_file, field="--hosts")
    return len(hosts), nproc or (slots.pop() if slots else None), 0


def remote_parts(hosts_file: str, shell: str | None, nnodes: int, nproc: int, kind: str, quick: bool,
                 timeout: float) -> tuple[list[Any], str]:
    """The other hosts' ``autotune profile --nnodes N --node-rank K ...`` lines (through the remote
    shell) and what this host's torchrun line starts with (autotune.hostfile)."""
    import shlex

    from autotune import hostfile
    from autotune.export.launch import RemoteLine

    hosts = hostfile.read_hosts(hosts_file)
    words = hostfile.remote_shell(shell)
    addr, port = hostfile.rendezvous(hosts)
    cmds = [shlex.join(["autotune", "profile", "--nnodes", str(nnodes), "--node-rank", str(k), "--nproc", str(nproc),
                        "--device", kind, "--timeout", f"{timeout:g}", *(["--quick"] if quick else [])])
            for k in range(nnodes)]
    lines = hostfile.node_lines(hosts, cmds, words, addr, port)
    return ([RemoteLine(k, k, h.name, line) for k, (h, line) in enumerate(zip(hosts, lines, strict=True)) if k],
            hostfile.here_prefix(addr, port))


def profile_request(o: ProfileOptions) -> ProfileRequest:
    """Check the options before minutes of measuring (a bad --storage, host or rank count fails here)."""
    from profilers.launch import check_request, default_nproc
    from profilers.store import engine_for

    engine_for(o.storage)
    nnodes, nproc, node_rank = o.nnodes, o.nproc, o.node_rank
    if o.hosts is not None:  # every host from here: node-rank 0 is this one and stores
        nnodes, nproc, node_rank = hosts_request(o.hosts, nnodes, nproc, node_rank)
    elif o.remote_shell is not None:
        raise InputError("--remote-shell only goes with --hosts", field="--remote-shell")
    if node_rank is not None and not node_rank < nnodes:
        raise InputError(f"--nnodes {nnodes}: node-rank 0..{nnodes - 1}", field="--node-rank")
    kind = check_request(o.device, nproc)
    nproc = nproc or default_nproc(kind)
    remote, prefix = [], ""
    if o.hosts is not None:
        remote, prefix = remote_parts(o.hosts, o.remote_shell, nnodes, nproc, kind, o.quick, o.timeout_s)
    if nnodes > 1 and o.emulate:
        raise InputError("--emulate-slowdown is for one host", field="--nnodes")
    return ProfileRequest(kind, nproc, nnodes, node_rank, remote, prefix)


def run_profile(o: ProfileOptions, req: ProfileRequest, progress: Progress) -> Stored | None:
    """Measure this host's ranks (with ``nnodes`` > 1: joined with the other hosts') and store the
    profile; None on a node of a multi-host profile whose rank 0 ran elsewhere (that host stores it)."""
    from profilers.launch import launch_local, launch_node
    from profilers.store import load_profile, save_profile
    from profilers.summary import summarize_profile

    t0 = time.perf_counter()
    with machine_load.watch() as load:  # stored with the profile: validate compares the trials' with it
        if req.nnodes > 1:
            progress(0, None, f"{req.nproc} ranks here, waiting for {req.nnodes} nodes")
            result = launch_node(req.nnodes, req.kind, req.nproc, quick=o.quick, timeout_s=o.timeout_s,
                                 node_rank=req.node_rank, remote=req.remote, prefix=req.prefix)
        else:
            result = launch_local(req.kind, req.nproc, quick=o.quick, emulate=o.emulate, timeout_s=o.timeout_s,
                                  progress=progress)
    if result is None:
        return None
    result["fingerprint"] = {**(result.get("fingerprint") or {}), "load": load}
    wall = time.perf_counter() - t0
    pid = save_profile(result, o.storage, label=o.label, nproc=result.get("world", req.nproc), wall_s=wall)
    return Stored(pid, summarize_profile(load_profile(pid, o.storage)), wall)


def prepare_layers(o: LayerProfileOptions) -> tuple[Any, str, Any]:
    """(model, device, sweep) of a layer profile, checked before anything is built or measured."""
    from autotune.specs.model import load_model
    from profilers.layers import default_sweep, parse_grid, sdpa_backends, shard_sizes
    from profilers.store import engine_for

    sdpa_backends(o.attention)  # a bad --attention fails before anything is built
    model = load_model(o.model)
    engine_for(o.storage)  # a bad --storage fails before the measuring
    device, dtype = o.device, o.dtype
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device not in ("cpu", "cuda"):
        raise InputError(f"must be auto, cpu or cuda, got {device!r}", field="--device")
    if dtype == "auto":
        from profilers.dtypes import trial_dtype

        dtype = trial_dtype(device)
    sweep = default_sweep(model, device, dtype)
    sweep.attention = o.attention
    sweep.micro_batches = parse_grid(o.mbs, "mbs") or sweep.micro_batches
    sweep.seq_lens = parse_grid(o.seq, "seq") or sweep.seq_lens
    if o.tp is not None:
        sweep.tp, sweep.notes = shard_sizes(model, parse_grid(o.tp, "tp"))
    return model, device, sweep


def run_layers(o: LayerProfileOptions, prepared: tuple[Any, str, Any], progress: Progress) -> tuple[Any, dict[str, Any]]:
    """Time the model's pieces over the sweep and store them: (layer profile id, its document)."""
    from profilers.layers import profile_layers
    from profilers.store import save_layer_profile

    model, device, sweep = prepared
    doc = profile_layers(model, device, sweep, progress)
    return save_layer_profile(doc, o.storage, label=o.label), doc
