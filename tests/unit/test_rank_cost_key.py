"""The cross-plan memo of the rank cost (``cost.rank.rank_cost_memo``) is exact: its key
(``RankContext.cost_key``) names everything ``rank_cost`` reads, and a search prices the same
figures with it as without it."""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from autotune.cost import context as CX
from autotune.cost import rank as RK

DATA = Path(__file__).resolve().parents[1] / "data"

def _estimate_module():
    import autotune.cost.estimate  # noqa: F401 - the package re-exports the function under this name

    return sys.modules["autotune.cost.estimate"]


def _corpus():
    spec = importlib.util.spec_from_file_location("make_cost_corpus", DATA / "make_cost_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, json.loads((DATA / "cost_corpus.json").read_text())["entries"]


class _Reads:
    """A read-only proxy that records the attributes read through it."""

    def __init__(self, target: Any, log: collections.Counter):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_log", log)

    def __getattr__(self, name: str) -> Any:
        self._log[name] += 1
        return getattr(self._target, name)


def test_rank_cost_reads_nothing_its_key_leaves_out(monkeypatch):
    """Every corpus plan (every schedule, recompute mode, ZeRO stage, dtype, CP layout; catalogue,
    mixed, measured-GPU and CPU clusters; calibrated entries) priced with ``rank_cost`` on proxies:
    what it reads from the rank's context and its step is what ``cost_key`` names."""
    gen, entries = _corpus()
    est_mod = _estimate_module()
    step_reads: collections.Counter = collections.Counter()
    rank_reads: collections.Counter = collections.Counter()

    def spied(ctx):
        inner = dataclasses.replace(ctx, step=_Reads(ctx.step, step_reads))
        return RK.rank_cost(_Reads(inner, rank_reads))

    monkeypatch.setattr(est_mod, "rank_cost_memo", spied)
    clusters = {}
    for e in entries:
        c = clusters.get(e["cluster"]) or clusters.setdefault(e["cluster"], gen.build_cluster(e["cluster"]))
        gen.price(e, c)
    assert set(step_reads) - set(CX.STEP_INPUTS) - set(CX.STEP_OBJECTS) == set(), "rank_cost reads step " \
        "fields that RankContext.cost_key leaves out: add them to STEP_INPUTS (or STEP_OBJECTS)"
    assert set(rank_reads) - set(CX.RANK_INPUTS) - set(CX.RANK_OBJECTS) - {"step"} == set(), "rank_cost " \
        "reads rank fields that RankContext.cost_key leaves out: add them to RANK_INPUTS (or RANK_OBJECTS)"
    # the proxies saw the reads (a spy that records nothing would pass the two checks above)
    assert {"tp", "mbs", "recompute", "zero", "microbatches"} <= set(step_reads)
    assert {"tokens", "heads", "layers", "links", "spec"} <= set(rank_reads)


def _search_trials(memo: bool, monkeypatch) -> list[tuple[Any, ...]]:
    from autotune.search import SearchOptions, search
    from autotune.specs import load_model
    from autotune.specs.cluster import cluster_from_dict
    from autotune.study import open_study

    est_mod = _estimate_module()
    RK._MEMO.clear()
    monkeypatch.setattr(est_mod, "rank_cost_memo", RK.rank_cost_memo if memo else RK.rank_cost)
    cluster = cluster_from_dict({"name": "mixed16", "inter_node": {"bandwidth": "25GB/s"},
                                 "nodes": [{"count": 1, "devices_per_node": 8, "device": "H100-SXM"},
                                           {"count": 1, "devices_per_node": 8, "device": "A100-80GB"}]})
    res = search(load_model("llama3-8b"), cluster, 16384, 16, study_name=f"memo-{memo}", storage=":memory:",
                 options=SearchOptions(trials=30, seed=3))
    trials = open_study(res.study_name, res.storage).get_trials()
    return [(t.params, t.value, json.dumps(t.user_attrs.get("breakdown"), sort_keys=True, default=str))
            for t in trials]


def test_a_search_prices_the_same_with_and_without_the_memo(monkeypatch):
    with_memo = _search_trials(True, monkeypatch)
    assert RK._MEMO, "the search did not go through the memo"
    without = _search_trials(False, monkeypatch)
    assert len(with_memo) == len(without) > 100
    assert with_memo == without


def test_what_a_rank_keeps_per_place_reads_no_attention_work(monkeypatch):
    """``rank._fixed`` (with the block's activations, ``dense_activations``) is kept once per place (``rank._fixed_memo``,
    keyed by ``RankContext.place_token``, which leaves out the attention work a step of documents
    gives each replica): priced over the corpus on a proxy, it reads none of ``DOC_INPUTS``."""
    gen, entries = _corpus()
    est_mod = _estimate_module()
    reads: collections.Counter = collections.Counter()

    def spied(ctx):
        if ctx.step.experts is None:
            proxy = _Reads(ctx, reads)
            RK._fixed(proxy, RK.dense_activations(proxy))
        return RK.rank_cost(ctx)

    monkeypatch.setattr(est_mod, "rank_cost_memo", spied)
    clusters = {}
    for e in entries:
        c = clusters.get(e["cluster"]) or clusters.setdefault(e["cluster"], gen.build_cluster(e["cluster"]))
        gen.price(e, c)
    assert set(reads) & set(CX.DOC_INPUTS) == set(), "what rank_cost keeps per place reads the attention work"
    assert {"tokens", "layers", "links", "params", "microbatches"} <= set(reads)  # the proxy saw the reads
