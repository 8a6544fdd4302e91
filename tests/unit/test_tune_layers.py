"""`tune` measures the model it tunes (autotune/commands/tune_layers.py): the grid it times is what
the search can price, the precision it picks is the fastest measured, and the search prices from it."""

import pytest

from autotune.commands import tune_layers as TL
from autotune.specs import load_model


def test_grid_is_every_micro_batch_the_batch_allows_and_every_tp_the_model_splits_into():
    small = load_model("small")
    mbs, tps, eps = TL.layer_grid(small, 8, 2)
    assert mbs == (1, 2, 4, 8) and tps == (1, 2) and eps == (1,)
    mbs, tps, _ = TL.layer_grid(small, 6, 4)
    assert mbs == (1, 2, 3, 6)
    assert tps == tuple(t for t in (1, 2, 4) if all(v % t == 0 for v in (small.heads, small.kv_heads,
                                                                          small.ffn_hidden, small.vocab)))


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_an_moe_models_grid_times_every_ep_the_search_can_choose(world):
    """The moe piece is timed at every EP and expert-TP degree the default space offers on ``world``
    local ranks (its own lists, ``ep_divs`` and ``etp_divs``), so no searched MoE plan falls back for
    want of its ep or etp."""
    from autotune.specs import load_cluster
    from search_spaces.base import SearchContext
    from search_spaces.default import DefaultSpace

    moe = load_model("tiny-moe")
    space = DefaultSpace(SearchContext(model=moe, cluster=load_cluster(f"local:{world}"), seq_len=64,
                                       global_batch=8))
    assert TL.layer_grid(moe, 8, world)[2] == tuple(space.ep_divs)
    assert TL.etp_grid(moe, world) == tuple(space.etp_divs)  # and every etp (one node here)


def test_per_token_cost_of_an_moe_model_counts_its_dense_and_moe_blocks():
    moe = load_model("tiny-moe")
    doc = _doc(3e-3, 1e-3)
    doc["points"].append({"piece": "moe", "tp": 1, "ep": 1, "micro_batch": 2, "seq": 16, "fwd_s": 2e-3, "bwd_s": 3e-3})
    doc["points"].append({"piece": "moe", "tp": 1, "ep": 2, "micro_batch": 2, "seq": 16, "fwd_s": 9.0, "bwd_s": 9.0})
    doc["model"] = {"moe": moe.moe.to_dict()}
    dense, n_moe = len(moe.moe.dense_layers), moe.moe_layer_count
    assert TL.per_token_s(doc, moe.layers) == pytest.approx((dense * 3e-3 + n_moe * 5e-3 + 1e-3) / 32)


def _doc(block_s, head_s, mbs=2, seq=16):
    return {"points": [{"piece": "block", "tp": 1, "micro_batch": mbs, "seq": seq, "fwd_s": block_s / 3,
                        "bwd_s": 2 * block_s / 3},
                       {"piece": "head", "tp": 1, "micro_batch": mbs, "seq": seq, "fwd_s": head_s / 2,
                        "bwd_s": head_s / 2}]}


def test_per_token_cost_is_every_block_and_the_head_over_the_tokens():
    tiny = load_model("tiny")
    assert TL.per_token_s(_doc(3e-3, 1e-3), tiny.layers) == pytest.approx((tiny.layers * 3e-3 + 1e-3) / 32)


def test_per_token_cost_counts_the_accumulation_per_micro_batch_and_the_update_per_step():
    tiny = load_model("tiny")
    upd = {"params": 1000, "accumulate_s_per_param": 2e-9, "update_s_per_param": 8e-9}
    base = TL.per_token_s(_doc(3e-3, 1e-3), tiny.layers)
    # micro-batch 2 of 16 tokens (32 tokens), global batch 8 (128 tokens a step)
    assert TL.per_token_s(_doc(3e-3, 1e-3), tiny.layers, upd, 8) == pytest.approx(base + 2e-6 / 32 + 8e-6 / 128)


def test_a_precision_whose_update_costs_more_can_lose(monkeypatch):
    tiny = load_model("tiny")
    monkeypatch.setattr("profilers.layers.profile_layers", lambda model, device, sweep, progress=None: _doc(2e-3, 1e-3))
    costs = {"bf16": 1e-6, "fp32": 0.0}  # same layers; bf16 accumulates its gradients in fp32 every micro-batch
    monkeypatch.setattr("profilers.update_costs.measure_update", lambda model, dt: {
        "params": 10_000, "accumulate_s_per_param": costs[dt], "update_s_per_param": 1e-9})
    assert TL.choose_precision(tiny, 16, 8, ["bf16", "fp32"], lambda _m: None).dtype == "fp32"


def test_precision_is_the_fastest_measured_and_the_note_says_so(monkeypatch):
    tiny = load_model("tiny")
    timed = {"bf16": _doc(4e-3, 1e-3), "fp32": _doc(2e-3, 1e-3), "fp16": _doc(5e-3, 1e-3)}
    seen = []

    def fake(model, device, sweep, progress=None):
        seen.append((sweep.dtype, sweep.micro_batches, sweep.pieces, sweep.threads))
        return timed[sweep.dtype]

    monkeypatch.setattr("profilers.layers.profile_layers", fake)
    monkeypatch.setattr("profilers.update_costs.measure_update", lambda model, dt: {
        "params": 1, "accumulate_s_per_param": 0.0, "update_s_per_param": 0.0})
    got = TL.choose_precision(tiny, 16, 8, ["bf16", "fp16", "fp32"], lambda _m: None)
    assert got.dtype == "fp32" == min(got.per_token_s, key=got.per_token_s.get)
    assert [s[0] for s in seen] == ["bf16", "fp16", "fp32"] and all(s[1] == (TL.PROBE_MBS,) for s in seen)
    assert got.note.startswith("precision: fp32") and "--dtype" in got.note and "\n" not in got.note
    # one precision to choose from: nothing timed
    seen.clear()
    assert TL.choose_precision(tiny, 16, 8, ["fp32"], lambda _m: None).dtype == "fp32" and not seen


def test_the_search_prices_the_plan_from_the_layers_tune_measured(tmp_path):
    """The cluster `tune` searches carries the measured layers, and the cost model prices the block
    from them (not from the kernel curves)."""
    from autotune.commands.tune import _like_this_machine
    from autotune.cost import estimate
    from autotune.plan import Plan
    from profilers.layers import LayerSweep, profile_layers
    from profilers.store import save_layer_profile

    storage = f"sqlite:///{tmp_path}/t.db"
    tiny = load_model("tiny")
    doc = profile_layers(tiny, "cpu", LayerSweep(micro_batches=(1, 2), seq_lens=(32,), tp=(1,), dtype="fp32",
                                                 rounds=1, min_repeats=1, max_repeats=1))
    lid = save_layer_profile(doc, storage)
    cluster = _like_this_machine("CPU", "local", storage, 1, None, (f"layers:{lid}",))
    est = estimate(Plan.from_dict({"degrees": {"dp": cluster.num_devices}, "micro_batch_size": 1, "dtype": "fp32"}),
                   tiny, cluster, 32, 2 * cluster.num_devices)
    src = next(iter(est.breakdown["compute_source"].values()))
    assert src["block"].startswith(f"layers:{lid}") and src["head"].startswith(f"layers:{lid}")
