"""Interleaved 1F1B (Narayanan et al. 2021, section 2.2): v model chunks per rank, chunk c of rank s
is model stage ``c * p + s`` (looped placement); forwards in groups of p micro-batches per chunk,
warm-up ``(p - s - 1) * 2 + (v - 1) * p`` (Megatron's ``forward_backward_pipelining_with_interleaving``).

The bubble shrinks by v; micro-batches per replica must be a multiple of p and at least p.
torch's ``ScheduleInterleaved1F1B``, Megatron's ``--num-layers-per-virtual-pipeline-stage``,
torchtitan's ``Interleaved1F1B``.
"""

from __future__ import annotations

from functools import lru_cache

from autotune.schedules.base import B, F, Op, Schedule


class Interleaved1F1B(Schedule):
    name = "interleaved_1f1b"
    summary = "interleaved 1F1B: v looped chunks per rank (Narayanan et al. 2021, section 2.2)"
    torch_class = "ScheduleInterleaved1F1B"
    multi_stage = True
    targets = {"megatron": "interleaved 1F1B", "torchtitan": "Interleaved1F1B"}
    refusals = {
        "deepspeed": "schedule interleaved_1f1b: DeepSpeed's pipeline engine runs its own 1F1B schedule "
                     "(TrainSchedule), one stage per rank",
        "accelerate": "schedule interleaved_1f1b: Accelerate has no training pipeline schedule",
    }

    def virtual_stage_choices(self, pp: int) -> tuple[int, ...]:
        return (2, 4)

    def check_shape(self, pp: int, virtual_stages: int) -> list[str]:
        out = []
        if virtual_stages < 2:
            out.append("virtual_stages: interleaved_1f1b needs virtual_stages >= 2")
        if pp < 2:
            out.append("schedule: interleaved_1f1b needs pp >= 2")
        return out

    def min_microbatches(self, pp: int, virtual_stages: int) -> int:
        return pp

    def microbatch_multiple(self, pp: int, virtual_stages: int) -> int:
        return pp  # forwards go in groups of p micro-batches per chunk

    def op_order(self, pp: int, virtual_stages: int, m: int, rank: int) -> tuple[Op, ...]:
        return _order(pp, virtual_stages, m, rank)


@lru_cache(maxsize=1024)
def _order(p: int, v: int, m: int, s: int) -> tuple[Op, ...]:
    total = m * v

    def mb(k: int) -> int:
        return (k // (p * v)) * p + k % p

    fwd = [Op(F, ((k // p) % v) * p + s, mb(k)) for k in range(total)]
    bwd = [Op(B, (v - 1 - (k // p) % v) * p + s, mb(k)) for k in range(total)]
    warm = min((p - s - 1) * 2 + (v - 1) * p, total)
    order = fwd[:warm]
    for k in range(total - warm):
        order.append(fwd[warm + k])
        order.append(bwd[k])
    order += bwd[total - warm:]
    return tuple(order)
