"""The nearest expressible plan: the fastest accepted candidate, priced by the cost model."""

import pytest

from autotune.errors import InputError
from autotune.export import ExportRefused, export
from autotune.export import torchtitan as T
from autotune.export.common import ExportContext, fold, nearest_expressible
from autotune.plan import Degrees, Plan, Shares
from autotune.plan_record import PlanRecord
from autotune.specs.cluster import load_cluster
from autotune.specs.model import PRESETS


def ctx_for():
    return ExportContext(model=PRESETS["small"], cluster=load_cluster("local:8"), seq_len=256, global_batch=16)


def test_fastest_accepted_candidate_wins_under_a_given_price():
    ctx = ctx_for()
    plan = Plan(degrees=Degrees(hp=2, dp=4), zero_stage=3).resolve(ctx.model, ctx.cluster, 256, 16)
    # price: pretend more data parallelism is faster, so hp folded into dp must win over hp -> cp
    def price(p, _ctx):
        return PlanRecord(p, predicted={"tokens_per_s": float(p.degrees.dp), "step_time_s": 1.0 / p.degrees.dp,
                                        "feasible": True}), ""
    near, _ = nearest_expressible(T, plan, ctx, price=price)
    assert near.plan.degrees == Degrees(dp=8)
    accepted = []
    for c in T.candidates(plan, ctx):
        try:
            r = c.resolve(ctx.model, ctx.cluster, 256, 16)
        except InputError:  # a candidate the plan rules refuse is no candidate
            continue
        if not T.reasons(r, ctx):
            accepted.append(r)
    assert near.predicted["tokens_per_s"] == max(p.degrees.dp for p in accepted)


def test_fold_keeps_world_and_resets_shares():
    ctx = ctx_for()
    plan = Plan(degrees=Degrees(pp=2, dp=4), shares=Shares(layers=(3, 5))).resolve(ctx.model, ctx.cluster, 256, 16)
    f = fold(plan, "pp", "dp").resolve(ctx.model, ctx.cluster, 256, 16)
    assert f.world == plan.world and f.degrees.pp == 1 and f.shares.layers == (8,)


def test_refusal_prices_the_nearest_plan_with_the_cost_model():
    import autotune.cost as cost
    ctx = ctx_for()
    plan = Plan(degrees=Degrees(cp=2, dp=4), shares=Shares(tokens=(160, 96))).resolve(ctx.model, ctx.cluster, 256, 16)
    with pytest.raises(ExportRefused) as e:
        export(plan, ctx, "megatron")
    near = e.value.nearest
    ref = cost.estimate(near.plan, ctx.model, ctx.cluster, 256, 16)
    assert near.predicted["tokens_per_s"] == pytest.approx(ref.predicted["tokens_per_s"])
    assert "tokens/s" in str(e.value)


def test_predict_calls_the_cost_model_contract(monkeypatch):
    """Plumbing only (the figures are the stub's): estimate(plan, model, cluster, seq, batch,
    calibration=, kernels=) is called with the study's calibration and, for a target's nearest plan,
    the target's kernel costs; its Estimate.plan/.predicted come back."""
    import sys
    import types

    from autotune.export.common import predict

    calls = []

    class Est:
        def __init__(self, plan):
            self.plan = plan
            self.predicted = {"step_time_s": 2.0, "tokens_per_s": 2048.0, "feasible": True}

    def estimate(plan, model, cluster, seq_len, global_batch, *, calibration=None, kernels=None):
        calls.append((model.name, cluster.num_devices, seq_len, global_batch, calibration, kernels))
        return Est(plan)

    if "autotune.cost" not in sys.modules:
        stub = types.ModuleType("autotune.cost")
        stub.estimate = estimate
        monkeypatch.setitem(sys.modules, "autotune.cost", stub)
    else:
        monkeypatch.setattr(sys.modules["autotune.cost"], "estimate", estimate)
    cal = {"local": {"compute": 1.5, "comm": 1.0}}
    ctx = ExportContext(model=PRESETS["small"], cluster=load_cluster("local:8"), seq_len=256, global_batch=16,
                        calibration=cal)
    plan = Plan(degrees=Degrees(cp=2, dp=4), shares=Shares(tokens=(160, 96))).resolve(ctx.model, ctx.cluster, 256, 16)
    priced, _ = predict(plan, ctx)
    assert priced.predicted["tokens_per_s"] == 2048.0 and calls[0] == ("small", 8, 256, 16, cal, None)
    with pytest.raises(ExportRefused) as e:
        export(plan, ctx, "megatron")
    assert "predicted 2 s/step, 2048 tokens/s" in str(e.value)
    from autotune.export import megatron

    assert calls[-1][-1] is megatron.KERNELS  # the nearest plan priced as Megatron runs it
