"""Checking that no finished trial of a study is lost or recorded twice.

Every search process numbers the trials it records in the ``origin`` user attribute
(``<process id>:<n>``), so the trials of one origin in the storage must be exactly 0..n-1."""

from __future__ import annotations

from collections import defaultdict


def by_origin(trials) -> dict[str, list[int]]:
    """{process id: the numbers its trials carry}."""
    out: dict[str, list[int]] = defaultdict(list)
    for t in trials:
        proc, n = str(t.user_attrs["origin"]).rsplit(":", 1)
        out[proc].append(int(n))
    return out


def assert_no_gaps(trials) -> dict[str, list[int]]:
    """Every process numbers the trials it records 0, 1, ...: a gap is a lost trial, a repeat a duplicate."""
    seqs = by_origin(trials)
    for proc, ns in seqs.items():
        assert sorted(ns) == list(range(len(ns))), f"process {proc} lost or duplicated trials: {sorted(ns)[:50]}"
    return seqs
