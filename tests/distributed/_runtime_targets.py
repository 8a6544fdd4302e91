"""Launcher targets for the runtime's multi-process tests (imported by the spawned workers)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autotune.plan import Degrees, Plan


def tp_layers(payload, rank, world, device):
    """Megatron layers on a tp group of the whole world vs the same computation unsharded:
    returns the largest forward and gradient differences per layer kind."""
    from autotune.runtime.mesh import build_mesh
    from autotune.runtime.tensor import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        enter_parallel,
        vocab_parallel_cross_entropy,
    )

    plan = Plan(degrees=Degrees(tp=world))
    tp = build_mesh(plan, rank, device)["tp"]
    g = torch.Generator().manual_seed(7)
    B, S, H, Fh, V = 2, 8, 16, 24, 32
    x = torch.randn(B, S, H, generator=g)
    w1 = torch.randn(Fh, H, generator=g)
    w2 = torch.randn(H, Fh, generator=g)
    emb = torch.randn(V, H, generator=g)
    ids = torch.randint(0, V, (B, S), generator=g)
    tgt = torch.randint(0, V, (B, S), generator=g)
    out = {}
    for sp in (False, True):
        # reference: y = gelu(x W1^T) W2^T, loss = sum(y * c)
        xr = x.clone().requires_grad_(True)
        w1r, w2r = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        c = torch.randn(B, S, H, generator=torch.Generator().manual_seed(9))
        yr = F.linear(F.gelu(F.linear(xr, w1r)), w2r)
        (yr * c).sum().backward()
        col = ColumnParallelLinear(H, Fh, tp, sp)
        row = RowParallelLinear(Fh, H, tp, sp)
        with torch.no_grad():
            col.weight.copy_(w1[col.out_start:col.out_end])
            row.weight.copy_(w2[:, row.in_start:row.in_end])
        s_loc = S // world
        xin = x[:, rank * s_loc:(rank + 1) * s_loc] if sp else x
        xin = xin.clone().requires_grad_(True)
        y = row(F.gelu(col(xin)))
        cl = c[:, rank * s_loc:(rank + 1) * s_loc] if sp else c
        (y * cl).sum().backward()
        yref = yr[:, rank * s_loc:(rank + 1) * s_loc] if sp else yr
        gx = xr.grad[:, rank * s_loc:(rank + 1) * s_loc] if sp else xr.grad
        out[f"mlp_sp{int(sp)}"] = max(
            (y - yref).abs().max().item(), (xin.grad - gx).abs().max().item(),
            (col.weight.grad - w1r.grad[col.out_start:col.out_end]).abs().max().item(),
            (row.weight.grad - w2r.grad[:, row.in_start:row.in_end]).abs().max().item())
        # vocabulary-parallel embedding
        e = VocabParallelEmbedding(V, H, tp, sp)
        with torch.no_grad():
            e.weight.copy_(emb[e.start:e.end])
        er = emb.clone().requires_grad_(True)
        hr = F.embedding(ids, er)
        (hr * c).sum().backward()
        h = e(ids)
        hl = hr[:, rank * s_loc:(rank + 1) * s_loc] if sp else hr
        (h * cl).sum().backward()
        out[f"embedding_sp{int(sp)}"] = max((h - hl).abs().max().item(),
                                            (e.weight.grad - er.grad[e.start:e.end]).abs().max().item())
    # vocabulary-parallel cross-entropy through a column-parallel head
    hr = x.clone().requires_grad_(True)
    head = emb.clone().requires_grad_(True)
    lr = F.cross_entropy(F.linear(hr, head).flatten(0, 1), tgt.flatten(), reduction="none").view(B, S)
    (lr * torch.arange(B * S).view(B, S)).sum().backward()
    hx = x.clone().requires_grad_(True)
    col = ColumnParallelLinear(H, V, tp, False)
    with torch.no_grad():
        col.weight.copy_(emb[col.out_start:col.out_end])
    loss = vocab_parallel_cross_entropy(col(hx), tgt, col.out_start, tp)
    (loss * torch.arange(B * S).view(B, S)).sum().backward()
    out["cross_entropy"] = max((loss - lr).abs().max().item(), (hx.grad - hr.grad).abs().max().item(),
                               (col.weight.grad - head.grad[col.out_start:col.out_end]).abs().max().item())
    # f then g is the identity forward and sums gradients over ranks backward
    z = torch.ones(3, requires_grad=True)
    enter_parallel(z, tp, False).sum().backward()
    out["f_backward"] = (z.grad - world).abs().max().item()
    return out


def fail_on(payload, rank, world, device):
    """Rank ``payload['rank']`` raises (or runs out of memory); the others wait in a collective."""
    if rank == payload["rank"]:
        time.sleep(0.2)
        if payload["kind"] == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (emulated)")
        raise ValueError("boom from the test")
    dist.all_reduce(torch.ones(1))
    dist.all_reduce(torch.ones(1))
    return {"rank": rank}


def hang(payload, rank, world, device):
    time.sleep(3600)


def ok(payload, rank, world, device):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item()}
