"""The tie-break rule (autotune/cost/tiebreak.py): simpler plans first among predictions that tie,
checked against its definition on random lists and on the case the issue names (a ZeRO-2 plan
priced like the identical ZeRO-1 plan)."""

from __future__ import annotations

import random

import pytest

from autotune.cost import tiebreak as T
from autotune.plan import Plan, parse_inline


def _plan(zero=0, shares=None, **deg):
    d = {"degrees": deg or {"dp": 1}, "zero_stage": zero}
    if shares:
        d["shares"] = shares
    return Plan.from_dict(d)


def _rank(pairs, **kw):
    return T.rank(pairs, plan=lambda x: x[0], tokens_per_s=lambda x: x[1], **kw)


def test_lower_zero_stage_wins_a_tie():
    z1, z2 = _plan(1, dp=8), _plan(2, dp=8)
    assert _rank([(z2, 1000.0), (z1, 1000.0)])[0][0] is z1
    assert _rank([(z2, 1005.0), (z1, 1000.0)])[0][0] is z1  # within 1%
    assert _rank([(z2, 1020.0), (z1, 1000.0)])[0][0] is z2  # beyond it the faster wins
    assert T.prefer(z1, 1000.0, z2, 1005.0) and not T.prefer(z2, 1005.0, z1, 1000.0)


def test_fewer_dimensions_then_even_shares_win_ties():
    dp8, dp4tp2 = _plan(dp=8), _plan(dp=4, tp=2)
    assert _rank([(dp4tp2, 1000.0), (dp8, 999.0)])[0][0] is dp8
    even, uneven = _plan(pp=2), _plan(pp=2, shares={"layers": [3, 1]})
    assert T.simplicity(even) < T.simplicity(uneven)
    assert _rank([(uneven, 1000.0), (even, 995.0)])[0][0] is even
    assert T.simplicity(_plan(3, dp=8)) > T.simplicity(_plan(0, dp=4, tp=2))  # ZeRO stage counts first


def test_rank_meets_its_definition_on_random_lists():
    """At every place: the item is within the tolerance of the fastest item not yet placed, and
    nothing else that ties with that fastest item is simpler."""
    rng = random.Random(13)
    plans = [parse_inline(x) for x in ("dp=8", "dp=8,zero=1", "dp=8,zero=2", "dp=8,zero=3", "dp=4,tp=2",
                                        "dp=2,tp=2,pp=2", "dp=4,cp=2,zero=1")]
    for _ in range(200):
        items = [(rng.choice(plans), rng.choice([1000.0, 1003.0, 1008.0, 1012.0, 990.0, 1100.0]))
                 for _ in range(rng.randint(1, 9))]
        out = _rank(items)
        assert sorted(map(id, out)) == sorted(map(id, items))
        for k, (p, tps) in enumerate(out):
            rest = out[k:]
            fastest = max(x[1] for x in rest)
            assert T.ties(tps, fastest)
            tied = [x for x in rest if T.ties(x[1], fastest)]
            assert T.simplicity(p) == min(T.simplicity(x[0]) for x in tied)
        assert _rank(items, top=2) == out[:2]
        assert T.best(items, plan=lambda x: x[0], tokens_per_s=lambda x: x[1]) is out[0]


@pytest.mark.parametrize("a,b,tie", [(1000.0, 1010.0, True), (1000.0, 1010.2, False), (0.0, 0.0, True)])
def test_tolerance_is_relative_to_the_larger(a, b, tie):
    assert T.ties(a, b) is tie
