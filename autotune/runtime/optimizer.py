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


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


class OverlappedGradReduce:
    """DDP-style overlap (Li et al. 2020, "PyTorch Distributed", section 3.2.3): parameters are
    grouped into ~25 MiB buckets in reverse order (the order backward produces gradients); during the
    last micro-batch's backward, a bucket whose gradients are all accumulated is all-reduced
    asynchronously while backward continues. ``finish`` waits and copies the sums back."""

    def __init__(self, params: list[torch.nn.Parameter], axis: Axis, wait_clock=None):
        self.axis, self.active, self.wait_clock = axis, False, wait_clock
        self.buckets: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in reversed(params):
            if size >= BUCKET_BYTES:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.owner = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.ready = [0] * len(self.buckets)
        self.works: list[tuple[int, torch.Tensor, object]] = []
        for p in params:
            p.register_post_accumulate_grad_hook(self._hook)

    def arm(self) -> None:
        """The next backward is the step's last: reduce buckets as they fill."""
        self.active, self.ready, self.works = True, [0] * len(self.buckets), []

    def _hook(self, p: torch.nn.Parameter) -> None:
        if not self.active:
            return
        b = self.owner[id(p)]
        self.ready[b] += 1
        if self.ready[b] == len(self.buckets[b]):
            flat = _flat([q.grad for q in self.buckets[b]])
            self.works.append((b, flat, dist.all_reduce(flat, group=self.axis.group, async_op=True)))

    def finish(self) -> bool:
        """Wait for the buckets; False when some bucket never filled (then reduce synchronously)."""
        self.active = False
        if len(self.works) != len(self.buckets):
            for _, _, w in self.works:
                w.wait()
            return False
        for b, flat, w in self.works:
            if self.wait_clock is not None:
                self.wait_clock(w.wait)
            else:
                w.wait()
            _unflatten_into(flat, [q.grad for q in self.buckets[b]])
        return True


class TrainOptimizer:
    """Reduce gradients over the gradient group (SUM) and step AdamW."""

    def __init__(self, params: list[torch.nn.Parameter], grad_axis: Axis | None, zero_stage: int = 0,
                 overlap: bool = False, wait_clock=None):
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
        self.overlap = (OverlappedGradReduce(params, self.axis, wait_clock)
                        if overlap and self.axis is not None and not self.zero else None)

        self._reduced = False

    def before_last_backward(self) -> None:
        if self.overlap is not None:
            self.overlap.arm()

    def finish_overlap(self) -> None:
        """Wait for the buckets reduced during backward (before any other change to the gradients:
        ``finish`` copies the bucket sums over them)."""
        self._reduced = self.overlap is not None and self.overlap.finish()

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
        if self._reduced:
            self._reduced = False  # already summed during backward
        elif self.axis is not None:
            flat = _flat(grads)
            dist.all_reduce(flat, group=self.axis.group)  # SUM: each loss is already / global tokens
            _unflatten_into(flat, grads)
        with step_region():
            self.opt.step()

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.opt.state.values() for t in st.values()
                   if torch.is_tensor(t))
