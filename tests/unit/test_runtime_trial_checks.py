"""What ``run_trial`` refuses before any process starts, and single-process pieces of the runtime."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autotune.errors import InputError
from autotune.plan import Plan
from autotune.runtime.data import local_batch, synthetic_tokens
from autotune.runtime.model import StageModel, apply_rotary, init_weights, rotary, unsharded_layout
from autotune.runtime.trial import prepare, run_trial
from autotune.specs import ModelSpec, load_model


def plan(**deg):
    return Plan.from_dict({"degrees": deg, "dtype": "fp32"})


def test_world_must_match_nproc():
    with pytest.raises(InputError, match=r"= 2 != --nproc\(4\)"):
        prepare(plan(dp=2), "tiny", 64, 8, nproc=4, device="cpu")


def test_shares_the_model_cannot_take():
    with pytest.raises(InputError, match="shares.layers"):
        prepare(Plan.from_dict({"degrees": {"pp": 2}, "shares": {"layers": [1, 5]}}), "tiny", 64, 8, device="cpu")
    with pytest.raises(InputError, match="tp"):
        prepare(plan(tp=3), "tiny", 64, 8, device="cpu")


def test_model_too_large_for_the_device():
    with pytest.raises(InputError, match="needs about"):
        prepare(plan(dp=2), "llama3-70b", 4096, 8, device="cpu")


def test_every_zero_stage_is_accepted():
    for zero in (0, 1, 2, 3):
        resolved, _, _ = prepare(Plan.from_dict({"degrees": {"dp": 2}, "zero_stage": zero}), "tiny", 64, 8,
                                 device="cpu")
        assert resolved.zero_stage == zero


OPT_LIKE = ModelSpec(name="opt-like", layers=2, hidden=32, heads=4, kv_heads=4, ffn_hidden=48, vocab=50,
                    activation="gelu", norm="layernorm", position="learned", max_positions=16, bias=True,
                    tied_embeddings=True)


def test_every_architecture_the_spec_accepts_is_built():
    """LayerNorm, linear biases, learned positions, GELU, tied embeddings (GPT-3's preset) pass the
    runtime's checks; what they cannot take is refused with the field that says why."""
    resolved, _, _ = prepare(plan(dp=2), OPT_LIKE, 16, 4, device="cpu")
    assert resolved.degrees.dp == 2
    with pytest.raises(InputError, match=r"seq_len: 32 tokens > the learned position table.*max_positions: 16"):
        prepare(plan(dp=1), OPT_LIKE, 32, 4, device="cpu")
    odd = ModelSpec(name="odd", layers=1, hidden=12, heads=4, kv_heads=4, ffn_hidden=8, vocab=8,
                    position="learned", max_positions=8)  # head_dim 3: fine without rotary
    prepare(plan(dp=1), odd, 8, 2, device="cpu")
    with pytest.raises(InputError, match="even head_dim"):
        prepare(plan(dp=1), odd.__class__(**{**odd.to_dict(), "position": "rope", "max_positions": 0}), 8, 2,
                device="cpu")


def test_run_trial_refuses_bad_steps_and_emulation_before_launch():
    with pytest.raises(InputError, match="steps"):
        run_trial(plan(dp=2), "tiny", 64, 8, steps=0, device="cpu")
    with pytest.raises(InputError, match="emulate"):
        run_trial(plan(dp=2), "tiny", 64, 8, emulate_slowdown={5: 2.0}, device="cpu")


def test_placement_of_another_cluster_is_ignored_locally():
    p = Plan.from_dict({"degrees": {"dp": 2}, "placement": [{"rank": 0, "node": 3, "device": 1},
                                                           {"rank": 1, "node": 3, "device": 2}]})
    resolved, _, _ = prepare(p, "tiny", 64, 8, device="cpu")
    assert [(x.node, x.device) for x in resolved.placement] == [(0, 0), (0, 1)]


def test_rotary_is_a_rotation_at_global_positions():
    """RoPE preserves norms, and q.k depends only on the position difference (Su et al. 2021)."""
    d = 16
    q, k = torch.randn(1, 1, 1, d, dtype=torch.float64), torch.randn(1, 1, 1, d, dtype=torch.float64)
    pos = torch.tensor([3, 10, 20, 27])
    cos, sin = rotary(pos, d, torch.float64)
    rq = apply_rotary(q.expand(1, 1, 4, d), cos, sin)
    rk = apply_rotary(k.expand(1, 1, 4, d), cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1).expand(1, 1, 4))
    dot = (rq[0, 0, 1] * rk[0, 0, 0]).sum(), (rq[0, 0, 3] * rk[0, 0, 2]).sum()  # both differ by 7
    torch.testing.assert_close(dot[0], dot[1])


def test_model_matches_a_plain_pytorch_llama_block():
    """The unsharded StageModel against the same computation written with plain torch ops."""
    spec = ModelSpec(name="t", layers=1, hidden=32, heads=4, kv_heads=2, ffn_hidden=48, vocab=50)
    m = StageModel(spec, unsharded_layout(), [0], first=True, last=True, seq_len=8)
    init_weights(m, spec, 3)
    ids = torch.randint(0, 50, (2, 8))
    sd = dict(m.named_parameters())
    x = F.embedding(ids, sd["embed.weight"])

    def norm(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    h = norm(x, sd["layers.0.attn_norm.weight"])
    q = (h @ sd["layers.0.attn.wq.weight"].T).view(2, 8, 4, 8).transpose(1, 2)
    k = (h @ sd["layers.0.attn.wk.weight"].T).view(2, 8, 2, 8).transpose(1, 2)
    v = (h @ sd["layers.0.attn.wv.weight"].T).view(2, 8, 2, 8).transpose(1, 2)
    cos, sin = rotary(torch.arange(8), 8, torch.float32)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    att = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    att = att.masked_fill(torch.triu(torch.ones(8, 8, dtype=torch.bool), 1), float("-inf")).softmax(-1)
    o = (att @ v).transpose(1, 2).reshape(2, 8, 32) @ sd["layers.0.attn.wo.weight"].T
    x = x + o
    h = norm(x, sd["layers.0.mlp_norm.weight"])
    x = x + (F.silu(h @ sd["layers.0.mlp.w1.weight"].T) * (h @ sd["layers.0.mlp.w3.weight"].T)) @ sd[
        "layers.0.mlp.w2.weight"].T
    logits = norm(x, sd["norm.weight"]) @ sd["head.weight"].T
    torch.testing.assert_close(m(ids), logits, atol=1e-5, rtol=1e-5)


def test_model_matches_a_plain_pytorch_opt_block():
    """An OPT/GPT-2-style StageModel (LayerNorm, biases, learned positions, GELU, tied head) against
    the same computation written with plain torch ops."""
    spec = OPT_LIKE.__class__(**{**OPT_LIKE.to_dict(), "layers": 1})
    m = StageModel(spec, unsharded_layout(), [0], first=True, last=True, seq_len=8)
    init_weights(m, spec, 3)
    m.reset_buffers()
    ids = torch.randint(0, 50, (2, 8))
    sd = dict(m.named_parameters())
    assert all(float(sd[f"layers.0.{n}.bias"].detach().abs().sum()) > 0 for n in ("attn.wq", "attn.wo", "mlp.w2"))
    x = F.embedding(ids, sd["embed.weight"]) + sd["pos_embed.weight"][:8]

    def norm(t, name):
        return F.layer_norm(t, (32,), sd[name + ".weight"], sd[name + ".bias"], 1e-5)

    def lin(t, name):
        return t @ sd[name + ".weight"].T + sd[name + ".bias"]

    h = norm(x, "layers.0.attn_norm")
    q, k, v = (lin(h, f"layers.0.attn.{w}").view(2, 8, 4, 8).transpose(1, 2) for w in ("wq", "wk", "wv"))
    att = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    att = att.masked_fill(torch.triu(torch.ones(8, 8, dtype=torch.bool), 1), float("-inf")).softmax(-1)
    x = x + lin((att @ v).transpose(1, 2).reshape(2, 8, 32), "layers.0.attn.wo")
    x = x + lin(F.gelu(lin(norm(x, "layers.0.mlp_norm"), "layers.0.mlp.w1")), "layers.0.mlp.w2")
    logits = norm(x, "norm") @ sd["embed.weight"].T
    torch.testing.assert_close(m(ids), logits, atol=1e-5, rtol=1e-5)


def test_init_is_the_same_whatever_the_split():
    spec = load_model("tiny")
    a = StageModel(spec, unsharded_layout(), [0, 1, 2, 3], first=True, last=True, seq_len=8)
    b = StageModel(spec, unsharded_layout(), [2, 3], first=False, last=True, seq_len=8)
    init_weights(a, spec, 5)
    init_weights(b, spec, 5)
    pa = dict(a.named_parameters())
    for name, p in b.named_parameters():
        torch.testing.assert_close(p, pa[name])


def test_data_slices_by_replica_and_positions():
    p = Plan.from_dict({"degrees": {"dp": 2}, "shares": {"samples": [3, 1]}}).resolve(
        load_model("tiny"), __import__("autotune.specs", fromlist=["local_cluster"]).local_cluster(2), 16, 4)
    tok = synthetic_tokens(0, 256, 4, 16)
    x, y = local_batch(tok, p, 1, torch.tensor([0, 5, 9]))
    assert x.shape == (1, 3)
    assert torch.equal(x[0], tok[3, [0, 5, 9]]) and torch.equal(y[0], tok[3, [1, 6, 10]])
