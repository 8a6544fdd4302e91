"""FP8 quantisation kernels of a MoE layer's grouped GEMMs, per recipe, as Transformer Engine's
``GroupedLinear`` issues them (``export/megatron.TE_FP8_QUANTIZE``): current scaling quantises each
expert's input on its own in three kernels (amax, scale, cast), MXFP8 and the blockwise recipe in one,
delayed scaling every expert's input of a GEMM in one fused cast-transpose; the host term of an
estimate grows by exactly those kernels."""

from __future__ import annotations

import pytest

from autotune.cost import kernels as K
from autotune.cost.estimate import estimate
from autotune.export import megatron as M
from autotune.plan import parse_inline
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model


def test_kernels_per_recipe_scale_with_the_local_experts_where_each_is_cast_alone():
    k = M.KERNELS
    for experts in (1, 4, 16):
        cast_alone = {r: K.fp8_quantize_kernels(k, experts, r) for r in ("current", "mxfp8", "blockwise")}
        assert cast_alone["current"] == 3 * cast_alone["mxfp8"] == 3 * cast_alone["blockwise"] == 3 * 2 * experts
        assert K.fp8_quantize_kernels(k, experts, "delayed") == 2  # one fused kernel per GEMM, any expert count
        assert K.fp8_quantize_kernels(k, experts, None) == 0
    f, b = K.moe_layer_host(k, 16, "current")
    f0, b0 = K.moe_layer_host(k, 16, None)
    assert f - f0 == pytest.approx(96 * k.host_s) and b - b0 == pytest.approx(96 * k.host_s)


def test_the_estimate_prices_current_scaling_above_delayed_by_its_casts():
    cluster = cluster_from_dict({"name": "dgx-h100-16", "inter_node": {"bandwidth": "50GB/s", "latency": "5us"},
                                 "nodes": [{"count": 2, "devices_per_node": 8, "device": "H100-SXM"}]})
    model = load_model("qwen3-30b-a3b")
    est = {d: estimate(parse_inline(f"dp=16,ep=8,mbs=1,zero=1,dtype={d}"), model, cluster, 4096, 64, kernels=M.KERNELS)
           for d in ("fp8", "fp8-current")}
    local, passes = model.moe.experts // 8, model.moe_layer_count * (64 // 16)
    extra = 2 * (K.fp8_quantize_kernels(M.KERNELS, local, "current") - K.fp8_quantize_kernels(M.KERNELS, local, "delayed"))
    got = est["fp8-current"].breakdown["moe"]["moe_host_s"] - est["fp8"].breakdown["moe"]["moe_host_s"]
    assert got == pytest.approx(extra * M.KERNELS.host_s * passes, rel=1e-6)
