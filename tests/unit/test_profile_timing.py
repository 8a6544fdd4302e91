"""Timing discipline, emulated slowdown and the fits: checked against hand-computed references."""

import statistics
import time

import pytest

from profilers.emulation import SlowdownEmulator, emulate_delay
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
