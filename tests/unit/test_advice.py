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


def test_beyond_64_ranks_the_terms_are_priced_again_and_pick_the_levers():
    """A search drops a trial's per-rank rows above 64 ranks (search/pricing.RANKS_LIMIT); the advice
    then prices the closest plan's memory terms again (it said "a shorter sequence" for a 405B model
    whose weights, gradients and optimizer were 90% of the need). Its figures are the estimate's own."""
    from autotune.search.pricing import RANKS_LIMIT, trim_breakdown
    from autotune.specs.cluster import cluster_from_dict

    cluster = cluster_from_dict({"name": "l40s-128", "inter_node": {"bandwidth": "25GB/s"},
                                 "nodes": [{"count": 16, "devices_per_node": 8, "device": "L40S"}]})
    model = load_model("llama3-405b")
    est = estimate(load_plan("dp=8,cp=2,hp=2,tp=4,zero=3,recompute=full"), model, cluster, 4096, 8)
    assert not est.predicted["feasible"] and est.plan.world > RANKS_LIMIT
    stored = SimpleNamespace(user_attrs={"plan": est.record().to_dict(), "breakdown": trim_breakdown(est.breakdown)})
    assert stored.user_attrs["breakdown"]["ranks"] is None  # what the study holds
    line = nothing_fits([stored], (model, cluster, 4096, 8))
    mem, cap = est.predicted["memory_bytes"], est.predicted["capacity_bytes"]
    r = max(range(len(mem)), key=lambda i: mem[i] / cap[i])
    terms = est.breakdown["ranks"][r]["memory"]  # the unstripped estimate's row of the same rank
    states = terms["weights"] + terms["gradients"] + terms["optimizer"]
    assert states > terms["activations"] + terms["logits"]
    assert f"weights+gradients+optimizer {fmt_bytes(states)}" in line and "on L40S" in line
    assert "tensor or pipeline parallelism" in line and "shorter sequence" not in line
    # without the workload the line still says what it can, with no terms
    assert "weights+gradients" not in nothing_fits([stored])


def test_zero3_accumulating_whole_gradients_is_told_to_run_one_micro_batch():
    """ZeRO-2/3 keep several micro-batches' gradients whole in fp32 (the runtime's FSDP2 and the cost
    model); where those dominate, one micro-batch per replica is the lever, and not under pipelining
    (there torch's stages accumulate whole gradients even for one)."""
    from autotune.specs.cluster import cluster_from_dict

    cluster = cluster_from_dict({"name": "h100-64", "nodes": [{"count": 8, "devices_per_node": 8,
                                                                "device": "H100-SXM"}]})
    model = load_model("llama3-405b")

    def line(inline: str) -> str:
        est = estimate(load_plan(inline), model, cluster, 1024, 256)
        assert not est.predicted["feasible"]
        t = SimpleNamespace(user_attrs={"plan": est.record().to_dict(), "breakdown": est.breakdown})
        return nothing_fits([t], (model, cluster, 1024, 256))

    accumulating = line("dp=64,zero=3,mbs=1")  # 4 micro-batches a replica
    assert "one micro-batch per replica" in accumulating
    assert "one micro-batch" not in line("dp=32,pp=2,zero=3,mbs=1")
