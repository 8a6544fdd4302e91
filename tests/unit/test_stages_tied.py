"""The row matching of a tied embedding between a per-stage plan's first and last stage
(``runtime/tied.staged_tied_segments``): against the rows each rank holds (``vocab_rows``), every
row of a holder's shard is swapped with exactly one rank of the other stage's same replica, one
holding that row, and both sides name the same segment."""

from __future__ import annotations

import pytest

from autotune.runtime.tied import staged_tied_segments, vocab_rows
from autotune.stages import Replica, Stage, layout_of

VOCAB = 96


def _stages(*tps_per_stage):
    out, n = [], 0
    for tps in tps_per_stage:
        reps = []
        for t in tps:
            reps.append(Replica(tp=t, devices=tuple(range(n, n + t))))
            n += t
        out.append(Stage(layers=2, replicas=tuple(reps)))
    return tuple(out)


SHAPES = {
    "tp2-then-tp1": ([2], [1]),
    "tp1-then-tp4": ([1], [4]),
    "tp2-tp1-tp1": ([2], [1], [1]),
    "tp3-then-tp2": ([3], [2]),  # boundaries that do not nest: 32 | 48 | 64
    "replicas-tp1-tp2-then-tp2-tp1": ([1, 2], [1, 1], [2, 1]),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_segments_tile_each_holders_rows_with_the_other_stages_holders(name):
    stages = _stages(*SHAPES[name])
    lay, last = layout_of(stages), len(stages) - 1
    seg = {x.rank: staged_tied_segments(stages, x.rank, VOCAB, 0, last) for x in lay.slots}
    for x in lay.slots:
        if x.stage not in (0, last):
            assert seg[x.rank] == []
            continue
        lo, hi = vocab_rows(VOCAB, x.tp, x.tp_index)
        rows = [r for _, a, b in seg[x.rank] for r in range(a, b)]
        assert rows == list(range(lo, hi))  # each own row once, in order
        for peer, a, b in seg[x.rank]:
            y = lay.slots[peer]
            assert y.stage == (last if x.stage == 0 else 0) and y.replica == x.replica
            plo, phi = vocab_rows(VOCAB, y.tp, y.tp_index)
            assert plo <= a < b <= phi
            assert (x.rank, a, b) in seg[peer]  # the peer swaps the same rows back


def test_one_stage_holds_both_copies_without_an_exchange():
    stages = _stages([2, 1])
    assert all(staged_tied_segments(stages, r, VOCAB, 0, 0) == [] for r in range(3))
