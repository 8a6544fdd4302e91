"""Token layout of the CP x HP attention sharding, and the ring's block arithmetic on one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.runtime import ring_attention as ring_attention_module
from autotune.runtime.attention import (
    AttentionContext,
    gqa_index,
    local_token_positions,
    shard_segments,
    sharded_attention,
)
from autotune.runtime.ring_attention import _pairs, ring_attention
from autotune.runtime.ulysses import kv_head_range


def ctx_for(tokens, layout, hp_heads, cp_i=0, hp_i=0, **kw):
    return AttentionContext(cp_ranks=range(len(tokens)), cp_index=cp_i, cp_tokens=tokens, cp_layout=layout,
                            hp_ranks=range(len(hp_heads)), hp_index=hp_i, hp_heads=hp_heads, **kw)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_even_zigzag_is_chunks_i_and_mirror(cp):
    s = 2 * cp * 5
    chunk = s // (2 * cp)
    segs = shard_segments([s // cp] * cp, "zigzag")
    for i in range(cp):
        assert segs[i] == [(i * chunk, chunk), ((2 * cp - 1 - i) * chunk, chunk)]


def test_uneven_zigzag_by_hand():
    # f = 2, 4, 3: fronts fill [0, 9) in rank order, backs fill [9, 18) in reverse rank order from the end
    assert shard_segments([4, 8, 6], "zigzag") == [[(0, 2), (16, 2)], [(2, 4), (12, 4)], [(6, 3), (9, 3)]]
    assert shard_segments([4, 8, 6], "contiguous") == [[(0, 4)], [(4, 8)], [(12, 6)]]


def test_hp_ranks_split_each_segment_evenly():
    got = [local_token_positions(ctx_for([8, 12], "zigzag", [1, 1], cp_i=0, hp_i=h)).tolist() for h in (0, 1)]
    assert got == [[0, 1, 16, 17], [2, 3, 18, 19]]
    got = [local_token_positions(ctx_for([8, 12], "zigzag", [1, 1], cp_i=1, hp_i=h)).tolist() for h in (0, 1)]
    assert got == [[4, 5, 6, 10, 11, 12], [7, 8, 9, 13, 14, 15]]


def test_one_shard_ignores_the_layout():
    ctx = ctx_for([9], "zigzag", [2, 1, 3], hp_i=1)
    assert ctx.layout == "contiguous"
    assert local_token_positions(ctx).tolist() == [3, 4, 5]


@settings(max_examples=60, deadline=None)
@given(cp=st.integers(1, 4), hp=st.integers(1, 4), zigzag=st.booleans(),
       units=st.lists(st.integers(1, 5), min_size=4, max_size=4))
def test_every_position_is_held_once_in_order(cp, hp, zigzag, units):
    layout = "zigzag" if zigzag else "contiguous"
    g = (2 if zigzag and cp > 1 else 1) * hp
    tokens = [g * u for u in units[:cp]]
    held = []
    for i in range(cp):
        for h in range(hp):
            pos = local_token_positions(ctx_for(tokens, layout, [1] * hp, cp_i=i, hp_i=h)).tolist()
            assert pos == sorted(pos) and len(pos) == tokens[i] // hp
            held += pos
    assert sorted(held) == list(range(sum(tokens)))


@pytest.mark.parametrize(("kw", "msg"), [
    ({"tokens": [5, 7], "layout": "zigzag", "heads": [1]}, "even token share"),
    ({"tokens": [6, 10], "layout": "zigzag", "heads": [1, 1]}, "does not split over hp=2"),
    ({"tokens": [6], "layout": "contiguous", "heads": [2, 0]}, "at least one head"),
    ({"tokens": [6], "layout": "ring", "heads": [1]}, "zigzag or contiguous"),
    ({"tokens": [6], "layout": "contiguous", "heads": [2, 2], "extra": {"heads": 5}}, "sum to 4"),
    ({"tokens": [6, 6], "layout": "contiguous", "heads": [1], "extra": {"seq_len": 10}}, "not seq_len=10"),
])
def test_bad_context_is_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ctx_for(kw["tokens"], kw["layout"], kw["heads"], **kw.get("extra", {}))


def test_gqa_heads_of_uneven_hp_ranks():
    # 8 query heads over 2 kv heads (rep 4) split 3 / 5: kv head 0 is needed by both ranks (replicated)
    assert [kv_head_range([3, 5], 8, 2, r) for r in (0, 1)] == [(0, 1), (0, 2)]
    assert gqa_index(8, 2, 3, 5, 0, torch.device("cpu")).tolist() == [0, 1, 1, 1, 1]
    assert [kv_head_range([1, 3, 3, 1], 8, 8, r) for r in range(4)] == [(0, 1), (1, 4), (4, 7), (7, 8)]


def _masked_reference(q, k, v, pos):
    rep = q.shape[1] // k.shape[1]
    mask = pos[:, None] >= pos[None, :]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          attn_mask=mask)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kv", [4, 2])
@pytest.mark.parametrize("score_elements", [1 << 26, 2 * 4 * 6 * 3])  # the second walks 3-row chunks
def test_ring_blocks_on_one_rank_match_masked_sdpa(kv, fused, score_elements, monkeypatch):
    """One shard of several segments (a zigzag front and back, plus a gap): the block pairs, the
    online-softmax merge and the hand-written backward against SDPA with the causal mask."""
    monkeypatch.setattr(ring_attention_module, "USE_FUSED", fused)
    monkeypatch.setattr(ring_attention_module, "SCORE_ELEMENTS", score_elements)
    segs = [[(0, 5), (11, 3), (20, 6)]]
    pos = torch.cat([torch.arange(s, s + n) for s, n in segs[0]])
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, len(pos), 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv, len(pos), 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv, len(pos), 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, len(pos), 8, generator=g, dtype=torch.float64)
    out = ring_attention(q, k, v, gqa_index(4, kv, 0, 4, 0, q.device), segs, 0, None, [0])
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = _masked_reference(q, k, v, pos)
    refg = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert torch.allclose(out.double(), ref, atol=1e-5)
    for a, b in zip(grads, refg, strict=True):
        assert torch.allclose(a.double(), b, atol=1e-5)


def test_whole_sequence_context_is_plain_causal_attention():
    ctx = ctx_for([12], "contiguous", [4])
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(sharded_attention(q, k, v, ctx), ref, atol=1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        sharded_attention(q[:, :3], k, v, ctx)


def test_block_kinds_follow_positions():
    # query segments (0,4),(10,4) against key segments (4,2),(10,4),(12,3)
    kinds = [(a, c, k if k is None or isinstance(k, str) else k.tolist())
             for a, c, k in _pairs([(0, 4), (10, 4)], [(4, 2), (10, 4), (12, 3)])]
    # queries 10..13 against keys 12..14: rows 10 and 11 see none of them
    partial = [[False, False, False], [False, False, False], [True, False, False], [True, True, False]]
    assert kinds == [(1, 0, None), (1, 1, "causal"), (1, 2, partial)]


def test_matmul_block_with_a_partial_mask_and_empty_rows(monkeypatch):
    """The general-mask path: rows that see no key give out 0 and lse -inf; chunking changes nothing."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[False, False, False, False], [True, False, False, False],
                         [True, True, False, True], [True, True, True, True]])
    s = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    ref_lse = torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1)
    ref = torch.softmax(s[:, :, 1:].masked_fill(~mask[1:], float("-inf")), -1) @ v
    monkeypatch.setattr(ring_attention_module, "USE_FUSED", False)
    for elements in (1 << 26, 2 * 4):  # whole block, then one row at a time
        monkeypatch.setattr(ring_attention_module, "SCORE_ELEMENTS", elements)
        o, lse = ring_attention_module.block_forward(q, k, v, 8 ** -0.5, mask)
        assert torch.equal(o[:, :, 0], torch.zeros_like(o[:, :, 0])) and torch.isinf(lse[:, :, 0]).all()
        assert torch.allclose(o[:, :, 1:].double(), ref, atol=1e-6)
        assert torch.allclose(lse.double(), ref_lse, atol=1e-6)
