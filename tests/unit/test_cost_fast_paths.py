"""The cost model's shortcuts against the computation they skip (issue 40: the same prices, faster):

- ``Links`` keeps its hash: equal to the value's, never carried by pickle, and a Links that differs
  in one link is another key of the rank-cost memo (another cost);
- ``context._new_rank_context`` builds the same context as the dataclass's ``__init__``;
- ``ring.ring_blocks`` (one object per distinct block) against the runtime's rule written out;
- ``pipeline_parallel.simulate_replicas`` shares a simulation only between replicas whose stages
  hold the same costs: each replica's against a simulation of that replica alone;
- the estimate of mixed devices, uneven samples and a MoE model, twice in a row (the second from the
  caches) and with every memo emptied, prices the same to the last bit.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from autotune.cost import context as CX
from autotune.cost import pipeline_parallel as PP
from autotune.cost import rank as RK
from autotune.cost import ring as RG
from autotune.cost.estimate import estimate
from autotune.cost.pipeline import simulate_cached
from autotune.cost.steps import step_context, tp_groups
from autotune.plan import parse_inline
from autotune.specs.cluster import Link, cluster_from_dict
from autotune.specs.model import load_model

M = load_model("tiny")
C = cluster_from_dict({"name": "mixed", "nodes": [
    {"count": 1, "devices_per_node": 4, "device": "A100-40GB"},
    {"count": 1, "devices_per_node": 4, "device": "V100-16GB"}], "inter_node": {"bandwidth": "25GB/s"}})
SEQ, GB = 128, 16


def _groups(txt: str) -> tuple:
    s = step_context(parse_inline(txt + ",dtype=fp16"), M, C, SEQ, GB, None)
    return s, tp_groups(s)


def test_links_hash_is_the_values_and_one_link_apart_is_another_cost():
    s, groups = _groups("dp=2,pp=2,tp=2")
    ctx = groups[0][2]
    a = ctx.links
    b = dataclasses.replace(a)  # equal value, another object
    assert a is not b and a == b and hash(a) == hash(b)
    assert hash(a) == hash(tuple(getattr(a, f) for f in CX._LINKS_FIELDS))
    slower = Link(bandwidth=a.dp.bandwidth / 2, latency=a.dp.latency, kind=a.dp.kind)
    c = dataclasses.replace(a, dp=slower)
    assert c != a and hash(c) != hash(a)
    back = pickle.loads(pickle.dumps(a))
    assert "_hash" not in back.__dict__ and back == a and hash(back) == hash(a)
    # the memo tells them apart: the gradient reduction over the slower link costs more
    RK._MEMO.clear()
    RK._FIXED.clear()
    fast = RK.rank_cost_memo(ctx)
    slow = RK.rank_cost_memo(dataclasses.replace(ctx, links=c))
    assert slow.dp_comm_s > fast.dp_comm_s
    assert RK.rank_cost_memo(dataclasses.replace(ctx, links=b)) is fast


def test_new_rank_context_is_the_dataclass_init():
    _, groups = _groups("dp=2,pp=2,cp=2")
    for _, _, ctx in groups:
        fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(CX.RankContext)}
        assert CX._new_rank_context(**fields) == CX.RankContext(**fields)
    fields.pop("tokens")
    with pytest.raises(TypeError):
        CX._new_rank_context(**fields)


def _reference_blocks(tokens, index, zigzag, seq_len):
    segs = RG.segments(tokens, zigzag, seq_len)
    keys = [(ks, kl) for row in segs for ks, kl in row if kl]
    return tuple((ql, kl, ks + kl > qs + 1) for qs, ql in segs[index] if ql for ks, kl in keys if ks < qs + ql)


@pytest.mark.parametrize("tokens", [(64, 64), (32, 32, 32, 32), (48, 16, 40, 24), (8,) * 16,
                                    (4,) * 96, tuple(2 * (1 + k % 5) for k in range(80))])  # numpy past 64 keys
@pytest.mark.parametrize("zigzag", [False, True])
def test_ring_blocks_are_the_runtime_rule(tokens, zigzag):
    seq = sum(tokens)
    RG.ring_blocks.cache_clear()
    for i in range(len(tokens)):
        got = RG.ring_blocks(tokens, i, zigzag, seq)
        ref = _reference_blocks(tokens, i, zigzag, seq)
        assert got == ref and [tuple(map(type, b)) for b in got] == [tuple(map(type, b)) for b in ref]
        # equal blocks are one object (a cached layout costs a pointer per block)
        firsts = {}
        assert all(firsts.setdefault(b, b) is b for b in got)


@pytest.mark.parametrize("txt", ["dp=8,samples=3/3/3/3/1/1/1/1", "dp=4,pp=2,samples=6/2/6/2",
                                 "dp=2,pp=2,tp=2,schedule=zbv,vpp=2"])
def test_each_replica_gets_its_own_simulation(txt):
    # uneven samples over mixed devices: replicas differ in micro-batches and in stage costs
    plan = parse_inline(txt + ",mbs=1,dtype=fp16")
    s = step_context(plan, M, C, SEQ, GB, None)
    costs = {}
    groups = [(r0, d, ctx, costs.setdefault(id(ctx), RK.rank_cost(ctx))) for r0, d, ctx in tp_groups(s)]
    per = PP.replica_stages(groups)
    sims = PP.simulate_replicas(s, per)
    assert len({id(x) for x in sims}) == len({(s.microbatches[d], *(tuple(per[(d, st)]) for st in range(s.pp)))
                                              for d in range(s.dp)})
    for d in range(s.dp):
        simulate_cached.cache_clear()
        alone = dataclasses.replace(s, degrees=dataclasses.replace(s.degrees, dp=1), microbatches=(s.microbatches[d],))
        ref = PP.simulate_replicas(alone, {(0, st): per[(d, st)] for st in range(s.pp)})[0]
        assert sims[d].m == s.microbatches[d]
        assert (sims[d].fwd, sims[d].bwd, sims[d].p2p, sims[d].wgt) == (ref.fwd, ref.bwd, ref.p2p, ref.wgt)
        assert sims[d].rank_finish == ref.rank_finish and sims[d].rank_busy == ref.rank_busy


def _forget() -> None:
    RK._MEMO.clear()
    RK._FIXED.clear()
    CX._MESH_LINKS.clear()
    CX._PLACE_TOKENS.clear()
    RG.ring_blocks.cache_clear()
    simulate_cached.cache_clear()


@pytest.mark.parametrize("model,txt", [
    ("tiny", "dp=2,pp=2,tp=2,layers=1/3"), ("tiny", "pp=2,cp=2,hp=2,mbs=1"),
    ("tiny", "dp=8,zero=1"), ("tiny", "pp=2,cp=4,cp_layout=zigzag,schedule=gpipe"),
    ("tiny-moe", "dp=4,pp=2,ep=2"), ("tiny-moe", "dp=8,ep=4")])
def test_cached_estimates_match_cold_ones(model, txt):
    m = load_model(model)
    plan = parse_inline(txt + ",dtype=fp16")
    _forget()
    cold = estimate(plan, m, C, SEQ, GB, timeline=True)
    warm = estimate(plan, m, C, SEQ, GB, timeline=True)
    assert (cold.predicted, cold.breakdown) == (warm.predicted, warm.breakdown)
