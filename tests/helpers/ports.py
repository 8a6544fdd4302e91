"""Ports for tests that start a rendezvous: node-rank 0's control store listens on MASTER_PORT + 1
(autotune/runtime/control.py), so a multi-host test needs two free ports in a row."""

from __future__ import annotations

import socket

from autotune.runtime.launcher import free_port


def free_pair() -> int:
    """A free port whose next port is free too."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two free ports in a row")
