"""The micro-batch a start grows to (search_spaces/_fill.py) against the cost model: the plan at that
micro-batch fits, and at twice it either does not fit or leaves the pipeline too few micro-batches."""

from __future__ import annotations

import pytest

from autotune.cost.estimate import estimate
from autotune.specs import ModelSpec
from autotune.specs.cluster import cluster_from_dict
from search_spaces import _fill
from search_spaces.base import SearchContext
from search_spaces.default import DefaultSpace

M = ModelSpec(name="m8", layers=8, hidden=2048, heads=16, kv_heads=16, ffn_hidden=8192, vocab=32000)
C = cluster_from_dict({"name": "mix8", "nodes": [
    {"count": 1, "devices_per_node": 4, "device": "A100-40GB"},
    {"count": 1, "devices_per_node": 4, "device": "V100-16GB"}], "inter_node": {"bandwidth": "25Gbit/s"}})
SEQ, GB = 4096, 256


@pytest.mark.parametrize("tp,pp,recompute", [(1, 2, "none"), (2, 2, "selective"), (1, 4, "none"), (4, 1, "none")])
def test_grown_micro_batch_fits_and_twice_it_does_not(tp, pp, recompute):
    space = DefaultSpace(SearchContext(model=M, cluster=C, seq_len=SEQ, global_batch=GB, dtype="fp16"))
    p = space.params(tp=tp, pp=pp, recompute=recompute, zero=1, placement="pp" if pp > 1 else "dp", balance=1.0)
    plan = space.build(p)
    e = estimate(plan, M, C, SEQ, GB)
    assert e.predicted["feasible"]
    samples = min(e.plan.shares.samples)
    mbs = _fill.largest_micro_batch(e.breakdown["ranks"], samples, pp, 64)
    assert mbs >= 1

    def fits(k: int) -> bool | None:
        q = space.build({**p, "mbs_exp": k.bit_length() - 1})
        return None if not hasattr(q, "degrees") else estimate(q, M, C, SEQ, GB).predicted["feasible"]

    if mbs > 1:
        assert fits(mbs) is not False
    if 2 * mbs <= min(64, samples // pp):
        assert fits(2 * mbs) is not True
