"""How busy the machine was with other work while something was measured (a profile, a trial).

A profile taken on a quiet machine prices plans a busy machine then runs slower (measured here:
tune's validated plans 50-58% slower than predicted on a loaded machine, 4-16% on a quiet one). So
``profile`` and every trial record the load they ran under (``watch``), and ``validate``/``tune`` say
in one line when the two differ enough to make predicted against measured unreliable (``note``).

What a reading holds (``Reading.to_dict``):

- ``others_share``: the fraction of the machine's CPU time spent by processes other than this one
  and its children (the workers it waited for) over the measured interval: ``/proc/stat``'s busy
  time (user, nice, system, irq, softirq, steal) less this process tree's ``os.times()``, over all
  CPUs' time. None where ``/proc/stat`` is not readable (not Linux).
- ``steal_share``: the hypervisor's steal time over all CPUs' time (``/proc/stat``), None likewise.
- ``loadavg``: ``os.getloadavg()``'s 1-minute figure when the interval began (before our own
  workers started), per CPU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

UNRELIABLE_GAP = 0.25
"""Other processes' share of the CPUs that, differing this much between the profile and a trial,
makes the comparison unreliable: a quarter of the machine taken by others in one and not the other
(on the 2-core machine this project is measured on, one busy core; the gap measured above was 50%
of the CPUs between a quiet and a busy run)."""


@dataclass(frozen=True)
class Counters:
    """One sample: the CPUs' busy, steal and total time (seconds, all CPUs) and this process tree's
    CPU seconds, or None for the /proc figures where they cannot be read."""

    busy_s: float | None
    steal_s: float | None
    total_s: float | None
    own_s: float
    loadavg: float | None
    cpus: int


def sample() -> Counters:
    """Read the counters now (``/proc/stat``'s first line; ``os.times`` for this process tree)."""
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0] / cpus
    except OSError:
        load = None
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return Counters(None, None, None, own, load, cpus)
    hz = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0.0] * 8)[:8]
    busy = user + nice + system + irq + softirq + steal
    return Counters(busy / hz, steal / hz, (busy + idle + iowait) / hz, own, load, cpus)


@dataclass(frozen=True)
class Reading:
    """The load over one measured interval."""

    others_share: float | None
    steal_share: float | None
    loadavg: float | None
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"others_share": self.others_share, "steal_share": self.steal_share, "loadavg": self.loadavg,
                "seconds": self.seconds}


def between(a: Counters, b: Counters, seconds: float) -> Reading:
    """The reading of the interval from sample ``a`` to sample ``b``."""
    if a.total_s is None or b.total_s is None or b.total_s <= a.total_s:
        return Reading(None, None, a.loadavg, seconds)
    total = b.total_s - a.total_s
    others = (b.busy_s - a.busy_s) - (b.own_s - a.own_s)  # type: ignore[operator]
    steal = (b.steal_s - a.steal_s) / total  # type: ignore[operator]
    return Reading(min(1.0, max(0.0, others / total)), max(0.0, steal), a.loadavg, seconds)


SAMPLER: Callable[[], Counters] = sample
"""What ``watch`` samples with (tests put an injected reading here)."""


@contextmanager
def watch() -> Iterator[dict[str, Any]]:
    """``with watch() as load: ...``: ``load`` is filled with the interval's ``Reading.to_dict()``
    when the block ends (also when it raises)."""
    out: dict[str, Any] = {}
    t0, a = time.monotonic(), SAMPLER()
    try:
        yield out
    finally:
        out.update(between(a, SAMPLER(), time.monotonic() - t0).to_dict())


def share(reading: Any) -> float | None:
    """Other processes' CPU share of a stored reading (None where it was not measured)."""
    v = reading.get("others_share") if isinstance(reading, dict) else None
    return float(v) if isinstance(v, (int, float)) else None


def note(profile: Any, trials: list[Any]) -> str | None:
    """One line when the profile's load and the trials' differ by ``UNRELIABLE_GAP`` or more of the
    CPUs (either way), None otherwise or where either was not measured."""
    p = share(profile)
    runs = [s for s in (share(t) for t in trials) if s is not None]
    if p is None or not runs:
        return None
    worst = max(runs, key=lambda s: abs(s - p))
    if abs(worst - p) < UNRELIABLE_GAP:
        return None
    return (f"load: other processes took {p:.0%} of the CPUs while the profile was measured and {worst:.0%} "
            "while a trial ran, so predicted against measured is unreliable here (rerun on a quiet machine, "
            "or profile under the same load)")
