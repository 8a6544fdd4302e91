"""Mixed-precision training as the plan's ``dtype`` asks (Micikevicius et al. 2018, "Mixed Precision
Training"; Megatron-LM's ``--bf16`` / ``--fp16``):

* compute in the low precision (bf16 or fp16 copies of the weights, activations in that dtype);
* fp32 master weights and fp32 AdamW states (the optimizer never sees a low-precision tensor);
* gradients accumulated over micro-batches and reduced over the data-parallel ranks in
  ``GRAD_REDUCE_DTYPE`` (fp32, Megatron's default under ``--bf16``; the cost model prices these bytes);
* fp16 only: dynamic loss scaling (``LossScale``), because fp16's 5 exponent bits flush small
  gradients to zero. bf16 has fp32's exponent range and runs unscaled, as Megatron does.

An fp32 plan takes none of these detours: the master weights *are* the module's weights, so fp32
trials stay bit-comparable with one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autotune.plan import GRAD_REDUCE_DTYPE

TORCH_DTYPES = {"fp32": torch.float32, "fp32-strict": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
REDUCE_DTYPE = TORCH_DTYPES[GRAD_REDUCE_DTYPE]

# torch.amp.GradScaler's defaults (and Megatron's DynamicGradScaler's, but for the window)
INIT_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


def is_low_precision(dtype: str) -> bool:
    return TORCH_DTYPES[dtype] != torch.float32


class LossScale:
    """Dynamic loss scaling for fp16 (a constant 1 otherwise).

    torch.amp.GradScaler runs on CPU in this torch, but it decides per process and per device whether
    a gradient overflowed; a sharded or pipelined step must skip on every rank or on none, so the
    overflow flag is MAX-reduced over the whole world here (as Megatron's optimizer does over its
    model-parallel group) with the same constants and the same fused unscale-and-check kernel."""

    def __init__(self, dtype: str):
        self.dynamic = dtype == "fp16"
        self.scale = INIT_SCALE if self.dynamic else 1.0
        self._good_steps = 0
        self.skipped = 0

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide ``grads`` (fp32, in place) by the scale; True when every rank's are finite (then the
        optimizer steps). Updates the scale as GradScaler.update does. Every rank must call it."""
        if not self.dynamic:
            return True
        device = grads[0].device if grads else torch.device("cpu")
        found = torch.zeros(1, dtype=torch.float32, device=device)
        inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=device)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for gs in by_device.values():
            torch._amp_foreach_non_finite_check_and_unscale_(gs, found, inv)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        ok = float(found.item()) == 0.0
        if ok:
            self._good_steps += 1
            if self._good_steps == GROWTH_INTERVAL:
                self.scale *= GROWTH_FACTOR
                self._good_steps = 0
        else:
            self.scale *= BACKOFF_FACTOR
            self._good_steps = 0
            self.skipped += 1
        return ok
