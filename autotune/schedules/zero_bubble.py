"""ZB-V, the V-shaped zero-bubble schedule (Qi et al. 2023, "Zero Bubble Pipeline Parallelism",
arXiv 2401.10241, section 6; torch's ``ScheduleZBVZeroBubble``).

* Placement: two model chunks per rank in a V: rank r holds chunks r and 2p - 1 - r, so rank 0 holds
  both ends of the model (embedding and loss) and the turn (chunks p - 1 and p) stays on rank p - 1.
* Backward split in two: I, the input gradient (on the critical path: the previous chunk waits for
  it) and W, the weight gradient (nobody waits for it), which the schedule moves into what would
  be bubbles. With F = I = W the bubble vanishes for m >= 2p - 1 (the paper's claim).
* Memory is the price: a micro-batch's activations stay until its W, and the V keeps about 2p
  chunk-micro-batches on every rank (1F1B's first rank: p of its single chunk, i.e. the same
  layers-worth; later ranks hold more than in 1F1B). ``in_flight`` reads it from the order.

The order is torch's own (``ScheduleZBVZeroBubble._calculate_single_rank_operations``, the code the
runtime executes, ported without torch in zero_bubble_orders.py and pinned equal by a test), so
the simulation, the memory figure, the Gantt chart and the trial run one order. Megatron-LM upstream has no zero-bubble schedule (Sea AI Lab's fork adds
``--zero-bubble-v-schedule``); torchtitan runs it as ``ZBVZeroBubble``.
"""

from __future__ import annotations

from autotune.schedules.base import Op, Schedule
from autotune.schedules.zero_bubble_orders import zbv_order


class ZBV(Schedule):
    name = "zbv"
    summary = "ZB-V zero bubble: V placement, backward split into input and weight gradients (Qi et al. 2023)"
    splits_backward = True
    torch_class = "ScheduleZBVZeroBubble"
    multi_stage = True
    targets = {"torchtitan": "ZBVZeroBubble"}
    refusals = {
        "megatron": "schedule zbv: upstream Megatron-LM has no zero-bubble schedule (Sea AI Lab's fork "
                    "sail-sg/zero-bubble-pipeline-parallelism runs it with --zero-bubble-v-schedule)",
        "deepspeed": "schedule zbv: DeepSpeed's pipeline engine runs its own 1F1B schedule (TrainSchedule), "
                     "one stage per rank",
        "accelerate": "schedule zbv: Accelerate has no training pipeline schedule",
    }

    def virtual_stage_choices(self, pp: int) -> tuple[int, ...]:
        return (2,)

    def check_shape(self, pp: int, virtual_stages: int) -> list[str]:
        out = super().check_shape(pp, virtual_stages)
        if pp < 2:
            out.append("schedule: zbv needs pp >= 2")
        return out

    def stage_rank(self, stage: int, pp: int, virtual_stages: int) -> int:
        return stage if stage < pp else 2 * pp - 1 - stage

    def op_order(self, pp: int, virtual_stages: int, m: int, rank: int) -> tuple[Op, ...]:
        return zbv_order(pp, m, rank)
