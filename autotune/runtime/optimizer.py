"""AdamW over this rank's parameters, whole (zero_stage 0) or with states sharded (zero_stage 1).

zero_stage 1 is ZeRO stage 1 (Rajbhandari et al. 2020, section 5.1) in the shape of Megatron's
distributed optimizer: gradients are reduce-scattered over the ranks that hold the same parameters
(the gradient group dp x cp x hp), each rank updates only its contiguous slice of the flattened
parameters with AdamW (whose update is elementwise, so the result is exactly the unsharded one),
and the updated slices are all-gathered back. The flat buffer is padded to a multiple of the group
size so every slice has the same length (gloo's tensor collectives need equal sizes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autotune.runtime.mesh import Axis

LR = 1e-3
WEIGHT_DECAY = 0.01


def _flat(tensors: list[torch.Tensor], pad_to: int = 1) -> torch.Tensor:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    pad = (-flat.numel()) % pad_to
    return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    off = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[off:off + n].view_as(t))
        off += n


class TrainOptimizer:
    """Reduce gradients over the gradient group (SUM) and step AdamW."""

    def __init__(self, params: list[torch.nn.Parameter], grad_axis: Axis | None, zero_stage: int = 0):
        if zero_stage not in (0, 1):
            raise ValueError(f"zero_stage {zero_stage} is not built (0 or 1)")
        self.params = params
        self.axis = grad_axis if grad_axis is not None and grad_axis.group is not None else None
        self.zero = zero_stage == 1 and self.axis is not None
        if self.zero:
            n = self.axis.size
            flat = _flat([p.detach() for p in params], pad_to=n)
            self.shard_len = flat.numel() // n
            start = self.axis.index * self.shard_len
            self.shard = torch.nn.Parameter(flat[start:start + self.shard_len].clone())
            self.opt = torch.optim.AdamW([self.shard], lr=LR, weight_decay=WEIGHT_DECAY)
        else:
            self.opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)

    def reduce_and_step(self, step_region) -> None:
        """``step_region``: a context manager timing the optimizer arithmetic as compute."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        if self.zero:
            flat = _flat(grads, pad_to=self.axis.size)
            mine = flat.new_empty(self.shard_len)
            rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            rs(mine, flat, group=self.axis.group)
            self.shard.grad = mine
            with step_region():
                self.opt.step()
            full = flat.new_empty(self.shard_len * self.axis.size)
            ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            ag(full, self.shard.detach(), group=self.axis.group)
            with torch.no_grad():
                _unflatten_into(full, [p.data for p in self.params])
            return
        if self.axis is not None:
            flat = _flat(grads)
            dist.all_reduce(flat, group=self.axis.group)  # SUM: each loss is already / global tokens
            _unflatten_into(flat, grads)
        with step_region():
            self.opt.step()

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.opt.state.values() for t in st.values()
                   if torch.is_tensor(t))
