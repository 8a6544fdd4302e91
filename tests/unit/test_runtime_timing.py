"""The trial's clock: CUDA-event spans settled once per step give the same compute/comm split as
host timing does when every call is timed at once (the CPU path), with fake events on a fake clock.
The real CUDA events are checked in tests/gpu/test_gpu_runtime.py."""

from __future__ import annotations

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
