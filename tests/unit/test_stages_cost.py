"""The cost model on per-stage plans (autotune/cost/stages.py), checked against uniform plans:

- a uniform plan written as stages prices bit for bit as the uniform plan (every rank's row);
- a cell of a per-stage plan at tp t costs what the same cell of a uniform tp=t plan costs
  (compute, memory), on the same devices;
- the gradient reduction of a stage whose replicas differ in tp moves what the uniform plan at the
  stage's smallest tp moves;
- a hop between stages of different tp costs what the runtime sends: one whole copy per receiver a
  sending tp rank serves (tests/distributed/test_stages_hop.py counts them);
- stages of different speed: moving layers from the slow stage to the fast one shortens the step.
"""

from __future__ import annotations

import pytest

from autotune import stages as ST
from autotune.cost.estimate import estimate
from autotune.plan import Plan, parse_inline
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model

M = load_model("tiny")
C = cluster_from_dict({"name": "mixed", "nodes": [
    {"count": 1, "devices_per_node": 4, "device": "A100-40GB"},
    {"count": 1, "devices_per_node": 4, "device": "V100-16GB"}], "inter_node": {"bandwidth": "25GB/s"}})
SEQ, GB = 128, 16


def cells(*stages):
    return tuple(ST.Stage(layers=n, replicas=tuple(ST.Replica(tp=t, devices=tuple(d)) for t, d in reps))
                 for n, reps in stages)


def knobs(u):
    return dict(dtype=u.dtype, schedule=u.schedule, virtual_stages=u.virtual_stages,
                micro_batch_size=u.micro_batch_size, zero_stage=u.zero_stage, recompute=u.recompute)


@pytest.mark.parametrize("txt", ["dp=2,pp=2,tp=2", "pp=2,tp=4,mbs=2", "dp=4,pp=2,zero=1", "dp=8",
                                 "pp=2,dp=2,tp=2,schedule=interleaved_1f1b,vpp=2,recompute=full",
                                 "pp=4,dp=2,schedule=gpipe,layers=1/1/1/1",
                                 # cp and hp inside the stages: the uniform plan's ring and Ulysses terms
                                 "dp=2,cp=2,tp=2", "pp=2,cp=2,hp=2", "pp=2,dp=2,cp=2,zero=1", "pp=2,hp=2,tp=2",
                                 "pp=2,cp=4,schedule=gpipe", "pp=2,dp=2,cp=2,cp_layout=contiguous",
                                 "pp=2,dp=2,hp=2,schedule=interleaved_1f1b,vpp=2,recompute=full"])
def test_uniform_plan_as_stages_prices_identically(txt):
    u = parse_inline(txt + ",dtype=fp16").resolve(M, C, SEQ, GB)
    s = Plan(stages=ST.as_stages(u, C), **knobs(u), cp_layout=u.cp_layout)
    a, b = estimate(u, M, C, SEQ, GB, timeline=True), estimate(s, M, C, SEQ, GB, timeline=True)
    assert a.predicted == b.predicted
    assert a.breakdown == b.breakdown


def _row(e, rank):
    return e.breakdown["ranks"][rank]


def test_a_cp_cell_costs_what_the_uniform_cp_cell_of_its_tp_costs():
    # stage 0: the V100s as one replica of tp 2 x cp 2; stage 1: two A100s as tp 1 x cp 2
    def split(*stages):
        return Plan(stages=tuple(ST.Stage(layers=n, replicas=(ST.Replica(tp=t, cp=2, devices=tuple(d)),))
                                 for n, t, d in stages), dtype="fp16")
    e = estimate(split((2, 2, [4, 5, 6, 7]), (2, 1, [0, 1])), M, C, SEQ, GB)
    e2 = estimate(split((2, 2, [4, 5, 6, 7]), (2, 2, [0, 1, 2, 3])), M, C, SEQ, GB)  # tp 2 x cp 2 everywhere
    e1 = estimate(split((2, 1, [4, 5]), (2, 1, [0, 1])), M, C, SEQ, GB)              # tp 1 x cp 2 everywhere
    for k in ("compute_s", "tp_comm_s", "cp_comm_s", "memory_bytes", "optimizer_s", "dp_comm_s"):
        for r in range(4):
            assert _row(e, r)[k] == _row(e2, r)[k], (k, r)        # the tp 2 V100 cells, both CP shards
        for r in range(2):
            assert _row(e, 4 + r)[k] == _row(e1, 2 + r)[k], (k, r)  # the tp 1 A100 cells
    assert _row(e, 0)["cp_comm_s"] > 0 and _row(e, 4)["cp_comm_s"] > 0
    # the hop from tp 2 to tp 1 moves each CP shard: half the tokens of a cp = 1 plan's hop
    one = estimate(Plan(stages=cells((2, [(2, [4, 5])]), (2, [(1, [0])])), dtype="fp16"), M, C, SEQ, GB)
    assert _row(e, 0)["pp_comm_s"] < _row(one, 0)["pp_comm_s"]


def test_a_cell_costs_what_the_uniform_cell_of_its_tp_costs():
    # stage 0: two tp=2 replicas on the V100s, stage 1: two tp=1 replicas on A100s
    s = Plan(stages=cells((2, [(2, [4, 5]), (2, [6, 7])]), (2, [(1, [0]), (1, [1])])), dtype="fp16")
    e = estimate(s, M, C, SEQ, GB)
    # references: the uniform tp=2 plan on the V100s' stage and the tp=1 plan on the A100s
    u2 = Plan(stages=cells((2, [(2, [4, 5]), (2, [6, 7])]), (2, [(2, [0, 1]), (2, [2, 3])])), dtype="fp16")
    u1 = Plan(stages=cells((2, [(1, [4]), (1, [5])]), (2, [(1, [0]), (1, [1])])), dtype="fp16")
    e2, e1 = estimate(u2, M, C, SEQ, GB), estimate(u1, M, C, SEQ, GB)
    for k in ("compute_s", "tp_comm_s", "memory_bytes", "optimizer_s", "dp_comm_s"):
        assert _row(e, 0)[k] == _row(e2, 0)[k], k      # the tp=2 V100 cell
        assert _row(e, 4)[k] == _row(e1, 2)[k], k      # the tp=1 A100 cell
    assert len(e.predicted["memory_bytes"]) == s.world == 6


def test_mixed_replicas_reduce_what_the_smallest_tp_moves():
    # stage 1's replicas run tp=1 and tp=2: the reduction moves parameters / 1
    mixed = Plan(stages=cells((2, [(1, [4]), (1, [5])]), (2, [(1, [0]), (2, [2, 3])])), dtype="fp16", zero_stage=1)
    ref = Plan(stages=cells((2, [(1, [4]), (1, [5])]), (2, [(1, [0]), (1, [2])])), dtype="fp16", zero_stage=1)
    same = Plan(stages=cells((2, [(1, [4]), (1, [5])]), (2, [(2, [0, 1]), (2, [2, 3])])), dtype="fp16", zero_stage=1)
    e, r, s2 = (estimate(p, M, C, SEQ, GB) for p in (mixed, ref, same))
    assert _row(e, 3)["dp_comm_s"] == _row(r, 3)["dp_comm_s"]      # the tp=2 replica waits for the tp=1 one
    assert _row(s2, 3)["dp_comm_s"] < _row(e, 3)["dp_comm_s"]      # replicas of equal tp=2 move half
    # memory: each rank shards its own tp shard over the replicas (ZeRO-1), as the uniform tp=2 plan
    assert _row(e, 3)["memory_bytes"] == _row(s2, 3)["memory_bytes"]


def test_hop_between_different_tp():
    # stage 0 at tp=2 (V100s 4, 5), stage 1 at tp=1 (A100 0): the runtime sends the activation whole
    # from tp rank 0 to the one receiver, and the gradient whole from the receiver to both tp ranks
    a = Plan(stages=cells((2, [(2, [4, 5])]), (2, [(1, [0])])), dtype="fp16")
    e = estimate(a, M, C, SEQ, GB)
    one = estimate(Plan(stages=cells((2, [(1, [4])]), (2, [(1, [0])])), dtype="fp16"), M, C, SEQ, GB)
    # references: the tp=1 -> tp=1 plan (one copy per send), and at micro-batch 2 (each send the
    # bytes of two micro-batch-1 copies, half as many sends)
    two = estimate(Plan(stages=cells((2, [(1, [4])]), (2, [(1, [0])])), dtype="fp16", micro_batch_size=2),
                   M, C, SEQ, GB)
    assert _row(e, 0)["pp_comm_s"] == _row(one, 0)["pp_comm_s"]        # forward: one whole copy
    assert _row(e, 2)["pp_comm_s"] == pytest.approx(2 * _row(two, 1)["pp_comm_s"], rel=1e-12)  # back: two
    assert _row(e, 2)["pp_comm_s"] > _row(one, 1)["pp_comm_s"]


def test_stages_of_different_speed():
    big = load_model("small")
    n = big.layers
    slow_heavy = Plan(stages=cells((n - 2, [(1, [4])]), (2, [(1, [0])])), dtype="fp16")
    fast_heavy = Plan(stages=cells((2, [(1, [4])]), (n - 2, [(1, [0])])), dtype="fp16")
    f, s = (estimate(p, big, C, 1024, GB).breakdown["stages"] for p in (fast_heavy, slow_heavy))
    assert f[0]["fwd_s"][0] < s[0]["fwd_s"][0] and f[1]["fwd_s"][0] > s[1]["fwd_s"][0]
    assert max(x["pipeline_s"] for x in f) < max(x["pipeline_s"] for x in s)
