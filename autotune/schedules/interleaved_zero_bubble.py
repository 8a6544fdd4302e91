"""ZB1P, interleaved zero bubble (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv
2401.10241; torch's ``ScheduleInterleavedZeroBubble``): interleaved 1F1B's looped placement (chunk
c of rank s is model stage ``c * p + s``) and order, with every backward split into I (input
gradient) and W (weight gradient) and the W passes moved into the bubbles. The HelixPipe paper's
ZB1P baseline.

The order is torch's own (``_calculate_single_rank_operations``; the runtime pads it with idle
slots, which do not change a rank's order). Micro-batches per replica: a multiple of pp, as
interleaved 1F1B (torch needs ``m % max(1, m // pp) == 0``; multiples of pp satisfy it).
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

from autotune.schedules.base import B, F, I, Op, Schedule, W

_KIND = {"F": F, "B": B, "I": I, "W": W}


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
        return _torch_order(pp, virtual_stages, m, rank)


@lru_cache(maxsize=1024)
def _torch_order(pp: int, v: int, m: int, rank: int) -> tuple[Op, ...]:
    """Rank ``rank``'s actions as torch's ZB1P schedule computes them (idle slots dropped)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    rounds = max(1, m // pp)
    # the method reads only these attributes; building the schedule itself needs real stages
    shape = SimpleNamespace(n_local_stages=v, pp_group_size=pp, _n_microbatches=m, number_of_rounds=rounds,
                            microbatches_per_round=m // rounds)
    actions = ScheduleInterleavedZeroBubble._calculate_single_rank_operations(shape, rank)
    return tuple(Op(_KIND[a.computation_type.value], a.stage_index, a.microbatch_index)
                 for a in actions if a is not None)
