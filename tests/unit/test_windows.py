"""Sliding-window attention (GPT-OSS) against references: the pair count against Megatron Core's own
window mask counted element by element, the windowed layers against Megatron Core's layer rule, the
estimate of a windowed model against the same model whose window covers the sequence (the full
price), the windowed ring's blocks against the mask, the export read back into Megatron Core's
config, the runtime's windowed attention against a softmax over that mask, and one-line errors."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from unittest import mock

import numpy as np
import pytest
import torch

from autotune.cost import estimate
from autotune.cost import windows as CW
from autotune.cost.compute import causal_keys
from autotune.cost.documents import masked_pairs
from autotune.cost.ring import segments
from autotune.errors import InputError
from autotune.export import ExportRefused, export
from autotune.export import megatron as M
from autotune.export.common import ExportContext
from autotune.plan import Degrees, Plan, PlanError, parse_inline
from autotune.runtime.attention import causal_sdpa
from autotune.specs import windows as W
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import PRESETS, ModelSpec, load_model, model_from_dict

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mcore = pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer import utils as MU

TINY_W = ModelSpec(name="tiny-window", layers=4, hidden=64, heads=8, kv_heads=4, ffn_hidden=176, vocab=256,
                   window=8, window_skip_freq=2)


def megatron_mask(seq: int, window: int) -> torch.Tensor:
    """Megatron Core's sliding-window causal mask (True: masked out) for ``--window-size window-1,0``,
    its own function on CPU (it allocates on cuda)."""
    real = torch.ones
    with mock.patch.object(MU.torch, "ones", lambda *a, **k: real(*a, dtype=k.get("dtype"))):
        return MU.get_sliding_window_causal_mask(seq, seq, (window - 1, 0))


# ---- the pair count -------------------------------------------------------------------------------
@pytest.mark.parametrize("seq,window", [(1, 2), (7, 3), (16, 4), (16, 16), (16, 40), (33, 8), (64, 128)])
def test_window_pairs_count_what_megatrons_mask_keeps(seq, window):
    kept = ~megatron_mask(seq, window)
    rows = kept.sum(dim=1).tolist()  # keys each query attends
    for lo in range(seq):
        for hi in (lo + 1, seq):
            assert W.query_keys(lo, hi, 0, window) == float(sum(rows[lo:hi]))


@pytest.mark.parametrize("tokens,zigzag", [((24,), False), ((8, 16), False), ((12, 12), True), ((4, 8, 6, 6), True)])
@pytest.mark.parametrize("window", [2, 5, 9, 64])
def test_window_with_documents_counts_the_brute_force_mask(tokens, zigzag, window):
    """The one rule with documents and a window together (``masked_pairs(window=)``) against a mask
    built element by element; without a window it is the causal count."""
    s = sum(tokens)
    segs = segments(tokens, zigzag, s)
    rng = np.random.default_rng(3)
    for _ in range(4):
        cuts = sorted(rng.choice(np.arange(1, s), size=3, replace=False).tolist())
        docs = tuple(b - a for a, b in zip([0, *cuts], [*cuts, s], strict=True))
        starts = np.repeat(np.cumsum((0,) + docs[:-1]), docs)
        for c in range(len(tokens)):
            brute = sum(1 for a, n in segs[c] for p in range(a, a + n)
                        for k in range(s) if starts[k] == starts[p] and 0 <= p - k < window)
            assert masked_pairs(docs, segs[c], window) == brute
        assert masked_pairs((s,), segs[0]) == causal_keys(tokens, 0, zigzag, s)


def test_layers_are_windowed_as_megatron_core_decides():
    for freq in (None, 2, 3, (1, 0, 0, 1)):
        m = dataclasses.replace(TINY_W, window_skip_freq=freq)
        assert [m.is_window_layer(i) for i in range(4)] == \
            [MU.is_layer_window_attention((7, 0), list(freq) if isinstance(freq, tuple) else freq, i + 1)
             for i in range(4)]
    gpt = PRESETS["gpt-oss-120b"]  # the HF config's layer_types: sliding first, then alternating
    assert [gpt.is_window_layer(i) for i in range(gpt.layers)] == [i % 2 == 0 for i in range(36)]
    assert gpt.window == 128 and gpt.sinks and gpt.window_layer_count == 18


# ---- pricing -----------------------------------------------------------------------------------------
def _h100(n: int):
    return cluster_from_dict({"name": f"h100-{n}", "inter_node": {"bandwidth": "400Gbit/s", "latency": "10us"},
                              "nodes": [{"count": max(1, n // 8), "devices_per_node": min(8, n), "device": "H100-SXM",
                                         "intra_node": {"bandwidth": "450GB/s", "latency": "3us"}}]})


def _plain(m: ModelSpec) -> ModelSpec:
    return dataclasses.replace(m, window=0, window_skip_freq=None)


@pytest.mark.parametrize("name,plan,n,seq,batch", [
    ("gpt-oss-20b", "dp=8,pp=2,ep=8", 16, 2048, 64),
    ("gpt-oss-20b", "dp=4,pp=2,cp=2,ep=8,recompute=selective", 16, 4096, 32),
    ("gpt-oss-120b", "dp=8,pp=2,tp=2,sp=1,ep=8,vpp=3,schedule=interleaved_1f1b", 32, 2048, 64),
    ("tiny-window", "dp=2,pp=2,tp=2,sp=1", 8, 64, 16),
    ("tiny-window", "dp=2,cp=2,hp=2", 8, 64, 16),
])
def test_a_window_that_covers_the_sequence_prices_as_full_attention(name, plan, n, seq, batch):
    """The windowed path with window = sequence (every layer's pairs causal) gives the full price, and
    a real window prices less: the windowed layers' attention is all that moves."""
    m = TINY_W if name == "tiny-window" else load_model(name)
    p = parse_inline(plan)
    full = estimate(p, _plain(m), _h100(n), seq, batch).predicted
    covered = estimate(p, dataclasses.replace(m, window=seq), _h100(n), seq, batch).predicted
    assert covered["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-12)
    assert covered["memory_bytes"] == full["memory_bytes"]
    assert covered["mfu"] == pytest.approx(full["mfu"], rel=1e-12)
    short = estimate(p, dataclasses.replace(m, window=seq // 16), _h100(n), seq, batch).predicted
    assert short["step_time_s"] < full["step_time_s"]
    assert short["memory_bytes"] == full["memory_bytes"]  # windows keep a full layer's activations


def test_windowed_flops_count_the_window_on_half_the_layers():
    m = load_model("gpt-oss-120b")
    seq = 32768
    att = lambda keys: m.layer_attention_flops_fwd(seq, keys=keys)  # noqa: E731
    want = 18 * att((seq + 1) / 2) + 18 * att(W.query_keys(0, seq, 0, 128) / seq)
    assert m.attention_flops_fwd(seq) == pytest.approx(want, rel=1e-12)
    assert m.window_keys(seq) == pytest.approx(128 - 127 * 128 / 2 / seq)  # 128 keys but near the start
    assert _plain(m).model_flops_per_token(seq) > m.model_flops_per_token(seq)


@pytest.mark.parametrize("tokens,zigzag", [((16, 16), False), ((8, 8, 8, 8), True), ((8, 8, 8, 8), False)])
@pytest.mark.parametrize("window", [3, 8, 20])
def test_windowed_ring_blocks_cover_the_kept_pairs_and_only_neighbours(tokens, zigzag, window):
    s = sum(tokens)
    segs = segments(tokens, zigzag, s)
    kept = ~megatron_mask(s, window)
    for c in range(len(tokens)):
        blocks = CW.ring_blocks(segs, c, window)
        want = {(qs, ks) for qs, ql in segs[c] for ksegs in segs for ks, kl in ksegs
                if kl and kept[qs:qs + ql, ks:ks + kl].any()}
        assert len(blocks) == len(want)  # one block per (query segment, key segment) with a kept pair
        if window <= min(tokens) // (2 if zigzag else 1):  # a short window reaches the neighbour at most
            assert len(blocks) <= 2 * len(segs[c])


def test_documents_and_windows_together_are_refused_in_one_line():
    from autotune.documents import LengthDistribution

    p = Plan.from_dict({"degrees": {"dp": 2}, "doc_mask": True})
    with pytest.raises(PlanError, match="doc_mask"):
        estimate(p, TINY_W, _h100(2), 64, 4, documents=LengthDistribution((8, 16), (1, 1)))


# ---- the spec ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,field", [
    ({"window": -1}, "window"), ({"window": 1}, "window"), ({"window": True}, "window"),
    ({"window_skip_freq": 2}, "window_skip_freq"),
    ({"window": 8, "window_skip_freq": 1}, "window_skip_freq"),
    ({"window": 8, "window_skip_freq": [1, 0]}, "window_skip_freq"),
    ({"window": 8, "window_skip_freq": [1, 0, 2, 0]}, "window_skip_freq"),
    ({"window": 8, "window_skip_freq": [0, 0, 0, 0]}, "window_skip_freq"),
    ({"window": 8, "window_skip_freq": "2"}, "window_skip_freq"),
    ({"sinks": "yes"}, "sinks"),
])
def test_bad_window_fields_are_one_line_errors_naming_the_field(extra, field):
    base = {"name": "x", "layers": 4, "hidden": 64, "heads": 8, "kv_heads": 4, "ffn_hidden": 176, "vocab": 256}
    with pytest.raises(InputError) as e:
        model_from_dict({**base, **extra})
    assert e.value.field == field and "\n" not in str(e.value)


def test_window_fields_round_trip_and_a_dense_dict_has_none():
    for m in (TINY_W, dataclasses.replace(TINY_W, window_skip_freq=(1, 1, 0, 1), sinks=True), PRESETS["gpt-oss-20b"]):
        assert model_from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert not {"window", "window_skip_freq", "sinks"} & set(PRESETS["llama3-8b"].to_dict())


# ---- exports -----------------------------------------------------------------------------------------
def _ctx(model: ModelSpec, nodes: int = 2, seq: int = 4096) -> ExportContext:
    return ExportContext(model=model, cluster=_h100(8 * nodes), seq_len=seq, global_batch=256)


def _megatron_config(args: list[str], m: ModelSpec) -> TransformerConfig:
    """The window and softmax flags as megatron/training/arguments.py types them (``tuple_type``:
    "127,0" -> (127, 0); ``moe_freq_type``: an integer, or a list expression evaluated) into Megatron
    Core's TransformerConfig fields of the same names."""
    f = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--") and not args[i + 1].startswith("--")}
    freq = f.get("--window-attn-skip-freq")
    return TransformerConfig(
        num_layers=int(f["--num-layers"]), hidden_size=int(f["--hidden-size"]),
        num_attention_heads=int(f["--num-attention-heads"]), kv_channels=int(f.get("--kv-channels", 0)) or None,
        window_size=tuple(int(x) for x in f["--window-size"].strip("()").split(",")),
        window_attn_skip_freq=None if freq is None else (eval(freq, {"__builtins__": {}}) if "[" in freq else int(freq)),  # noqa: S307
        softmax_type=f.get("--softmax-type", "vanilla"))


@pytest.mark.parametrize("name", ["gpt-oss-120b", "gpt-oss-20b", "pattern"])
def test_megatron_reads_back_the_windows_and_sinks(name):
    m = dataclasses.replace(TINY_W, window_skip_freq=(1, 1, 0, 1)) if name == "pattern" else load_model(name)
    ctx = _ctx(m)
    plan = Plan(degrees=Degrees(dp=16, ep=8 if m.moe else 1), micro_batch_size=1).resolve(m, ctx.cluster, ctx.seq_len, ctx.global_batch)
    cfg = _megatron_config(M.parse_script(export(plan, ctx, "megatron").text), m)
    assert cfg.kv_channels == m.head_dim
    assert [MU.is_layer_window_attention(cfg.window_size, cfg.window_attn_skip_freq, i + 1) for i in range(m.layers)] \
        == [m.is_window_layer(i) for i in range(m.layers)]
    kept = ~megatron_mask(300, cfg.window_size[0] + 1)
    assert int(kept[-1].sum()) == min(m.window, 300) and cfg.window_size[1] == 0  # the keys one query sees
    assert cfg.softmax_type == ("learnable" if m.sinks else "vanilla")


def test_torchtitan_and_accelerate_refuse_what_their_windowed_models_cannot_run_in_one_line():
    m = load_model("gpt-oss-20b")
    ctx = _ctx(m)
    piped = Plan(degrees=Degrees(dp=8, pp=2, ep=8), micro_batch_size=1, zero_stage=3,
                 sequence_parallel=False).resolve(m, ctx.cluster, ctx.seq_len, ctx.global_batch)
    with pytest.raises(ExportRefused) as e:
        export(piped, ctx, "torchtitan")
    assert any("pp(2)" in r and "gpt_oss" in r for r in e.value.reasons)
    near = e.value.nearest.plan  # the pipeline folded into the data ranks
    assert (near.degrees.pp, near.degrees.cp, near.world) == (1, 1, piped.world)
    export(near, ctx, "torchtitan")
    dense = _ctx(dataclasses.replace(TINY_W, window=16), nodes=1, seq=256)
    cp = Plan(degrees=Degrees(dp=4, cp=2), micro_batch_size=1, zero_stage=3).resolve(
        dense.model, dense.cluster, dense.seq_len, dense.global_batch)
    with pytest.raises(ExportRefused) as e:
        export(cp, dense, "accelerate")
    assert any(r.startswith("cp(2)") and "window" in r for r in e.value.reasons)
    export(Plan(degrees=Degrees(dp=8), micro_batch_size=1, zero_stage=3).resolve(
        dense.model, dense.cluster, dense.seq_len, dense.global_batch), dense, "accelerate")  # cp 1 runs


def test_deepspeed_writes_the_hf_window_keys():
    m = load_model("gpt-oss-20b")
    ctx = _ctx(m)
    plan = Plan(degrees=Degrees(dp=16, ep=8), micro_batch_size=1, zero_stage=1).resolve(
        m, ctx.cluster, ctx.seq_len, ctx.global_batch)
    att = json.loads(export(plan, ctx, "deepspeed").text)["autotune"]["attention"]
    assert att["sliding_window"] == 128 and att["sinks"] is True
    assert att["layer_types"] == ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)]


# ---- runtime -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seq,window", [(16, 4), (16, 16), (16, 40), (33, 7)])
def test_runtime_window_is_a_softmax_over_megatrons_mask(seq, window):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, seq, 8, generator=g, dtype=torch.float64) for _ in range(3))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    want = scores.masked_fill(megatron_mask(seq, window), float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(causal_sdpa(q, k, v, window), want)


def test_runtime_refuses_what_it_does_not_run_with_the_reason():
    from autotune.runtime.trial import check_runtime_support
    from autotune.specs import local_cluster

    def resolved(**kw):
        return Plan.from_dict(kw).resolve(TINY_W, local_cluster(4), 32, 8)

    check_runtime_support(resolved(degrees={"tp": 2, "pp": 2}), TINY_W)
    check_runtime_support(resolved(degrees={"hp": 4}), TINY_W)
    for kw, field in (({"degrees": {"cp": 2, "dp": 2}}, "degrees.cp"), ({"degrees": {"dp": 4}, "doc_mask": True}, "doc_mask"),
                      ({"degrees": {"pp": 2, "dp": 2}, "schedule": "helixpipe"}, "schedule helixpipe")):
        with pytest.raises(PlanError) as e:
            check_runtime_support(resolved(**kw), TINY_W)
        assert field in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(PlanError, match="sinks"):
        check_runtime_support(resolved(degrees={"dp": 4}), dataclasses.replace(TINY_W, sinks=True))


def test_the_rank_cost_memo_is_exact_for_windowed_ranks(monkeypatch):
    """Windowed work differs where nothing else in the memo's key does: between the zigzag CP shards
    (equal causal work, but only shard 0 holds the sequence's start) and between middle pipeline
    stages of equal layer counts that start at another layer (8/7/9 against 9/7/8: 4 windowed layers
    against 3). The key carries it (``RankContext.window``): every plan priced with the memo, after
    all the others, is priced as ``rank_cost`` prices it without one."""
    import sys

    from autotune.cost import rank as RK

    moe = load_model("gpt-oss-20b")
    dense = dataclasses.replace(moe, name="gpt-oss-dense", moe=None)  # no expert layout in the step's key
    cases = [(m, p) for m in (moe, dense) for p in (
        "dp=2,cp=4,pp=3,ep=8", "dp=8,pp=3,ep=8,layers=8/7/9", "dp=8,pp=3,ep=8,layers=9/7/8",
        "dp=4,cp=2,pp=3,ep=8,layers=9/7/8", "dp=4,pp=3,tp=2,sp=1,ep=8,layers=8/7/9")]

    def prices():
        return [estimate(parse_inline(p if m.moe else p.replace(",ep=8", "")), m, _h100(24), 8192, 48
                         ).predicted["step_time_s"] for m, p in cases]

    est_mod = sys.modules["autotune.cost.estimate"]
    with monkeypatch.context() as mp:
        mp.setattr(est_mod, "rank_cost_memo", RK.rank_cost)  # no memo: every rank priced on its own
        alone = prices()
    RK._MEMO.clear()
    prices()
    assert prices() == alone
    assert len(set(alone)) == len(alone)
