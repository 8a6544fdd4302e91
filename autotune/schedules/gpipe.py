"""GPipe (Huang et al. 2019): every forward of the step, then every backward.

Holds all m micro-batches' activations at once; bubble ``(p-1)/(m+p-1)`` like 1F1B. torch's
``ScheduleGPipe``; Megatron-LM has no GPipe schedule (it runs 1F1B), DeepSpeed's engine runs its own
1F1B, Accelerate's pippy inference API trains nothing.
"""

from __future__ import annotations

from functools import lru_cache

from autotune.schedules.base import B, F, Op, Schedule


class GPipe(Schedule):
    name = "gpipe"
    summary = "GPipe: all forwards, then all backwards (Huang et al. 2019)"
    torch_class = "ScheduleGPipe"
    targets = {"torchtitan": "GPipe"}
    refusals = {
        "megatron": "schedule gpipe: Megatron pipelines run 1F1B (interleaved with virtual stages), "
                    "there is no GPipe schedule",
        "deepspeed": "schedule gpipe: DeepSpeed's pipeline engine runs its own 1F1B schedule (TrainSchedule), "
                     "one stage per rank",
        "accelerate": "schedule gpipe: Accelerate has no training pipeline schedule",
    }

    def op_order(self, pp: int, virtual_stages: int, m: int, rank: int) -> tuple[Op, ...]:
        return _order(pp, m, rank)

    def in_flight(self, pp: int, virtual_stages: int, m: int, rank: int,
                  layers: tuple[int, ...]) -> tuple[int, int]:
        """The walk of ``Schedule.in_flight`` over ``_order`` in closed form: every forward before
        any backward, so all ``m`` micro-batches (the last stage's are its logits)."""
        return layers[0] * m, (m if rank == pp - 1 else 0)


@lru_cache(maxsize=1024)
def _order(pp: int, m: int, s: int) -> tuple[Op, ...]:
    return tuple(Op(F, s, i) for i in range(m)) + tuple(Op(B, s, i) for i in range(m))
