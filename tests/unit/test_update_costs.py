"""The step's update outside the layers (profilers/update_costs.py, cost/layers.py ``update_time``):
what tune measures is the runtime's own optimizer, and the cost model charges it per step and, for
the fp32 gradient accumulation, per micro-batch, on the rank's (sharded) parameters."""

import dataclasses

import pytest
from _cost_helpers import device, one_node
from test_profile_layers_cost import SMALL, _doc

from autotune.cost import data_parallel as DP
from autotune.cost import estimate
from autotune.plan import parse_inline
from autotune.specs.model import load_model
from profilers.update_costs import measure_update

ACC, UPD = 5e-10, 3e-9
"""Seconds per parameter of one micro-batch's accumulation and of one update (the size measured on
this project's machine for `small` in bf16)."""


def _cluster(n, update=True):
    doc = _doc()
    if update:
        doc["meta"] = {"update": {"accumulate_s_per_param": ACC, "update_s_per_param": UPD, "params": 1}}
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


def test_a_malformed_update_is_ignored_not_trusted():
    doc = _doc()
    doc["meta"] = {"update": {"accumulate_s_per_param": -1.0, "update_s_per_param": "x"}}
    bad = one_node(2, dev=dataclasses.replace(device(), layer_profiles=(doc,)))
    a = estimate(parse_inline("dp=2,mbs=1"), SMALL, bad, 512, 8).breakdown["ranks"][0]["optimizer_s"]
    b = estimate(parse_inline("dp=2,mbs=1"), SMALL, _cluster(2, False), 512, 8).breakdown["ranks"][0]["optimizer_s"]
    assert a == b


def test_measured_update_is_the_runtimes_optimizer_per_parameter():
    tiny = load_model("tiny")
    bf16, fp32 = measure_update(tiny, "bf16"), measure_update(tiny, "fp32")
    assert bf16["params"] == fp32["params"] > 0 and bf16["clock"] == "thread"
    assert bf16["update_s_per_param"] > 0 and fp32["update_s_per_param"] > 0
    # fp32 parameters are their own masters: autograd's gradient is the accumulator
    assert bf16["accumulate_s_per_param"] > 0 and fp32["accumulate_s_per_param"] == 0.0
