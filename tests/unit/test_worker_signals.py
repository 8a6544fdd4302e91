"""A search worker's signal handlers (autotune/search/workers.take_stop_signals): Ctrl-C stops a worker
only when the search itself listens to it. A background `autotune search --workers K` starts with SIGINT
ignored; a group Ctrl-C then used to stop the workers while the parent went on and exited 0."""

import signal

import pytest

from autotune.search.signals import request_stop
from autotune.search.workers import take_stop_signals


@pytest.fixture
def restore_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_a_worker_of_a_search_started_with_ctrl_c_ignored_ignores_it_too(restore_handlers):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    take_stop_signals()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is request_stop  # a kill still asks it to flush and stop


def test_a_worker_of_an_interactive_search_stops_on_ctrl_c(restore_handlers):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    take_stop_signals()
    assert signal.getsignal(signal.SIGINT) is request_stop
    assert signal.getsignal(signal.SIGTERM) is request_stop
