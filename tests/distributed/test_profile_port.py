"""A local profile whose rendezvous port is taken between ``free_port`` choosing it and rank 0 binding
it (another launch on the machine, e.g. the other test worker) is launched again on another port, as
trials are (``runtime.launcher.launch``); a port that stays taken ends in one line naming it."""

import socket

import pytest

import profilers.worker as W
from autotune.errors import WorkError
from profilers.launch import PORT_TRIES, launch_local

pytestmark = pytest.mark.slow


def _busy() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_taken_port_is_retried_on_another(monkeypatch):
    busy = _busy()
    offered = []
    real = W.free_port

    def port():
        offered.append(busy.getsockname()[1] if not offered else real())
        return offered[-1]

    monkeypatch.setattr(W, "free_port", port)
    try:
        res = launch_local("cpu", 2, quick=True, timeout_s=60)
    finally:
        busy.close()
    assert len(offered) == 2 and offered[0] != offered[1]  # the second launch, on its own port
    assert res["world"] == 2 and [r["rank"] for r in res["ranks"]] == [0, 1]


def test_a_port_that_stays_taken_is_one_error(monkeypatch):
    busy = _busy()
    offered = []
    monkeypatch.setattr(W, "free_port", lambda: offered.append(1) or busy.getsockname()[1])
    try:
        with pytest.raises(WorkError, match="rendezvous port was taken") as e:
            launch_local("cpu", 2, quick=True, timeout_s=30)
    finally:
        busy.close()
    assert len(offered) == PORT_TRIES and "\n" not in str(e.value)
