"""Timing discipline, emulated slowdown and the fits: checked against hand-computed references."""

import statistics
import time

import pytest

from autotune.runtime.emulation import SlowdownEmulator, emulate_delay
from profilers.fits import affine_fit, predict
from profilers.timing import summarize, time_fn


def test_summarize_matches_statistics_reference():
    xs = [0.5, 0.1, 0.3, 0.2, 0.4]
    t = summarize(xs, max_spread=10.0)
    q = statistics.quantiles(sorted(xs), n=4, method="inclusive")
    assert t.median_s == 0.3
    assert (t.p25_s, t.p75_s) == (q[0], q[2]) == (0.2, 0.4)
    assert t.spread == pytest.approx((0.4 - 0.2) / 0.3)
    assert (t.min_s, t.max_s) == (0.1, 0.5)
    assert not t.unstable


def test_bimodal_samples_are_flagged_not_hidden():
    t = summarize([1.0, 1.0, 1.0, 4.0, 4.0, 4.0], max_spread=0.1)
    assert t.unstable and t.spread > 0.1
    assert t.samples == [1.0, 1.0, 1.0, 4.0, 4.0, 4.0]  # raw repeats are kept
    assert not summarize([1.0, 1.01, 0.99, 1.0], max_spread=0.1).unstable


def test_time_fn_runs_warmup_then_repeats_and_retries_once_when_unstable():
    calls = []
    seq = iter([0.0] * 2 + [0.001, 0.02] * 3 + [0.001] * 6)  # warm-up, a bimodal round, a steady round

    def fn():
        d = next(seq)
        calls.append(d)
        if d:
            time.sleep(d)

    t = time_fn(fn, warmup=2, repeats=6, max_spread=0.1)
    assert len(calls) == 2 + 6 + 6 and t.warmup == 2
    assert len(t.samples) == 12  # both rounds kept
    t2 = time_fn(lambda: None, warmup=0, repeats=3, retry=False)
    assert len(t2.samples) == 3


def test_emulate_delay_is_never_short_and_rarely_long():
    for want in (0.0002, 0.003, 0.02):
        got = []
        for _ in range(5):
            t0 = time.perf_counter()
            emulate_delay(want)
            got.append(time.perf_counter() - t0)
        assert min(got) >= want  # the spin makes it never short
        # Never far over on an idle machine (~10 us); a loaded shared machine can delay a wake-up.
        assert statistics.median(got) < want + 0.03


def test_slowdown_emulator_after_and_context_manager():
    emu = SlowdownEmulator(3.0)
    t0 = time.perf_counter()
    extra = emu.after(0.01)
    assert extra == pytest.approx(0.02)
    assert time.perf_counter() - t0 >= 0.02
    t0 = time.perf_counter()
    with emu:
        time.sleep(0.01)
    assert time.perf_counter() - t0 >= 0.03  # 1x kernel + 2x idle
    with emu.kernel():
        time.sleep(0.005)
    assert emu.emulated_s >= 0.02 + 0.02 + 0.01
    assert not SlowdownEmulator(1.0).active and SlowdownEmulator(1.0).after(1.0) == 0.0
    for bad in (0.5, float("nan"), float("inf"), "2"):
        with pytest.raises(ValueError):
            SlowdownEmulator(bad)


def test_time_fn_with_emulator_reports_the_slower_device():
    """A 2x emulated device measures ~2x the plain one on the same kernel (a fixed sleep)."""
    def kernel():
        time.sleep(0.015)

    plain = time_fn(kernel, warmup=1, repeats=5, retry=False)
    emu = time_fn(kernel, warmup=1, repeats=5, retry=False, emulator=SlowdownEmulator(2.0))
    # Loose bounds: a loaded machine delays sleeps' wake-ups (the idle itself is checked exactly above).
    assert 1.6 < emu.median_s / plain.median_s < 2.8
    assert emu.emulated_s == pytest.approx(emu.median_s / 2, rel=0.3)


def test_affine_fit_recovers_a_known_line():
    alpha, rate = 5e-5, 2e9
    xs = [8, 4096, 65536, 1 << 20, 4 << 20]
    f = affine_fit(xs, [alpha + x / rate for x in xs])
    assert f["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert f["rate"] == pytest.approx(rate, rel=1e-6)
    assert f["r2"] == pytest.approx(1.0)
    assert predict(f, 1 << 30) == pytest.approx(alpha + (1 << 30) / rate)


def test_affine_fit_clamps_negative_intercept_and_single_point():
    f = affine_fit([1.0, 2.0, 3.0], [0.5, 1.5, 2.5])  # least squares gives alpha = -0.5
    assert f["alpha_s"] == 0.0
    assert f["rate"] == pytest.approx(sum(x * x for x in (1, 2, 3)) / (0.5 + 3.0 + 7.5))
    one = affine_fit([4.0], [2.0])
    assert one["alpha_s"] == 0.0 and one["rate"] == pytest.approx(2.0)
    assert affine_fit([], [])["rate"] == 0.0


# --- rounds (profilers.timing.Meter, median_of_rounds) ---------------------------------------------

from profilers.timing import Meter, median_of_rounds, repeats_for  # noqa: E402
from profilers.worker import over_budget  # noqa: E402


def _reference(rounds, max_spread):
    """Independent computation: numpy percentiles ('linear' = statistics' 'inclusive') of the pooled
    repeats, median over per-round medians."""
    import numpy as np

    pooled = np.concatenate([np.asarray(r, dtype=float) for r in rounds])
    med = float(np.median([np.median(r) for r in rounds]))
    p25, p75 = np.percentile(pooled, [25, 75])
    return med, float(p25), float(p75), (p75 - p25) / med > max_spread


@pytest.mark.parametrize("seed", range(20))
def test_median_of_rounds_matches_a_numpy_reference(seed):
    import random

    rng = random.Random(seed)
    rounds = [[rng.lognormvariate(-7, 0.3) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(1, 7))]
    t = median_of_rounds(rounds, max_spread=0.1)
    med, p25, p75, unstable = _reference(rounds, 0.1)
    assert t.median_s == pytest.approx(med, rel=1e-12)
    assert (t.p25_s, t.p75_s) == (pytest.approx(p25, rel=1e-12), pytest.approx(p75, rel=1e-12))
    assert t.spread == pytest.approx((p75 - p25) / med, rel=1e-9) and t.unstable == unstable
    assert t.samples == [x for r in rounds for x in r] and t.per_round == [len(r) for r in rounds]
    assert t.rounds == [statistics.median(r) for r in rounds]


def test_a_burst_that_spoils_one_round_is_discarded_but_flagged():
    clean = [[0.98, 0.99, 1.01, 1.02]] * 4
    burst = [[4.0, 5.0, 4.5, 6.0]]  # another process took the core for the whole round
    t = median_of_rounds(clean[:2] + burst + clean[2:], max_spread=0.1)
    assert t.median_s == pytest.approx(1.0)
    # The same repeats pooled into one median would move; all at once (one round) they would be lost.
    assert statistics.median(t.samples) > t.median_s
    assert not t.unstable  # 4 of 20 repeats high: the pooled IQR stays inside the clean mode
    t2 = median_of_rounds(clean[:2] + burst * 2 + clean[2:3], max_spread=0.1)
    assert t2.median_s == pytest.approx(1.0) and t2.unstable  # 2 of 5 rounds: the spread shows it
    with pytest.raises(ValueError):
        median_of_rounds([[], []])


def test_meter_counts_calls_warmup_and_rewarm():
    calls = []
    m = Meter(lambda: calls.append(1))
    assert m.warm(3) >= 0 and len(calls) == 3 and m.warmup == 3
    m.take(5)  # one untimed call, then five timed
    m.take(4, rewarm=False)
    assert len(calls) == 3 + 6 + 4
    t = m.timing()
    assert t.per_round == [5, 4] and len(t.samples) == 9 and t.warmup == 3 and t.clock == "wall"
    with pytest.raises(ValueError):
        Meter(lambda: None, clock="cpu")


def _spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_thread_clock_counts_cpu_work_not_time_off_cpu():
    """A sleep is off the CPU (what another process holding the core looks like to us): the thread
    clock does not count it, the wall clock (kept as wall_median_s) does; busy work counts on both."""
    sleepy = Meter(lambda: time.sleep(0.01), clock="thread")
    sleepy.take(3, rewarm=False)
    t = sleepy.timing()
    assert t.clock == "thread" and t.median_s < 0.003 and t.wall_median_s >= 0.01
    busy = Meter(lambda: _spin(0.005), clock="thread")
    busy.take(5, rewarm=False)
    b = busy.timing()
    # CPU time <= wall time always; on a loaded machine the spin loses part of its wall time to others.
    assert 0.0005 < b.median_s <= b.wall_median_s * 1.01 and b.wall_median_s >= 0.005


def test_meter_with_emulator_adds_the_idle_on_either_clock():
    for clock in ("wall", "thread"):
        m = Meter(lambda: _spin(0.004), clock=clock, emulator=SlowdownEmulator(2.0))
        m.take(3, rewarm=False)
        t = m.timing()
        assert t.emulated_s == pytest.approx(t.median_s / 2, rel=0.05)
        assert t.wall_median_s >= t.median_s * 0.99


def test_repeats_for_and_the_time_budget():
    assert repeats_for(1e-4, 0.01, 3, 20) == 20  # 100 would be asked: capped
    assert repeats_for(0.002, 0.01, 3, 20) == 5
    assert repeats_for(0.5, 0.01, 3, 20) == 3  # a slow call still gets the minimum
    assert repeats_for(0.0, 0.01, 3, 20) == 20
    from profilers.compute import MIN_ROUNDS

    assert not over_budget(MIN_ROUNDS - 1, 100.0, 10.0, 5.0)  # never fewer than MIN_ROUNDS
    assert over_budget(MIN_ROUNDS, 4.0, 1.5, 5.0)  # the next round would end at 5.5 s
    assert not over_budget(MIN_ROUNDS, 3.0, 1.5, 5.0)
