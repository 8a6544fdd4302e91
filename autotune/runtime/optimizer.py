"""AdamW over this rank's parameters: whole (zero_stage 0), states sharded (zero_stage 1), or with
gradients and parameters sharded too (zero_stage 2 and 3, ``ShardedOptimizer`` over FSDP2).

zero_stage 1 is ZeRO stage 1 (Rajbhandari et al. 2020, section 5.1) in the shape of Megatron's
distributed optimizer: gradients are reduce-scattered over the ranks that hold the same parameters
(the gradient group dp x cp x hp), each rank updates only its contiguous slice of the flattened
parameters with AdamW (whose update is elementwise, so the result is exactly the unsharded one),
and the updated slices are all-gathered back. The flat buffer is padded to a multiple of the group
size so every slice has the same length (gloo's tensor collectives need equal sizes).

Memory is what the cost model prices (weights, gradients in fp32, optimizer states over the group):
the step adds no whole-model copy on top. Under bf16/fp16 the fp32 gradient accumulators are views
of one padded flat buffer, reduce-scattered as they are; in fp32 autograd's gradients are moved into
a flat buffer one parameter at a time (each freed as it goes). The updated shards are all-gathered
into that same buffer (the gradients are spent by then), and zero_stage 0 all-reduces in ~25 MiB
buckets. (Before: a flat copy of every gradient, a padded copy of that, and a gathered copy of the
weights made ZeRO-1 hold about twice its prediction, more than zero_stage 0;
tests/distributed/test_zero_memory.py measures it.)
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from autotune.runtime import grad_norm as GN
from autotune.runtime.mesh import Axis
from autotune.runtime.precision import REDUCE_DTYPE, LossScale
from autotune.runtime.tied import reduce_tied

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


def _slice_of(tensors: list[torch.Tensor], start: int, length: int) -> torch.Tensor:
    """Elements ``start .. start + length`` of the tensors flattened one after another, in fp32,
    zero past their end (the padding), without making the whole flat copy."""
    out = torch.zeros(length, dtype=REDUCE_DTYPE, device=tensors[0].device)
    off = 0
    for t in tensors:
        n = t.numel()
        lo, hi = max(start, off), min(start + length, off + n)
        if lo < hi:
            out[lo - start:hi - start].copy_(t.detach().reshape(-1)[lo - off:hi - off])
        off += n
    return out


def _chunk(flat: torch.Tensor, shard_len: int, axis: Axis) -> int:
    """Elements of each rank's slice a collective moves at once: all of it on NCCL (its reduce-scatter
    and all-gather work in place); ~BUCKET_BYTES over the group on gloo, which emulates them with
    whole-size scratch copies (measured: +1.5x the input for a reduce-scatter, +0.5x for a gather),
    so the step would hold far more than ZeRO-1 saves."""
    if dist.get_backend(axis.group) != "gloo":
        return shard_len
    return max(1, min(shard_len, BUCKET_BYTES // (flat.element_size() * axis.size)))


def _reduce_scatter(mine: torch.Tensor, flat: torch.Tensor, shard_len: int, axis: Axis) -> None:
    """``mine`` = the sum over the group of slice ``axis.index`` of ``flat`` (in chunks, see _chunk);
    ``mine`` may be that slice itself."""
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    c = _chunk(flat, shard_len, axis)
    if c == shard_len:
        rs(mine, flat, group=axis.group)
        return
    for j in range(0, shard_len, c):  # ``mine`` may be this rank's slice of ``flat``: piece j is
        k = min(c, shard_len - j)  # copied out before it is written, and later pieces read after it
        rs(mine[j:j + k], torch.cat([flat[r * shard_len + j:r * shard_len + j + k] for r in range(axis.size)]),
           group=axis.group)


def _all_gather(full: torch.Tensor, mine: torch.Tensor, shard_len: int, axis: Axis) -> None:
    """``full`` = every rank's ``mine``, rank after rank (in chunks, see _chunk)."""
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    c = _chunk(full, shard_len, axis)
    if c == shard_len:
        ag(full, mine, group=axis.group)
        return
    for j in range(0, shard_len, c):
        k = min(c, shard_len - j)
        got = mine.new_empty(k * axis.size)
        ag(got, mine[j:j + k], group=axis.group)
        for r in range(axis.size):
            full[r * shard_len + j:r * shard_len + j + k].copy_(got[r * k:(r + 1) * k])


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive views of ``flat`` shaped as ``like`` (the padding after them stays unused)."""
    out, off = [], 0
    for t in like:
        out.append(flat[off:off + t.numel()].view(t.shape))
        off += t.numel()
    return out


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in consecutive groups of about BUCKET_BYTES (one tensor may exceed it alone)."""
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        if out[-1] and size + t.numel() * t.element_size() > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.numel() * t.element_size()
    return out


class OverlappedGradReduce:
    """DDP-style overlap (Li et al. 2020, "PyTorch Distributed", section 3.2.3): parameters are
    grouped into ~25 MiB buckets in reverse order (the order backward produces gradients); during the
    last micro-batch's backward, a bucket whose gradients are all accumulated is all-reduced
    asynchronously while backward continues. ``finish`` waits and copies the sums back.
    ``masters[i]`` is the tensor whose ``.grad`` is reduced (the parameter itself in fp32);
    ``notify(i)`` is called once its gradient of the micro-batch is accumulated."""

    def __init__(self, masters: list[torch.Tensor], axis: Axis, wait_clock=None):
        self.axis, self.active, self.wait_clock = axis, False, wait_clock
        self.masters = masters
        self.buckets: list[list[int]] = [[]]
        size = 0
        for i in reversed(range(len(masters))):
            if size >= BUCKET_BYTES:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += masters[i].numel() * REDUCE_DTYPE.itemsize
        self.owner = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self.ready = [0] * len(self.buckets)
        self.works: list[tuple[int, torch.Tensor, object]] = []

    def arm(self) -> None:
        """The next backward is the step's last: reduce buckets as they fill."""
        self.active, self.ready, self.works = True, [0] * len(self.buckets), []

    def notify(self, i: int) -> None:
        if not self.active:
            return
        b = self.owner[i]
        self.ready[b] += 1
        if self.ready[b] == len(self.buckets[b]):
            flat = _flat([self.masters[j].grad for j in self.buckets[b]])
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
            _unflatten_into(flat, [self.masters[j].grad for j in self.buckets[b]])
        return True


def _reduce_replicated(grads: list[torch.Tensor], tp_axis: Axis | None) -> None:
    """Sequence parallelism: the parameters every tp rank holds whole (norms, row-parallel biases,
    the position table: ``model.tp_replicated``) saw different tokens on each; sum their gradients."""
    if not grads or tp_axis is None or tp_axis.group is None:
        return
    flat = _flat(grads)
    dist.all_reduce(flat, group=tp_axis.group)
    _unflatten_into(flat, grads)


class TrainOptimizer:
    """Reduce gradients over the gradient group (SUM) and step AdamW (zero_stage 0 or 1).

    ``replicated``: indices of parameters whose gradients are also summed over ``tp_axis``;
    ``tied``: indices of this rank's copies of a tied embedding, summed with the other holders' over
    ``tied_axis`` (``runtime/tied.py``); ``counted``: which parameters this rank counts in the
    global gradient norm (``runtime/grad_norm.py``; default all), which ``reduce_and_step`` leaves
    in ``grad_sq`` (this rank's part of its square)."""

    def __init__(self, params: list[torch.nn.Parameter], grad_axis: Axis | None, zero_stage: int = 0,
                 overlap: bool = False, wait_clock=None, *, dtype: str = "fp32",
                 replicated: list[int] | None = None, tp_axis: Axis | None = None,
                 masters: list[torch.Tensor] | None = None, tied: list[int] | None = None,
                 tied_axis: Axis | None = None, counted: list[bool] | None = None):
        """``masters``: the fp32 initial values of low-precision ``params`` (default: their values)."""
        if zero_stage not in (0, 1):
            raise ValueError(f"zero_stage {zero_stage} is sharded by ShardedOptimizer, not here")
        self.params = params
        self.counted = list(counted) if counted is not None else [True] * len(params)
        self.grad_sq = 0.0
        self.axis = grad_axis if grad_axis is not None and grad_axis.group is not None else None
        self.zero = zero_stage == 1 and self.axis is not None
        self.replicated, self.tp_axis = list(replicated or []), tp_axis
        self.tied, self.tied_axis = list(tied or []), tied_axis
        self.loss_scale = LossScale(dtype)
        self.low_precision = any(p.dtype != REDUCE_DTYPE for p in params)
        # fp32: the parameters are their own masters; else fp32 copies own the gradients and the update
        init = masters if masters is not None else [p.detach() for p in params]
        if self.zero:
            # only this rank's slice of the flattened (padded) fp32 masters is ever made
            n = self.axis.size
            total = sum(p.numel() for p in params)
            self.shard_len = -(-total // n)
            self.shard = torch.nn.Parameter(_slice_of(init, self.axis.index * self.shard_len, self.shard_len))
            self.opt = torch.optim.AdamW([self.shard], lr=LR, weight_decay=WEIGHT_DECAY)
            self.masters = [] if self.low_precision else list(params)  # Megatron: the master is the shard
            if self.low_precision:  # the fp32 accumulators, views of the one buffer the reduce-scatter sends
                self._grad_flat = torch.zeros(self.shard_len * n, dtype=REDUCE_DTYPE, device=self.shard.device)
                self._grads = _views(self._grad_flat, params)
        elif self.low_precision:
            self.masters = [torch.nn.Parameter(m.detach().to(REDUCE_DTYPE).clone()) for m in init]
        else:
            self.masters = list(params)
        if not self.zero:
            self.opt = torch.optim.AdamW(self.masters, lr=LR, weight_decay=WEIGHT_DECAY)
        self.overlap = (OverlappedGradReduce(self.masters, self.axis, wait_clock)
                        if overlap and self.axis is not None and not self.zero else None)
        if self.low_precision or self.overlap is not None:
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad(i))
        self._reduced = False
        self._flat = self._mine = None  # ZeRO-1: the reduced buffer and its slice, from reduce() to step()

    # ---- gradients ----------------------------------------------------------------------------
    def _accumulate(self, i: int) -> None:
        """Move the low-precision gradient of parameter ``i`` into its fp32 accumulator."""
        p = self.params[i]
        if p.grad is None:
            return
        if self.zero:
            self._grads[i].add_(p.grad)
        else:
            m = self.masters[i]
            if m.grad is None:
                m.grad = p.grad.to(REDUCE_DTYPE)
            else:
                m.grad.add_(p.grad)
        p.grad = None

    def _on_grad(self, i: int) -> None:
        if self.low_precision:
            self._accumulate(i)
        if self.overlap is not None:
            self.overlap.notify(i)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.low_precision:
            if self.zero:
                self._grad_flat.zero_()  # also what the last step gathered into it
            else:
                for m in self.masters:
                    m.grad = None

    def _full_grads(self) -> list[torch.Tensor]:
        """The fp32 gradient of every parameter (zeros where backward left none)."""
        if self.low_precision:
            for i in range(len(self.params)):  # whatever a schedule accumulated without the hook
                self._accumulate(i)
            if self.zero:
                return self._grads
        holders = self.masters
        for m in holders:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
        return [m.grad for m in holders]

    def begin_step(self) -> None:
        self.zero_grad()

    def before_last_backward(self) -> None:
        if self.overlap is not None:
            self.overlap.arm()

    def after_last_forward(self) -> None:
        return None

    def finish_overlap(self) -> None:
        """Wait for the buckets reduced during backward (before any other change to the gradients:
        ``finish`` copies the bucket sums over them)."""
        self._reduced = self.overlap is not None and self.overlap.finish()

    def reduce_and_step(self, step_region) -> None:
        """``step_region``: a context manager timing the optimizer arithmetic as compute."""
        grads = self.reduce()
        if self.loss_scale.unscale_and_check(grads):
            self.grad_sq = self.sq_norm(grads)
            self.step(step_region)
        else:
            self.grad_sq = GN.SKIPPED

    def sq_norm(self, grads: list[torch.Tensor]) -> GN.Square:
        """This rank's part of the squared global gradient norm, from what ``reduce`` returned (once
        unscaled): the ``counted`` gradients if this rank is its replicas' first, or under ZeRO-1
        the ``counted`` elements of its own slice (``runtime/grad_norm.py``)."""
        if self.zero:
            sizes = [p.numel() for p in self.params]
            return GN.slice_sq_sum(grads[0], self.axis.index * self.shard_len, sizes, self.counted)
        return GN.replica_sq_sum(grads, self.counted, self.axis)

    def reduce(self) -> list[torch.Tensor]:
        """Sum the step's gradients over the group (reduce-scatter under ZeRO-1); returns the fp32
        tensors the loss scale checks (this rank's slice under ZeRO-1)."""
        grads = self._full_grads()
        _reduce_replicated([grads[i] for i in self.replicated], self.tp_axis)
        reduce_tied([grads[i] for i in self.tied], self.tied_axis)
        if self.zero:
            return [self._zero1_reduce(grads)]
        if self._reduced:
            self._reduced = False  # already summed during backward
        elif self.axis is not None:
            for bucket in _buckets(grads):  # SUM: each loss is already / global tokens
                flat = _flat(bucket)
                dist.all_reduce(flat, group=self.axis.group)
                _unflatten_into(flat, bucket)
        return grads

    def step(self, step_region) -> None:
        """Step on the reduced gradients (once the loss scale found them finite on every rank)."""
        if self.zero:
            self._zero1_step(step_region)
            return
        with step_region():
            self.opt.step()
        if self.low_precision:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters, strict=True):
                    p.copy_(m)

    def _zero1_reduce(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Reduce-scatter the flat gradients; returns this rank's slice (kept for ``_zero1_step``)."""
        if self.low_precision:
            flat = self._grad_flat  # the accumulators are its views
        else:  # autograd's gradients into one buffer, each freed once copied
            # empty, not zeros: its pages are touched as the gradients are freed, never all at once
            flat = grads[0].new_empty(self.shard_len * self.axis.size)
            flat[sum(p.numel() for p in self.params):].zero_()  # the padding
            off = 0
            for i, p in enumerate(self.params):
                n = p.numel()
                flat[off:off + n].copy_(grads[i].reshape(-1))
                p.grad = grads[i] = None  # the caller's list too: nothing else holds it
                off += n
        start = self.axis.index * self.shard_len
        mine = flat[start:start + self.shard_len]  # in place, as NCCL allows and Megatron does
        _reduce_scatter(mine, flat, self.shard_len, self.axis)
        self._flat, self._mine = flat, mine
        return mine

    def _zero1_step(self, step_region) -> None:
        """Step this rank's slice, all-gather the slices into the same buffer (in the compute dtype)
        and copy them into the parameters."""
        flat, mine = self._flat, self._mine
        self._flat = self._mine = None  # an overflow skips this: the next reduce sets them again
        self.shard.grad = mine
        with step_region():
            self.opt.step()
        self.shard.grad = None
        dtype = self.params[0].dtype  # gather in the compute dtype (fp32 plans: exactly as before)
        full = flat.view(dtype)[:self.shard_len * self.axis.size]  # the spent gradients' memory
        _all_gather(full, self.shard.detach().to(dtype), self.shard_len, self.axis)
        with torch.no_grad():
            _unflatten_into(full, [p.data for p in self.params])

    def master_weights(self) -> list[torch.Tensor]:
        """fp32 master weight of every parameter, in ``params`` order (ZeRO-1 in low precision gathers
        the shards: a collective over the gradient group)."""
        if not (self.zero and self.low_precision):
            return [m.detach() for m in self.masters]
        full = self.shard.new_empty(self.shard_len * self.axis.size)
        dist.all_gather_into_tensor(full, self.shard.detach(), group=self.axis.group)
        out = [torch.empty(p.shape, dtype=REDUCE_DTYPE, device=p.device) for p in self.params]
        _unflatten_into(full, out)
        return out

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.opt.state.values() for t in st.values()
                   if torch.is_tensor(t))


class ExpertSplitOptimizer:
    """An MoE model's two gradient groups (Megatron-Core's expert data parallelism): the dense
    parameters in one ``TrainOptimizer`` over the gradient group (dp x cp x hp), the routed experts'
    in another over expert-DP (the ranks holding the same expert slices); ``is_expert[i]`` says which
    holds parameter ``i`` of the rank's parameter order. Both share one loss scale and one decision:
    under fp16 an overflow in either group skips the step of both on every rank (two dynamic scales
    would skip per group and train the two halves of the model on different steps)."""

    def __init__(self, dense: TrainOptimizer, expert: TrainOptimizer, is_expert: list[bool]):
        self.dense, self.expert, self.is_expert = dense, expert, is_expert
        self.loss_scale = expert.loss_scale = dense.loss_scale
        self.grad_sq = 0.0

    def begin_step(self) -> None:
        self.dense.begin_step()
        self.expert.begin_step()

    def before_last_backward(self) -> None:
        self.dense.before_last_backward()
        self.expert.before_last_backward()

    def after_last_forward(self) -> None:
        return None

    def finish_overlap(self) -> None:
        self.dense.finish_overlap()
        self.expert.finish_overlap()

    def reduce_and_step(self, step_region) -> None:
        dense, expert = self.dense.reduce(), self.expert.reduce()
        if self.loss_scale.unscale_and_check(dense + expert):  # one flag, MAX-reduced over the world, for both groups
            self.grad_sq = self.dense.sq_norm(dense) + self.expert.sq_norm(expert)
            self.dense.step(step_region)
            self.expert.step(step_region)
        else:
            self.grad_sq = GN.SKIPPED

    def master_weights(self) -> list[torch.Tensor]:
        """fp32 master weights in the rank's parameter order (collective under ZeRO-1, as each part's)."""
        parts = {False: iter(self.dense.master_weights()), True: iter(self.expert.master_weights())}
        return [next(parts[e]) for e in self.is_expert]

    def state_bytes(self) -> int:
        return self.dense.state_bytes() + self.expert.state_bytes()


class ShardedOptimizer:
    """AdamW over FSDP2-sharded parameters (zero_stage 2 and 3; autotune/runtime/sharding.py).

    The parameters are fp32 DTensor shards over the gradient group (the masters); FSDP2 all-gathers
    them in the compute dtype and reduce-scatters the gradients in ``GRAD_REDUCE_DTYPE`` as a SUM
    (each loss is already divided by the global token count, so uneven replicas weigh right).
    Gradients are reduced once per step, during the last micro-batch's backward: the pipeline
    schedules do so for their stages, and ``begin_step``/``before_last_backward`` do so for the
    plain micro-batch loop (pp = 1)."""

    def __init__(self, modules: list[torch.nn.Module], params: list[torch.nn.Parameter], *, dtype: str,
                 replicated: list[int] | None = None, tp_axis: Axis | None = None, own_loop: bool = True,
                 zero_stage: int = 3, gather_per_microbatch: bool = True, tied: list[int] | None = None,
                 tied_axis: Axis | None = None, counted: list[bool] | None = None):
        """``counted``: as ``TrainOptimizer``'s (every rank counts its own FSDP2 shards: the root
        ``fully_shard`` of each module leaves no parameter whole)."""
        self.modules, self.params = modules, params
        self.counted = list(counted) if counted is not None else [True] * len(params)
        self.grad_sq = 0.0
        self.zero_stage, self.gather_per_microbatch = zero_stage, gather_per_microbatch
        self.replicated, self.tp_axis = list(replicated or []), tp_axis
        self.tied, self.tied_axis = list(tied or []), tied_axis  # on FSDP2's shards (runtime/tied.py)
        self.loss_scale = LossScale(dtype)
        self.own_loop = own_loop
        self.opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)

    def _sync(self, last: bool) -> None:
        """The plain micro-batch loop: reduce only in the last backward; between micro-batches keep
        the gathered parameters unless ZeRO-3 gathers per micro-batch."""
        if self.own_loop:
            keep = not (self.zero_stage == 3 and self.gather_per_microbatch)
            for m in self.modules:
                m.set_requires_gradient_sync(last)
                m.set_reshard_after_backward(last or not keep)

    def begin_step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self._sync(False)

    def before_last_backward(self) -> None:
        self._sync(True)

    def after_last_forward(self) -> None:
        """ZeRO-3 with per-step gathering: free the parameters so the last backward gathers again."""
        if self.own_loop and self.zero_stage == 3 and not self.gather_per_microbatch:
            from autotune.runtime.sharding import reshard_units

            for m in self.modules:
                reshard_units(m)

    def finish_overlap(self) -> None:
        return None

    def reduce_and_step(self, step_region) -> None:
        local = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local.append(_local(p.grad))
        _reduce_replicated([local[i] for i in self.replicated], self.tp_axis)
        reduce_tied([local[i] for i in self.tied], self.tied_axis)
        if not self.loss_scale.unscale_and_check(local):
            self.grad_sq = GN.SKIPPED
            return
        self.grad_sq = GN.sq_sum([g for g, c in zip(local, self.counted, strict=True) if c])
        with step_region() if step_region is not None else nullcontext():
            self.opt.step()

    def master_weights(self) -> list[torch.Tensor]:
        """Whole fp32 weights (``full_tensor`` all-gathers over the gradient group: a collective)."""
        return [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in self.params]

    def state_bytes(self) -> int:
        return sum(_local(t).numel() * t.element_size() for st in self.opt.state.values() for t in st.values()
                   if torch.is_tensor(t))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
