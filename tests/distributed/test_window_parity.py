"""Sliding-window layers (GPT-OSS's alternation: windowed, full, windowed, ...) train like one process
in every parallel dimension the runtime runs them in: tp (with sequence parallelism), Ulysses hp
(uneven heads), pp (1F1B with full recomputation, interleaved with selective recomputation), dp;
all in ONE launch of 4 workers, each plan's losses and final weights against ``reference_run`` of
the same windowed model. cp > 1 is refused (tests/unit/test_windows.py)."""

from __future__ import annotations

import functools

import pytest
from helpers.parity import assert_matches_reference, reference, run_plans

from autotune.specs import ModelSpec

pytestmark = pytest.mark.slow

SPEC = ModelSpec(name="window-equiv", layers=4, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, vocab=128,
                 window=6, window_skip_freq=2)
SEQ, BATCH, STEPS, SEED = 32, 4, 2, 91

B = {"dtype": "fp32"}
CASES = [
    ("tp4-sp", dict(B, degrees={"tp": 4}, sequence_parallel=True)),
    ("hp2-uneven-dp2", dict(B, degrees={"hp": 2, "dp": 2}, shares={"heads": [3, 5]})),
    ("pp2-hp2-1f1b-recompute-full", dict(B, degrees={"pp": 2, "hp": 2}, recompute="full")),
    ("pp2-dp2-interleaved-selective", dict(B, degrees={"pp": 2, "dp": 2}, schedule="interleaved_1f1b",
                                           virtual_stages=2, recompute="selective")),
]


@functools.cache
def run_all() -> dict[str, list]:
    return run_plans("autotune.runtime.worker:plans_job", SPEC, CASES, 4, SEQ, BATCH, STEPS, SEED)


@pytest.mark.parametrize("name", [n for n, _ in CASES])
def test_windowed_layers_match_one_process(name):
    assert_matches_reference(run_all()[name], reference(SPEC, SEQ, BATCH, STEPS, SEED))


def test_the_window_changes_the_training():
    """The windowed reference is not the causal one (the mask really acts), and a window that covers
    the sequence is the causal one."""
    import dataclasses

    windowed = reference(SPEC, SEQ, BATCH, STEPS, SEED)["losses"]
    plain = reference(dataclasses.replace(SPEC, window=0, window_skip_freq=None), SEQ, BATCH, STEPS, SEED)["losses"]
    covered = reference(dataclasses.replace(SPEC, window=SEQ), SEQ, BATCH, STEPS, SEED)["losses"]
    assert windowed[0] != pytest.approx(plain[0], rel=1e-4)
    assert covered == pytest.approx(plain, rel=1e-6)
