"""Each rank builds only its own shard (meta device, then materialise), and every split starts from
the same numbers: the shards of a tp=2 build, laid side by side, are the unsharded build's weights."""

from __future__ import annotations

import pytest
import torch

from autotune.runtime.mesh import Axis
from autotune.runtime.model import (
    Layout,
    StageModel,
    build_on_meta,
    materialize,
    shard_info,
    unsharded_layout,
)
from autotune.specs import ModelSpec, load_model

# OPT-style: biases (column-parallel ones split with their rows), LayerNorm, a learned position table
OPT = ModelSpec(name="opt-like", layers=2, hidden=64, heads=8, kv_heads=4, ffn_hidden=176, vocab=256,
                activation="gelu", norm="layernorm", position="learned", max_positions=16, bias=True,
                tied_embeddings=True)


def _build(layout: Layout, layers: list[int], first: bool = True, spec: ModelSpec | None = None) -> StageModel:
    spec = spec or load_model("tiny")
    m = build_on_meta(lambda: StageModel(spec, layout, layers, first=first, last=True, seq_len=16))
    assert all(p.is_meta for p in m.parameters()), "the build allocates no storage"
    return materialize(m, spec, 7, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("spec", [load_model("tiny"), OPT], ids=lambda s: s.name)
def test_tp_shards_side_by_side_are_the_unsharded_weights(spec):
    whole = dict(_build(unsharded_layout(), [0, 1], spec=spec).named_parameters())
    shards = []
    for i in range(2):
        m = _build(Layout(tp=Axis(size=2, index=i, ranks=[0, 1], group=None)), [0, 1], spec=spec)
        shards.append((dict(m.named_parameters()), shard_info(m)))
    assert set(shards[0][0]) == set(whole)
    for name, full in whole.items():
        info = shards[0][1][name]
        if info is None:  # replicated: every rank holds the whole tensor
            for params, _ in shards:
                torch.testing.assert_close(params[name], full, rtol=0, atol=0)
            continue
        joined = torch.cat([params[name] for params, _ in shards], dim=info[0])
        torch.testing.assert_close(joined, full, rtol=0, atol=0)


def test_a_pipeline_stage_draws_the_same_layers_and_real_buffers():
    whole = _build(unsharded_layout(), [0, 1, 2, 3])
    stage = _build(unsharded_layout(), [2, 3], first=False)
    ref = dict(whole.named_parameters())
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p, ref[name], rtol=0, atol=0)
    assert not any(b.is_meta for b in stage.buffers())
    torch.testing.assert_close(stage.cos, whole.cos, rtol=0, atol=0)
    # weights are N(0, 0.02), not left as uninitialised memory
    w = ref["layers.0.mlp.w1.weight"].detach()
    assert abs(float(w.std()) - 0.02) < 0.002 and abs(float(w.mean())) < 0.002
