"""Cost-balanced CP token shares (autotune/cost/cp_shares.py, documents_estimator.cp_balanced)
against references: the split of one whole causal document (S / sqrt(2) for two contiguous ranks),
the masked pairs each rank really gets over the drawn windows (``cost.documents.masked_pairs``),
uneven count shares kept in ratio, and the priced choice against pricing every candidate."""

from __future__ import annotations

import math
import statistics

import pytest

from autotune import documents as W
from autotune.cost import cp_shares as CPS
from autotune.cost import documents as DOC
from autotune.cost.documents_estimator import DocumentsEstimator, cp_balanced
from autotune.cost.estimate import estimate
from autotune.plan import Plan
from autotune.specs import load_model
from autotune.specs.cluster import cluster_from_dict

LOGNORMAL = W.lognormal(5.5, 1.3, n=20000, seed=0, max_len=65536)


def _rank_pairs(dist, seq, tokens, zigzag):
    """Mean masked pairs of each CP rank over the cost model's drawn windows (the reference)."""
    segs = DOC.segments(tokens, zigzag, seq)
    wins = [d for (d,) in DOC.drawn_steps(dist, seq, 1, DOC.DRAWS, DOC.SEED)]
    return [statistics.fmean(DOC.masked_pairs(w, segs[c]) for w in wins) for c in range(len(tokens))]


def test_one_causal_document_splits_at_s_over_sqrt2():
    seq = 4096
    whole = W.LengthDistribution((10**6,), (1,), "one long document")
    tokens = CPS.cost_tokens(CPS.key_profile(whole, seq), (seq // 2, seq // 2), False, 8)
    assert abs(tokens[0] - seq / math.sqrt(2)) <= 8 and sum(tokens) == seq
    # zigzag already balances a causal window: the rule leaves it even
    assert CPS.cost_tokens(CPS.key_profile(whole, seq), (seq // 2, seq // 2), True, 8) == (seq // 2, seq // 2)


@pytest.mark.parametrize("start,zigzag", [((2048, 2048), False), ((1024,) * 4, False), ((2048, 2048), True),
                                          ((1024,) * 4, True), ((1536, 2560), False), ((1024, 3072), True)])
def test_cost_shares_equalise_the_masked_pairs_each_rank_gets(start, zigzag):
    seq, g = 4096, 8
    tokens = CPS.cost_tokens(CPS.key_profile(LOGNORMAL, seq), start, zigzag, g)
    assert sum(tokens) == seq and all(t % g == 0 for t in tokens)
    pairs = _rank_pairs(LOGNORMAL, seq, tokens, zigzag)
    per_count = [p / (s / seq) for p, s in zip(pairs, start, strict=True)]  # work over the rank's count share
    assert max(per_count) / min(per_count) < 1.03, (tokens, pairs)
    if not zigzag:  # contiguous count shares are far from it: later ranks attend more keys
        even = _rank_pairs(LOGNORMAL, seq, start, zigzag)
        even_per_count = [p / (s / seq) for p, s in zip(even, start, strict=True)]
        assert max(even_per_count) / min(even_per_count) > 1.1


def _h100(n):
    return cluster_from_dict({"name": "h", "nodes": [{"count": 1, "devices_per_node": n, "device": "H100-SXM",
                                                        "intra_node": {"bandwidth": "450GB/s", "latency": "3us"}}]})


def test_cp_balanced_keeps_the_fastest_priced_candidate():
    """llama3-8b at 32k, contiguous CP over 4 H100s: the chosen shares price no slower than any
    candidate on the line, each priced on its own, and faster than the count shares."""
    model, seq, gb, dist = load_model("llama3-8b"), 32768, 4, W.lognormal(7.5, 1.3, n=20000, seed=0, max_len=10**6)
    plan = Plan.from_dict({"degrees": {"cp": 4}, "cp_layout": "contiguous", "doc_mask": True})
    cl = _h100(4)
    got = cp_balanced(plan, model, cl, seq, gb, dist)
    count = estimate(plan, model, cl, seq, gb, documents=dist)
    rp = count.plan
    target = CPS.cost_tokens(CPS.key_profile(dist, seq), rp.shares.tokens, False, rp.token_granule())
    import dataclasses
    cands = [estimate(rp.replace(shares=dataclasses.replace(rp.shares, tokens=CPS.toward(rp.shares.tokens, target, f,
                                                                                            rp.token_granule()))),
                      model, cl, seq, gb, documents=dist).predicted["step_time_s"] for f in (1 / 3, 2 / 3, 1.0)]
    assert got.predicted["step_time_s"] == pytest.approx(min(cands + [count.predicted["step_time_s"]]), rel=1e-12)
    assert got.predicted["step_time_s"] < count.predicted["step_time_s"]
    assert got.plan.shares.tokens != rp.shares.tokens and sum(got.plan.shares.tokens) == seq
    assert got.breakdown["documents"]["cp_tokens"]["by"] == "cost"
    # the search's estimator takes it where the plan fits (and can be told not to); this plan does not
    # fit (no ZeRO, no recomputation), and uneven shares free no memory, so it keeps its count shares (documents_estimator.SCREEN)
    fits = plan.replace(zero_stage=3, recompute="full")
    chosen = DocumentsEstimator(dist)(fits, model, cl, seq, gb)
    assert chosen.predicted["feasible"]
    assert chosen.plan.shares.tokens == cp_balanced(fits, model, cl, seq, gb, dist).plan.shares.tokens != rp.shares.tokens
    assert DocumentsEstimator(dist, cp_balance=False)(fits, model, cl, seq, gb).plan.shares.tokens == rp.shares.tokens
    assert DocumentsEstimator(dist)(plan, model, cl, seq, gb).plan.shares.tokens == rp.shares.tokens


@pytest.mark.parametrize("dist", [LOGNORMAL, W.LengthDistribution((32, 4096), (12800, 100)),
                                  W.LengthDistribution((10**6,), (1,))], ids=("lognormal", "two-mode", "one"))
def test_key_profile_is_each_positions_keys_counted_window_by_window(dist):
    """``key_profile`` (running sums of the pieces' starts) against the keys each query of each drawn
    window attends, position by position: the same floats."""
    seq = 4096
    acc = [0] * seq
    for (docs,) in DOC.drawn_steps(dist, seq, 1, DOC.DRAWS, DOC.SEED):
        p = 0
        for n in docs:
            for j in range(n):
                acc[p + j] += j + 1
            p += n
    assert CPS.key_profile(dist, seq) == tuple(a / DOC.DRAWS for a in acc)
    assert DOC._draw_pairs(dist, seq, 8, DOC.SEED) == [
        [W.attention_pairs(w) for w in st] for st in DOC.drawn_steps(dist, seq, 8, DOC.DRAWS, DOC.SEED)]
