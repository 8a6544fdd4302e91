"""1F1B (PipeDream-Flush, Narayanan et al. 2021): ``min(p - s - 1, m)`` warm-up forwards on rank s,
then one forward one backward, then the remaining backwards.

Holds ``min(p - s, m)`` micro-batches on rank s; bubble ``(p-1)/(m+p-1)``. torch's
``Schedule1F1B``, Megatron's ``forward_backward_pipelining_without_interleaving``, DeepSpeed's
``TrainSchedule``, torchtitan's ``1F1B``.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import repeat

from autotune.schedules.base import B, F, Op, Schedule, ops_of


class OneFOneB(Schedule):
    name = "1f1b"
    summary = "1F1B: warm-up forwards, then one forward one backward (Narayanan et al. 2021)"
    torch_class = "Schedule1F1B"
    targets = {"megatron": "1F1B", "torchtitan": "1F1B", "deepspeed": "TrainSchedule"}
    refusals = {"accelerate": "schedule 1f1b: Accelerate has no training pipeline schedule"}

    def min_microbatches(self, pp: int, virtual_stages: int) -> int:
        return pp  # torch's Schedule1F1B refuses fewer micro-batches than stages

    def op_order(self, pp: int, virtual_stages: int, m: int, rank: int) -> tuple[Op, ...]:
        return _order(pp, m, rank)

    def in_flight(self, pp: int, virtual_stages: int, m: int, rank: int,
                  layers: tuple[int, ...]) -> tuple[int, int]:
        """The walk of ``Schedule.in_flight`` over ``_order`` in closed form: the warm-up forwards and
        one more before the first backward, ``min(p - s, m)`` micro-batches (the last stage's are its
        logits). A search prices thousands of plans at up to a thousand micro-batches each."""
        held = min(pp - rank, m)
        return layers[0] * held, (held if rank == pp - 1 else 0)


@lru_cache(maxsize=1024)
def _order(p: int, m: int, s: int) -> tuple[Op, ...]:
    warm = min(p - s - 1, m)
    fwd = ops_of(repeat(F, m), repeat(s, m), range(m))
    bwd = ops_of(repeat(B, m), repeat(s, m), range(m))
    steady = [None] * (2 * (m - warm))
    steady[0::2], steady[1::2] = fwd[warm:], bwd[:m - warm]  # one forward, one backward
    return tuple(fwd[:warm] + steady + bwd[m - warm:])
