"""The ring's CUDA block path (fused kernel returning the log-sum-exp; its state kept per block for the
backward), run on CPU with stand-ins that follow the aten kernels' contracts: the output, the ring's
merge and the hand-written backward must equal the masked SDPA reference, and every block's backward
must get back exactly the state its own forward returned. The real kernels are compared on a GPU in
tests/gpu/test_gpu_runtime.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autotune.runtime.ring_attention as R
from autotune.runtime.attention import gqa_index


def _reference_block(q, k, v, causal, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ v.double(), lse


def _reference_backward(do, q, k, v, out, lse, causal, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    p = torch.exp(s - lse.double()[..., None])
    dv = p.transpose(-1, -2) @ do.double()
    delta = (do.double() * out.double()).sum(-1)
    ds = p * (do.double() @ v.double().transpose(-1, -2) - delta[..., None])
    return (ds @ k.double()) * scale, (ds.transpose(-1, -2) @ q.double()) * scale, dv


class Kernels:
    """flash: lse [B, H, T]; efficient: lse padded to 32 rows (as torch's memory-efficient kernel)."""

    def __init__(self):
        self.issued: dict[int, tuple] = {}
        self.returned: list[tuple] = []

    def flash(self, q, k, v, dropout, causal, debug, *, scale):
        assert dropout == 0.0 and not debug
        o, lse = _reference_block(q, k, v, causal, scale)
        state = (object(), object(), q.shape[-2], k.shape[-2], object(), object())
        self.issued[id(state[0])] = state
        return (o.to(q.dtype), lse.float(), *state, None)

    def flash_bwd(self, do, q, k, v, out, lse, cq, ck, mq, mk, dropout, causal, seed, offset, *, scale):
        assert self.issued[id(cq)] == (cq, ck, mq, mk, seed, offset), "the state of this block's forward"
        assert (mq, mk) == (q.shape[-2], k.shape[-2]) and lse.shape[-1] == q.shape[-2]
        self.returned.append(cq)
        return tuple(g.to(q.dtype) for g in _reference_backward(do, q, k, v, out, lse, causal, scale))

    def efficient(self, q, k, v, bias, want_lse, dropout, causal, *, scale):
        assert bias is None and want_lse and dropout == 0.0
        o, lse = _reference_block(q, k, v, causal, scale)
        pad = -(-q.shape[-2] // 32) * 32
        seed, offset = object(), object()
        self.issued[id(seed)] = (seed, offset)
        return o.to(q.dtype), F.pad(lse.float(), (0, pad - q.shape[-2])), seed, offset

    def efficient_bwd(self, do, q, k, v, bias, out, lse, seed, offset, dropout, mask, causal, *, scale):
        assert self.issued[id(seed)] == (seed, offset) and list(mask) == [True, True, True, False]
        assert lse.shape[-1] == -(-q.shape[-2] // 32) * 32, "lse handed back in the kernel's padded layout"
        self.returned.append(seed)
        grads = _reference_backward(do, q, k, v, out, lse[..., :q.shape[-2]], causal, scale)
        return (*(g.to(q.dtype) for g in grads), None)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_ring_with_the_cuda_block_kernels_matches_masked_sdpa(kernel, monkeypatch):
    fake = Kernels()
    monkeypatch.setattr(R, "_FLASH", fake.flash)
    monkeypatch.setattr(R, "_FLASH_BWD", fake.flash_bwd)
    monkeypatch.setattr(R, "_EFFICIENT", fake.efficient)
    monkeypatch.setattr(R, "_EFFICIENT_BWD", fake.efficient_bwd)
    monkeypatch.setattr(R, "cuda_kernel", lambda q, kind: kernel if kind is None or kind is R.CAUSAL else None)
    segs = [[(0, 5), (11, 3), (20, 6)]]  # a front, a back and a gap: visible, causal and skipped blocks
    pos = torch.cat([torch.arange(s, s + n) for s, n in segs[0]])
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, len(pos), 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, len(pos), 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, len(pos), 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, len(pos), 8, generator=g, dtype=torch.float64)
    out = R.ring_attention(q, k, v, gqa_index(4, 2, 0, 4, 0, q.device), segs, 0, None, [0])
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    mask = pos[:, None] >= pos[None, :]
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    refg = torch.autograd.grad((ref * w).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    for a, b in zip(grads, refg, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # 6 visible blocks (3 causal, 3 whole), each backward fed its own forward's state, once
    assert len(fake.issued) == 6 and sorted(map(id, fake.returned)) == sorted(fake.issued)


def test_which_cuda_kernel_a_block_runs_in(monkeypatch):
    q = torch.zeros(1, 1, 4, 64)
    assert R.cuda_kernel(q, None) is None  # not on CUDA: the CPU kernel or the matmuls
    monkeypatch.setattr(R, "USE_FUSED", False)
    assert R.cuda_kernel(q, R.CAUSAL) is None
