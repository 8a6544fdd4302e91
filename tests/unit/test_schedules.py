"""Every registered pipeline schedule keeps the contract of ``autotune.schedules.base.Schedule``:
its placement covers every model chunk once, its order runs every operation of its chunks once and
never deadlocks in the chain simulation, and the plan, the cost model and the exporters ask it
rather than its name."""

from __future__ import annotations

import pytest

from autotune.cost.pipeline import simulate
from autotune.errors import InputError
from autotune.plan import SCHEDULES, Degrees, Plan, PlanError
from autotune.schedules import EXPORT_TARGETS, B, F, I, UnknownSchedule, W, get_schedule, names, schedule_of
from autotune.specs import load_model
from autotune.specs.cluster import local_cluster

# the built-ins; a schedule module of another helper (helixpipe) registers itself and is checked too
BUILT_IN = ("gpipe", "1f1b", "interleaved_1f1b")


def shapes(name: str):
    """(p, v, m) the schedule's own rules accept, a few of each."""
    sched = get_schedule(name)
    for p in (2, 3, 4):
        for v in sched.virtual_stage_choices(p):
            if sched.check_shape(p, v):
                continue
            k = sched.microbatch_multiple(p, v)
            least = sched.min_microbatches(p, v)
            for m in sorted({max(k, -(-least // k) * k), 2 * max(k, least), 3 * k * p}):
                if not sched.check_microbatches(p, v, [m]):
                    yield p, v, m


def chain_schedules():
    """Registered schedules whose data flow is the chain of chunks (order, memory and simulation
    as ``base.Schedule`` reads them); HelixPipe's has its own tests (test_helix_*.py)."""
    return [n for n in names() if get_schedule(n).chain]


def test_plan_reads_the_registry():
    assert SCHEDULES == names()
    assert set(BUILT_IN) <= set(SCHEDULES)


def test_unknown_schedule_is_an_input_error_with_a_suggestion():
    with pytest.raises(UnknownSchedule, match=r"unknown schedule '1fb1'.*did you mean 1f1b"):
        get_schedule("1fb1")
    assert issubclass(UnknownSchedule, InputError)
    with pytest.raises(PlanError, match="schedule"):
        Plan.from_dict({"degrees": {"pp": 2}, "schedule": "zerobubble-typo"})


@pytest.mark.parametrize("name", names())
def test_placement_covers_every_chunk_once(name):
    sched = get_schedule(name)
    for p, v, _ in shapes(name):
        held = [j for s in range(p) for j in sched.stages_of_rank(s, p, v)]
        assert sorted(held) == list(range(p * v)), (p, v)
        for s in range(p):
            assert all(sched.stage_rank(j, p, v) == s for j in sched.stages_of_rank(s, p, v))
            assert len(sched.stages_of_rank(s, p, v)) == v  # every rank holds v chunks


@pytest.mark.parametrize("name", chain_schedules())
def test_order_runs_each_operation_of_the_rank_once(name):
    sched = get_schedule(name)
    bwd_kinds = (I, W) if sched.splits_backward else (B,)
    for p, v, m in shapes(name):
        for s in range(p):
            ops = sched.op_order(p, v, m, s)
            want = {(k, j, i) for k in (F, *bwd_kinds) for j in sched.stages_of_rank(s, p, v) for i in range(m)}
            assert len(ops) == len(want) and set(ops) == want, (p, v, m, s)
            seen = set()
            for k, j, i in ops:  # within a rank: F before its backward, I before its W
                if k in (B, I):
                    assert (F, j, i) in seen
                if k == W:
                    assert (I, j, i) in seen
                seen.add((k, j, i))


@pytest.mark.parametrize("name", chain_schedules())
def test_chain_simulation_finishes_and_counts_all_work(name):
    sched = get_schedule(name)
    for p, v, m in shapes(name):
        n = p * v
        fwd = tuple(1.0 + 0.1 * j for j in range(n))
        bwd = tuple(2.0 * x for x in fwd)
        wgt = tuple(x / 2.0 for x in bwd) if sched.splits_backward else None
        sim = simulate(name, p, v, m, fwd, bwd, (0.05,) * (n - 1), wgt)
        for s in range(p):
            work = m * sum(fwd[j] + bwd[j] for j in sched.stages_of_rank(s, p, v))
            assert sim.rank_busy[s] == pytest.approx(work)
            assert sim.rank_finish[s] <= sim.makespan
        # the step is at least the busiest rank's work, and at least one micro-batch's critical path
        # (its forwards, then its input gradients back down the chain: W waits for nobody)
        assert sim.makespan >= max(sim.rank_busy) - 1e-9
        assert sim.makespan >= sum(fwd) + sum(bwd) - (sum(wgt) if wgt else 0.0) - 1e-9


@pytest.mark.parametrize("name", chain_schedules())
def test_in_flight_is_read_from_the_order(name):
    sched = get_schedule(name)
    for p, v, m in shapes(name):
        for s in range(p):
            layers = tuple(range(1, v + 1))
            held, last = sched.in_flight(p, v, m, s, layers)
            assert min(layers) <= held <= m * sum(layers)
            holds_last = p * v - 1 in sched.stages_of_rank(s, p, v)
            assert (1 <= last <= m) if holds_last else last == 0


@pytest.mark.parametrize("name", names())
def test_export_targets_either_name_or_refuse(name):
    sched = get_schedule(name)
    for target in EXPORT_TARGETS:
        why = sched.refusal(target)
        assert (why is None) == (target in sched.targets)
        if why is not None:
            assert why.strip()


def test_schedule_rules_reach_the_plan():
    """The plan's validation is the schedule's: interleaved needs pp >= 2 and micro-batches a
    multiple of pp; 1F1B at least pp micro-batches."""
    model, cluster = load_model("tiny"), local_cluster(4)
    with pytest.raises(PlanError, match="interleaved_1f1b needs pp >= 2"):
        Plan(degrees=Degrees(dp=4), schedule="interleaved_1f1b", virtual_stages=2).resolve(model, cluster, 64, 8)
    with pytest.raises(PlanError, match=r"1f1b needs at least pp\(4\) micro-batches"):
        Plan(degrees=Degrees(pp=4), schedule="1f1b").resolve(model, cluster, 64, 2)
    with pytest.raises(PlanError, match=r"divisible by pp\(2\)"):
        Plan(degrees=Degrees(pp=2, dp=2), schedule="interleaved_1f1b", virtual_stages=2).resolve(
            model, cluster, 64, 6)
    plan = Plan(degrees=Degrees(pp=2, dp=2), schedule="interleaved_1f1b", virtual_stages=2).resolve(
        model, cluster, 64, 8)
    assert schedule_of(plan) is get_schedule("interleaved_1f1b")
    assert [plan.stages_of_rank(s) for s in range(2)] == [(0, 2), (1, 3)]


def test_configured_instances_compare_by_options():
    a, b = get_schedule("1f1b"), get_schedule("1f1b")
    assert a is b and a == b and hash(a) == hash(b)
    assert a != get_schedule("gpipe")


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_closed_form_in_flight_matches_the_walk_of_the_order(name):
    """1F1B's and GPipe's in_flight (closed forms) against Schedule.in_flight's walk of op_order."""
    from autotune.schedules import get_schedule
    from autotune.schedules.base import Schedule

    sched = get_schedule(name)
    for p in (1, 2, 3, 5, 8):
        for m in (1, 2, 4, 7, 16):
            for s in range(p):
                assert sched.in_flight(p, 1, m, s, (3,)) == Schedule.in_flight(sched, p, 1, m, s, (3,)), (p, m, s)


def test_interleaved_in_flight_matches_the_walk_of_the_order():
    """Interleaved 1F1B's in_flight (prefix sums) against Schedule.in_flight's walk of op_order, with
    chunks of different layer counts (what the cost model's memory asks) and the stage program's ones."""
    from autotune.schedules import get_schedule
    from autotune.schedules.base import Schedule

    sched = get_schedule("interleaved_1f1b")
    for p in (2, 3, 4, 5, 8):
        for v in (2, 3, 4):
            for m in (p, 2 * p, 3 * p, 8 * p):
                for layers in ((1,) * v, tuple(range(1, v + 1)), tuple(range(2 * v, v, -1))):
                    for s in range(p):
                        got = sched.in_flight(p, v, m, s, layers)
                        assert got == Schedule.in_flight(sched, p, v, m, s, layers), (p, v, m, s, layers)
                        assert all(type(x) is int for x in got)
