"""HelixPipe's runtime pieces in one process: the kept attention (recomputation without attention)
against plain autograd, and a whole-model helix block chain against the single-process model."""

from __future__ import annotations

import pytest
import torch

from autotune.runtime import helix as HX
from autotune.runtime.mesh import Axis
from autotune.runtime.model import Layout, StageModel, init_weights
from autotune.specs import ModelSpec

SPEC = ModelSpec(name="helix-unit", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=64)
SEQ = 12


def whole(spec=SPEC):
    layout = Layout(tp=Axis(size=1, index=0, ranks=[0], group=None))
    model = HX.HelixRankModel(spec, layout, tuple(range(spec.layers + 1)), SEQ)
    init_weights(model, spec, 3)
    ref = StageModel(spec, layout, list(range(spec.layers)), first=True, last=True, seq_len=SEQ)
    init_weights(ref, spec, 3)
    return model, ref


def chain_loss(model, tokens, target, keep):
    x, n, w = model.block(0, None, None, tokens, None, tokens.numel())
    for j in range(1, model.spec.layers + 1):
        o = model.attention(n, w, keep)
        out = model.block(j, x, o, None, target, tokens.numel())
        if j == model.spec.layers:
            return out[0]
        x, n, w = out


@pytest.mark.parametrize("keep", [False, True])
def test_the_helix_chain_is_the_single_process_model(keep):
    model, ref = whole()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SPEC.vocab, (2, SEQ), generator=g)
    target = torch.randint(0, SPEC.vocab, (2, SEQ), generator=g)
    loss = chain_loss(model, tokens, target, keep)
    want = ref.token_losses(ref(tokens), target).sum() / tokens.numel()
    torch.testing.assert_close(loss, want)
    loss.backward()
    want.backward()
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=lambda m, n=name: f"{n}: {m}")
    assert {n for n, _ in model.named_parameters()} == set(grads)


def test_kept_attention_never_runs_the_attention_forward_again(monkeypatch):
    model, _ = whole()
    calls = {"fwd": 0, "bwd": 0}
    fwd, bwd = HX.attention_with_lse, HX.attention_backward

    def count_fwd(*a):
        calls["fwd"] += 1
        return fwd(*a)

    def count_bwd(*a):
        calls["bwd"] += 1
        return bwd(*a)

    monkeypatch.setattr(HX, "attention_with_lse", count_fwd)
    monkeypatch.setattr(HX, "attention_backward", count_bwd)
    g = torch.Generator().manual_seed(1)
    n = torch.randn(2, SEQ, SPEC.hidden, generator=g, requires_grad=True)
    w = torch.randn(2 * SPEC.hidden, SPEC.hidden, generator=g) * 0.1  # q (32) + k, v (2 x 8 heads*dim)
    w = w[: (SPEC.heads + 2 * SPEC.kv_heads) * SPEC.head_dim].clone().requires_grad_(True)
    o = model.attention(n, w, keep=True)
    o.square().sum().backward()
    assert calls == {"fwd": 1, "bwd": 1}
    n2, w2 = n.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    o2 = model.attention(n2, w2, keep=False)
    o2.square().sum().backward()
    torch.testing.assert_close(o, o2)
    torch.testing.assert_close(n.grad, n2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_math_attention_path_matches_the_cpu_kernel():
    """The device-agnostic form (used off CPU) against the CPU flash kernel, forward and backward."""
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(2, 3, 10, 8, generator=g) for _ in range(4))
    o, lse = HX.math_attention_with_lse(q, k, v)
    o_cpu, lse_cpu = HX.attention_with_lse(q, k, v)
    torch.testing.assert_close(o, o_cpu)
    torch.testing.assert_close(lse.to(lse_cpu.dtype), lse_cpu)
    scale = 8 ** -0.5
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    lse_m = torch.logsumexp(s, -1)
    torch.testing.assert_close(lse.to(lse_m.dtype), lse_m)
    grads = HX.math_attention_backward(do, q, k, v, o, lse)
    qm, km, vm = (t.clone().requires_grad_(True) for t in (q, k, v))
    om = torch.nn.functional.scaled_dot_product_attention(qm, km, vm, is_causal=True)
    om.backward(do)
    for a, b in zip(grads, (qm.grad, km.grad, vm.grad), strict=True):
        torch.testing.assert_close(a, b)
