"""The pipeline simulation against hand-derived schedule results (no constants from the code)."""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from autotune.cost.pipeline import op_order, peak_in_flight, simulate


def _uniform(schedule, p, m, f=1.0, b=2.0, v=1, c=0.0):
    n = p * v
    return simulate(schedule, p, v, m, (f,) * n, (b,) * n, (c,) * (n - 1))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 32), (8, 8), (8, 64), (1, 5)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule, p, m):
    # Narayanan et al. 2021: with equal stages the step is (m + p - 1)(F + B) and every stage idles
    # (p - 1)(F + B) of it.
    sim = _uniform(schedule, p, m)
    assert sim.makespan == pytest.approx((m + p - 1) * 3.0)
    for s in range(p):
        assert sim.bubble_fraction(s) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (2, 3, 6)])
def test_interleaved_bubble_shrinks_by_v(p, v, m):
    # Narayanan et al. 2021 section 2.2: with v chunks of 1/v the work the bubble is (p-1)(F+B)/v
    f, b = 1.0 / v, 2.0 / v
    sim = _uniform("interleaved_1f1b", p, m, f, b, v=v)
    assert sim.makespan == pytest.approx(m * 3.0 + (p - 1) * 3.0 / v)


@pytest.mark.parametrize("slow", [0, 1, 2, 3])
def test_slow_stage_sets_the_pace(slow):
    p, m, k = 4, 12, 3.0
    fwd = tuple(k if s == slow else 1.0 for s in range(p))
    bwd = tuple(2 * x for x in fwd)
    # GPipe: fill and drain through every stage once, the other m - 1 micro-batches at the slow
    # stage's rate: sum_j (F_j + B_j) + (m - 1)(F_k + B_k)
    gp = simulate("gpipe", p, 1, m, fwd, bwd, (0.0,) * (p - 1))
    assert gp.makespan == pytest.approx(sum(fwd) + sum(bwd) + (m - 1) * 3 * k)
    # 1F1B: the slow stage k starts after the forwards of the stages before it and is never idle
    # again (faster neighbours feed it and return gradients sooner than it needs them); after its
    # last backward the stages before it run theirs: sum_{j<k} (F_j + B_j) + m (F_k + B_k)
    ob = simulate("1f1b", p, 1, m, fwd, bwd, (0.0,) * (p - 1))
    assert ob.makespan == pytest.approx(sum(fwd[:slow]) + sum(bwd[:slow]) + m * 3 * k)
    assert ob.rank_busy[slow] == pytest.approx(m * 3 * k)
    assert ob.bubble_fraction(slow) < min(ob.bubble_fraction(s) for s in range(p) if s != slow)


def test_p2p_delay_adds_on_the_fill_and_drain_path():
    # gpipe, 2 stages, m micro-batches, transfer c each way: the last backward of stage 0 ends at
    # F + c + m*(F+B) on stage 1 ... derived: stage 1 starts at F + c, runs m F then m B (its own
    # forwards arrive every F, no faster than it works), stage 0's last B waits for stage 1's last B + c.
    F, B, c, m = 1.0, 2.0, 0.5, 4
    sim = simulate("gpipe", 2, 1, m, (F, F), (B, B), (c,))
    stage1_end = F + c + m * F + m * B
    # stage 0 runs its m backwards as the gradients arrive: the i-th leaves stage 1 at
    # F + c + m F + (i+1) B, and stage 0 then needs B for each one
    assert sim.rank_finish[1] == pytest.approx(stage1_end)
    assert sim.rank_finish[0] == pytest.approx(stage1_end + c + B)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (8, 16)])
def test_in_flight_micro_batches(p, m):
    # 1F1B keeps min(p - s, m) micro-batches of activations on stage s, GPipe all m; the second
    # figure (logits in flight) counts on the rank holding the last stage only
    for s in range(p):
        last = s == p - 1
        assert peak_in_flight("1f1b", p, 1, m, s, (3,)) == (3 * min(p - s, m), min(p - s, m) if last else 0)
        assert peak_in_flight("gpipe", p, 1, m, s, (3,)) == (3 * m, m if last else 0)


def test_orders_run_every_operation_once():
    for sched, p, v, m in [("1f1b", 4, 1, 8), ("gpipe", 3, 1, 5), ("interleaved_1f1b", 4, 2, 8)]:
        for s in range(p):
            ops = op_order(sched, p, v, m, s)
            assert sorted(ops) == sorted({(k, c * p + s, i) for k in (0, 1) for c in range(v) for i in range(m)})


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 24), extra=st.integers(1, 16),
       times=st.lists(st.floats(0.1, 5.0), min_size=6, max_size=6), schedule=st.sampled_from(["1f1b", "gpipe"]))
def test_more_micro_batches_never_a_larger_bubble_fraction(p, m, extra, times, schedule):
    m = max(m, p)
    fwd = tuple(times[:p])
    bwd = tuple(2 * x for x in fwd)

    def frac(mm):
        sim = simulate(schedule, p, 1, mm, fwd, bwd, (0.0,) * (p - 1))
        return 1.0 - sum(sim.rank_busy) / (p * sim.makespan)

    assert frac(m + extra) <= frac(m) + 1e-9


@settings(max_examples=60, deadline=None)
@given(p=st.integers(2, 5), m=st.integers(2, 12), c=st.floats(0.0, 2.0), dc=st.floats(0.0, 2.0),
       schedule=st.sampled_from(["1f1b", "gpipe"]))
def test_slower_links_never_speed_the_pipeline_up(p, m, c, dc, schedule):
    m = max(m, p)
    f = tuple(1.0 + 0.1 * s for s in range(p))
    b = tuple(2 * x for x in f)
    fast = simulate(schedule, p, 1, m, f, b, (c,) * (p - 1)).makespan
    slow = simulate(schedule, p, 1, m, f, b, (c + dc,) * (p - 1)).makespan
    assert slow >= fast - 1e-9


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 16), (8, 2, 16)])
def test_interleaved_first_stage_holds_p_plus_p_minus_1_over_v_micro_batches(p, v, m):
    # Narayanan et al. 2021 section 2.2.1: with interleaving the first stage keeps the activations of
    # p * (1 + (p - 1) / (p * v)) micro-batches' worth of its layers, i.e. p*v + p - 1 chunks
    peak, _ = peak_in_flight("interleaved_1f1b", p, v, m, 0, (1,) * v)
    assert peak == p * v + p - 1


def _reference_ends(schedule, p, v, m, fwd, bwd, p2p, wgt, p2p_back=None):
    """Each operation's end from its definition (the module docstring), by recursion: it starts when
    the operation before it on its rank has ended and its input has arrived."""
    import functools

    from autotune.schedules import B, F, W, as_schedule

    sched = as_schedule(schedule)
    n, last = p * v, p * v - 1
    rank = [sched.stage_rank(j, p, v) for j in range(n)]
    hop = [0.0 if rank[j] == rank[j + 1] else p2p[j] for j in range(n - 1)]
    back = hop if p2p_back is None else [0.0 if rank[j] == rank[j + 1] else p2p_back[j] for j in range(n - 1)]
    before, where = {}, {}
    for s in range(p):
        prev = None
        for op in sched.op_order(p, v, m, s):
            before[op], prev = prev, op
            where[(op.kind if op.kind in (F, W) else B, op.stage, op.microbatch)] = op

    @functools.cache
    def end(op):
        kind, j, i = op
        start = end(before[op]) if before[op] is not None else 0.0
        if kind == F:
            dep = end(where[(F, j - 1, i)]) + hop[j - 1] if j else 0.0
            d = fwd[j]
        elif kind == W:
            dep, d = end(where[(B, j, i)]), wgt[j]
        else:
            dep = end(where[(B, j + 1, i)]) + back[j] if j < last else end(where[(F, j, i)])
            d = bwd[j] if kind == B else bwd[j] - wgt[j]
        return max(start, dep) + d

    return {op: end(op) for op in before}


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["1f1b", "gpipe", "interleaved_1f1b", "zbv", "interleaved_zb"]), st.integers(1, 4),
       st.integers(1, 9), st.randoms(use_true_random=False))
def test_every_operation_ends_where_its_definition_puts_it(schedule, p, m, rng):
    # the simulation times operations in an order fixed once per shape (pipeline._program); the
    # reference times each one from the rule itself, whatever the order
    import sys

    from autotune.schedules import F, W, as_schedule

    sys.setrecursionlimit(10000)
    sched = as_schedule(schedule)
    v = sched.virtual_stage_choices(p)[-1]
    assume(not sched.check_shape(p, v) and not sched.check_microbatches(p, v, [m]))  # shapes it takes
    n = p * v
    fwd = tuple(rng.uniform(0.1, 2.0) for _ in range(n))
    bwd = tuple(f * rng.uniform(1.5, 2.5) for f in fwd)
    wgt = tuple(b * rng.uniform(0.2, 0.6) for b in bwd) if sched.splits_backward else None
    p2p = tuple(rng.choice([0.0, rng.uniform(0.0, 0.3)]) for _ in range(n - 1))
    # the gradients' hops back: the same as forward, or their own (stages of different tp)
    back = rng.choice([None, tuple(rng.choice([0.0, rng.uniform(0.0, 0.3)]) for _ in range(n - 1))])
    sim = simulate(schedule, p, v, m, fwd, bwd, p2p, wgt, back)
    ref = _reference_ends(schedule, p, v, m, fwd, bwd, p2p, wgt, back)
    for (kind, j, i), t in ref.items():
        got = sim.f_end[j][i] if kind == F else (sim.w_end[j][i] if kind == W else sim.b_end[j][i])
        assert got == pytest.approx(t, rel=1e-12, abs=1e-12), (kind, j, i)
    assert sim.makespan == pytest.approx(max(ref.values()), rel=1e-12)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved_1f1b", "zbv", "interleaved_zb"])
def test_program_walks_each_rank_in_its_order_after_what_it_waits_for(schedule):
    # pipeline._program writes each operation once, as the step simulate_chain walks: each rank's
    # operations in op_order, each after its rank's previous one and the one it waits for
    from autotune.cost.pipeline import _program
    from autotune.schedules import as_schedule

    sched = as_schedule(schedule)
    for p in (1, 2, 4):
        v = sched.virtual_stage_choices(p)[-1]
        for m in (4, 8, 12):
            if sched.check_shape(p, v) or sched.check_microbatches(p, v, [m]):
                continue
            prog = _program(sched, p, v, m)
            n = p * v
            for s in range(p):
                assert prog.rank_durs[s] == tuple(k * n + j for k, j, _i in sched.op_order(p, v, m, s))
            for k, (before, dep, _h, _d) in enumerate(prog.walk):
                assert before <= k and dep <= k  # 1-based indices of earlier operations (0: none)
            assert sorted(x for row in prog.f_at for x in row) == [
                k for k, w in enumerate(prog.walk) if w[3] < n]  # every forward placed once


@pytest.mark.parametrize("schedule,p,m", [("1f1b", 4, 200), ("interleaved_1f1b", 4, 64), ("zbv", 2, 100),
                                          ("interleaved_zb", 2, 48), ("gpipe", 3, 70), ("1f1b", 2, 3)])
def test_busy_seconds_are_the_running_total_in_the_order_each_rank_runs(schedule, p, m):
    # pipeline._busy sums a rank of many operations with numpy's accumulate: the same additions in the
    # same order as a running total (float ==, no tolerance)
    import random
    from functools import reduce
    from operator import add

    from autotune.schedules import F, W, as_schedule

    sched = as_schedule(schedule)
    v = sched.virtual_stage_choices(p)[-1]
    n = p * v
    rng = random.Random(p * 1000 + m)
    fwd = tuple(rng.uniform(1e-4, 3.0) for _ in range(n))
    bwd = tuple(f * rng.uniform(1.5, 2.5) for f in fwd)
    wgt = tuple(b * rng.uniform(0.2, 0.6) for b in bwd) if sched.splits_backward else None
    sim = simulate(schedule, p, v, m, fwd, bwd, tuple(rng.uniform(0, 0.1) for _ in range(n - 1)), wgt)
    for s in range(p):
        durs = [fwd[j] if k == F else (wgt[j] if k == W else (bwd[j] - wgt[j] if wgt is not None and k != 1 else bwd[j]))
                for k, j, _i in sched.op_order(p, v, m, s)]
        assert sim.rank_busy[s] == reduce(add, durs, 0.0)
