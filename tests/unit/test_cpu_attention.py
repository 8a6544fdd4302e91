"""CPU attention priced by kernel tiles (``cost/cpu_attention.py``) against independent computations:
the tiles against a brute-force walk over torch's CPU flash kernel's blocks, the profile's fit against
a known synthetic curve, a masked window's price against the curve summed over its documents by hand,
and malformed profile fields refused in one line. Nothing here is timed."""

import numpy as np
import pytest
from _cost_helpers import device

from autotune.cost import documents as DOC
from autotune.cost.compute import layer_compute, rates_for
from autotune.cost.cpu_attention import Line, fit_line, kernel_cells, read_curves
from autotune.errors import InputError
from autotune.specs import ModelSpec
from profilers.compute import compute_plan, cpu_attention_points, fit_attention_cpu

MODEL = ModelSpec(name="cpu-attn", layers=1, hidden=256, heads=8, kv_heads=4, ffn_hidden=704, vocab=256,
                  activation="swiglu")  # head_dim 32, as the benchmark's ``small``


def _cells_by_walk(q: int, k: int, causal: bool) -> int:
    """The kernel's loop written out: query blocks of 32 / 64 / 256 rows (from 0 / 192 / 768 queries),
    key blocks of 512; a cell counts when its tile is computed (causal: the tile's first key is
    before the query block's end, as ``num_keys = min(m + rows, k)``)."""
    qb = 256 if q >= 768 else 64 if q >= 192 else 32
    qb, kb = min(qb, q), min(512, k)
    done = np.zeros((q, k), dtype=bool)
    for m in range(0, q, qb):
        rows = min(qb, q - m)
        for n in range(0, k, kb):
            if not causal or n < min(m + rows, k):
                done[m:m + rows, n:n + kb] = True
    return int(done.sum())


@pytest.mark.parametrize("q,k,causal", [(1, 1, True), (16, 16, True), (100, 100, True), (191, 191, True),
                                        (192, 192, True), (700, 700, True), (767, 767, True), (768, 768, True),
                                        (1000, 1000, True), (4096, 4096, True), (300, 900, False), (513, 513, True)])
def test_kernel_cells_are_the_tiles_the_kernel_walks(q, k, causal):
    assert kernel_cells(q, k, causal) == _cells_by_walk(q, k, causal)


def test_tiles_over_pairs_fall_with_length_as_measured():
    """The full square up to 512 tokens, then 1.5x, 1.25x, 1.125x the causal pairs."""
    ratio = {s: kernel_cells(s, s, True) / (s * (s + 1) / 2) for s in (512, 1024, 2048, 4096)}
    assert ratio[512] == pytest.approx(2 * 512 / 513)
    assert [round(ratio[s] * (s + 1) / s, 4) for s in (1024, 2048, 4096)] == [1.5, 1.25, 1.125]


SYNTH = {"fwd": Line(call_s=12e-6, head_s=4e-6, tok_s=0.1e-6, cell_s=2.4e-9),
         "bwd": Line(call_s=70e-6, head_s=16e-6, tok_s=0.5e-6, cell_s=5.8e-9)}


def _samples(plan, trial_dt, curves):
    rows = []
    for dt, d, s, h in cpu_attention_points(plan, trial_dt):
        c = kernel_cells(s, s, True)
        f, b = (curves[dt, d][x].at(s, c, h) for x in ("fwd", "bwd"))
        rows.append({"kind": "attention_cpu", "params": {"dtype": dt, "head_dim": d, "seq": s, "heads": h},
                     "work": float(s), "timing": {"median_s": f + b}, "metrics": {"fwd_s": f, "bwd_s": b}})
    return rows


@pytest.mark.parametrize("quick", [True, False])
def test_the_profile_fit_recovers_a_known_curve(quick):
    plan = compute_plan("cpu", quick)
    curves = {(dt, d): {x: Line(*(v * (d / 32) * (1.5 if dt == "bf16" else 1.0) for v in vars(ln).values()))
                        for x, ln in SYNTH.items()} for dt in ("fp32", "bf16") for d in plan.cpu_attn_head_dims}
    fit = fit_attention_cpu(_samples(plan, "bf16", curves))
    assert set(fit) == {"fp32", "bf16"}
    for (dt, d), want in curves.items():
        got = fit[dt][str(d)]
        assert got["max_rel_err"] < 1e-9
        for x in ("fwd", "bwd"):
            assert [got[x][p] for p in ("call_s", "head_s", "tok_s", "cell_s")] == pytest.approx(list(vars(want[x]).values()),
                                                                                       rel=1e-6)


def test_a_noisy_negative_part_is_dropped_not_kept():
    pts = [(s, kernel_cells(s, s, True), h, 1e-9 * kernel_cells(s, s, True) * h * (1.02 if s == 64 else 1.0))
           for s, h in ((64, 1), (64, 4), (160, 1), (256, 1), (1024, 1))]
    line = fit_line(pts)
    assert min(line.call_s, line.head_s, line.tok_s, line.cell_s) >= 0 and line.cell_s == pytest.approx(1e-9, rel=0.05)


def _profile(curves=None):
    curves = curves or {"fp32": {"32": {x: vars(ln) for x, ln in SYNTH.items()}}}
    return {"id": 7, "attention_cpu": curves}


def _attention(docs: tuple[int, ...] | None, micro_batch: int = 1) -> tuple[float, float]:
    rates = rates_for(device(kind="cpu", profile=_profile()), "fp32", MODEL.head_dim)
    s = 4096 if docs is None else sum(docs)
    blocks = None if docs is None else tuple(
        (q, k, c, 1.0) for q, k, c in DOC.masked_blocks(docs, [[(0, s)]], 0))
    lc = layer_compute(MODEL, rates, tokens=micro_batch * s, tp=1, heads_local=MODEL.heads, keysum=0.0,
                       block_seq=s, micro_batch=micro_batch, act_bytes=0.0, blocks=blocks)
    return lc.attn_fwd, lc.attn_bwd


@pytest.mark.parametrize("docs", [(4096,), (3000, 1096), (100,) * 40 + (96,), (1, 2047, 2048), (700, 68, 3328)])
def test_a_masked_window_is_the_curve_summed_over_its_documents(docs):
    """The cost model's attention of a masked window over its whole window's equals, by hand, the
    fitted curve summed over the document pieces (one call each, of the rank's 8 heads) over one call
    of the whole window (micro-batch 2: whole, one call of 16 rows; masked, one call per row and piece)."""
    def by_hand(lengths, heads, calls):
        return sum(calls * ln.at(n, _cells_by_walk(n, n, True), heads) for n in lengths for ln in SYNTH.values())

    whole = sum(_attention(None, micro_batch=2))
    masked = sum(_attention(docs, micro_batch=2))
    assert whole == pytest.approx(by_hand((4096,), 16, 1), rel=1e-12)
    assert masked / whole == pytest.approx(by_hand(docs, 8, 2) / by_hand((4096,), 16, 1), rel=1e-12)


def test_head_dims_between_and_outside_the_profiled_ones():
    two = {"fp32": {"32": {x: vars(ln) for x, ln in SYNTH.items()},
                    "64": {x: {p: 2 * v for p, v in vars(ln).items()} for x, ln in SYNTH.items()}}}
    att = read_curves(two, "fp32")
    c = kernel_cells(1024, 1024, True)
    f48, _ = att.call(1024, 1024, True, 48, 4)
    assert f48 == pytest.approx(1.5 * SYNTH["fwd"].at(1024, c, 4))  # every part linear between 32 and 64
    f8, _ = att.call(1024, 1024, True, 8, 4)  # below: the smallest's curve as it is
    assert f8 == pytest.approx(SYNTH["fwd"].at(1024, c, 4))
    f128, _ = att.call(1024, 1024, True, 128, 4)  # above: the largest's fixed parts, its cells scaled
    f = SYNTH["fwd"]
    assert f128 == pytest.approx(Line(2 * f.call_s, 2 * f.head_s, 2 * f.tok_s, 4 * f.cell_s).at(1024, c, 4))
    assert read_curves(two, "bf16") is None and read_curves({}, "fp32") is None


@pytest.mark.parametrize("section,field", [
    ({"fp32": {"32": {"fwd": {"call_s": 1e-5, "head_s": 0, "tok_s": 0, "cell_s": -1e-9}, "bwd": vars(SYNTH["bwd"])}}},
     "attention_cpu.fp32.32.fwd.cell_s"),
    ({"fp32": {"32": {"fwd": vars(SYNTH["fwd"])}}}, "attention_cpu.fp32.32.bwd"),
    ({"fp32": {"32": {"fwd": {"call_s": "fast", "head_s": 0, "tok_s": 0, "cell_s": 1e-9}, "bwd": vars(SYNTH["bwd"])}}},
     "attention_cpu.fp32.32.fwd.call_s"),
    ({"fp32": {"32": {"fwd": {"call_s": float("nan"), "head_s": 0, "tok_s": 0, "cell_s": 1e-9},
                       "bwd": vars(SYNTH["bwd"])}}},
     "attention_cpu.fp32.32.fwd.call_s"),
    ({"fp32": {"x": {}}}, "attention_cpu.fp32"),
    ({"fp32": []}, "attention_cpu.fp32"),
    ([1, 2], "attention_cpu"),
])
def test_bad_profile_fields_are_refused_in_one_line(section, field):
    with pytest.raises(InputError) as e:
        rates_for(device(kind="cpu", profile=_profile(section)), "fp32", 32)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"profile 7.{field}: ")
