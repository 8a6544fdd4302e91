"""An MoE model's MoE block measured (``profile --layers``' ``moe`` piece) and priced from the measurement.

The piece times one EP rank of each ep degree in one process (``expert_parallel.shard_groups``): its
``experts / ep`` experts take the rows every EP rank would send them if all routed as this one does.
Checked against the one-process layer whose experts of every EP range carry EP rank 0's weights (the
same computation, unsplit), and the cost model against the measured figures it must reproduce.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autotune.runtime.expert_parallel import shard_groups, single_groups
from autotune.runtime.mesh import Axis
from autotune.runtime.moe import MoEContext, MoELayer
from autotune.specs import load_model

SEQ = 32


def _layer(model, groups, tp: int = 1) -> MoELayer:
    axis = Axis(size=tp, index=0, ranks=list(range(tp)), group=None)
    return MoELayer(model.moe, model.hidden, model.activation == "swiglu", MoEContext(groups=groups), axis, False)


def _pair(ep: int, tp: int = 1):
    """(shard layer of EP rank 0 of ``ep``, reference one-process layer whose expert ``j * share + i``
    has the shard's expert ``i``'s weights), the router the same."""
    m = load_model("tiny-moe")
    torch.manual_seed(0)
    shard, ref = _layer(m, shard_groups(m.moe.experts, ep, tp), tp), _layer(m, single_groups(m.moe.experts))
    with torch.no_grad():
        for p in shard.parameters():
            p.normal_(0.0, 0.3)
        ref.router.weight.copy_(shard.router.weight)
        share = m.moe.experts // ep
        for e, ex in ref.experts.items():
            src = shard.experts[str(int(e) % share)]
            for name, p in ex.named_parameters():
                p.copy_(dict(src.named_parameters())[name])
    return shard, ref, m


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_an_ep_shard_computes_what_every_rank_routing_alike_gives(ep):
    shard, ref, m = _pair(ep)
    x = torch.randn(2, SEQ, m.hidden)
    torch.testing.assert_close(shard(x), ref(x), rtol=1e-4, atol=1e-5)  # fp32 GEMMs of other row counts round differently


def test_a_tp_shard_routes_its_part_of_the_tokens():
    """Under tp (no sequence parallelism) a rank routes its 1/tp of the tokens; the loopback all-gather
    stands every rank's part for its own: the output is the reference's first half, twice."""
    shard, ref, m = _pair(2, tp=2)
    x = torch.randn(2, SEQ, m.hidden)
    half = ref(x).reshape(-1, m.hidden)[: 2 * SEQ // 2]
    torch.testing.assert_close(shard(x).reshape(-1, m.hidden), torch.cat([half, half]), rtol=1e-4, atol=1e-5)  # fp32 GEMMs of other row counts round differently


def test_shard_groups_refuse_an_ep_that_does_not_split_the_experts():
    with pytest.raises(ValueError, match="ep\\(3\\)"):
        shard_groups(8, 3, 1)


def test_the_layer_profile_of_an_moe_model_has_its_moe_block_per_ep_and_is_stored():
    from autotune.specs.profiles import load_layer_profile
    from profilers.layers import LayerSweep, model_pieces, profile_layers
    from profilers.store import save_layer_profile

    m = load_model("tiny-moe")
    sweep = LayerSweep(micro_batches=(1,), seq_lens=(16,), tp=(1,), ep=(1, 2), rounds=1, min_repeats=1,
                       max_repeats=1, pieces=model_pieces(m))
    doc = profile_layers(m, "cpu", sweep)
    moe = {p["ep"]: p for p in doc["points"] if p["piece"] == "moe"}
    block = next(p for p in doc["points"] if p["piece"] == "block")
    assert sorted(moe) == [1, 2] and "ep" not in block
    # EP rank 0 of 2 holds half the routed experts: the dense part (attention, router) is the same
    e = m.expert_params() * 4  # fp32 bytes of one routed expert
    assert moe[1]["param_bytes"] - moe[2]["param_bytes"] == m.moe.experts // 2 * e
    # the dense layer is the block (its MLP at the dense width), not an MoE layer
    assert block["param_bytes"] < moe[2]["param_bytes"]
    lid = save_layer_profile(doc, ":memory:", label="t")
    assert load_layer_profile(lid, ":memory:")["model"]["moe"] == m.moe.to_dict()


# ---- the price follows the measurement -------------------------------------------------------
BLOCK, MOE1, MOE2, HEAD = (2e-3, 4e-3), (5e-3, 9e-3), (3e-3, 7e-3), (1e-3, 1e-3)


def _balanced():
    """tiny-moe with forced balance: its busiest EP rank's load is its mean load (imbalance 1)."""
    m = load_model("tiny-moe")
    router = dataclasses.replace(m.moe.router, force_balance=True)
    return dataclasses.replace(m, name="tiny-moe-balanced", moe=dataclasses.replace(m.moe, router=router))


def _doc(m, eps=(1, 2)):
    from profilers.layers import model_dict

    def pt(piece, fb, **kw):
        return {"piece": piece, "tp": 1, "micro_batch": 2, "seq": 64, "fwd_s": fb[0], "bwd_s": fb[1], **kw}

    pts = [pt("embed", (1e-4, 0.0)), pt("block", BLOCK), pt("head", HEAD)]
    pts += [pt("moe", {1: MOE1, 2: MOE2}[e], ep=e) for e in eps]
    return {"kind": "autotune-layer-profile", "schema_version": 1, "device_kind": "cpu", "device_name": "test",
            "model": model_dict(m), "dtype": "fp32", "origin": "measured", "meta": {}, "points": pts}


def _ctx(m, inline: str, eps=(1, 2)):
    from autotune.commands.tune import _like_this_machine
    from autotune.cost.steps import step_context, tp_groups
    from autotune.plan import parse_inline
    from profilers.store import save_layer_profile

    lid = save_layer_profile(_doc(m, eps), ":memory:")
    cluster = _like_this_machine("CPU", "local", ":memory:", 1, None, (f"layers:{lid}",))
    s = step_context(parse_inline(inline + ",mbs=2,dtype=fp32"), m, cluster, 64, 8, None, None)
    return tp_groups(s)[0][2]


def _mean_block(ctx):
    from autotune.cost.rank import _moe_blocks

    b = _moe_blocks(ctx)[0][0]
    return b.comp_f, b.comp_b


@pytest.mark.parametrize(("inline", "moe"), [("dp=2", MOE1), ("dp=2,ep=2", MOE2)])
def test_on_the_shape_it_timed_a_layer_is_priced_at_its_measurement(inline, moe):
    """Even shares, forced balance, no recomputation, no calibration: each chunk's mean block is the
    measured dense block and MoE blocks in the model's proportion, at the plan's ep."""
    m = _balanced()
    n_moe, n = m.moe_layer_count, m.layers
    want = [((n - n_moe) * BLOCK[i] + n_moe * moe[i]) / n for i in (0, 1)]
    assert _mean_block(_ctx(m, inline)) == pytest.approx(want, rel=1e-9)


def test_uneven_shares_keep_their_modelled_extra_on_the_measured_scale():
    """The busiest EP rank holding 5 of 8 experts computes more than the even shard that was timed;
    by the model's ratio of the two shapes."""
    from autotune.cost import expert_ranks as ER
    from autotune.cost import moe_layers as ML

    m = _balanced()
    ctx = _ctx(m, "dp=2,ep=2,experts=5/3")
    lc, _, _, _ = ML.base_block(ctx, m.moe.shared_width)
    shared = ML.shared_gemm_fwd(ctx)
    routed = 2 * ML.tokens_in(ctx)  # two EP ranks route their tokens; four experts each, top-2 of 8
    even = ER.RankLoad(share=4, imbalance=1.0, received=routed * 2 * 4 / 8)
    plan_t, even_t = ML.moe_terms(ctx, shared), ML.moe_terms(ctx, shared, shape=(even, even))
    ratio = (lc.fwd + plan_t.comp_f) / (lc.fwd + even_t.comp_f)  # cf = 1
    n_moe, n = m.moe_layer_count, m.layers
    assert ratio > 1.0
    assert _mean_block(ctx)[0] == pytest.approx(((n - n_moe) * BLOCK[0] + n_moe * MOE2[0] * ratio) / n, rel=1e-9)


def test_an_ep_the_profile_did_not_time_falls_back_to_the_model():
    from autotune.cost import layers as LY

    m = _balanced()
    assert LY.moe_piece(_ctx(m, "dp=2,ep=2", eps=(1,))) is None
    assert LY.moe_piece(_ctx(m, "dp=2,ep=2", eps=(1, 2))) is not None
    assert LY.moe_piece(_ctx(m, "dp=2,etp=2", eps=(1, 2))) is None  # an etp the profile did not time


def test_a_profile_of_other_experts_is_not_used():
    from autotune.cost import layers as LY

    m = _balanced()
    other = dataclasses.replace(m, moe=dataclasses.replace(m.moe, top_k=1))
    assert LY.matches(_doc(m), m, "fp32") and not LY.matches(_doc(m), other, "fp32")
