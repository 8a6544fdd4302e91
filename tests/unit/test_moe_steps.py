"""An MoE layer measured step by step (``profilers/moe_parts.py``) and priced from those steps
(``autotune/cost/moe_steps.py``), and the collectives a CPU rank's MoE layer is priced with counted
against the ones the runtime issues."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from autotune.runtime.expert_parallel import ExpertGroups, shard_groups
from autotune.runtime.mesh import Axis
from autotune.runtime.moe import MoEContext, MoELayer
from autotune.specs import ModelSpec, load_model
from autotune.specs.moe import MoESpec, RouterSpec
from profilers.moe_parts import PARTS, REFERENCE, MoEParts

SHARED = ModelSpec(name="steps-moe-shared", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=64,
                   moe=MoESpec(experts=8, top_k=2, expert_ffn_hidden=32, dense_layers=(0,), shared_experts=1,
                               shared_ffn_hidden=16, router=RouterSpec(dropless=False, capacity_factor=1.0,
                                                                       aux_loss_coeff=0.01)))


def _layer(model, groups, tp: int = 1) -> MoELayer:
    axis = Axis(size=tp, index=0, ranks=list(range(tp)), group=None)
    torch.manual_seed(0)
    layer = MoELayer(model.moe, model.hidden, model.activation == "swiglu", MoEContext(groups=groups), axis, False)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    return layer


@pytest.mark.parametrize(("name", "ep", "tp", "etp"), [("tiny-moe", 1, 1, 1), ("tiny-moe", 2, 1, 1),
                                                       ("tiny-moe", 1, 2, 1), ("tiny-moe", 1, 1, 2),
                                                       ("tiny-moe", 2, 2, 2), ("shared", 2, 1, 1)])
def test_the_timed_steps_chained_are_the_layer(name, ep, tp, etp):
    """The steps the profile times, run one after another on what each hands the next, give the
    layer's own output (so they are the layer's work, not a copy of it)."""
    m = SHARED if name == "shared" else load_model(name)
    layer = _layer(m, shard_groups(m.moe.experts, ep, tp, etp), tp)
    x = torch.randn(2, 16, m.hidden)
    steps = MoEParts(layer, x)
    torch.testing.assert_close(steps.chained(), layer(x), rtol=0, atol=0)
    assert set(steps.calls()) == set(PARTS) | {REFERENCE} | ({"shared"} if name == "shared" else set())
    for fwd, fwd_bwd in steps.calls().values():  # every step runs forward and backward
        fwd()
        fwd_bwd()


def test_an_etp_shard_computes_a_slice_of_every_etp_ranks_rows():
    """etp rank 0 of 2 (loopback) holds half of each expert's width and takes both ranks' rows: its
    experts' step costs the GEMMs of twice the rows at half the width."""
    m = load_model("tiny-moe")
    whole, half = _layer(m, shard_groups(8, 1, 1, 1)), _layer(m, shard_groups(8, 1, 1, 2))
    assert half.experts["0"].w1.shape == (m.moe.expert_ffn_hidden // 2, m.hidden)
    x = torch.randn(1, 16, m.hidden)
    a, b = MoEParts(whole, x), MoEParts(half, x)
    assert b.out.shape == a.out.shape  # the partial sums of both etp ranks' rows, summed


def test_the_profile_stores_each_moe_points_steps_at_each_ep_and_etp():
    from autotune.specs.profiles import load_layer_profile
    from profilers.layers import LayerSweep, profile_layers
    from profilers.store import save_layer_profile

    m = load_model("tiny-moe")
    sweep = LayerSweep(micro_batches=(1,), seq_lens=(16,), tp=(1,), ep=(1, 2), etp=(1, 2), moe_world=2, rounds=1,
                       min_repeats=1, max_repeats=1, pieces=("moe",))
    doc = profile_layers(m, "cpu", sweep)
    shards = {(p["ep"], p.get("etp", 1)): p for p in doc["points"]}
    assert sorted(shards) == [(1, 1), (1, 2), (2, 1)]  # ep x etp within the 2 ranks
    for p in shards.values():
        assert set(p["parts"]) == set(PARTS) | {REFERENCE}
        assert all(len(v) == 2 and min(v) >= 0 for v in p["parts"].values())
    lid = save_layer_profile(doc, ":memory:", label="t")
    assert load_layer_profile(lid, ":memory:")["points"][0]["parts"] == doc["points"][0]["parts"]


# ---- the price is the stored steps -----------------------------------------------------------
BLOCK, HEAD = (2e-3, 4e-3), (1e-3, 1e-3)
MOE = {(1, 1): (6e-3, 11e-3), (1, 2): (7e-3, 12e-3), (2, 1): (5e-3, 9e-3)}
"""(ep, etp): the whole MoE block as the ``moe`` piece times it."""
STEPS = {"router": (2e-4, 3e-4), "dispatch": (1e-4, 2e-4), "experts": (1.5e-3, 3e-3), "combine": (5e-5, 1e-4)}
FFN = (1.9e-3, 3.6e-3)


def _balanced():
    m = load_model("tiny-moe")
    router = dataclasses.replace(m.moe.router, force_balance=True)
    return dataclasses.replace(m, name="tiny-moe-balanced", moe=dataclasses.replace(m.moe, router=router))


def _steps(scale: float) -> dict[str, list[float]]:
    return {**{k: [v[0] * scale, v[1] * scale] for k, v in STEPS.items()}, "ffn": [FFN[0] * scale, FFN[1] * scale]}


BLOCK_BYTES = 1.0e6
"""Activation bytes the dense block keeps per sequence (the profile's saved tensors)."""
MOE_BYTES = {(1, 1): 1.5e6, (1, 2): 1.7e6, (2, 1): 1.4e6}


def _doc(m, with_steps: bool = True):
    from profilers.layers import model_dict

    def pt(piece, fb, b=2, **kw):
        return {"piece": piece, "tp": 1, "micro_batch": b, "seq": 64, "fwd_s": fb[0] * b / 2, "bwd_s": fb[1] * b / 2,
                **kw}

    pts = [pt(p, fb, b) for p, fb in (("embed", (1e-4, 0.0)), ("head", HEAD)) for b in (1, 2)]
    pts += [pt("block", BLOCK, b, activation_bytes=BLOCK_BYTES * b) for b in (1, 2)]
    for (ep, etp), fb in MOE.items():
        for b in (1, 2):  # the steps of micro-batch 1 half those of 2: a cp=2 shard of mbs 2 is priced at 1
            extra = {"parts": _steps(b / 2)} if with_steps else {}
            pts.append(pt("moe", fb, b, ep=ep, **({"etp": etp} if etp > 1 else {}), **extra,
                          activation_bytes=MOE_BYTES[ep, etp] * b))
    return {"kind": "autotune-layer-profile", "schema_version": 1, "device_kind": "cpu", "device_name": "test",
            "model": model_dict(m), "dtype": "fp32", "origin": "measured", "meta": {}, "points": pts}


def _ctx(m, inline: str, with_steps: bool = True, device: str = "CPU"):
    from autotune.commands.tune import _like_this_machine
    from autotune.cost.steps import step_context, tp_groups
    from autotune.plan import parse_inline
    from profilers.store import save_layer_profile

    lid = save_layer_profile(_doc(m, with_steps), ":memory:")
    cluster = _like_this_machine(device, "local", ":memory:", 1, None, (f"layers:{lid}",))
    s = step_context(parse_inline(inline + ",mbs=2,dtype=fp32"), m, cluster, 64, 8, None, None)
    return tp_groups(s)[0][2]


@pytest.mark.parametrize(("inline", "shard"), [("dp=2", (1, 1)), ("dp=2,ep=2", (2, 1)), ("dp=2,etp=2", (1, 2))])
def test_a_moe_layer_is_priced_as_the_sum_of_its_stored_steps(inline, shard):
    """Even shares, forced balance, no recomputation, no calibration: the MoE layer's compute is the
    measured block less its ffn reference (the attention side) plus the stored steps' sum, at the
    plan's ep and etp, forward and backward."""
    from autotune.cost.rank import moe_block

    ctx = _ctx(_balanced(), inline)
    bm, t, _, _ = moe_block(ctx)
    for i, comp in ((0, bm.comp_f), (1, bm.comp_b)):
        steps = sum(v[i] for v in STEPS.values())
        assert (t.comp_f, t.comp_b)[i] == pytest.approx(steps, rel=1e-9)
        assert comp == pytest.approx(MOE[shard][i] - FFN[i] + steps, rel=1e-9)
    assert t.router_s == pytest.approx(sum(STEPS["router"]), rel=1e-9)
    assert t.experts_s == pytest.approx(sum(STEPS["experts"]), rel=1e-9)


def test_a_cp_shard_takes_its_steps_at_the_micro_batch_of_as_many_tokens():
    """cp=2 at micro-batch 2 holds one sequence's worth of tokens: its FFN is the steps measured at
    micro-batch 1 (the attention side is the kernel model's, on the dense block's scale)."""
    from autotune.cost import layers as LY
    from autotune.cost import moe_steps as MS

    ctx = _ctx(_balanced(), "cp=2")
    got = MS.measured_steps(ctx)
    assert got["experts"].fwd == pytest.approx(STEPS["experts"][0] / 2, rel=1e-9)
    assert LY.moe_piece(ctx) is None and "one scale" in MS.attention_side(ctx)[1]


@pytest.mark.parametrize(("inline", "shard"), [("dp=2", (1, 1)), ("dp=2,ep=2", (2, 1)), ("dp=2,etp=2", (1, 2))])
def test_each_layer_keeps_the_activations_its_own_piece_measured(inline, shard):
    """No recomputation, on the shape the profile timed: the activations a layer keeps per
    micro-batch are the dense block's measured bytes for the dense layer and the ``moe`` piece's at
    the plan's (ep, etp) for each MoE layer (not the dense block's ratio applied to the MoE layers)."""
    from autotune.cost.rank import rank_cost

    m = _balanced()
    n, n_moe = m.layers, m.moe_layer_count
    per_layer = rank_cost(_ctx(m, inline)).memory_terms["activation_per_layer_microbatch"]
    want = ((n - n_moe) * BLOCK_BYTES * 2 + n_moe * MOE_BYTES[shard] * 2) / n
    assert per_layer == pytest.approx(want, rel=1e-9)


def test_without_steps_the_block_keeps_the_measured_pieces_scale():
    from autotune.cost import moe_steps as MS

    assert MS.measured_steps(_ctx(_balanced(), "dp=2", with_steps=False)) is None


def test_uneven_shares_multiply_the_experts_step_by_the_models_busiest_over_even_ratio():
    from autotune.cost import moe_layers as ML
    from autotune.cost.rank import moe_block

    ctx = _ctx(_balanced(), "dp=2,ep=2,experts=5/3")
    ctx_even = _ctx(_balanced(), "dp=2,ep=2")
    shared = ML.shared_gemm_fwd(ctx)
    ratio = ML.moe_terms(ctx, shared).experts_s / ML.even_terms(ctx, shared).experts_s
    assert ratio > 1.0
    t, t_even = moe_block(ctx)[1], moe_block(ctx_even)[1]
    assert t.comp_f - t_even.comp_f == pytest.approx(STEPS["experts"][0] * (ratio - 1.0), rel=1e-9)


# ---- the collectives a CPU rank's MoE layer pays -------------------------------------------------
class _Count:
    """torch.distributed calls with a stand-in group of two ranks: each output filled as a loopback
    (this rank's input stands for the peer's), each call counted."""

    def __init__(self, monkeypatch):
        self.calls = 0

        def a2a(out, x, recv=None, send=None, group=None):
            self.calls += 1
            n = min(out.shape[0], x.shape[0])
            out.zero_()[:n].copy_(x[:n])

        def gather(out, x, group=None):
            self.calls += 1
            out.copy_(x.repeat(out.shape[0] // x.shape[0], *([1] * (x.dim() - 1))))

        def reduce(t, group=None, **_):
            self.calls += 1

        for name, fn in (("all_to_all_single", a2a), ("all_gather_into_tensor", gather), ("all_reduce", reduce)):
            monkeypatch.setattr(dist, name, fn)
        monkeypatch.setattr(dist, "all_gather_single", None, raising=False)


def _axis(n: int) -> Axis:
    return Axis(size=n, index=0, ranks=list(range(n)), group=object() if n > 1 else None)


@pytest.mark.parametrize(("ep", "etp", "route", "split"), [(2, 1, 1, 1), (1, 2, 1, 1), (2, 2, 1, 1), (1, 1, 2, 1),
                                                           (1, 1, 1, 2), (2, 1, 2, 1), (1, 1, 1, 1)])
def test_the_price_counts_the_blocking_collectives_the_runtime_issues(monkeypatch, ep, etp, route, split):
    """One MoE layer forward and backward on stand-in groups: the calls counted are the ones
    ``cpu.moe_sync_calls`` prices for the plan of those degrees (route: a cp split; split: tp
    without sequence parallelism)."""
    from autotune.cost.cpu import moe_sync_calls

    m = load_model("tiny-moe")
    groups = ExpertGroups(shares=(8 // ep,) * ep, ep=_axis(ep), etp=_axis(etp), edp=_axis(1), route=_axis(route),
                          token_split=_axis(split))
    layer = MoELayer(m.moe, m.hidden, True, MoEContext(groups=groups, seq_len=16), _axis(split), False)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    count = _Count(monkeypatch)
    y = layer(torch.randn(2, 16, m.hidden, requires_grad=True))
    fwd = count.calls
    y.sum().backward()
    step = SimpleNamespace(experts=SimpleNamespace(ep=ep, etp=etp), cp=route, hp=1, tp=split, sp=False,
                           recompute="none", recompute_modules=())
    assert (fwd, count.calls - fwd) == moe_sync_calls(step)


def test_an_etp_plan_on_gloo_is_priced_with_its_extra_collectives():
    """dp=2,etp=2 on a CPU: beyond the exchange the model prices (``expert_dispatch``), the layer pays
    the gloo table's small collectives and a wait at each of its 4 + 2 blocking calls; dp=2 (no
    expert split) pays none of it."""
    from autotune.cost import cpu as CPU
    from autotune.cost.rank import moe_block

    ctx = _ctx(_balanced(), "dp=2,etp=2")
    bm, t, _, _ = moe_block(ctx)
    comm_f, comm_b = CPU.moe_comm(ctx)
    cpu = ctx.rates.cpu
    assert comm_f > 0 and CPU.moe_sync_calls(ctx.step) == (4, 2)
    assert bm.ep_f - t.ep_f == pytest.approx(comm_f + 4 * cpu.sync_call_s + cpu.sync_skew * bm.comp_f, rel=1e-9)
    assert bm.ep_b - t.ep_b == pytest.approx(comm_b + 2 * cpu.sync_call_s + cpu.sync_skew * bm.comp_b, rel=1e-9)
    plain = _ctx(_balanced(), "dp=2")
    bm0, t0, _, _ = moe_block(plain)
    assert bm0.ep_f == t0.ep_f == 0.0 and bm0.ep_b == t0.ep_b == 0.0


def test_a_gpu_moe_layer_pays_no_cpu_collectives():
    from autotune.commands.tune import _like_this_machine
    from autotune.cost.rank import moe_block
    from autotune.cost.steps import step_context, tp_groups
    from autotune.plan import parse_inline

    cluster = _like_this_machine("H100-SXM", "gpus", ":memory:", 1, 2)
    s = step_context(parse_inline("dp=2,etp=2,mbs=2,dtype=bf16"), _balanced(), cluster, 64, 8, None, None)
    bm, t, _, _ = moe_block(tp_groups(s)[0][2])
    assert (bm.ep_f, bm.ep_b) == (t.ep_f, t.ep_b)
