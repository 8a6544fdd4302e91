"""What the runtime builds for every architecture the model spec accepts agrees with what the cost
model counts: the parameters of the built modules (whole, per tp shard, per pipeline rank with a
tied head's copy) against ``ModelSpec.param_count`` and ``cost.data_parallel.stage_params``, and the
matmul FLOPs of a forward (counted by torch) against the spec's FLOP formulas."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from autotune.cost.data_parallel import stage_params
from autotune.plan import Plan
from autotune.runtime.mesh import Axis
from autotune.runtime.model import (
    Layout,
    StageModel,
    build_on_meta,
    init_weights,
    shard_info,
    unsharded_layout,
)
from autotune.specs import ModelSpec, load_model, local_cluster

BASE = dict(layers=4, hidden=64, heads=8, kv_heads=4, ffn_hidden=96, vocab=128)


def _arch(activation, norm, position, bias, tied) -> ModelSpec:
    return ModelSpec(name=f"{activation}-{norm}-{position}-b{int(bias)}-t{int(tied)}", **BASE,
                     activation=activation, norm=norm, position=position,
                     max_positions=32 if position == "learned" else 0, bias=bias, tied_embeddings=tied)


# every combination the spec accepts
ARCHS = [_arch(*c) for c in itertools.product(("swiglu", "gelu"), ("rmsnorm", "layernorm"), ("rope", "learned"),
                                              (False, True), (False, True))]


def _stage(spec: ModelSpec, layout: Layout, layer_ids: list[int], first: bool, last: bool) -> StageModel:
    return build_on_meta(lambda: StageModel(spec, layout, layer_ids, first, last, seq_len=16))


def _count(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("spec", ARCHS, ids=lambda s: s.name)
def test_built_parameters_are_the_specs_count_whole_and_over_tp_shards(spec):
    assert _count(_stage(spec, unsharded_layout(), list(range(spec.layers)), True, True)) == spec.param_count()
    for tp in (2, 4):
        total, whole = 0, {}
        for i in range(tp):
            m = _stage(spec, Layout(tp=Axis(size=tp, index=i, ranks=list(range(tp)), group=None)),
                       list(range(spec.layers)), True, True)
            info = shard_info(m)
            for name, p in m.named_parameters():
                if info[name] is None:  # held whole by every tp rank: one parameter, tp copies
                    whole.setdefault(name, p.numel())
                else:
                    total += p.numel()
        assert total + sum(whole.values()) == spec.param_count()


@pytest.mark.parametrize("spec", [a for a in ARCHS if a.norm == "layernorm" and a.activation == "gelu"],
                         ids=lambda s: s.name)
@pytest.mark.parametrize("plan", [{"degrees": {"pp": 2}, "shares": {"layers": [1, 3]}},
                                  {"degrees": {"pp": 2}, "schedule": "interleaved_1f1b", "virtual_stages": 2},
                                  {"degrees": {"pp": 2}, "schedule": "zbv", "virtual_stages": 2}],
                         ids=["1f1b", "interleaved", "zbv"])
def test_each_pipeline_rank_holds_what_the_cost_model_counts(spec, plan):
    """The embedding and position table with the first chunk, the final norm and head with the last,
    a tied head's copy of the embedding where the last chunk sits on another rank."""
    p = Plan.from_dict({**plan, "dtype": "fp32"}).resolve(spec, local_cluster(2), 16, 8)
    chunks, start = [], 0
    for n in p.shares.layers:
        chunks.append(list(range(start, start + n)))
        start += n
    priced = stage_params(spec, p)
    for pp_i in range(p.degrees.pp):
        built = sum(_count(_stage(spec, unsharded_layout(), chunks[j], j == 0, j == len(chunks) - 1))
                    for j in p.stages_of_rank(pp_i))
        assert built == priced[pp_i][0], (pp_i, p.stages_of_rank(pp_i))
        assert priced[pp_i][1] == spec.layer_params() == _count(
            _stage(spec, unsharded_layout(), [0], False, False))


@pytest.mark.parametrize("spec", ARCHS[1::5] + [load_model("tiny")], ids=lambda s: s.name)
def test_forward_matmul_flops_are_the_specs(spec):
    """torch's FLOP counter over the built model's forward (every linear, biases riding in addmm, the
    LM head or tied embedding) equals the spec's per-token matmul FLOPs times the tokens."""
    m = StageModel(spec, unsharded_layout(), list(range(spec.layers)), True, True, seq_len=16)
    init_weights(m, spec, 0)
    m.reset_buffers()
    ids = torch.randint(0, spec.vocab, (2, 16))
    with FlopCounterMode(display=False) as fc:
        m(ids)
    counted = fc.get_flop_counts()["Global"]
    matmul = sum(v for k, v in counted.items() if str(k) in ("aten.mm", "aten.addmm", "aten.bmm", "aten.matmul"))
    tokens = 2 * 16
    assert matmul == tokens * (spec.layers * spec.layer_matmul_flops_fwd() + spec.head_flops_fwd())
