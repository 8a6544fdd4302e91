"""The size-aware datasheet model (autotune/cost/datasheet.py): tile and wave quantisation, the
memory-bound regime, per-sample time falling with the micro-batch, and its error against measured
per-layer times it was not fitted on (Sailor's GPT-Neo-2.7B layers; benchmarks/data/sailor)."""

import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from autotune.cost.datasheet import K_FILL, K_MIN, K_REF, TILE, size_model
from autotune.cost.kernels import MEGATRON_DEEPSPEED_EAGER
from autotune.cost.layers import predicted_pieces
from autotune.plan import parse_inline
from autotune.specs.catalogue import CATALOGUE
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import model_from_dict

A100 = size_model(CATALOGUE["A100-40GB"], "bf16", 2)
SAILOR = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "sailor"
GPT_NEO = model_from_dict({"name": "gpt-neo-2.7b", "layers": 32, "hidden": 2560, "heads": 20, "ffn_hidden": 10240,
                           "vocab": 50257, "activation": "gelu", "norm": "layernorm", "position": "learned",
                           "max_positions": 2048, "bias": True})


COMPUTE_BOUND = dataclasses.replace(A100, mem_bw=1e18)  # the compute side alone (a 128-wide product is memory-bound)


def test_a_partial_wave_costs_a_whole_one():
    sms, k = A100.sms, 8192
    one_over = COMPUTE_BOUND.gemm_time(TILE * (sms + 1), TILE, k)  # one tile more than the SMs: two waves
    two_full = COMPUTE_BOUND.gemm_time(TILE * 2 * sms, TILE, k)
    full = COMPUTE_BOUND.gemm_time(TILE * sms, TILE, k)
    assert one_over == pytest.approx(two_full)
    assert one_over == pytest.approx(2 * full)


def test_a_partial_tile_costs_a_whole_one_and_thin_products_are_memory_bound():
    k = 8192
    assert COMPUTE_BOUND.gemm_time(TILE * A100.sms - 64, TILE, k) == pytest.approx(
        COMPUTE_BOUND.gemm_time(TILE * A100.sms, TILE, k))
    m, n = 1 << 16, 1  # a matrix-vector product: its bytes, not its FLOPs, set the time
    assert A100.gemm_time(m, n, k) == pytest.approx(2 * (m * k + k * n + m * n) / A100.mem_bw)


def test_a_large_gemm_runs_at_the_catalogue_ceiling_and_a_shallow_one_below_it():
    spec = CATALOGUE["A100-40GB"]
    m = n = TILE * 12 * 9  # 108 x 9 tiles: whole waves, no partial tile
    rate = 2.0 * m * n * K_REF / COMPUTE_BOUND.gemm_time(m, n, K_REF)
    assert rate == pytest.approx(spec.flops("bf16") * spec.sustained()[0] * spec.gemm_fraction("bf16")[0])
    shallow = 2.0 * m * n * 2048 / COMPUTE_BOUND.gemm_time(m, n, 2048)
    assert shallow == pytest.approx(rate * (2048 / (2048 + K_FILL)) / (K_REF / (K_REF + K_FILL)))
    # below the sweep's shallowest GEMM (K_MIN) the efficiency stays at K_MIN's
    assert 2.0 * m * n * 64 / COMPUTE_BOUND.gemm_time(m, n, 64) == pytest.approx(
        rate * (K_MIN / (K_MIN + K_FILL)) / (K_REF / (K_REF + K_FILL)))


def test_only_unprofiled_gpus_get_the_size_model():
    assert size_model(dataclasses.replace(CATALOGUE["A100-40GB"], sm_count=0), "bf16", 2) is None
    assert size_model(dataclasses.replace(CATALOGUE["A100-40GB"], profile={"gemm": {}}), "bf16", 2) is None
    v = size_model(CATALOGUE["V100-16GB"], "fp32", 4)
    assert v.peak == CATALOGUE["V100-16GB"].flops("fp32-strict")  # no TF32 on Volta: CUDA cores
    a100 = CATALOGUE["A100-40GB"]  # TF32 tensor cores, at the clock a training run sustains
    assert size_model(a100, "fp32", 4).peak == a100.flops("fp32") * a100.sustained()[0] > v.peak
    assert size_model(a100, "fp32", 4).tensor_cores and not v.tensor_cores


def _cluster(dev, tp, attention="materialized"):
    return cluster_from_dict({"nodes": [{"devices_per_node": tp, "device": dev, "attention": attention}]})


def test_per_sample_time_falls_with_the_micro_batch():
    per_sample = []
    for b in (1, 2, 4, 8):
        blk = predicted_pieces(parse_inline(f"tp=2,mbs={b},dtype=fp16"), GPT_NEO, _cluster("A100-40GB", 2, "fused"),
                               2048, b)["block"]
        per_sample.append((blk.fwd + blk.bwd) / b)
        assert blk.source == "datasheet (size-aware)"
    assert per_sample == sorted(per_sample, reverse=True) and per_sample[0] > 1.05 * per_sample[-1]


def _errors(flat: bool) -> list[float]:
    errs = []
    for gpu, dev in (("A100-40", "A100-40GB"), ("V100-16", "V100-16GB")):
        prof = json.loads((SAILOR / "GPT-Neo-2.7" / gpu / "profile.json").read_text())
        for mbs, by_tp in prof.items():
            for tp, layers in by_tp.items():
                c = _cluster(dev, int(tp))
                if flat:
                    c = dataclasses.replace(c, groups=tuple(dataclasses.replace(
                        g, device=dataclasses.replace(g.device, sm_count=0)) for g in c.groups))
                blk = predicted_pieces(parse_inline(f"tp={tp},mbs={mbs},dtype=fp32"), GPT_NEO, c, 2048,
                                       int(mbs), kernels=MEGATRON_DEEPSPEED_EAGER)["block"]
                measured = layers["2"][0] + layers["2"][1]  # Sailor: [fwd_s, bwd_s, update_s]
                errs.append(abs(blk.fwd + blk.bwd - measured) / measured)
    return errs


def test_held_out_layers_are_priced_closer_than_by_the_flat_rate():
    # the runtime's host time per kernel was fitted on OPT-350's layers; GPT-Neo-2.7B (hidden 2560,
    # head dim 128) was not seen
    sized, flat = _errors(False), _errors(True)
    assert len(sized) >= 20
    assert statistics.median(sized) < 0.5 * statistics.median(flat)
    assert statistics.median(sized) < 0.10


@pytest.mark.parametrize("cp,zigzag", [(2, False), (4, True)])
def test_materialised_attention_under_cp_prices_every_ring_block_as_a_square(cp, zigzag):
    """A cp rank's materialised attention is its ring's blocks (``ring.ring_blocks``, the runtime's
    rule), each one full (query x key) square; over the ring the squares cover exactly the visible
    segment pairs, never less than the causal half the rank's queries need."""
    from autotune.cost.compute import causal_keys
    from autotune.cost.ring import ring_blocks

    mat = dataclasses.replace(A100, fused=False)
    S, bh, hd = 2048, 32, 64
    tokens = (S // cp,) * cp
    area = 0
    for r in range(cp):
        blocks = ring_blocks(tokens, r, zigzag, S)
        keys = causal_keys(tokens, r, zigzag, S)
        got = mat.attention(bh, S // cp, hd, keys, blocks)
        want = [sum(x) for x in zip(*(mat.attention(bh, q, hd, 0.0) for q, _, _ in blocks), strict=True)]
        assert all(k == q for q, k, _ in blocks)  # equal segments: every block is a square of one size
        assert got == pytest.approx(tuple(want), rel=1e-12)
        one = mat.attention(bh, S // cp, hd, keys)[0]  # one square of the rank's shard
        assert got[0] > one if len(blocks) > 1 else got[0] == one
        area += sum(q * k for q, k, _ in blocks)
        assert sum(q * k for q, k, _ in blocks) >= keys
    seg = S // cp // (2 if zigzag else 1)
    n = S // seg
    assert area == seg * seg * n * (n + 1) // 2  # the lower triangle of segment pairs, diagonal included
