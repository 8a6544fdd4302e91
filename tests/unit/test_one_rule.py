"""One rule per figure: each user of a figure against the one place that states it.

- optimizer-state bytes per parameter (``memory.state_bytes_per_param``): the stage program's ZeRO-1
  share and the pool's smallest subset;
- a layer's parameters (``ModelSpec.layer_params``): the stage program's gradient sync;
- the objective's ordering (``objective.sort_key``): the pool search's subset ranking, validate's
  best measured plan and its calibrated re-ranking.
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest

from autotune.cost import memory as M
from autotune.objective import STUDY_KEY, Objective, cost_at, figures, sort_key, step_of
from autotune.search import pool as POOL
from autotune.specs import load_model
from autotune.specs.cluster import cluster_from_dict
from search_spaces import _stages as ST
from search_spaces.base import SearchContext

CLUSTER = cluster_from_dict({"name": "a4", "nodes": [{"count": 1, "devices_per_node": 4, "device": "A100-40GB"}]})


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_stage_program_zero1_shards_the_memory_models_optimizer_states(dtype):
    """The ZeRO-1 share the program takes off a layer's states is the optimizer term of
    ``memory.model_states`` for that layer (12 of 18 bytes under bf16, 8 of 16 in fp32): the old
    12/18 was a third too much in fp32."""
    model = load_model("tiny")
    ctx = SearchContext(model=model, cluster=CLUSTER, seq_len=64, global_batch=8, dtype=dtype)
    opts = ST.option_costs(ctx, (1, "none", dtype), {})
    assert opts
    for o in opts:
        want = M.model_states(model.layer_params() / o.tp, dtype, 0, 1, model.layer_params() / o.tp)
        assert ST._opt_share(o) == pytest.approx(want["optimizer"], rel=1e-9)
        assert ST._opt_share(o) / o.layer_states == pytest.approx(M.optimizer_share(dtype), rel=1e-9)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32", "fp8"])
def test_pool_needs_the_model_states_fully_sharded(dtype):
    """The pool leaves out a subset that cannot hold the model states fully sharded: the bytes a
    parameter are what ``model_states`` puts on n ZeRO-3 ranks together (less the gathered blocks)."""
    params, n = 1e9, 64
    per_rank = M.model_states(params, dtype, 3, n, 0.0)
    assert sum(per_rank.values()) * n == pytest.approx(M.sharded_bytes_per_param(dtype) * params, rel=1e-12)
    model = load_model("llama3-8b")
    need = M.sharded_bytes_per_param(dtype) * model.param_count()
    pool = cluster_from_dict({"name": "p", "nodes": [
        {"available": 4, "devices_per_node": 1, "device": "A100-40GB"},
        {"available": 2, "devices_per_node": 1, "device": "V100-16GB"}]})
    subsets, _ = POOL.candidates(pool, model, Objective(), dtype)
    for uses in itertools.product(range(5), range(3)):
        if not any(uses):
            continue
        mem = sum(n * g.devices_per_node * g.device.memory_bytes for g, n in zip(pool.groups, uses, strict=True))
        assert (tuple(uses) in subsets) == (mem >= need)


@pytest.mark.parametrize("kind", ["time", "cost"])
def test_pool_ranks_subsets_by_the_objectives_sort_key(kind):
    """The pool's (step, cost) ranking orders points as ``objective.sort_key`` orders their trials."""
    obj, rng, tokens = Objective(kind=kind), random.Random(0), 2048 * 8
    pts = [(rng.choice([0.5, 1.0, 2.0]) * rng.uniform(0.9, 1.1), rng.choice([None, 1.0, 2.0, 3.0])) for _ in range(40)]
    by_pool = sorted(range(len(pts)), key=lambda i: (POOL._objective_key(obj, *pts[i]), i))
    by_rule = sorted(range(len(pts)), key=lambda i: (sort_key(obj, tokens / pts[i][0], {"cost": {"per_mtok": pts[i][1]}}), i))
    assert by_pool == by_rule


def _fake_study(kind):
    """Two trials: 0 fast on dear devices, 1 slower on cheap ones (their cost attrs as a pool search
    writes them, ``objective.figures``)."""
    pool = cluster_from_dict({"name": "p", "nodes": [
        {"available": 1, "devices_per_node": 2, "device": "H100-SXM", "price": "8USD/h"},
        {"available": 1, "devices_per_node": 2, "device": "V100-16GB", "price": "1USD/h"}]})
    trials = []
    for i, (uses, step) in enumerate((((1, 0), 1.0), ((0, 1), 2.0))):
        pred = {"step_time_s": step, "tokens_per_s": 16384 / step}
        attrs = {"plan": {"predicted": pred}, "cost": figures(pool, uses, pred, 2048, 8)}
        trials.append(SimpleNamespace(number=i, user_attrs=attrs, value=pred["tokens_per_s"]))
    stored = {}
    return SimpleNamespace(user_attrs={STUDY_KEY: Objective(kind=kind).attrs()}, get_trials=lambda deepcopy=False: trials,
                           set_user_attr=stored.__setitem__, stored=stored), trials


@pytest.mark.parametrize("kind", ["time", "cost"])
def test_validate_names_the_best_measured_plan_by_the_studys_objective(kind, monkeypatch):
    """Measured 10% slower than predicted each, the fast dear plan is the best by time, the slow
    cheap one by cost (before: the fastest whatever the objective)."""
    from autotune.validate import _rerank, _store_best

    study, trials = _fake_study(kind)
    runs = [{"measured": {"step_time_s": 1.1 * step_of(t.user_attrs), "tokens_per_s": 16384 / (1.1 * step_of(
        t.user_attrs))}, "predicted": t.user_attrs["plan"]["predicted"], "row": {"trial": t.number, "plan": {}}}
        for t in trials]
    out = {}
    _store_best(study, out, runs, [])
    want = min(trials, key=lambda t: sort_key(Objective(kind=kind), t.value, t.user_attrs)).number
    assert out["best_measured_trial"] == want == (0 if kind == "time" else 1)
    # re-ranked under a calibration that prices trial 0 at 1.5 s and trial 1 at 2 s: by time trial 0
    # is first, by cost trial 1 (before: by tokens/s whatever the objective)
    import autotune.validate as V

    monkeypatch.setattr(V, "trial_record", lambda t: SimpleNamespace(tokens_per_s=lambda: t.value))
    plans = [SimpleNamespace(dtype="bf16", step=s, degrees=SimpleNamespace(inline=lambda: "dp=2")) for s in (1.5, 2.0)]
    re = _rerank(study, list(zip(trials, plans, strict=True)), "bf16", {}, lambda p, c: p.step, 2048, 8)
    key = {x["trial"]: sort_key(Objective(kind=kind), x["calibrated_tokens_per_s"],
                                cost_at(trials[x["trial"]].user_attrs, x["calibrated_step_time_s"])) for x in re}
    assert [x["trial"] for x in re] == sorted(key, key=key.get) == ([0, 1] if kind == "time" else [1, 0])
