"""Count the kernels a Megatron-Core MoE layer issues outside its experts' GEMMs, by running
megatron-core's own routing and permutation functions (``megatron.core.transformer.moe.moe_utils``,
unfused, as Megatron defaults them) on CPU under a TorchDispatchMode: every aten op that is not a
view or an allocation is one kernel on a GPU. The counts ``autotune/export/megatron.py`` KERNELS
prices (``moe_fwd``, ``moe_bwd``) are these plus the dispatcher's own bookkeeping, which needs
process groups and is counted from its code there (MOE_KERNELS).

Usage: python benchmarks/count_moe_kernels.py
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NOT_KERNELS = {"view", "_unsafe_view", "reshape", "expand", "t", "transpose", "permute", "unsqueeze", "squeeze",
               "select", "slice", "alias", "detach", "as_strided", "split", "split_with_sizes", "unbind",
               "_reshape_alias", "lift_fresh", "empty", "empty_like", "new_empty", "new_empty_strided",
               "empty_strided", "is_same_size"}
"""Aten ops that launch no kernel on a GPU (views, uninitialised allocations)."""


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name not in NOT_KERNELS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def router_counts(tokens: int = 64, experts: int = 16, top_k: int = 4, hidden: int = 32) -> tuple[int, int]:
    """(forward, backward) kernels of the gating GEMM, softmax top-k routing and the auxiliary loss."""
    from megatron.core.transformer.moe import moe_utils as U

    x = torch.randn(tokens, hidden, requires_grad=True)
    w = torch.randn(experts, hidden, requires_grad=True)
    with _Ops() as f:
        logits = torch.nn.functional.linear(x, w)
        probs, _ = U.topk_routing_with_score_function(logits, top_k, use_pre_softmax=False, num_groups=None,
                                                      group_topk=None, scaling_factor=None, score_function="softmax",
                                                      expert_bias=None, fused=False)
        aux_map, scores = U.compute_routing_scores_for_aux_loss(logits, top_k, "softmax", fused=False)
        aux = U.switch_load_balancing_loss_func(probs=scores, tokens_per_expert=aux_map.sum(dim=0),
                                                total_num_tokens=tokens, topk=top_k, num_experts=experts,
                                                moe_aux_loss_coeff=1e-3)
    with _Ops() as b:
        (probs.sum() + aux).backward()
    return len(f.ops), len(b.ops)


def permutation_counts(tokens: int = 64, experts: int = 16, top_k: int = 4, hidden: int = 32,
                       local: int = 4) -> tuple[int, int]:
    """(forward, backward) kernels of ``permute``, the two ``sort_chunks_by_idxs`` around the experts
    and ``unpermute`` with the probabilities applied, as the alltoall dispatcher runs them."""
    from megatron.core.transformer.moe import moe_utils as U

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, requires_grad=True)
    probs = torch.rand(tokens, experts, requires_grad=True)
    routing = torch.zeros(tokens, experts, dtype=torch.bool)
    routing[torch.arange(tokens)[:, None], torch.stack([torch.randperm(experts, generator=gen)[:top_k]
                                                        for _ in range(tokens)])] = True
    n_out = tokens * top_k
    splits = torch.full((local,), n_out // local)
    order = torch.arange(local).flip(0)
    with _Ops() as f:
        px, pp, sorted_map = U.permute(x, routing, probs=probs, num_out_tokens=n_out)[:3]
        sx = U.sort_chunks_by_idxs(px, splits, order)[0]
        ux = U.sort_chunks_by_idxs(sx, splits, order)[0]
        out = U.unpermute(ux * pp.unsqueeze(-1).to(ux.dtype), sorted_map, restore_shape=x.shape, routing_map=routing)
    with _Ops() as b:
        out.sum().backward()
    return len(f.ops), len(b.ops)


def main() -> int:
    rf, rb = router_counts()
    pf, pb = permutation_counts()
    print(f"router and auxiliary loss: {rf} forward, {rb} backward")
    print(f"permute, two chunk sorts, unpermute: {pf} forward, {pb} backward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
