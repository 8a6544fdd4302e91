"""Signal handling of search processes: a first Ctrl-C or SIGTERM stops the work, and nothing
interrupts the final write of a batch (which would otherwise stop inside a database transaction)."""

from __future__ import annotations

import contextlib
import signal
from typing import Any


def ignore(*_: Any) -> None:
    """A handler that does nothing. Not SIG_IGN: a signal already pending when the handler changes
    would then raise OSError ("ignored due to race condition") in whatever code runs next."""


_STOP_REQUESTED: list[int] = []  # the signal that asked this process to stop, once one has


def request_stop(sig: int, _frame: Any = None) -> None:
    """A search worker's handler for the first of Ctrl-C (to the whole process group) and the
    parent's SIGTERM: note the request; the search loops read it where they read their deadline
    (``stop_requested``) and end between two trials, and the flush that follows runs whole.
    Raising KeyboardInterrupt from here once stopped a worker inside a SQLAlchemy fetch, whose
    cursor clean-up then printed a traceback on the user's terminal."""
    _STOP_REQUESTED.append(sig)
    signal.signal(signal.SIGINT, ignore)
    signal.signal(signal.SIGTERM, ignore)


def stop_requested() -> bool:
    return bool(_STOP_REQUESTED)


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGINT and SIGTERM back inside the block and deliver them after it (main thread only;
    elsewhere nothing changes). Delivered, not dropped: a Ctrl-C that came during a batch write was
    once lost, and the search ran on to its own end."""
    came: list[int] = []

    def hold(sig: int, _frame: Any) -> None:
        came.append(sig)

    try:
        old = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: signals are not ours to handle
        yield
        return
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        if came:
            signal.raise_signal(came[0])  # the handler the block replaced now runs
