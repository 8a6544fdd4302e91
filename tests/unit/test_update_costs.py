"""The step's update outside the layers (profilers/update_costs.py, cost/layers.py ``update_time``):
what tune measures is the runtime's own optimizer, and the cost model charges it per step and, for
the fp32 gradient accumulation, per micro-batch, on the rank's (sharded) parameters."""

import dataclasses

import pytest
from _cost_helpers import device, one_node
from test_profile_layers_cost import SMALL, _doc

from autotune.cost import data_parallel as DP
from autotune.cost import estimate
from autotune.errors import InputError
from autotune.plan import parse_inline
from autotune.specs.model import load_model
from profilers import fsdp_costs
from profilers.update_costs import measure_update

ACC, UPD = 5e-10, 3e-9
"""Seconds per parameter of one micro-batch's accumulation and of one update (the size measured on
this project's machine for `small` in bf16)."""


FSDP = {"2": {"step_s_per_param": 3e-9, "microbatch_s_per_param": 1.7e-9, "update_s_per_param": 6.7e-9},
        "3": {"step_s_per_param": 2.2e-9, "microbatch_s_per_param": 4.3e-9, "update_s_per_param": 6.7e-9},
        "params": 1, "world": 2, "clock": "thread"}
"""What FSDP2 adds per parameter (the size measured on this project's machine for `small` in bf16)."""


def _cluster(n, update=True, fsdp=False):
    doc = _doc()
    doc["meta"] = {}
    if update:
        doc["meta"]["update"] = {"accumulate_s_per_param": ACC, "update_s_per_param": UPD, "params": 1}
    if fsdp:
        doc["meta"]["fsdp"] = FSDP
    return one_node(n, dev=dataclasses.replace(device(), layer_profiles=(doc,)))


def _params(est):
    return est.breakdown["ranks"][0]["memory"]["weights"] / 2  # bf16 weights: 2 bytes a parameter


@pytest.mark.parametrize("inline,acc_per_mb,shard", [("dp=1,mbs=1", 1, 1), ("dp=2,mbs=1", 1, 1),
                                                    ("dp=2,mbs=1,zero=1", 1, 2), ("dp=2,mbs=1,zero=2", 0, 2)])
def test_the_measured_update_is_charged_per_step_and_the_accumulation_per_micro_batch(inline, acc_per_mb, shard):
    n = 2 if "dp=2" in inline else 1
    g = 4 * n
    est = estimate(parse_inline(inline), SMALL, _cluster(n), 512, g)
    r = est.breakdown["ranks"][0]
    m = g // n  # micro-batches of one sample per rank
    p = _params(est)  # the rank's parameters, as the memory model holds them (sharded only from ZeRO-3)
    assert r["optimizer_s"] == pytest.approx(UPD * p / shard + ACC * p * m * acc_per_mb, rel=1e-9)


def test_without_a_measured_update_the_bandwidth_price_stands():
    with_, without = (estimate(parse_inline("dp=2,mbs=1"), SMALL, _cluster(2, u), 512, 8) for u in (True, False))
    assert with_.breakdown["ranks"][0]["optimizer_s"] != without.breakdown["ranks"][0]["optimizer_s"]
    # the update ends the step: the step grows by exactly what the term grew by
    d_opt = with_.breakdown["ranks"][0]["optimizer_s"] - without.breakdown["ranks"][0]["optimizer_s"]
    assert with_.predicted["step_time_s"] - without.predicted["step_time_s"] == pytest.approx(d_opt, rel=1e-9)
    assert without.breakdown["ranks"][0]["optimizer_s"] > 0 and DP.ADAM_BYTES_PER_PARAM > 0


@pytest.mark.parametrize("field,value", [("update", {"accumulate_s_per_param": -1.0, "update_s_per_param": 3e-9}),
                                         ("update", {"accumulate_s_per_param": 5e-10, "update_s_per_param": "x"}),
                                         ("update", {"accumulate_s_per_param": 5e-10}),
                                         ("update", [1, 2]),
                                         ("fsdp", {"2": {**FSDP["2"], "step_s_per_param": float("nan")}}),
                                         ("fsdp", {"3": {"update_s_per_param": 1e-9}}),
                                         ("fsdp", 7)])
def test_a_malformed_measurement_is_refused_with_the_field_named(field, value):
    doc = _doc()
    doc["meta"] = {field: value}
    bad = one_node(2, dev=dataclasses.replace(device(), layer_profiles=(doc,)))
    with pytest.raises(InputError) as e:
        estimate(parse_inline("dp=2,mbs=1"), SMALL, bad, 512, 8)
    assert f"meta.{field}" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("zero,m", [(2, 4), (3, 4), (2, 1), (3, 2)])
def test_zero_2_and_3_are_charged_fsdp2s_measured_work_per_step_and_micro_batch(zero, m):
    """On a profile holding ``meta.fsdp`` a ZeRO-2/3 step is priced above the same plan without it by
    exactly the measured terms less the plain update they replace; ZeRO-1 does not move."""
    g = 2 * m  # two replicas, micro-batches of one sample
    plan = parse_inline(f"dp=2,mbs=1,zero={zero}")
    with_, without = (estimate(plan, SMALL, _cluster(2, fsdp=f), 512, g) for f in (True, False))
    p = _params(estimate(parse_inline("dp=2,mbs=1,zero=2"), SMALL, _cluster(2), 512, g))  # unsharded weights
    z = FSDP[str(zero)]
    charged = z["update_s_per_param"] * p / 2 + z["step_s_per_param"] * p + z["microbatch_s_per_param"] * p * m
    assert with_.breakdown["ranks"][0]["optimizer_s"] == pytest.approx(charged, rel=1e-9)
    assert without.breakdown["ranks"][0]["optimizer_s"] == pytest.approx(UPD * p / 2, rel=1e-9)  # the old price
    d = with_.predicted["step_time_s"] - without.predicted["step_time_s"]
    assert d == pytest.approx(charged - UPD * p / 2, rel=1e-9) and d > 0
    z1 = [estimate(parse_inline("dp=2,mbs=1,zero=1"), SMALL, _cluster(2, fsdp=f), 512, g) for f in (True, False)]
    assert z1[0].predicted["step_time_s"] == z1[1].predicted["step_time_s"]


def test_without_an_update_the_fsdp_terms_still_price_zero_2():
    g = 8
    a = estimate(parse_inline("dp=2,mbs=1,zero=2"), SMALL, _cluster(2, update=False, fsdp=True), 512, g)
    b = estimate(parse_inline("dp=2,mbs=1,zero=2"), SMALL, _cluster(2, fsdp=True), 512, g)
    assert a.breakdown["ranks"][0]["optimizer_s"] == b.breakdown["ranks"][0]["optimizer_s"]


def test_fsdp_terms_split_the_overhead_into_per_step_and_per_micro_batch():
    """``terms`` against a reference overhead a + b n built from known a, b."""
    hi, params, local = fsdp_costs.MICROBATCHES_HI, 1000, 500
    a, b, plain = {2: 0.02, 3: 0.015}, {2: 0.012, 3: 0.03}, 0.01
    med = {"plain1": plain, f"plain{hi}": plain * hi}
    for z in (2, 3):
        for n in (1, hi):
            med[f"z{z}_{n}"] = plain * n + a[z] + b[z] * n
            med[f"z{z}_update{n}"] = 0.005
    got = fsdp_costs.terms(med, params, local)
    for z in (2, 3):
        assert got[str(z)]["step_s_per_param"] == pytest.approx(a[z] / params)
        assert got[str(z)]["microbatch_s_per_param"] == pytest.approx(b[z] / params)
        assert got[str(z)]["update_s_per_param"] == pytest.approx(0.005 / local)


def test_measured_fsdp_work_is_positive_on_the_runtimes_sharding():
    """Two gloo ranks of the runtime's FSDP2 (tiny, bf16): ZeRO-3 gathers every micro-batch, so it does
    more per micro-batch than ZeRO-2."""
    got = fsdp_costs.measure_fsdp(load_model("tiny"), "bf16")
    assert got["params"] > 0 and got["world"] == 2 and got["clock"] == "thread"
    for z in ("2", "3"):
        assert got[z]["update_s_per_param"] > 0
        assert got[z]["step_s_per_param"] + got[z]["microbatch_s_per_param"] > 0
    assert got["3"]["microbatch_s_per_param"] > got["2"]["microbatch_s_per_param"]


def test_measured_update_is_the_runtimes_optimizer_per_parameter():
    tiny = load_model("tiny")
    bf16, fp32 = measure_update(tiny, "bf16"), measure_update(tiny, "fp32")
    assert bf16["params"] == fp32["params"] > 0 and bf16["clock"] == "thread"
    assert bf16["update_s_per_param"] > 0 and fp32["update_s_per_param"] > 0
    # fp32 parameters are their own masters: autograd's gradient is the accumulator
    assert bf16["accumulate_s_per_param"] > 0 and fp32["accumulate_s_per_param"] == 0.0
