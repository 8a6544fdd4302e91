"""The nothing-fits line against plans priced by the real cost model on a cluster too small for them."""

from types import SimpleNamespace

from autotune.advice import nothing_fits
from autotune.cost import estimate
from autotune.plan import load_plan
from autotune.specs import load_cluster, load_model
from autotune.units import fmt_bytes


def priced(inline, model="llama3-70b", seq=8192, batch=8):
    est = estimate(load_plan(inline), load_model(model), load_cluster("local:2"), seq, batch)
    plan = est.record().to_dict()
    return SimpleNamespace(user_attrs={"plan": plan, "breakdown": est.breakdown,
                                       "infeasible_reason": est.predicted.get("infeasible_reason")}), est


def test_names_the_closest_plan_its_need_and_the_levers_it_does_not_pull():
    a, est_a = priced("dp=2")
    b, est_b = priced("pp=2,recompute=full")
    assert not est_a.predicted["feasible"] and not est_b.predicted["feasible"]
    line = nothing_fits([a, b])
    best = min((est_a, est_b), key=lambda e: max(m / c for m, c in zip(e.predicted["memory_bytes"],
                                                                       e.predicted["capacity_bytes"], strict=True)))
    r = max(range(2), key=lambda i: best.predicted["memory_bytes"][i] / best.predicted["capacity_bytes"][i])
    assert fmt_bytes(best.predicted["memory_bytes"][r]) in line and fmt_bytes(best.predicted["capacity_bytes"][r]) in line
    assert line.startswith("nothing fits") and "\n" not in line and len(line) < 400
    if best is est_b:  # already recomputes fully: not suggested again
        assert "recompute=full" not in line.split("try ")[1]


def test_model_states_dominant_suggests_zero3():
    t, est = priced("dp=2,zero=1", model="llama3-70b", seq=128, batch=2)
    line = nothing_fits([t])
    assert "ZeRO-3" in line


def test_nothing_priced_gives_no_advice():
    assert nothing_fits([SimpleNamespace(user_attrs={"infeasible_reason": "degrees: 3 != 2"})]) is None
