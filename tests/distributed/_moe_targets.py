"""Launcher target for the MoE layer's module-level parity test (imported by the spawned workers).

One MoE layer (router, routed experts, shared experts) is run on one process over a whole batch,
then on the world's ranks under a configuration (ep, etp, uneven expert shares, how the tokens are
held: distinct samples per rank, a sequence split over two ranks, or two tp ranks holding the same
tokens), and the loss ``sum(y * c)`` plus the injected auxiliary loss's gradients are compared."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from autotune.runtime.expert_parallel import ExpertGroups, single_groups
from autotune.runtime.mesh import Axis, _new_group
from autotune.runtime.model import init_weights
from autotune.runtime.moe import MoEContext, MoELayer, route

H, S, SEED = 16, 16, 11


def moe_spec(cfg: dict) -> SimpleNamespace:
    router = SimpleNamespace(dropless=cfg.get("capacity") is None, capacity_factor=cfg.get("capacity"),
                             force_balance=cfg.get("force_balance", False), aux_loss_coeff=0.1,
                             score=cfg.get("score", "softmax"))
    return SimpleNamespace(experts=8, top_k=2, expert_ffn_hidden=24, shared_experts=cfg.get("shared", 0),
                           shared_ffn_hidden=12 if cfg.get("shared") else 0, router=router)


def _axis(groups: list[list[int]], rank: int) -> Axis:
    """Create every group (collectively, in order) and return this rank's."""
    mine = next(g for g in groups if rank in g)
    out = Axis(size=len(mine), index=mine.index(rank), ranks=mine, group=None)
    if len(mine) > 1:
        for g in groups:
            pg = _new_group(g, None)
            if rank in g:
                out.group = pg
    return out


def _groups(cfg: dict, rank: int, world: int) -> ExpertGroups:
    ep, etp = cfg["ep"], cfg.get("etp", 1)
    coords = [(r // (etp * ep), (r // etp) % ep, r % etp) for r in range(world)]

    def by(fixed) -> list[list[int]]:
        out: dict = {}
        for r, c in enumerate(coords):
            out.setdefault(fixed(c), []).append(r)
        return list(out.values())

    pairs = [[r, r + 1] for r in range(0, world, 2)]
    solo = [[r] for r in range(world)]
    shares = tuple(cfg.get("shares") or [8 // ep] * ep)
    return ExpertGroups(shares=shares, ep=_axis(by(lambda c: (c[0], c[2])), rank),
                        etp=_axis(by(lambda c: (c[0], c[1])), rank), edp=_axis(by(lambda c: (c[1], c[2])), rank),
                        route=_axis(pairs if cfg["tokens"] == "seq2" else solo, rank),
                        token_split=_axis(pairs if cfg["tokens"] == "tp2" else solo, rank))


def _layer(cfg: dict, groups: ExpertGroups, batch: int, positions) -> tuple[MoELayer, MoEContext]:
    ctx = MoEContext(groups=groups, seq_len=S, aux_grad_scale=1.0 / batch, positions=positions)
    solo = Axis(size=1, index=0, ranks=[0], group=None)
    layer = MoELayer(moe_spec(cfg), H, cfg.get("swiglu", True), ctx, solo, False)
    init_weights(layer, None, SEED)
    return layer, ctx


def _local_tokens(cfg: dict, rank: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(this rank's part of the batch, its global positions or None, copies of each token)."""
    if cfg["tokens"] == "data":
        return x[rank:rank + 1], None, 1
    if cfg["tokens"] == "tp2":
        return x[rank // 2:rank // 2 + 1], None, 2
    half = S // 2  # seq2: ranks 2i and 2i+1 hold the halves of sample i
    pos = torch.arange(half) + (rank % 2) * half
    return x[rank // 2:rank // 2 + 1, pos], pos, 1


def _run(layer: MoELayer, x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    y = layer(x)
    loss = (y * c).sum()
    loss.backward()
    return loss.detach(), x.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _compare(cfg: dict, rank: int, world: int) -> dict[str, float]:
    dup = 2 if cfg["tokens"] in ("tp2", "seq2") else 1
    batch = world // dup
    g = torch.Generator().manual_seed(5)
    x, c = torch.randn(batch, S, H, generator=g), torch.randn(batch, S, H, generator=g)
    ref, ref_ctx = _layer(cfg, single_groups(8), batch, None)
    ref_loss, ref_dx = _run(ref, x, c)
    keep = route(ref.router, x, moe_spec(cfg), ref_ctx).keep
    groups = _groups(cfg, rank, world)
    xl, pos, copies = _local_tokens(cfg, rank, x)
    cl, _, _ = _local_tokens(cfg, rank, c)
    layer, _ = _layer(cfg, groups, batch, pos)
    loss, dx = _run(layer, xl, cl)
    dist.all_reduce(loss)
    out = {"dropped": 0.0 if keep is None else float((~keep).sum()),
           "loss": abs(float(loss) / copies - float(ref_loss)) / abs(float(ref_loss)),
           "dx": _rel(dx, _local_tokens(cfg, rank, ref_dx)[0])}
    ref_params = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        grad = p.grad.clone()
        axis = groups.edp if name.startswith("experts.") else None
        if axis is None:  # a dense weight: summed over the ranks holding distinct tokens
            dist.all_reduce(grad)
            grad /= copies
        elif axis.group is not None:
            dist.all_reduce(grad, group=axis.group)
        want = ref_params[name].grad
        shard = getattr(layer.get_submodule(name.rsplit(".", 1)[0]), "shards", {}).get(name.rsplit(".", 1)[1])
        if shard is not None:
            want = want.narrow(shard[0], shard[1], grad.shape[shard[0]])
        out[f"grad:{name}"] = _rel(grad, want)
    return out


def moe_layers(payload, rank, world, device):
    """{config name: {quantity: relative gap}} for each configuration of the payload, plus the
    count of dropped choices of the reference under capacity (so the capacity case can fail)."""
    results = {}
    for name, cfg in payload["configs"].items():
        results[name] = _compare(cfg, rank, world)
    return results
