"""The MoE layer on one process against a token-by-token reading of its definition (runtime/moe.py):
each token's output is the weighted sum of its top-k experts plus the shared experts, a capacity
keeps the earliest tokens of each sequence per expert, forced balance sends token t to experts
(t k + j) mod E, and the auxiliary loss's gradient is that of coeff * scale * sum_b sum_e f_be P_be.
The parallel parity tests compare layouts with this layer; this test checks the layer itself."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from autotune.runtime.expert_parallel import single_groups
from autotune.runtime.mesh import Axis
from autotune.runtime.model import init_weights
from autotune.runtime.moe import MoEContext, MoELayer
from autotune.specs.moe import MoESpec, RouterSpec

B, S, H, E, K = 2, 12, 8, 6, 2
SCALE = 0.5  # the aux loss's gradient scale (1 / global batch in training)


def _layer(router: RouterSpec, shared: int = 0, swiglu: bool = True) -> MoELayer:
    moe = MoESpec(experts=E, top_k=K, expert_ffn_hidden=10, shared_experts=shared,
                  shared_ffn_hidden=4 if shared else 0, router=router)
    ctx = MoEContext(groups=single_groups(E), seq_len=S, aux_grad_scale=SCALE)
    layer = MoELayer(moe, H, swiglu, ctx, Axis(size=1, index=0, ranks=[0], group=None), False)
    init_weights(layer, None, 3)
    return layer


def _ffn(x, w1, w3, w2, swiglu):
    a = F.silu(x @ w1.T) * (x @ w3.T) if swiglu else F.gelu(x @ w1.T)
    return a @ w2.T


def _naive(layer: MoELayer, x: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """(y, sum_b aux_b, choices dropped), written token by token."""
    moe, r = layer.moe, layer.moe.router
    logits = x @ layer.router.weight.T  # [B, S, E]
    scores = logits.softmax(-1) if r.score == "softmax" else logits.sigmoid() / logits.sigmoid().sum(-1, keepdim=True)
    cap = None if r.dropless else math.ceil(r.capacity_factor * S * K / E)
    y = torch.zeros_like(x)
    aux = x.new_zeros(())
    dropped = 0
    for b in range(B):
        taken = [0] * E
        counts = torch.zeros(E)
        for t in range(S):
            chosen = ([(t * K + j) % E for j in range(K)] if r.force_balance
                      else scores[b, t].topk(K).indices.tolist())
            w = scores[b, t, chosen] / scores[b, t, chosen].sum()
            for j, e in enumerate(chosen):
                counts[e] += 1
                taken[e] += 1
                if cap is not None and taken[e] > cap:
                    dropped += 1
                    continue  # beyond the expert's capacity in this sequence: dropped
                ex = layer.experts[str(e)]
                y[b, t] += w[j] * _ffn(x[b, t], ex.w1, getattr(ex, "w3", None), ex.w2, swiglu)
        aux = aux + (counts * E / (K * S) * scores[b].mean(0)).sum()
    if moe.shared_experts:
        sh = layer.shared
        y = y + _ffn(x, sh.w1.weight, sh.w3.weight if swiglu else None, sh.w2.weight, swiglu)
    return y, aux, dropped


@pytest.mark.parametrize("router,shared,swiglu", [
    (RouterSpec(aux_loss_coeff=0.1), 0, True),
    (RouterSpec(dropless=False, capacity_factor=0.75, aux_loss_coeff=0.1), 1, True),
    (RouterSpec(score="sigmoid", aux_loss_coeff=0.2), 2, False),
    (RouterSpec(force_balance=True, aux_loss_coeff=0.1), 0, True),
], ids=["dropless", "capacity-shared", "sigmoid-gelu", "forced-balance"])
def test_layer_is_its_definition(router, shared, swiglu):
    g = torch.Generator().manual_seed(0)
    x, c = torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)
    layer = _layer(router, shared, swiglu)
    xa = x.clone().requires_grad_(True)
    (layer(xa) * c).sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()} | {"x": xa.grad}
    layer.zero_grad()
    xb = x.clone().requires_grad_(True)
    y, aux, dropped = _naive(layer, xb, swiglu)
    ((y * c).sum() + router.aux_loss_coeff * SCALE * aux).backward()
    want = {n: p.grad for n, p in layer.named_parameters()} | {"x": xb.grad}
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert (dropped > 0) == (not router.dropless)  # a capacity case drops, or it would not test it
