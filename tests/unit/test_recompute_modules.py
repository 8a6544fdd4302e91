"""Per-module selective recomputation (``recompute_modules``, Megatron-Core's ``--recompute-modules``):
the plan field as plans read and write it, and its price: every module keeps less and costs backward
time, the named modules compose, ``moe`` keeps what full recomputation keeps of the routed experts,
and the FP8 routed activations are kept at one byte where the GEMMs read FP8."""

import pytest
from test_moe_cost import h100

from autotune.cost import estimate
from autotune.cost import moe_memory as MM
from autotune.errors import InputError
from autotune.plan import Plan, check_schema, parse_inline, plan_schema
from autotune.plan_parts import RECOMPUTE_MODULES
from autotune.specs.model import load_model

BASE = "dp=64,tp=2,pp=8,ep=64,sp=1,mbs=1"
"""DeepSeek-V3 on 1024 H100: MLA, shared experts and dense layers, so every module has work."""


def priced(extra: str, dtype: str = "bf16"):
    est = estimate(parse_inline(f"{BASE},{extra},dtype={dtype}" if extra else f"{BASE},dtype={dtype}"),
                   load_model("deepseek-v3"), h100(1024), 4096, 4096)
    return est.predicted["step_time_s"], est.predicted["memory_bytes"][0], est


def test_inline_json_round_trip_and_dense_plans_unchanged():
    p = parse_inline("dp=8,recompute=selective,recompute_modules=moe_act/layernorm")
    assert p.recompute_modules == ("moe_act", "layernorm")
    assert Plan.from_dict(p.to_dict()) == p
    assert "recompute_modules" not in parse_inline("dp=8,recompute=selective").to_dict()
    check_schema(p.to_dict())  # the plan file's JSON schema takes it, with the registry's names
    assert plan_schema()["properties"]["recompute_modules"]["items"]["enum"] == list(RECOMPUTE_MODULES)


@pytest.mark.parametrize("text,field", [("dp=8,recompute_modules=moe_act", "recompute_modules"),
                                        ("dp=8,recompute=full,recompute_modules=mlp", "recompute_modules"),
                                        ("dp=8,recompute=selective,recompute_modules=moe_ac", "recompute_modules")])
def test_bad_modules_are_one_line_errors_naming_the_field(text, field):
    with pytest.raises(InputError) as e:
        parse_inline(text)
    assert e.value.field == field and "\n" not in str(e.value)


@pytest.mark.parametrize("module", [m for m in RECOMPUTE_MODULES if m != "core_attn"])
def test_each_module_keeps_less_and_costs_backward_time(module):
    """Against the same plan recomputing nothing: less memory, a longer step (the module's forward
    again in the backward). core_attn is left out: a fused attention keeps no scores to drop."""
    t0, m0, _ = priced("")
    t1, m1, _ = priced(f"recompute=selective,recompute_modules={module}")
    assert m1 < m0 and t1 > t0


def test_modules_compose():
    """Two modules save what each saves, added (the terms are disjoint)."""
    _, m0, _ = priced("")
    _, ma, _ = priced("recompute=selective,recompute_modules=moe_act")
    _, mb, _ = priced("recompute=selective,recompute_modules=layernorm")
    _, mab, _ = priced("recompute=selective,recompute_modules=moe_act/layernorm")
    # the allocator's reserve is a fraction of what is allocated: compare the savings to a part in 1e6
    assert (m0 - mab) == pytest.approx((m0 - ma) + (m0 - mb), rel=1e-6)


def test_moe_module_keeps_what_full_recomputation_keeps_of_the_routed_experts():
    model = load_model("deepseek-v3")
    kw = dict(received=8192.0, tokens=1024.0, etp=1, bpe=2)
    full = MM.routed_activation_bytes(model, recompute="full", **kw)
    moe = MM.routed_activation_bytes(model, recompute="selective", modules=("moe",), **kw)
    none = MM.routed_activation_bytes(model, recompute="none", **kw)
    assert moe == full < none


def test_fp8_keeps_the_routed_gemm_inputs_at_one_byte():
    """Under FP8 the two grouped GEMMs' inputs (hidden and width per copy) are kept at one byte
    instead of two; the activation's input (the first GEMM's output) stays 16-bit."""
    model = load_model("qwen3-30b-a3b")
    kw = dict(received=8192.0, tokens=1024.0, etp=1, bpe=2, recompute="none")
    bf16 = MM.routed_activation_bytes(model, dtype="bf16", **kw)
    fp8 = MM.routed_activation_bytes(model, dtype="fp8-mx", **kw)
    assert bf16 - fp8 == pytest.approx(kw["received"] * (model.hidden + model.moe.expert_ffn_hidden))
