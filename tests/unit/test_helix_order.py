"""HelixPipe's order of operations (``autotune.schedules.helixpipe.rank_order``) on its own, and its
simulation against the hand-derived figures of the schedule (ideal links, backward = 2 x forward)."""

from __future__ import annotations

from collections import Counter

import pytest

from autotune.cost import helixpipe as HC
from autotune.cost.pipeline import simulate as simulate_chain
from autotune.schedules import helixpipe as H

SHAPES = [(2, 2, 2, 1), (2, 4, 4, 2), (4, 4, 4, 1), (4, 8, 16, 2), (3, 6, 6, 1), (8, 16, 16, 2)]


def unit_times(p, L, t_p=1.0, t_a=1.0, bwd=2.0, ends=(1.0, 1.0)):
    n = 2 * L + 1

    def t(k):
        if k == 0:
            return ends[0] * t_p
        if k == 2 * L:
            return ends[1] * t_p
        return t_p if k % 2 == 0 else t_a

    fwd = tuple(tuple(t(k) for _ in range(p)) for k in range(n))
    return fwd, tuple(tuple(bwd * x for x in row) for row in fwd)


def ideal_links(p, t=0.0):
    m = tuple(tuple(0.0 if a == b else t for b in range(p)) for a in range(p))
    return (m, m)


@pytest.mark.parametrize("p,L,m,F", SHAPES)
def test_every_operation_once_on_its_rank(p, L, m, F):
    seen = Counter()
    for r in range(p):
        for op in H.rank_order(p, L, m, F, r):
            assert H.chain_rank(op.k, op.microbatch, p, F) == r
            seen[op] += 1
    want = {H.HelixOp(kind, k, mb) for kind in (H.FWD, H.BWD) for k in range(2 * L + 1) for mb in range(m)}
    assert set(seen) == want and set(seen.values()) == {1}


@pytest.mark.parametrize("p,L,m,F", SHAPES)
def test_every_forward_comes_before_every_backward_first_in_last_out(p, L, m, F):
    for r in range(p):
        order = H.rank_order(p, L, m, F, r)
        half = len(order) // 2
        assert all(op.kind == H.FWD for op in order[:half]) and all(op.kind == H.BWD for op in order[half:])
        assert [op.k for op in order[half:]] == [op.k for op in reversed(order[:half])]
        # the fold is the innermost loop: fold f + 1 runs the same operation right after fold f
        if F == 2:
            fwd = order[:half]
            for a, b in zip(fwd[::2], fwd[1::2], strict=True):
                assert (a.k, a.microbatch + 1) == (b.k, b.microbatch)


@pytest.mark.parametrize("p,L,m,F", SHAPES)
def test_dependencies_hold_in_the_simulated_times(p, L, m, F):
    fwd, bwd = unit_times(p, L, t_a=2.5)
    hops = ideal_links(p, 0.3)
    sim = HC.simulate(p, L, m, F, fwd, bwd, hops)
    for mb in range(m):
        for k in range(2 * L + 1):
            r = H.chain_rank(k, mb, p, F)
            start_f = sim.f_end[mb][k] - fwd[k][r]
            if k:
                src = H.chain_rank(k - 1, mb, p, F)
                assert start_f >= sim.f_end[mb][k - 1] + (hops[(k - 1) % 2][src][r] if src != r else 0) - 1e-9
            start_b = sim.b_end[mb][k] - bwd[k][r]
            assert start_b >= sim.f_end[mb][k] - 1e-9
            if k < 2 * L:
                src = H.chain_rank(k + 1, mb, p, F)
                assert start_b >= sim.b_end[mb][k + 1] + (hops[k % 2][src][r] if src != r else 0) - 1e-9


@pytest.mark.parametrize("p,L,m,F", SHAPES)
def test_attention_is_balanced_and_rotates(p, L, m, F):
    for mb in range(m):
        per_rank = Counter(H.chain_rank(2 * i + 1, mb, p, F) for i in range(L))
        assert set(per_rank.values()) == {L // p} and len(per_rank) == p
    # the p offsets of a group run one layer's attention on p different ranks
    for i in range(L):
        assert {H.attention_rank(i, d, p) for d in range(p)} == set(range(p))
    # offset 0 is an ordinary pipeline: attention of layer i on the rank of the block after it
    assert all(H.attention_rank(i, 0, p) == H.block_rank(i + 1, p) for i in range(L))
    # rank 0 holds both ends
    assert H.block_rank(0, p) == H.block_rank(L, p) == 0


def test_shapes_it_cannot_run_are_refused():
    assert any("divisible by pp(4)*helix_folds(2)" in x for x in H.problems(4, 8, 12, 2))
    assert any("layers(6) divisible by pp(4)" in x for x in H.problems(4, 6, 8, 1))
    assert H.problems(4, 8, 8, 2) == []
    with pytest.raises(ValueError, match="divisible"):
        H.rank_order(4, 8, 6, 1, 0)


def test_in_flight_is_every_microbatch_on_every_rank():
    p, L, m, F = 4, 8, 8, 2
    for r in range(p):
        held, logits = H.in_flight(p, L, m, F, r)
        ops_per_mb = sum(1 for k in range(2 * L + 1) if H.chain_rank(k, 0, p, F) == r)
        assert held == m * ops_per_mb
        assert logits == (m if r == 0 else 0)


# The hand-derived figures: with ideal links and unit parameter blocks, rank 0 (both ends: L/p + 1
# blocks) never waits, so the step is its work and the overhead over the mean rank's work is
# m (1 - 1/p) (t_Pf + t_Pb) = F (p - 1)(t_Pf + t_Pb) at m = pF, whatever t_A and L; 1F1B's bubble is
# (p - 1)(L/p)(t_P + t_A)(f + b).
@pytest.mark.parametrize("p,L,ratio", [(4, 32, 1.0), (8, 32, 1.0), (8, 32, 3.0), (16, 64, 1.0)])
def test_bubble_matches_the_hand_derived_figure_and_beats_1f1b(p, L, ratio):
    F, t_p = 2, 1.0
    m = p * F
    fwd, bwd = unit_times(p, L, t_p=t_p, t_a=ratio * t_p)
    sim = HC.simulate(p, L, m, F, fwd, bwd, ideal_links(p))
    overhead = sim.makespan - sum(sim.rank_busy) / p
    assert overhead == pytest.approx(F * (p - 1) * (t_p + 2 * t_p))
    assert sim.makespan == pytest.approx(sim.rank_busy[0])
    # 1F1B over the same layers (L/p whole layers per stage), simulated by the cost model
    layer = (t_p + ratio * t_p)
    chain = simulate_chain("1f1b", p, 1, m, (L / p * layer,) * p, (2 * L / p * layer,) * p, (0.0,) * (p - 1))
    bubble_1f1b = chain.makespan - chain.rank_busy[0]
    assert bubble_1f1b == pytest.approx((p - 1) * (L / p) * layer * 3)
    assert overhead < bubble_1f1b


def test_overhead_does_not_grow_with_attention_time():
    p, L, F = 4, 8, 2
    spans = []
    for ratio in (0.5, 1.0, 4.0):
        fwd, bwd = unit_times(p, L, t_a=ratio)
        sim = HC.simulate(p, L, p * F, F, fwd, bwd, ideal_links(p))
        spans.append(sim.makespan - sum(sim.rank_busy) / p)
    assert spans[0] == pytest.approx(spans[1]) == pytest.approx(spans[2])


def test_a_slow_link_between_two_ranks_that_are_not_neighbours_costs_time():
    """Every pair of pipeline ranks exchanges hops: a slow 0 <-> 2 link (not neighbours in a ring of 4)
    slows the helix, where a chain pipeline would never use it."""
    p, L, m, F = 4, 8, 8, 1
    fwd, bwd = unit_times(p, L)
    fast = ideal_links(p, 0.01)
    slow = [list(row) for row in fast[0]]
    slow[0][2] = slow[2][0] = 2.0
    slow_t = tuple(tuple(r) for r in slow)
    base = HC.simulate(p, L, m, F, fwd, bwd, fast).makespan
    assert HC.simulate(p, L, m, F, fwd, bwd, (slow_t, slow_t)).makespan > base + 1.0


def test_two_folds_hide_a_hop_that_one_fold_exposes():
    p, L = 4, 8
    fwd, bwd = unit_times(p, L)
    hop = ideal_links(p, 0.5)  # half an operation per hop
    over = {}
    for F in (1, 2):
        m = p * 2
        ideal = HC.simulate(p, L, m, F, fwd, bwd, ideal_links(p)).makespan
        over[F] = HC.simulate(p, L, m, F, fwd, bwd, hop).makespan - ideal
    assert over[2] < over[1]


def test_events_cover_each_rank_without_overlap():
    p, L, m, F = 4, 4, 8, 2
    fwd, bwd = unit_times(p, L, t_a=2.0)
    sim = HC.simulate(p, L, m, F, fwd, bwd, ideal_links(p, 0.2))
    ev = sim.events()
    for s in range(p):
        mine = sorted((e for e in ev if e["stage"] == s and e["kind"] != "comm"), key=lambda e: e["start"])
        assert mine[0]["start"] == 0.0 and mine[-1]["end"] == pytest.approx(sim.makespan)
        for a, b in zip(mine, mine[1:], strict=False):
            assert b["start"] == pytest.approx(a["end"])
    assert sum(1 for e in ev if e["kind"] == "fwd") == m * (2 * L + 1)


WEIGHTED = [(2, 8, 4, 1, (5, 3)), (4, 8, 8, 2, (3, 3, 1, 1)), (4, 8, 4, 1, (0, 4, 2, 2)), (3, 6, 6, 2, (1, 2, 3))]


@pytest.mark.parametrize("p,L,m,F,shares", WEIGHTED)
def test_weighted_attention_shares_keep_the_order_whole_and_deadlock_free(p, L, m, F, shares):
    seen = Counter()
    for r in range(p):
        for op in H.rank_order(p, L, m, F, r, shares):
            assert H.chain_rank(op.k, op.microbatch, p, F, shares) == r
            seen[op] += 1
    assert len(seen) == 2 * m * (2 * L + 1) and set(seen.values()) == {1}
    for mb in range(m):  # every micro-batch runs shares[r] of its attentions on rank r
        per_rank = Counter(H.chain_rank(2 * i + 1, mb, p, F, shares) for i in range(L))
        assert [per_rank.get(r, 0) for r in range(p)] == list(shares)
    fwd, bwd = unit_times(p, L, t_a=1.7)
    sim = HC.simulate(p, L, m, F, fwd, bwd, ideal_links(p, 0.1), shares)  # raises if the order deadlocks
    assert sim.makespan > 0


def test_even_shares_are_the_published_rotation():
    p, L = 4, 8
    even = (2, 2, 2, 2)
    assert H.attention_slots(even) == tuple(x % p for x in range(L))
    for i in range(L):
        for d in range(p):
            assert H.attention_rank(i, d, p, even) == H.attention_rank(i, d, p)


def test_attention_shares_that_do_not_add_up_are_refused():
    assert any("helix_attention" in x for x in H.problems(2, 8, 4, 1, (5, 4)))
    assert any("helix_attention" in x for x in H.problems(2, 8, 4, 1, (8,)))


def test_weighted_shares_balance_a_slow_rank():
    """Rank 1 twice as slow: giving it fewer attentions shortens the step."""
    p, L, m, F = 2, 8, 8, 2
    n = 2 * L + 1
    speed = (1.0, 2.0)
    fwd = tuple(tuple(1.0 * speed[r] for r in range(p)) for _ in range(n))
    bwd = tuple(tuple(2 * x for x in row) for row in fwd)
    links = ideal_links(p, 0.05)
    even = HC.simulate(p, L, m, F, fwd, bwd, links).makespan
    weighted = HC.simulate(p, L, m, F, fwd, bwd, links, (6, 2)).makespan
    assert weighted < even


def _walked_in_flight(p, L, m, F, r, shares=None):
    """The peaks by walking rank_order (forwards add, backwards take away), the reference."""
    held = peak = logits = peak_logits = 0
    for op in H.rank_order(p, L, m, F, r, shares):
        step = 1 if op.kind == H.FWD else -1
        held += step
        peak = max(peak, held)
        if op.k == 2 * L:
            logits += step
            peak_logits = max(peak_logits, logits)
    return peak, peak_logits


@pytest.mark.parametrize("p,L,m,F,shares", [(4, 8, 8, 2, None), (4, 8, 16, 1, (3, 1, 2, 2)),
                                            (2, 6, 4, 2, (5, 1)), (4, 12, 8, 1, (0, 4, 4, 4))])
def test_in_flight_counts_match_the_walked_order(p, L, m, F, shares):
    for r in range(p):
        assert H.in_flight(p, L, m, F, r, shares) == _walked_in_flight(p, L, m, F, r, shares)


def _scanned_forward(p, L, m, F, shares):
    """The list schedule as its docstring states it, every ready operation of every rank scanned
    each step: the reference ``_listed_forward``'s heaps must reproduce exactly."""
    per = L / p
    slow = min(x for x in shares if x > 0) / per
    dur = [1.0 / (x / per if x > 0 else slow) for x in shares]
    n, group = 2 * L + 1, p * F
    ready = [[] for _ in range(p)]
    ready[0] = [((mb // group, H.offset_of(mb, p, F), mb % F), 0.0, 0, mb) for mb in range(m)]
    free, out = [0.0] * p, [[] for _ in range(p)]
    for _ in range(m * n):
        best = None
        for r in range(p):
            if ready[r]:
                at = max(free[r], min(it[1] for it in ready[r]))
                item = min(it for it in ready[r] if it[1] <= at)
                if best is None or (at, r) < best[:2]:
                    best = (at, r, item)
        at, r, item = best
        ready[r].remove(item)
        key, _, k, mb = item
        out[r].append(H.HelixOp(H.FWD, k, mb))
        free[r] = at + dur[r]
        if k + 1 < n:
            g, d, f = key[0], H.offset_of(mb, p, F), mb % F
            ready[H.chain_rank(k + 1, mb, p, F, shares)].append(((g, d + k + 1, f), free[r], k + 1, mb))
    return tuple(tuple(o) for o in out)


@pytest.mark.parametrize("p,L,m,F,shares", [(2, 8, 8, 1, (5, 3)), (2, 8, 16, 2, (6, 2)), (3, 6, 12, 2, (0, 2, 4)),
                                            (4, 8, 16, 1, (3, 1, 2, 2)), (4, 16, 32, 2, (7, 1, 0, 8)),
                                            (8, 16, 16, 1, (4, 0, 2, 2, 1, 3, 2, 2))])
def test_listed_forward_matches_the_scanned_list_schedule(p, L, m, F, shares):
    assert H._listed_forward.__wrapped__(p, L, m, F, shares) == _scanned_forward(p, L, m, F, shares)
