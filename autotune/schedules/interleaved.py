"""Interleaved 1F1B (Narayanan et al. 2021, section 2.2): v model chunks per rank, chunk c of rank s
is model stage ``c * p + s`` (looped placement); forwards in groups of p micro-batches per chunk,
warm-up ``(p - s - 1) * 2 + (v - 1) * p`` (Megatron's ``forward_backward_pipelining_with_interleaving``).

The bubble shrinks by v; micro-batches per replica must be a multiple of p and at least p.
torch's ``ScheduleInterleaved1F1B``, Megatron's ``--num-layers-per-virtual-pipeline-stage``,
torchtitan's ``Interleaved1F1B``.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import repeat

from autotune.schedules.base import B, F, Op, Schedule, ops_of


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

    def in_flight(self, pp: int, virtual_stages: int, m: int, rank: int,
                  layers: tuple[int, ...]) -> tuple[int, int]:
        """The walk of ``Schedule.in_flight`` over ``_order`` as prefix sums (the same integers, no
        operations built): the warm-up forwards, then in the steady state each forward's peak is
        the forwards so far less the backwards before it; backwards free (B), the cool-down only
        frees. The stage program asks it for every pipeline shape it composes (measured: walking
        the order was a third of a per-stage search's plan building at global batch 2048)."""
        import numpy as np

        p, v = pp, virtual_stages
        total = m * v
        warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
        chunk = (np.arange(total) // p) % v  # local chunk of the k-th forward; the k-th backward's is v-1-chunk
        held = _peak(np.asarray(layers)[chunk], np.asarray(layers)[v - 1 - chunk], warm)
        if rank != p - 1:  # the last model chunk (p*v - 1) is chunk v-1 of rank p-1
            return held, 0
        return held, _peak((chunk == v - 1).astype(np.int64), (chunk == 0).astype(np.int64), warm)


def _peak(fwd, bwd, warm: int) -> int:
    """Most held at once when forwards add ``fwd[k]`` in order, the first ``warm`` alone, then each
    further forward followed by the backward that frees ``bwd[k]`` (numpy integer arrays)."""
    import numpy as np

    ends = np.cumsum(fwd)  # held after the k-th forward, had no backward run: sum(fwd[:k + 1])
    steady = len(fwd) - warm
    peak = int(ends[warm - 1]) if warm else 0
    if steady:
        freed = np.concatenate(([0], np.cumsum(bwd[:steady - 1])))  # backwards run before forward warm + k
        peak = max(peak, int((ends[warm:] - freed).max()))
    return peak


@lru_cache(maxsize=1024)
def _order(p: int, v: int, m: int, s: int) -> tuple[Op, ...]:
    total = m * v
    ks = range(total)
    mb = [(k // (p * v)) * p + k % p for k in ks]  # the k-th forward's (and backward's) micro-batch
    fwd = ops_of(repeat(F, total), [((k // p) % v) * p + s for k in ks], mb)
    bwd = ops_of(repeat(B, total), [(v - 1 - (k // p) % v) * p + s for k in ks], mb)
    warm = min((p - s - 1) * 2 + (v - 1) * p, total)
    order = fwd[:warm]
    steady = [None] * (2 * (total - warm))
    steady[0::2], steady[1::2] = fwd[warm:], bwd[:total - warm]  # one forward, one backward
    order += steady
    order += bwd[total - warm:]
    return tuple(order)
