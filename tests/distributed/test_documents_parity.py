"""Packed windows with document masks train like one process in every parallel dimension that has
an attention path: tp (with sequence parallelism), the CP ring (zigzag and contiguous, uneven
shares), Ulysses hp (uneven heads), cp x hp, pp (1F1B, interleaved, recomputation) and HelixPipe's
attention ranks; dp too (each replica reads only its rows' documents, dealt in order or by cost); CP token
shares by cost (``cost/cp_shares.cost_tokens`` on these documents, contiguous and zigzag). All in ONE launch of 4
workers; each plan's losses and final weights against ``reference_run`` with the same documents.
The documents come from a histogram whose pieces cross every CP/HP shard boundary of the window.
An OPT-style model (learned positions restarting at each document, LayerNorm, biases, GELU, tied
head) runs the plans where positions are cut differently (SP, CP layouts, HP, PP, HelixPipe) in a
second launch."""

from __future__ import annotations

import functools

import pytest
from helpers.parity import assert_matches_reference, reference, run_plans

from autotune.cost import cp_shares as CPS
from autotune.documents import LengthDistribution
from autotune.specs import ModelSpec

pytestmark = pytest.mark.slow

SPEC = ModelSpec(name="docs-equiv", layers=4, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, vocab=128)
OPT = ModelSpec(name="docs-equiv-opt", layers=4, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, vocab=128,
                activation="gelu", norm="layernorm", position="learned", max_positions=32, bias=True,
                tied_embeddings=True)
SEQ, BATCH, STEPS, SEED = 32, 4, 2, 77
DIST = LengthDistribution((1, 3, 5, 9, 17, 40), (2, 6, 5, 3, 2, 1), "test")
DOCS = DIST.to_payload()
COST_TOKENS_2 = list(CPS.cost_tokens(CPS.key_profile(DIST, SEQ), (16, 16), False, 1))  # (20, 12)
COST_TOKENS_4Z = list(CPS.cost_tokens(CPS.key_profile(DIST, SEQ), (8, 8, 8, 8), True, 2))  # (10, 8, 8, 6)

B = {"dtype": "fp32"}
CASES = [
    ("tp2-dp2", dict(B, degrees={"tp": 2, "dp": 2})),
    ("tp4-sp", dict(B, degrees={"tp": 4}, sequence_parallel=True)),
    ("cp4-zigzag", dict(B, degrees={"cp": 4})),
    ("cp2-contiguous-uneven-tp2", dict(B, degrees={"cp": 2, "tp": 2}, cp_layout="contiguous",
                                       shares={"tokens": [11, 21]})),
    ("cp2-zigzag-uneven-dp2", dict(B, degrees={"cp": 2, "dp": 2}, shares={"tokens": [12, 20]})),
    ("hp4", dict(B, degrees={"hp": 4})),
    ("hp2-uneven-dp2", dict(B, degrees={"hp": 2, "dp": 2}, shares={"heads": [3, 5]})),
    ("cp2-hp2-zigzag-uneven", dict(B, degrees={"cp": 2, "hp": 2}, shares={"tokens": [12, 20], "heads": [5, 3]})),
    ("pp2-cp2-1f1b-recompute-full", dict(B, degrees={"pp": 2, "cp": 2}, recompute="full")),
    ("pp2-hp2-selective", dict(B, degrees={"pp": 2, "hp": 2}, recompute="selective")),
    ("pp4-interleaved", dict(B, degrees={"pp": 2, "dp": 2}, schedule="interleaved_1f1b", virtual_stages=2)),
    ("helix-pp2-dp2-F1", dict(B, degrees={"pp": 2, "dp": 2}, schedule="helixpipe", helix_folds=1)),
    ("helix-pp4-recompute", dict(B, degrees={"pp": 4}, schedule="helixpipe", recompute="full")),
    # windows dealt to replicas by attention cost (the same counts; uneven ones too)
    ("dp4-balanced", dict(B, degrees={"dp": 4}, balance="cost")),
    ("dp2-balanced-uneven-cp2", dict(B, degrees={"dp": 2, "cp": 2}, balance="cost", shares={"samples": [1, 3]})),
    ("helix-pp2-dp2-balanced", dict(B, degrees={"pp": 2, "dp": 2}, schedule="helixpipe", balance="cost")),
    # CP token shares by cost (the rule's shares for these documents)
    ("cp2-contiguous-cost-tokens-dp2", dict(B, degrees={"cp": 2, "dp": 2}, cp_layout="contiguous",
                                            shares={"tokens": COST_TOKENS_2})),
    ("cp4-zigzag-cost-tokens", dict(B, degrees={"cp": 4}, shares={"tokens": COST_TOKENS_4Z})),
]


OPT_CASES = [(n, c) for n, c in CASES if n in (
    "tp4-sp", "cp2-contiguous-uneven-tp2", "cp2-hp2-zigzag-uneven", "pp2-cp2-1f1b-recompute-full",
    "pp4-interleaved", "helix-pp2-dp2-F1")]
SPECS = {SPEC.name: (SPEC, CASES), OPT.name: (OPT, OPT_CASES)}


@functools.cache
def run_all(spec_name: str = SPEC.name) -> dict[str, list]:
    spec, cases = SPECS[spec_name]
    return run_plans("autotune.runtime.worker:plans_job", spec, cases, 4, SEQ, BATCH, STEPS, SEED, documents=DOCS)


@pytest.mark.parametrize("name", [n for n, _ in CASES])
def test_masked_packed_windows_match_one_process(name):
    assert_matches_reference(run_all()[name], reference(SPEC, SEQ, BATCH, STEPS, SEED, documents=DOCS))


@pytest.mark.parametrize("name", [n for n, _ in OPT_CASES])
def test_opt_style_masked_packed_windows_match_one_process(name):
    assert_matches_reference(run_all(OPT.name)[name], reference(OPT, SEQ, BATCH, STEPS, SEED, documents=DOCS))


def test_the_documents_change_the_training():
    """The reference with documents is not the one without (the masks really act)."""
    with_docs = reference(SPEC, SEQ, BATCH, STEPS, SEED, documents=DOCS)["losses"]
    plain = reference(SPEC, SEQ, BATCH, STEPS, SEED)["losses"]
    assert with_docs[0] != pytest.approx(plain[0], rel=1e-4)
