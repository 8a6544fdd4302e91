"""The trial's clock: CUDA-event spans settled once per step give the same compute/comm split as
host timing does when every call is timed at once (the CPU path), with fake events on a fake clock.
The real CUDA events are checked in tests/gpu/test_gpu_runtime.py."""

from __future__ import annotations

import time

import pytest

from autotune.runtime.worker import CommClock, CudaStopwatch, WallStopwatch

NOW = [0.0]


class FakeEvent:
    """torch.cuda.Event's interface on a clock the test advances."""

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.t = None

    def record(self):
        self.t = NOW[0]

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.t - self.t) * 1e3


class FakeWall(WallStopwatch):
    @staticmethod
    def mark() -> float:
        return NOW[0]


def _advance(dt: float) -> None:
    NOW[0] += dt


def _one_step(clk: CommClock) -> None:
    comm = clk.wrap(_advance)
    with clk.compute_region():
        _advance(2.0)
        comm(3.0)  # communication inside the region: taken out of compute
        _advance(5.0)
        with clk.compute_region():  # nested: the outer region counts
            _advance(1.0)
    comm(2.0)  # outside any region (the DP wait after backward)
    with clk.compute_region():
        _advance(0.5)


@pytest.mark.parametrize("stopwatch", [FakeWall(), CudaStopwatch(FakeEvent)])
def test_the_split_is_the_same_settled_later_or_timed_at_once(stopwatch):
    clk = CommClock()
    clk.stopwatch = stopwatch
    _one_step(clk)
    if stopwatch.deferred:  # nothing is read before the step's synchronisation
        assert clk.compute == 0.0 and clk.comm == 0.0
    clk.settle()
    assert clk.compute == pytest.approx(2.0 + 5.0 + 1.0 + 0.5)
    assert clk.comm == pytest.approx(3.0 + 2.0)
    clk.reset()
    clk.settle()
    assert clk.compute == 0.0 and clk.comm == 0.0  # reset drops unsettled spans too


def test_a_reset_between_steps_drops_the_spans_of_the_end_barrier():
    clk = CommClock()
    clk.stopwatch = CudaStopwatch(FakeEvent)
    clk.wrap(_advance)(4.0)  # e.g. the end-of-step barrier, recorded after settle
    clk.reset()
    _one_step(clk)
    clk.settle()
    assert clk.comm == pytest.approx(5.0)


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_cpu_clock_counts_work_not_waiting_and_leaves_the_communication_out():
    """Against the wall clock of the same regions: a region that only waits (another process's
    slice, a sleep) costs wall time and no CPU time; one that works costs both alike; work inside a
    communication call is the call's, not the region's."""
    clk = CommClock()
    with clk.compute_region():
        time.sleep(0.05)
    assert clk.compute >= 0.045 and clk.compute_cpu < 0.01
    clk.reset()
    with clk.compute_region():
        _busy(0.02)
        clk.wrap(_busy)(0.02)  # a collective that spins: communication
    assert clk.compute_cpu == pytest.approx(0.02, abs=0.008)
    assert clk.compute_cpu <= clk.compute + 1e-3 and clk.comm >= 0.018
