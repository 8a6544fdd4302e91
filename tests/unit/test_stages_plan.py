"""Per-stage plans (autotune/stages.py): JSON round trip, the rules with their one-line errors, and
the uniform plan as the special case."""

from __future__ import annotations

import json

import pytest

from autotune import stages as ST
from autotune.errors import InputError
from autotune.plan import Degrees, Plan, PlanError, check_schema, parse_inline
from autotune.specs.cluster import cluster_from_dict, local_cluster
from autotune.specs.model import load_model

TINY = load_model("tiny")  # 4 layers, 4 heads
MIXED = cluster_from_dict({"name": "mixed", "nodes": [
    {"count": 1, "devices_per_node": 4, "device": "A100-40GB"},
    {"count": 1, "devices_per_node": 4, "device": "V100-16GB"}], "inter_node": {"bandwidth": "25GB/s"}})


def staged(*stages, **kw) -> Plan:
    """stages: (layers, [(tp, devices), ...])."""
    return Plan(stages=tuple(ST.Stage(layers=n, replicas=tuple(ST.Replica(tp=t, devices=tuple(d)) for t, d in reps))
                             for n, reps in stages), dtype="fp16", **kw)


GOOD = staged((1, [(2, [4, 5]), (2, [6, 7])]), (3, [(1, [0]), (2, [2, 3])]))


def test_round_trip_and_schema():
    r = GOOD.resolve(TINY, MIXED, 64, 8)
    assert r.degrees.pp == 2 and r.degrees.dp == 2 and r.degrees.tp == 2 and r.world == 7
    assert r.shares.layers == (1, 3) and r.shares.samples == (4, 4)
    d = r.to_dict()
    assert d["schema_version"] == 3 and d["stages"][1]["replicas"][0] == {"tp": 1, "devices": [0]}
    check_schema(d)
    back = Plan.from_json(json.dumps(d))
    assert back == r and back.resolve(TINY, MIXED, 64, 8) == r
    # devices of the placement follow the stages: rank 4 is stage 1, replica 0 (device 0 = node 0)
    assert [(p.node, p.device) for p in r.placement][:5] == [(1, 0), (1, 1), (1, 2), (1, 3), (0, 0)]
    assert r.coords(5) == {"pp": 1, "dp": 1, "cp": 0, "hp": 0, "tp": 0}


def test_uniform_plans_keep_their_json():
    p = parse_inline("dp=2,pp=2").resolve(TINY, MIXED.__class__(name="u", groups=MIXED.groups[:1],
                                                               inter_node=MIXED.inter_node), 64, 8)
    assert "stages" not in p.to_dict()
    with pytest.raises(PlanError, match="schema_version 3"):
        Plan.from_dict({"schema_version": 2, "stages": [{"layers": 4, "replicas": [{"devices": [0]}]}]})


@pytest.mark.parametrize("stages,kw,match", [
    (((2, [(2, [0, 1])]), (1, [(1, [2])])), {}, r"layers \[2, 1\] add up to 3, expected 4"),
    (((2, [(1, [0]), (1, [1])]), (2, [(1, [2])])), {}, "same number of replicas"),
    (((2, [(2, [0, 1]), (4, [4, 5, 6, 7])]), (2, [(1, [2]), (3, [3])])), {}, r"tp\(3\)|does not divide"),
    (((2, [(2, [3, 4])]), (2, [(1, [0])])), {}, "crosses nodes"),
    (((2, [(1, [0])]), (2, [(1, [0])])), {}, "used twice"),
    (((2, [(1, [0])]), (2, [(1, [9])])), {}, "not in the cluster"),
    (((2, [(1, [0])]), (2, [(1, [1])])), {"schedule": "zbv"}, "does not run per-stage plans"),
    (((2, [(1, [0])]), (2, [(1, [1])])), {"zero_stage": 2}, "zero_stage"),
    (((2, [(2, [0])]), (2, [(1, [1])])), {}, r"1 devices for tp\(2\)"),
    # degrees that disagree with the stages' cp (a plan's degrees are its stages' envelope)
    (((2, [(1, [0])]), (2, [(1, [1])])), {"degrees": Degrees(pp=2, cp=2)}, r"disagree with the stages'"),
])
def test_rules_name_what_is_wrong(stages, kw, match):
    with pytest.raises(PlanError, match=match) as e:
        staged(*stages, **kw).resolve(TINY, MIXED, 64, 8)
    assert "\n" not in str(e.value)


def test_tp_that_does_not_divide_the_heads_is_refused():
    assert ST.tp_problems(3, TINY) and not ST.tp_problems(2, TINY)
    assert ST.nesting_problem((1, 2, 4)) is None and "does not divide" in ST.nesting_problem((2, 3))


@pytest.mark.parametrize("bad,match", [
    ([], "non-empty"), ([{"layers": 4}], "replicas"), ([{"layers": 4, "replicas": [{"devices": [-1]}]}], "device"),
    ([{"layers": 4, "replicas": [{"devices": [0]}], "tp": 2}], "unknown"),
])
def test_bad_json_is_one_line(bad, match):
    with pytest.raises(InputError, match=match):
        Plan.from_dict({"stages": bad})


def test_uniform_plan_as_stages_resolves_to_the_same_mesh():
    u = parse_inline("dp=2,pp=2,tp=2,dtype=fp16").resolve(TINY, MIXED, 64, 8)
    st = ST.as_stages(u, MIXED)
    s = Plan(stages=st, dtype="fp16").resolve(TINY, MIXED, 64, 8)
    assert s.placement == u.placement and s.shares.layers == u.shares.layers and s.degrees == u.degrees
    assert ST.is_uniform(st) and not ST.is_uniform(GOOD.stages)
    assert ST.inline(GOOD.stages) == "1L(tp2x2) | 3L(tp1x1+tp2x1)"


def test_interleaved_chunks_split_each_stage():
    p = staged((3, [(1, [0])]), (1, [(1, [4])]), schedule="interleaved_1f1b", virtual_stages=2)
    with pytest.raises(PlanError, match="virtual_stages"):
        p.resolve(TINY, MIXED, 64, 8)
    p = staged((2, [(1, [0])]), (2, [(1, [4])]), schedule="interleaved_1f1b", virtual_stages=2)
    assert p.resolve(TINY, MIXED, 64, 8).shares.layers == (1, 1, 1, 1)


def test_scaled_keeps_the_shape_on_fewer_devices():
    from autotune.specs import local_cluster

    sailor = (ST.Stage(layers=1, replicas=(ST.Replica(tp=4, devices=(8, 9, 10, 11)), ST.Replica(tp=4, devices=(12, 13, 14, 15)))),
              *(ST.Stage(layers=1, replicas=(ST.Replica(tp=1, devices=(2 * i,)), ST.Replica(tp=1, devices=(2 * i + 1,))))
                for i in range(3)))
    mixed = (ST.Stage(layers=2, replicas=(ST.Replica(tp=1, devices=(0,)), ST.Replica(tp=1, devices=(1,)),
                                          ST.Replica(tp=4, devices=(4, 5, 6, 7)))),
             ST.Stage(layers=2, replicas=tuple(ST.Replica(tp=1, devices=(i,)) for i in (2, 3, 8))))
    for stages, kept in ((sailor, lambda s: len({r.tp for st in s for r in st.replicas}) > 1),
                         (mixed, lambda s: any(len(set(st.tps)) > 1 for st in s))):
        small = ST.scaled(stages, 4, TINY)
        assert kept(small) and sum(st.layers for st in small) == TINY.layers
        p = Plan(stages=small, dtype="fp32", schedule="gpipe").resolve(TINY, local_cluster(4), 64, 8)
        assert p.world == 4


@pytest.mark.parametrize("stages, once", [
    ([{"layers": 2, "replicas": [{"tp": 2, "devices": [0, 1]}]},
      {"layers": 2, "replicas": [{"tp": 2, "devices": [1, 0]}]}], "devices 1, 0 are used twice (also in stages[0]"),
    ([{"layers": 2, "replicas": [{"tp": 2, "devices": [0, 0]}]},
      {"layers": 3, "replicas": [{"tp": 2, "devices": [1, 2]}]}], "device 0 is used twice (listed twice in it)"),
])
def test_stage_errors_name_the_file_once_each(capsys, tmp_path, stages, once):
    """estimate and apply of a plan file: one line starting with the file's name, each field named
    once (no "stages: stages:"), a device two replicas share reported once (issue 39 item 8)."""
    from helpers.cli import cli

    f = tmp_path / "staged.json"
    f.write_text(json.dumps({"stages": stages}))
    for cmd in ("estimate", "apply"):
        code, out, err = cli(capsys, cmd, "-m", "tiny", "-c", "local:4", "-s", "128", "-b", "4", "-p", str(f))
        line = err.strip()
        assert code == 2 and "\n" not in line, err
        assert line.startswith(f"error: {f}: stages"), line
        assert "stages: stages" not in line and line.count("used twice") == 1 and once in line, line


def test_a_per_stage_plan_writes_no_heads_share_for_its_cells():
    """Cells of different tp attend different heads per tp rank (heads / own tp): the resolved plan
    holds no one heads share (before: heads / the largest tp, wrong for every other cell), and each
    cell's priced heads are its own tp's."""
    from autotune.cost.stages import staged_step_context, staged_tp_groups

    plan = Plan(stages=(ST.Stage(layers=2, replicas=(ST.Replica(tp=2, devices=(0, 1)),)),
                        ST.Stage(layers=2, replicas=(ST.Replica(tp=1, devices=(2,)),))))
    cluster = local_cluster(3)
    rp = plan.resolve(TINY, cluster, 32, 2)
    assert rp.shares.heads is None and Plan.from_dict(rp.to_dict()).resolve(TINY, cluster, 32, 2) == rp
    s = staged_step_context(rp, TINY, cluster, 32, 2, None)
    assert sorted({(ctx.step.tp, ctx.heads) for _, _, ctx in staged_tp_groups(s)}) == [(1, TINY.heads), (2, TINY.heads // 2)]


@pytest.mark.parametrize("stages, once", [
    ([{"layers": 2, "replicas": [{"tp": 2, "devices": [0, 1]}]},
      {"layers": 2, "replicas": [{"tp": 2, "devices": [1, 0]}]}], "devices 1, 0 are used twice (also in stages[0]"),
    ([{"layers": 2, "replicas": [{"tp": 2, "devices": [0, 0]}]},
      {"layers": 2, "replicas": [{"tp": 2, "devices": [1, 2]}]}], "device 0 is used twice (listed twice in it)"),
])
def test_a_local_trial_refuses_devices_used_twice_as_estimate_does(stages, once):
    """A local trial numbers a per-stage plan's devices anew (rank r on process r): it ran a plan whose
    replicas share devices as if they were distinct, where estimate and apply refuse it. It is
    refused in estimate's words, before any process starts (prepare)."""
    from autotune.runtime.trial import prepare

    plan = Plan.from_dict({"stages": stages})
    with pytest.raises(PlanError) as e:
        prepare(plan, "tiny", 128, 4, device="cpu")
    with pytest.raises(PlanError) as ref:
        plan.resolve(load_model("tiny"), local_cluster(4), 128, 4)
    assert once in e.value.message and e.value.message.count("used twice") == 1, e.value.message
    assert e.value.message in ref.value.message


def split(*stages, cp=1, hp=1, **kw) -> Plan:
    """stages: (layers, [(tp, devices), ...]), every replica at ``cp`` and ``hp`` (devices cp*hp*tp each)."""
    return Plan(stages=tuple(ST.Stage(layers=n, replicas=tuple(ST.Replica(tp=t, cp=cp, hp=hp, devices=tuple(d))
                                                                for t, d in reps)) for n, reps in stages),
                dtype="fp16", **kw)


def test_a_stage_splits_the_sequence_over_cp_and_hp():
    # stage 0: one V100 replica of tp 2 x cp 2; stage 1: one A100 replica of tp 1 x cp 2
    p = split((2, [(2, [4, 5, 6, 7])]), (2, [(1, [0, 1])]), cp=2).resolve(TINY, MIXED, 64, 8)
    assert p.degrees == Degrees(pp=2, cp=2, tp=2) and p.world == 6
    assert p.shares.tokens == (32, 32)  # zigzag halves: even in units of 2, as the uniform plan's
    assert [p.coords(r)["cp"] for r in range(6)] == [0, 0, 1, 1, 0, 1]
    assert [p.coords(r)["tp"] for r in range(6)] == [0, 1, 0, 1, 0, 0]
    assert ST.inline(p.stages) == "2L(cp2.tp2x1) | 2L(cp2.tp1x1)"
    d = p.to_dict()
    assert d["stages"][0]["replicas"][0] == {"tp": 2, "cp": 2, "devices": [4, 5, 6, 7]}
    check_schema(d)
    assert Plan.from_json(json.dumps(d)) == p
    h = split((2, [(1, [0, 1])]), (2, [(2, [4, 5, 6, 7])]), hp=2).resolve(TINY, MIXED, 64, 8)
    assert h.degrees == Degrees(pp=2, hp=2, tp=2) and [h.coords(r)["hp"] for r in range(6)] == [0, 1, 0, 0, 1, 1]


@pytest.mark.parametrize("stages,match", [
    # every replica splits the sequence alike: the hop passes each shard to the same shard
    ((ST.Stage(layers=2, replicas=(ST.Replica(tp=1, cp=2, devices=(0, 1)),)),
      ST.Stage(layers=2, replicas=(ST.Replica(tp=1, devices=(4,)),))), r"same cp and hp .* \[\(1, 1\), \(2, 1\)\]"),
    ((ST.Stage(layers=4, replicas=(ST.Replica(tp=2, cp=2, devices=(0, 1, 2)),)),), r"3 devices for cp\(2\) x hp\(1\) x tp\(2\)"),
    # each tp group stays inside a node; the cp ring may cross nodes
    ((ST.Stage(layers=4, replicas=(ST.Replica(tp=2, cp=2, devices=(0, 1, 3, 4)),)),), r"\[3, 4\] crosses nodes"),
    ((ST.Stage(layers=4, replicas=(ST.Replica(tp=4, hp=4, devices=tuple(range(16))),)),), r"hp\(4\) > heads per tp rank\(2\)"),
])
def test_split_rules_name_what_is_wrong(stages, match):
    with pytest.raises(PlanError, match=match) as e:
        Plan(stages=stages, dtype="fp16").resolve(TINY, MIXED, 64, 8)
    assert "\n" not in str(e.value)


def test_a_cp_ring_may_cross_nodes():
    p = split((4, [(1, [0, 4])]), cp=2).resolve(TINY, MIXED, 64, 8)
    assert p.world == 2 and p.shares.tokens == (32, 32)
    with pytest.raises(PlanError, match="shares.tokens"):  # 63 tokens do not split into zigzag halves
        split((4, [(1, [0, 4])]), cp=2).resolve(TINY, MIXED, 63, 8)


def test_uniform_cp_plan_as_stages_resolves_to_the_same_mesh():
    u = parse_inline("pp=2,cp=2,hp=2,dtype=fp16").resolve(TINY, MIXED, 64, 8)
    s = Plan(stages=ST.as_stages(u, MIXED), dtype="fp16").resolve(TINY, MIXED, 64, 8)
    assert s.placement == u.placement and s.degrees == u.degrees and s.shares.tokens == u.shares.tokens
    assert [s.coords(r) for r in range(8)] == [u.coords(r) for r in range(8)]


def test_scaled_keeps_the_sequence_split_where_it_fits():
    # two stages of one replica each at tp 2 x cp 2 (8 devices) on 4 local processes: cp 2 kept, tp 1
    big = tuple(ST.Stage(layers=2, replicas=(ST.Replica(tp=2, cp=2, devices=tuple(range(4 * s, 4 * s + 4))),))
                for s in range(2))
    small = ST.scaled(big, 4, TINY)
    assert [(r.tp, r.cp, r.hp) for st in small for r in st.replicas] == [(1, 2, 1), (1, 2, 1)]
    p = Plan(stages=small, dtype="fp16").resolve(TINY, local_cluster(4), 64, 8)
    assert p.degrees.cp == 2 and p.world == 4
    # on 1 process the split cannot stay: one replica of tp 1, the whole sequence
    one = ST.scaled(big, 1, TINY)
    assert [(r.tp, r.cp, len(r.devices)) for st in one for r in st.replicas] == [(1, 1, 1)]
