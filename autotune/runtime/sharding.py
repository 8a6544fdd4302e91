"""ZeRO-2 and ZeRO-3 with torch FSDP2 (``fully_shard``) over the gradient group.

The gradient group is every rank holding the same parameters (same pp and tp coordinate: dp x cp x
hp, ``Mesh.grad``), so that is where states, gradients and parameters are sharded: DeepSpeed-Ulysses
shards ZeRO over its sequence-parallel ranks the same way, and the cost model divides by the same
count. FSDP2 runs on a one-dimensional ``DeviceMesh`` made from the group the runtime already built
(``DeviceMesh.from_group``), so no second set of process groups exists.

* ZeRO-3 (Rajbhandari et al. 2020, P_os+g+p): ``reshard_after_forward=True``: each block's
  parameters are all-gathered for its forward, freed, and all-gathered again for its backward (and
  for recomputation), and freed after it (under pipelining too: torch's stages turn that off, the
  runtime turns it back on, worker.py ``_reshard_in_every_backward``).
* ZeRO-2 (P_os+g): ``reshard_after_forward=False``: the all-gathered parameters stay until the
  backward is done (what FSDP calls SHARD_GRAD_OP), gradients are reduce-scattered.

Gradients are accumulated over the micro-batches of a step (fp32, unsharded) and reduce-scattered
once, in the last backward (torch's pipeline stages do this for FSDP modules, after the last
backward; ``ShardedOptimizer`` does it for the plain micro-batch loop, in it). This is chosen over
what DeepSpeed's ZeRO-2 and FSDP2's default do (reduce-scatter every micro-batch's gradients in its
backward and accumulate only the shard), and the cost model prices the choice
(``autotune/cost/memory.py``, ``data_parallel.grads_accumulate_unsharded``): a rank running more
than one micro-batch, or any pipeline stage, holds a whole fp32 gradient buffer (4 bytes a
parameter), so ZeRO-2 then needs ZeRO-1's memory at its peak; in exchange the step runs one
reduce-scatter, not one per micro-batch. Why: with uneven samples per replica the replicas run
different micro-batch counts, and collectives matched by order over the gradient group would need
the replicas with fewer micro-batches to issue the missing reduce-scatters (with zero gradients,
in FSDP2's unit order and sizes, interleaved at the right place with the per-step gathers below);
torch's pipeline stages, which own the backward under pp > 1, turn gradient sync off for every
backward and reduce after the last, so per-micro-batch reduction there would mean overriding
their FSDP handling for every schedule, split backwards included. Measured on CPU (dp=2, bf16,
1.9M-parameter blocks; tests/distributed/test_zero_memory.py): four micro-batches need the fp32
buffer less the shards more than one micro-batch, within 15% of the cost model's difference, and
the replica running three micro-batches of an uneven trial needs it more than the one running one
(within 12%).

Uneven samples per replica: this is where FSDP2 alone cannot take the share. Its collectives are
matched by order over the gradient group, and FSDP2 all-gathers per micro-batch, so replicas that run
different numbers of micro-batches would issue different numbers of all-gathers and hang. When the
micro-batch counts differ (``gather_per_microbatch`` False) the parameters are therefore gathered
per *step*: each unit is all-gathered at its first forward and kept over the micro-batches; under
ZeRO-3 every unit is freed before the step's last backward (``reshard_units``) and gathered again
in it. Every replica then issues, per unit and step, the same all-gather(s) and one reduce-scatter
whatever its micro-batch count; the weighting itself needs nothing more (see the SUM below).

Every ``Block`` is its own FSDP unit (one all-gather per layer, prefetched), the stage module holds
the rest (embedding, final norm, head). The tensor-parallel layers are hand-written and hold plain
tensors, so FSDP shards each rank's tp shard further along dim 0 (uneven sizes are padded by FSDP2,
measured exact on gloo). Mixed precision is FSDP2's ``MixedPrecisionPolicy``: fp32 sharded masters,
compute in the plan's dtype, gradient reduce-scatter in ``GRAD_REDUCE_DTYPE``; the reduction is a
plain SUM (divide factor 1), because each loss is already divided by the global token count, which
is what makes uneven samples per replica exact without any other weighting.
"""

from __future__ import annotations

import torch
from torch import nn

from autotune.runtime.mesh import Axis
from autotune.runtime.precision import REDUCE_DTYPE

ZERO_RESHARD_AFTER_FORWARD = {2: False, 3: True}


def shard_stage_modules(modules: list[nn.Module], block_type: type, grad_axis: Axis, zero_stage: int,
                        compute_dtype: torch.dtype, device: torch.device,
                        gather_per_microbatch: bool = True) -> list[nn.Module]:
    """``fully_shard`` every ``block_type`` inside each module, then the module itself; returns the
    FSDP modules (the stage roots) whose gradient sync the optimizer toggles."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if zero_stage not in ZERO_RESHARD_AFTER_FORWARD:
        raise ValueError(f"zero_stage {zero_stage} is not sharded with FSDP (2 or 3)")
    mesh = DeviceMesh.from_group(grad_axis.group, device.type)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=REDUCE_DTYPE)
    reshard = ZERO_RESHARD_AFTER_FORWARD[zero_stage] and gather_per_microbatch
    roots = []
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, block_type):
                unit = fully_shard(sub, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
                _sum_reduction(unit)
        root = fully_shard(m, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        _sum_reduction(root)
        roots.append(root)
    return roots


def _sum_reduction(unit) -> None:
    """Reduce-scatter as a plain SUM (the losses are already weighted, see above). A divide factor
    alone makes FSDP2 use PREMUL_SUM, which gloo lacks; forcing sum-only collectives keeps SUM."""
    unit.set_gradient_divide_factor(1.0)
    unit.set_force_sum_reduction_for_comms(True)


def fsdp_units(module: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def reshard_units(module: nn.Module) -> None:
    """Free every gathered parameter of ``module``'s FSDP units (ZeRO-3 before the last backward
    under per-step gathering; ``FSDPModule.reshard`` is not recursive)."""
    for unit in fsdp_units(module):
        unit.reshard()
