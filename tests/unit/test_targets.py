"""What each target can run, asked of the target's own code, and the best plan per target of a study
of plans priced by the real cost model: every better plan is one the target's export refuses."""

from types import SimpleNamespace

import pytest

from autotune.cost import estimate
from autotune.errors import InputError
from autotune.export import ExportRefused, export
from autotune.plan import load_plan
from autotune.specs import load_cluster, load_model
from autotune.targets import TARGETS, best_per_target, check_target, context, refusals

MODEL, CLUSTER, SEQ, BATCH = load_model("tiny"), load_cluster("local:4"), 256, 8
INLINE = ("dp=2,pp=2,layers=3/1", "cp=2,dp=2,tokens=160/96", "dp=4,zero=1", "pp=4,schedule=gpipe", "dp=2,tp=2",
          "dp=4,samples=3/1/2/2", "cp=4")


@pytest.fixture(scope="module")
def ranked():
    out = []
    for i, text in enumerate(INLINE):
        est = estimate(load_plan(text), MODEL, CLUSTER, SEQ, BATCH)
        out.append((SimpleNamespace(number=i, value=est.predicted["tokens_per_s"],
                                    user_attrs={"plan": est.record().to_dict()}), est.plan))
    return sorted(out, key=lambda tp: -tp[0].value)


def accepted(target, plan, ctx):
    if target == "runtime":
        return not refusals("runtime", plan, ctx)
    try:
        export(plan, ctx, target)
    except ExportRefused:
        return False
    return True


def test_best_per_target_is_the_best_plan_the_target_itself_accepts(ranked):
    ctx = context(MODEL, CLUSTER, SEQ, BATCH)
    best = best_per_target(ranked, ctx)
    top = ranked[0][0].value
    for target in TARGETS:
        ok = [(t, p) for t, p in ranked if accepted(target, p, ctx)]
        if not ok:
            assert best[target] is None
            continue
        t, p = ok[0]
        assert best[target]["trial"] == t.number
        assert best[target]["ratio"] == pytest.approx(t.value / top)
    assert any(best[t] is None or best[t]["ratio"] < 1 for t in TARGETS)  # uneven shares are not free


def test_unknown_target_is_one_line():
    with pytest.raises(InputError, match="did you mean megatron"):
        check_target("megatorn")
