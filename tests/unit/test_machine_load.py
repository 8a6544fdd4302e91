"""The machine's load while a profile and a trial are measured (issue 39 item 9): each stores what
other processes took of the CPUs, and validate/tune say in one line when the two differ enough to
make predicted against measured unreliable. Readings are injected (machine_load.SAMPLER)."""

from __future__ import annotations

import itertools

import pytest
from _cost_helpers import device, one_node

from autotune import machine_load as L
from autotune.validate import load_note


def counters(busy, own, total, steal=0.0):
    return L.Counters(busy_s=busy, steal_s=steal, total_s=total, own_s=own, loadavg=0.5, cpus=2)


def inject(monkeypatch, *samples):
    it = itertools.cycle(samples)
    monkeypatch.setattr(L, "SAMPLER", lambda: next(it))


def test_a_reading_is_the_others_share_of_all_cpu_time():
    # 10 s of all CPUs' time: 7 s busy, of which 3 s were this process tree's: others took 40%
    r = L.between(counters(100.0, 1.0, 1000.0), counters(107.0, 4.0, 1010.0, steal=0.5), 5.0)
    assert r.others_share == pytest.approx(0.4) and r.steal_share == pytest.approx(0.05) and r.loadavg == 0.5
    assert L.between(L.Counters(None, None, None, 0.0, 1.0, 2), L.Counters(None, None, None, 1.0, 1.0, 2),
                     1.0).others_share is None  # no /proc/stat: not measured, never a guess


def test_watch_fills_the_reading_when_the_block_ends(monkeypatch):
    inject(monkeypatch, counters(0.0, 0.0, 0.0), counters(6.0, 1.0, 10.0))
    with L.watch() as load:
        assert load == {}
    assert load["others_share"] == pytest.approx(0.5)


def test_one_line_when_profile_and_trials_ran_under_different_load():
    quiet, busy = {"others_share": 0.05}, {"others_share": 0.6}
    cluster = one_node(2, device(profile={"load": quiet}))
    rows = [{"measured": {"step_time_s": 1.0, "load": busy}}, {"measured": None}]
    line = load_note(cluster, rows)
    assert line is not None and "\n" not in line and "5%" in line and "60%" in line and "unreliable" in line
    assert load_note(cluster, [{"measured": {"load": {"others_share": 0.1}}}]) is None  # alike: nothing to say
    assert load_note(one_node(2, device(profile={"load": busy})), [{"measured": {"load": quiet}}]) is not None
    assert load_note(one_node(2), rows) is None  # no measured profile, no comparison


def test_a_trial_stores_the_load_it_ran_under(monkeypatch):
    from autotune.plan import parse_inline
    from autotune.runtime.trial import run_trial

    inject(monkeypatch, counters(0.0, 0.0, 0.0), counters(3.0, 1.0, 10.0))
    res = run_trial(parse_inline("dp=1"), "tiny", 64, 2, steps=1, warmup=0, timeout_s=120)
    assert res.failure is None, res.failure
    assert res.measured["load"]["others_share"] == pytest.approx(0.2)
