"""``--hosts FILE``: the hosts of a multi-node run in the hostfile format DeepSpeed and MPI users
already have, and the remote-shell lines that start every other host's part from node-rank 0.

The file: one host a line, ``HOSTNAME slots=N`` (N ranks on that host) or a bare ``HOSTNAME``
(as many ranks as the plan puts on each node); ``#`` starts a comment; blank lines are skipped.
Line order is node-rank order: the first host is node-rank 0, the host the command runs on. A
host named twice is refused (two node-ranks on one host need two names for it, e.g. ``localhost``
and ``127.0.0.1``), as is anything else on a line (``max_slots=``, a second word): one line, exit 2.

The remote shell (``--remote-shell``, else ``AUTOTUNE_REMOTE_SHELL``, else ``ssh``) is called as
``SHELL HOST 'cd DIR && export VARS && COMMAND'``, as DeepSpeed's launcher does: every host must have this
directory and this Python environment at the same paths (a shared file system, or the same
image). ``VARS`` are the rendezvous (``MASTER_ADDR``, ``MASTER_PORT``), ``PATH`` with this
environment's ``bin`` first, and the variables in ``FORWARDED`` that are set here.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from autotune.errors import InputError

SHELL_ENV = "AUTOTUNE_REMOTE_SHELL"
DEFAULT_SHELL = "ssh"
DEFAULT_PORT = 29500
FORWARDED = ("PYTHONPATH", "OMP_NUM_THREADS")
FORWARDED_PREFIXES = ("NCCL_", "GLOO_")
"""Variables set here that the other hosts get too (network interfaces, thread counts, imports)."""

_LINE = re.compile(r"^(?P<host>[^\s=#]+)(?:\s+slots\s*=\s*(?P<slots>\S+))?$")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int | None
    """Ranks on this host (None: a bare hostname, as many as the plan puts on a node)."""
    line: int


def read_hosts(path: str | Path) -> list[Host]:
    """The hosts of FILE in node-rank order; a bad file is one InputError naming the line."""
    p = Path(path)
    src = str(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("no such file", source=src, field="--hosts") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read it: {e}", source=src, field="--hosts") from None
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        body = raw.split("#", 1)[0].strip()
        if not body:
            continue
        m = _LINE.match(body)
        if m is None:
            raise InputError(f"line {n}: expected `HOSTNAME slots=N` or `HOSTNAME`, got {body!r}", source=src)
        name, slots_text = m.group("host"), m.group("slots")
        slots = None
        if slots_text is not None:
            if not slots_text.isdigit() or int(slots_text) < 1:
                raise InputError(f"line {n}: slots must be a whole number >= 1, got {slots_text!r}", source=src)
            slots = int(slots_text)
        if name in seen:
            raise InputError(f"line {n}: host {name!r} is already node-rank {list(seen).index(name)} (line "
                             f"{seen[name]}); name each host once (two node-ranks on one machine need two names "
                             "for it, e.g. localhost and 127.0.0.1)", source=src)
        seen[name] = n
        hosts.append(Host(name, slots, n))
    if not hosts:
        raise InputError("no host in the file (one `HOSTNAME slots=N` a line)", source=src)
    return hosts


def check_hosts(hosts: list[Host], per_node: list[int], what: str, path: str | Path) -> None:
    """The hosts must be the run's nodes: as many, each with the ranks its node holds
    (``per_node``, in node-rank order)."""
    if len(hosts) != len(per_node):
        sizes = "/".join(map(str, sorted(set(per_node))))
        raise InputError(f"{what} runs on {len(per_node)} node(s) of {sizes} rank(s), the file lists {len(hosts)} "
                         f"host(s) ({', '.join(h.name for h in hosts)})", source=str(path), field="--hosts")
    for k, (h, n) in enumerate(zip(hosts, per_node, strict=True)):
        if h.slots is not None and h.slots != n:
            raise InputError(f"line {h.line}: {h.name} has slots={h.slots}, but {what} puts {n} rank(s) on "
                             f"node-rank {k}", source=str(path), field="--hosts")


def remote_shell(option: str | None) -> list[str]:
    """The remote-shell words: ``--remote-shell``, else ``$AUTOTUNE_REMOTE_SHELL``, else ``ssh``."""
    text = option if option is not None else os.environ.get(SHELL_ENV) or DEFAULT_SHELL
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise InputError(f"cannot split {text!r} into words: {e}", field="--remote-shell") from None
    if not words:
        raise InputError("is empty", field="--remote-shell")
    return words


def rendezvous(hosts: list[Host]) -> tuple[str, int]:
    """``MASTER_ADDR`` (default: the first host, node-rank 0) and ``MASTER_PORT`` (default 29500)."""
    addr = os.environ.get("MASTER_ADDR") or hosts[0].name
    port_text = os.environ.get("MASTER_PORT") or str(DEFAULT_PORT)
    if not port_text.isdigit() or not 0 < int(port_text) < 65535:
        raise InputError(f"must be a port number, got {port_text!r}", field="MASTER_PORT")
    return addr, int(port_text)


def node_env(addr: str, port: int) -> dict[str, str]:
    """What every node's line sets before its command (see the module docstring)."""
    env = {"MASTER_ADDR": addr, "MASTER_PORT": str(port)}
    for k in sorted(os.environ):
        if k in FORWARDED or k.startswith(FORWARDED_PREFIXES):
            env[k] = os.environ[k]
    return env


def _assigned(addr: str, port: int) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in node_env(addr, port).items())


def here_prefix(addr: str, port: int) -> str:
    """What node-rank 0's line starts with: the variables exported, not prefixed to the command
    (its own words expand "${MASTER_ADDR}")."""
    return f"export {_assigned(addr, port)} && "


def node_lines(hosts: list[Host], commands: list[str], shell: list[str], addr: str, port: int,
               cwd: str | Path | None = None) -> list[str]:
    """One shell line per node: node-rank 0's runs here as it is, every other host's through the
    remote shell. ``commands``: each node's command (shell text). These are the lines a dry run
    prints and the launch runs (``bash -c LINE``)."""
    assigned = _assigned(addr, port)
    bindir = os.path.dirname(sys.executable)
    where = shlex.quote(str(Path(cwd or os.getcwd()).resolve()))
    lines = []
    for k, (h, cmd) in enumerate(zip(hosts, commands, strict=True)):
        if k == 0:
            lines.append(here_prefix(addr, port) + cmd)
        else:
            inner = f'cd {where} && export {assigned} PATH={shlex.quote(bindir)}:"$PATH" && {cmd}'
            lines.append(" ".join(shlex.quote(w) for w in shell) + f" {shlex.quote(h.name)} {shlex.quote(inner)}")
    return lines
