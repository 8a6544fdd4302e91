"""ZB1P, interleaved zero bubble (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv
2401.10241; torch's ``ScheduleInterleavedZeroBubble``): interleaved 1F1B's looped placement (chunk
c of rank s is model stage ``c * p + s``) and order, with every backward split into I (input
gradient) and W (weight gradient) and the W passes moved into the bubbles. The HelixPipe paper's
ZB1P baseline.

The order is torch's own (``_calculate_single_rank_operations``, ported without torch in
zero_bubble_orders.py and pinned equal by a test; the runtime pads it with idle slots, which do not
change a rank's order). Micro-batches per replica: a multiple of pp, as
interleaved 1F1B (torch needs ``m % max(1, m // pp) == 0``; multiples of pp satisfy it).
"""

from __future__ import annotations

from autotune.schedules.base import Op, Schedule
from autotune.schedules.zero_bubble_orders import interleaved_zb_order


class InterleavedZeroBubble(Schedule):
    name = "interleaved_zb"
    summary = "ZB1P: interleaved 1F1B with the backward split into input and weight gradients (Qi et al. 2023)"
    splits_backward = True
    torch_class = "ScheduleInterleavedZeroBubble"
    multi_stage = True
    targets = {"torchtitan": "InterleavedZeroBubble"}
    refusals = {
        "megatron": "schedule interleaved_zb: upstream Megatron-LM has no zero-bubble schedule (Sea AI Lab's "
                    "fork sail-sg/zero-bubble-pipeline-parallelism runs it with --enable-zero-bubble)",
        "deepspeed": "schedule interleaved_zb: DeepSpeed's pipeline engine runs its own 1F1B schedule "
                     "(TrainSchedule), one stage per rank",
        "accelerate": "schedule interleaved_zb: Accelerate has no training pipeline schedule",
    }

    def virtual_stage_choices(self, pp: int) -> tuple[int, ...]:
        return (2, 4)

    def check_shape(self, pp: int, virtual_stages: int) -> list[str]:
        out = []
        if virtual_stages < 2:
            out.append("virtual_stages: interleaved_zb needs virtual_stages >= 2")
        if pp < 2:
            out.append("schedule: interleaved_zb needs pp >= 2")
        return out

    def min_microbatches(self, pp: int, virtual_stages: int) -> int:
        return pp

    def microbatch_multiple(self, pp: int, virtual_stages: int) -> int:
        return pp

    def op_order(self, pp: int, virtual_stages: int, m: int, rank: int) -> tuple[Op, ...]:
        return interleaved_zb_order(pp, virtual_stages, m, rank)
