"""Data parallelism and ZeRO against hand-computed references: the bytes each ZeRO stage moves per
step (gradients reduced in fp32 under bf16, weights gathered in the compute dtype, ZeRO-2 gathering
once a step, ZeRO-3 twice a micro-batch or twice a step under uneven micro-batch counts), the time
those bytes take over a ring (Thakur et al. 2005), and a step that is nothing but that time when
compute is free."""

from __future__ import annotations

import pytest
from _cost_helpers import GELU, cluster, device

from autotune.cost import data_parallel as DP
from autotune.cost import estimate
from autotune.cost.context import step_context, tp_groups
from autotune.plan import parse_inline

S, N, BW, LAT = 128, 4, 2e9, 1e-5
P = GELU.param_count()
LB = GELU.layer_params()
L = GELU.layers
R = P - L * LB  # embedding, final norm, LM head


def _cluster(peak=1e12):
    return cluster((1, N, device(peak=peak), BW, LAT))


def _ring(op, nbytes, n=N):
    """Ring collectives over n ranks, n the whole buffer (Thakur, Rabenseifner & Gropp 2005)."""
    if op == "all_reduce":
        return 2 * (n - 1) * LAT + 2 * (n - 1) / n * nbytes / BW
    return (n - 1) * LAT + (n - 1) / n * nbytes / BW


def _ctx(inline, batch=8, cl=None):
    s = step_context(parse_inline(inline), GELU, cl or _cluster(), S, batch, None)
    return tp_groups(s)[0][2]


def _hand(zero, dtype="bf16", m=2, per_step=False):
    """(op, bytes of one call, calls per step) of one rank, written out from the ZeRO stages."""
    g, w = 4, (2 if dtype == "bf16" else 4)  # fp32 gradient reduction; weights in the compute dtype
    if zero == 0:
        return [("all_reduce", g * P, 1)]
    if zero == 1:
        return [("reduce_scatter", g * P, 1), ("all_gather", w * P, 1)]
    if zero == 2:
        return [("reduce_scatter", g * P, 1), ("all_gather", w * LB, L), ("all_gather", w * R, 1)]
    if per_step:
        return [("reduce_scatter", g * P, 1), ("all_gather", w * LB, 2 * L), ("all_gather", w * R, 2)]
    return [("reduce_scatter", g * P, 1), ("all_gather", w * LB, 2 * L * m), ("all_gather", w * R, m)]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_bytes_moved_per_zero_stage(zero, dtype):
    ctx = _ctx(f"dp={N},zero={zero},dtype={dtype}")
    got = [(t.op, t.nbytes, t.calls) for t in DP.step_transfers(ctx)]
    assert got == [(op, pytest.approx(b, rel=1e-12), c) for op, b, c in _hand(zero, dtype)]


def test_zero3_gathers_per_step_when_replicas_run_different_micro_batch_counts():
    ctx = _ctx(f"dp={N},zero=3,samples=3/1/2/2")
    got = [(t.op, t.nbytes, t.calls) for t in DP.step_transfers(ctx)]
    assert got == [(op, pytest.approx(b, rel=1e-12), c) for op, b, c in _hand(3, per_step=True)]


def test_no_sharding_group_moves_nothing():
    assert DP.step_transfers(_ctx("tp=4", batch=2)) == []


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_step_is_the_dp_traffic_when_compute_is_free(zero):
    """Compute and memory at 1e30 FLOP/s (bytes/s): nothing hides a transfer, so the step is the
    sum of every transfer's ring time, and that sum is also what the breakdown reports as DP time."""
    est = estimate(parse_inline(f"dp={N},zero={zero}"), GELU, _cluster(peak=1e30), S, 8)
    hand = sum(calls * _ring(op, nbytes) for op, nbytes, calls in _hand(zero))
    assert est.breakdown["dp_comm_s"] == pytest.approx(hand, rel=1e-9)
    assert est.predicted["step_time_s"] == pytest.approx(hand, rel=1e-6)


def test_zero_stages_are_priced_apart_and_the_simpler_wins_ties():
    """With slow links each stage's own terms separate them: ZeRO-1 exposes a whole weight gather
    after the step, ZeRO-2 hides its block gathers behind the forward, ZeRO-3 pays gathers every
    micro-batch."""
    cl = cluster((1, N, device(peak=1e12), 2e8, LAT))
    t = {z: estimate(parse_inline(f"dp={N},zero={z}"), GELU, cl, S, 16).predicted["step_time_s"] for z in range(4)}
    assert len(set(t.values())) == 4
    assert t[2] < t[1] and t[3] > t[2]


def test_zero3_backward_gather_hides_behind_recomputation():
    """Full recomputation lengthens the backward a ZeRO-3 gather is prefetched behind: the exposed
    gathers shrink (FSDP2's pre-backward gather serves the recomputed forward, no third gather)."""
    cl = cluster((1, N, device(peak=3e10), 2e8, LAT))
    plain = _ctx(f"dp={N},zero=3", cl=cl)
    full = _ctx(f"dp={N},zero=3,recompute=full", cl=cl)
    assert [(t.op, t.calls) for t in DP.step_transfers(plain)] == [(t.op, t.calls) for t in DP.step_transfers(full)]
    g = DP._block_gather(plain)
    fwd, bwd = 1e-3, 2e-3
    assert DP.zero3_block_exposed(plain, fwd, bwd) == (pytest.approx(max(0, g - fwd)), pytest.approx(max(0, g - bwd)))
    assert DP.zero3_block_exposed(full, fwd, bwd + fwd)[1] <= DP.zero3_block_exposed(plain, fwd, bwd)[1]


def test_gradient_reduction_follows_the_plans_precision_rule():
    from autotune.plan import GRAD_REDUCE_DTYPE

    assert DP.grad_reduce_dtype("bf16") == DP.grad_reduce_dtype("fp16") == GRAD_REDUCE_DTYPE
    assert DP.grad_reduce_dtype("fp32") == "fp32"


@pytest.mark.parametrize("zero", [2, 3])
def test_pipelined_zero_reduction_follows_the_last_backward(zero):
    """Under pipelining torch's stages reduce-scatter after the last backward (perform_reduce_grad):
    nothing of the reduction overlaps, all of it is exposed; without pipelining it overlaps the last
    backward as before."""
    flat = _ctx(f"dp={N},zero={zero}")
    piped = step_context(parse_inline(f"dp=2,pp=2,zero={zero}"), GELU, _cluster(), S, 8, None)
    ctx = tp_groups(piped)[0][2]
    rs = [t for t in DP.step_transfers(ctx) if t.op == "reduce_scatter"][0]
    overl, fixed = DP.grad_sync(ctx, 1e9, 1e9)  # compute long enough to hide every gather
    assert overl == 0.0
    assert fixed == pytest.approx(DP._seconds(ctx, "reduce_scatter", rs.nbytes) + sum(
        t.calls * DP._seconds(ctx, "all_gather", t.nbytes) for t in DP.step_transfers(ctx)[2:]))
    flat_overl, _ = DP.grad_sync(flat, 1e9, 1e9)
    assert flat_overl == pytest.approx(DP._seconds(flat, "reduce_scatter", DP.step_transfers(flat)[0].nbytes))
