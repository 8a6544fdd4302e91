"""Pricing packed windows with document masks (autotune/cost/documents.py) against references: the
masked pairs against a brute-force count, one document per window against today's price, the
kernel calls against the pairs, balancing and the wait for the slowest replica."""

from __future__ import annotations

import numpy as np
import pytest

from autotune import documents as W
from autotune.cost import documents as DOC
from autotune.cost.compute import causal_keys
from autotune.cost.documents_estimator import DocumentsEstimator
from autotune.cost.estimate import estimate
from autotune.plan import Plan
from autotune.runtime.documents import dense_mask
from autotune.specs import load_model, local_cluster

TINY = load_model("tiny")


def _brute(docs, segs):
    mask = dense_mask((tuple(docs),))[0, 0]
    rows = [p for a, n in segs for p in range(a, a + n)]
    return float(mask[rows].sum())


@pytest.mark.parametrize("tokens,zigzag", [((24,), False), ((8, 16), False), ((12, 12), True), ((4, 8, 6, 6), True)])
def test_masked_pairs_count_what_the_mask_keeps(tokens, zigzag):
    s = sum(tokens)
    segs = DOC.segments(tokens, zigzag, s)
    rng = np.random.default_rng(1)
    for _ in range(5):
        docs = W.sample_window(W.LengthDistribution((1, 3, 7, 30), (3, 3, 2, 1)), s, rng)
        for c in range(len(tokens)):
            assert DOC.masked_pairs(docs, segs[c]) == _brute(docs, segs[c])
            blocks = DOC.masked_blocks(docs, segs, c)  # the kernel calls cover the same pairs
            assert sum(q * (q + 1) / 2 if causal else q * k for q, k, causal in blocks) == _brute(docs, segs[c])
        # one document: the whole causal window, as the cost model counts it without documents
        for c in range(len(tokens)):
            assert DOC.masked_pairs((s,), segs[c]) == causal_keys(tokens, c, zigzag, s)


def test_one_document_per_window_prices_as_the_window_on_an_accelerator():
    """Documents of 10**6 tokens: a window of 4096 is one document but where one ends inside it (about
    0.4% of windows; the 128 drawn steps' 1,024 windows hold a few), so the price is the plain one
    within a hundred-thousandth."""
    cluster = _gpu_cluster()
    one = W.LengthDistribution((10**6,), (1,), "one long document")
    for deg in ({"dp": 4}, {"cp": 4}, {"tp": 4}, {"pp": 2, "dp": 2}, {"cp": 2, "hp": 2}):
        p = Plan.from_dict({"degrees": deg})
        a = estimate(p, TINY, cluster, 4096, 8)
        b = estimate(p.replace(doc_mask=True), TINY, cluster, 4096, 8, documents=one)
        assert b.predicted["step_time_s"] == pytest.approx(a.predicted["step_time_s"], rel=1e-5), deg
        assert b.predicted["memory_bytes"] == a.predicted["memory_bytes"]


def _gpu_cluster():
    from autotune.specs.cluster import cluster_from_dict

    return cluster_from_dict({"name": "g", "nodes": [{"count": 1, "devices_per_node": 4, "device": "H100-SXM",
                                                      "intra_node": {"bandwidth": "450GB/s"}}],
                              "inter_node": {"bandwidth": "25GB/s"}})


def test_short_documents_are_cheaper_and_without_a_distribution_nothing_changes():
    cl = local_cluster(4)
    dist = W.lognormal(4.0, 1.0, n=5000, seed=0)
    for deg in ({"dp": 4}, {"cp": 4}, {"hp": 2, "dp": 2}):
        p = Plan.from_dict({"degrees": deg, "dtype": "fp32"})
        full = estimate(p, TINY, cl, 2048, 8).predicted["step_time_s"]
        masked = estimate(p.replace(doc_mask=True), TINY, cl, 2048, 8, documents=dist)
        assert masked.predicted["step_time_s"] < full
        assert masked.breakdown["documents"]["digest"] == dist.digest()
        # doc_mask off, or no distribution: today's price exactly
        assert estimate(p, TINY, cl, 2048, 8, documents=dist).predicted["step_time_s"] == full
        assert estimate(p.replace(doc_mask=True), TINY, cl, 2048, 8).predicted["step_time_s"] == full


def test_the_step_waits_for_the_slowest_replica_and_balancing_shortens_the_wait():
    """Against the drawn steps themselves: each drawn step's price is at least the price of its
    slowest replica's work given to every replica (the max, not the mean), and dealing by cost never
    prices a step above dealing in order on these draws."""
    cl = local_cluster(4)
    dist = W.lognormal(5.0, 1.3, n=20000, seed=0)
    p = Plan.from_dict({"degrees": {"dp": 4}, "dtype": "fp32"})
    count = estimate(p.replace(doc_mask=True), TINY, cl, 2048, 8, documents=dist)
    cost = estimate(p.replace(doc_mask=True, balance="cost"), TINY, cl, 2048, 8, documents=dist)
    assert cost.predicted["step_time_s"] < count.predicted["step_time_s"]
    rp = p.replace(doc_mask=True).resolve(TINY, cl, 2048, 8)
    for work in DOC.drawn_work(rp, dist, 2048, 8, on_cpu=True):
        sums = [k[0] for k in work.keysums]
        heaviest = sums.index(max(sums))
        from dataclasses import replace

        from autotune.cost.context import step_context
        from autotune.cost.estimate import _price
        s = step_context(rp, TINY, cl, 2048, 8, None)
        step = _price(replace(s, doc_work=work), False)[0]["step_time_s"]
        every_heaviest = DOC.DocWork(tuple(work.keysums[heaviest] for _ in sums),
                                     tuple(work.ring[heaviest] for _ in sums),
                                     tuple(work.attn_seq[heaviest] for _ in sums))
        alone = _price(replace(s, doc_work=every_heaviest), False)[0]["step_time_s"]
        assert step == pytest.approx(alone, rel=1e-9)


def test_the_search_estimator_records_its_choice_of_balance():
    dist = W.lognormal(5.0, 1.3, n=20000, seed=0)
    est = DocumentsEstimator(dist)(Plan.from_dict({"degrees": {"dp": 4}, "dtype": "fp32"}), TINY,
                                       local_cluster(4), 2048, 8)
    assert est.plan.doc_mask and est.plan.balance == "cost"
    import pickle  # search workers receive the estimator pickled

    again = pickle.loads(pickle.dumps(DocumentsEstimator(dist)))
    assert again.dist == dist
    # the unpickled estimator prices as the original; the same seed draws the same windows when
    # drawn afresh, not read back from the cache
    plan = Plan.from_dict({"degrees": {"dp": 4}, "dtype": "fp32"})
    assert again(plan, TINY, local_cluster(4), 2048, 8).predicted == est.predicted
    first = DOC.drawn_steps(dist, 2048, 8, 4, 0)
    DOC.drawn_steps.cache_clear()
    redrawn = DOC.drawn_steps(dist, 2048, 8, 4, 0)
    assert redrawn is not first and redrawn == first
    assert DOC.drawn_steps(dist, 2048, 8, 4, 1) != first  # another seed, other windows


def test_attention_runs_at_the_documents_length_not_the_windows():
    """The kernels' length (their efficiency on a measured GPU profile) follows the documents: the
    shard for one window-long document, much shorter for short documents."""
    plan = Plan.from_dict({"degrees": {"cp": 2, "dp": 2}}).resolve(TINY, _gpu_cluster(), 4096, 8)
    one = DOC.drawn_work(plan, W.LengthDistribution((10**6,), (1,)), 4096, 8, on_cpu=False)[0]
    assert one.attn_seq == ((2048.0, 2048.0), (2048.0, 2048.0))
    short = DOC.drawn_work(plan, W.LengthDistribution((64,), (1,)), 4096, 8, on_cpu=False)[0]
    assert all(0 < x < 2048 / 16 for row in short.attn_seq for x in row)


def _mixed_cluster():
    from autotune.specs.cluster import cluster_from_dict

    return cluster_from_dict({"name": "mix", "inter_node": {"bandwidth": "25GB/s"},
                              "nodes": [{"count": 1, "devices_per_node": 4, "device": "H100-SXM",
                                         "intra_node": {"bandwidth": "450GB/s"}},
                                        {"count": 1, "devices_per_node": 4, "device": "A100-80GB",
                                         "intra_node": {"bandwidth": "300GB/s"}}]})


@pytest.mark.parametrize("deg,cluster,rel", [
    ({"dp": 2}, "cpu", 1e-4), ({"tp": 4}, "gpu", 1e-4), ({"dp": 4}, "gpu", 1e-4), ({"dp": 2, "cp": 2}, "gpu", 1e-4),
    ({"dp": 4, "tp": 2}, "mixed", 1e-3), ({"dp": 2, "pp": 2, "tp": 2}, "mixed", 1e-3),
    ({"dp": 2, "cp": 2, "tp": 2}, "mixed", 1e-3)])
@pytest.mark.parametrize("balance", ["count", "cost"])
def test_summarised_step_is_the_mean_over_every_drawn_step_priced(deg, cluster, rel, balance):
    """The summarised price (two works priced, each replica on its line, ``documents_summary``) against
    the drawn-step reference: every one of the DRAWS steps priced by the whole model, replica by
    replica (``GivenWindows``), and their mean. Exact where a replica's time is linear in its pairs
    (one device type: within 1e-4 here); with H100 and A100 replicas each replica's line is a secant
    through two works whose attention lengths differ: within 0.1% here (0.04% at most measured), 1%
    on llama3-8b at 32k on 8 H100 + 8 A100 (docs/figures.md)."""
    dist = W.lognormal(5.5, 1.3, n=20000, seed=0, max_len=65536)
    cl = {"cpu": local_cluster(2), "gpu": _gpu_cluster(), "mixed": _mixed_cluster()}[cluster]
    seq, gb = 2048, 8
    plan = Plan.from_dict({"degrees": deg, "doc_mask": True, "balance": balance})
    est = estimate(plan, TINY, cl, seq, gb, documents=dist)
    ref = estimate(plan, TINY, cl, seq, gb,
                   documents=DOC.GivenWindows(DOC.drawn_steps(dist, seq, gb, DOC.DRAWS, DOC.SEED)))
    got, want = est.predicted["step_time_s"], ref.predicted["step_time_s"]
    assert got == pytest.approx(want, rel=rel), (got, want)
    assert len(ref.breakdown["documents"]["priced_steps_s"]) == DOC.DRAWS
    assert len(est.breakdown["documents"]["priced_steps_s"]) == 2


def test_trial_windows_are_the_runtime_feeds():
    from autotune.runtime.documents import DocumentFeed

    dist = W.lognormal(5.0, 1.0, n=2000, seed=0)
    feed = DocumentFeed(dist.to_payload(), None, seed=3)
    given = DOC.trial_windows(dist, 512, 4, seed=3, first=2, count=2)
    assert given.steps == tuple(feed.docs(st, 0, 4, 4, 512) for st in (2, 3))
