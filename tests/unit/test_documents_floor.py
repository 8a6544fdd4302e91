"""A CP share candidate that cannot win is not reported, nor priced at the heavy work where the
typical work's step already shows it (issue 40): ``documents_summary.step_floor`` is a floor under
``expected_step`` whatever the heavy step gives, and ``estimate(..., beat=)`` answers None exactly
when the full price is no faster. The search estimator keeps the same plan as pricing every
candidate in full."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autotune.cost.estimate  # noqa: F401 - the package re-exports the function under this name
from autotune import documents as W
from autotune.cost import cp_shares as CPS
from autotune.cost import documents_estimator as DE
from autotune.cost import documents_summary as SUM
from autotune.plan import Plan
from autotune.specs import load_model
from autotune.specs.cluster import cluster_from_dict

E = sys.modules["autotune.cost.estimate"]
TINY = load_model("tiny")
DISTS = (W.lognormal(5.0, 1.2, n=4000, seed=1), W.LengthDistribution((32, 4096), (12800, 100)))


def _mixed() -> object:
    return cluster_from_dict({"name": "mix", "inter_node": {"bandwidth": "25GB/s"},
                              "nodes": [{"count": 1, "devices_per_node": 4, "device": "H100-SXM"},
                                        {"count": 1, "devices_per_node": 4, "device": "A100-80GB"}]})


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.integers(1, 8), st.integers(0, 2**32 - 1))
def test_the_floor_is_under_the_expected_step_whatever_the_heavy_step(reps, draws, seed):
    rng = np.random.default_rng(seed)
    x_t = float(rng.uniform(1, 10))
    x = rng.uniform(0.2, 3.0, size=(draws, reps)) * x_t
    x[rng.random(x.shape) < 0.2] = x_t  # replicas exactly at the typical work
    wk = SUM.Works(None, None, x_t, x_t * float(rng.uniform(1.01, 4)), np.zeros((1, 1)))
    a = rng.uniform(0.5, 2.0, size=reps)
    b = a + rng.uniform(-0.5, 2.0, size=reps)  # a heavy end may even come earlier (slope clamped at 0)
    steps = [float(a.max() + rng.uniform(0, 0.5)), float(b.max() + rng.uniform(0, 0.5))]
    assert SUM.step_floor(wk, x, a) <= SUM.expected_step(wk, x, [a, b], steps)


def _text(est) -> str:
    return json.dumps([est.predicted, est.breakdown, est.plan.to_dict()], sort_keys=True, default=str)


@pytest.mark.parametrize("dist", DISTS, ids=("lognormal", "two-mode"))
def test_beat_answers_none_exactly_when_the_plan_is_no_faster(dist, monkeypatch):
    cluster, seq, gb = _mixed(), 4096, 16
    heavy_skipped = 0
    for deg in ({"dp": 4, "cp": 2}, {"dp": 2, "cp": 4}, {"dp": 2, "cp": 2, "tp": 2}, {"dp": 8}):
        plan = Plan.from_dict({"degrees": deg, "doc_mask": True})
        full = E.estimate(plan, TINY, cluster, seq, gb, documents=dist, balances=("count", "cost"))
        t = full.predicted["step_time_s"]
        for beat in (t * 0.9, t * (1 - 1e-12), t, t * (1 + 1e-12), t * 1.1):
            steps = []
            real = E._step
            monkeypatch.setattr(E, "_step", lambda s, r=None, real=real, steps=steps: steps.append(1) or real(s, r))
            got = E.estimate(plan, TINY, cluster, seq, gb, documents=dist, balances=("count", "cost"), beat=beat)
            monkeypatch.setattr(E, "_step", real)
            if t >= beat:
                assert got is None, (deg, beat)
                heavy_skipped += len(steps) == 1 and SUM.works(full.plan, dist, seq, gb, False).varies
            else:
                assert got is not None and _text(got) == _text(full), (deg, beat)
    assert heavy_skipped > 0  # the floor spared the heavy step somewhere


def _every_candidate(plan, cluster, seq, gb, dist):
    """``cp_balanced`` without ``beat``: every candidate priced and reported, the fastest kept."""
    kw = {"balances": ("count", "cost")}
    base = E.estimate(plan, TINY, cluster, seq, gb, documents=dist, **kw)
    rp, best = base.plan, base
    start, g = rp.shares.tokens, rp.token_granule()
    target = DE._target(dist, seq, start, rp.cp_layout == "zigzag", g)
    tried = {start}
    for frac in DE.CP_STEPS:
        tokens = CPS.toward(start, target, frac, g)
        if tokens in tried:
            continue
        tried.add(tokens)
        import dataclasses

        cand = rp.replace(shares=dataclasses.replace(rp.shares, tokens=tokens))
        est = E.estimate(cand, TINY, cluster, seq, gb, documents=dist, **kw)
        if est.predicted["tokens_per_s"] > best.predicted["tokens_per_s"]:
            best = est
    return best


@pytest.mark.parametrize("dist", DISTS, ids=("lognormal", "two-mode"))
def test_cp_balanced_keeps_what_pricing_every_candidate_keeps(dist):
    cluster, seq, gb = _mixed(), 4096, 16
    for deg in ({"dp": 4, "cp": 2}, {"dp": 2, "cp": 4}, {"dp": 1, "cp": 8}, {"dp": 2, "cp": 2, "tp": 2}):
        plan = Plan.from_dict({"degrees": deg, "doc_mask": True})
        ref = _every_candidate(plan, cluster, seq, gb, dist)
        got = DE.cp_balanced(plan, TINY, cluster, seq, gb, dist, balances=("count", "cost"))
        ref_bd = dict(ref.breakdown)
        got_bd = dict(got.breakdown)
        for bd in (ref_bd, got_bd):  # cp_balanced notes the count shares' step on a candidate that won
            bd["documents"] = {k: v for k, v in bd["documents"].items() if k != "cp_tokens"}
        assert json.dumps([got.predicted, got_bd, got.plan.to_dict()], sort_keys=True, default=str) == \
            json.dumps([ref.predicted, ref_bd, ref.plan.to_dict()], sort_keys=True, default=str), deg
