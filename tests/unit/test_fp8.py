"""FP8 training dtypes (``plan_parts.FP8_RECIPES``): priced as they run, refused where they cannot
run, exported in each framework's own terms.

Pricing is checked against the bf16 price of the same step: FP8 changes only the linear layers'
GEMMs (at the FP8 peak, 1-byte inputs, plus the recipe's quantisation passes), so on a device whose
FP8 peak and ceiling equal its bf16 ones and with no quantisation traffic the step must cost what
bf16 costs; on the catalogue's H100 each compute-bound GEMM must take its bf16 time scaled by the
ratio of the two datasheet rates, plus its quantisation stream."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
import tomllib

from autotune.cost import compute, datasheet
from autotune.cost.estimate import estimate
from autotune.export import ExportRefused, export
from autotune.export.common import ExportContext
from autotune.plan import FP8_RECIPES, Degrees, Plan, PlanError, choose_dtype
from autotune.plan_parts import gemm_peak
from autotune.specs.catalogue import CATALOGUE
from autotune.specs.cluster import ClusterSpec, Link, NodeGroup, load_cluster
from autotune.specs.model import PRESETS

H100 = CATALOGUE["H100-SXM"]


def _cluster(dev, nodes=2, name="fp8-test") -> ClusterSpec:
    g = NodeGroup(count=nodes, devices_per_node=8, device=dev, intra_node=Link(bandwidth=dev.intra_node_bandwidth,
                                                                              latency=3e-6))
    return ClusterSpec(name=name, groups=(g,), inter_node=Link(bandwidth=50e9, latency=5e-6, kind="inter"))


def _step(dev, dtype, plan=None, model="llama3-8b"):
    p = (plan or Plan(degrees=Degrees(dp=4, tp=2, pp=2), micro_batch_size=1)).replace(dtype=dtype)
    est = estimate(p, PRESETS[model], _cluster(dev), 4096, 64)
    return est


def test_fp8_at_bf16_rates_without_quantisation_costs_what_bf16_costs(monkeypatch):
    """A device whose FP8 rate and ceiling are its bf16 ones, with the quantisation passes priced at
    zero: every FP8 GEMM here is compute-bound, so the step time equals bf16's."""
    same = dataclasses.replace(H100, name="H100-fp8-as-bf16", peak_flops={**H100.peak_flops, "fp8": H100.flops("bf16")},
                               gemm_ceiling={**H100.gemm_ceiling, "fp8": H100.gemm_fraction("bf16")[0]})
    monkeypatch.setattr(datasheet, "QUANT_BYTES", {k: 0.0 for k in datasheet.QUANT_BYTES})
    compute._RATES.clear()
    bf16 = _step(same, "bf16").predicted["step_time_s"]
    for dt in ("fp8", "fp8-current", "fp8-blockwise"):
        assert _step(same, dt).predicted["step_time_s"] == pytest.approx(bf16, rel=1e-3)
    compute._RATES.clear()


@pytest.mark.parametrize("dtype", list(FP8_RECIPES))
def test_a_compute_bound_fp8_gemm_scales_by_the_datasheet_rates(dtype):
    """Each large linear GEMM: bf16 time x (bf16 peak x ceiling) / (FP8 peak x ceiling), plus the
    recipe's quantisation bytes over the activation input at the streaming rate."""
    dev = CATALOGUE["B200"] if dtype == "fp8-mx" else H100
    hp = datasheet.size_model(dev, "bf16", 2)
    f8 = datasheet.size_model(dev, dtype, 2)
    key = gemm_peak(dtype)
    m, n, k = 8192.0, 8192.0, 8192.0
    scale = (dev.flops("bf16") * dev.gemm_fraction("bf16")[0]) / (dev.flops(key) * dev.gemm_fraction(key)[0])
    quant = datasheet.QUANT_BYTES[FP8_RECIPES[dtype]] * m * k / (dev.memory_bandwidth * datasheet.MEM_EFF)
    assert f8.gemm_time(m, n, k) == pytest.approx(hp.gemm_time(m, n, k) * scale + quant, rel=1e-9)
    # attention and the LM head stay in bf16
    assert f8.hp == hp
    assert f8.attention(64, 4096, 128, 4096 * 4097 / 2) == hp.attention(64, 4096, 128, 4096 * 4097 / 2)


def test_fp8_is_faster_than_bf16_and_current_scaling_costs_more_than_delayed():
    bf16, fp8, cur = (_step(H100, dt).predicted["step_time_s"] for dt in ("bf16", "fp8", "fp8-current"))
    assert fp8 < bf16
    assert fp8 < cur < bf16


def test_mfu_under_fp8_is_of_the_bf16_peak():
    """MFU divides the model's FLOPs by the bf16 peak whatever the recipe (documented in docs/cost-model.md):
    so the two MFUs stand in the ratio of the step times."""
    a, b = _step(H100, "bf16").predicted, _step(H100, "fp8").predicted
    assert b["mfu"] / a["mfu"] == pytest.approx(a["step_time_s"] / b["step_time_s"], rel=1e-9)


def test_fp8_keeps_weights_twice_and_nothing_else_changes_in_memory():
    """Transformer Engine's dual-precision weights: the weights term doubles (bf16 + FP8 copy and its
    transpose), gradients and optimizer states stay as under bf16."""
    plan = Plan(degrees=Degrees(dp=4, tp=2, pp=2), micro_batch_size=1, zero_stage=1)
    ra, rb = (_step(H100, dt, plan).breakdown["ranks"][0]["memory"] for dt in ("bf16", "fp8"))
    assert rb["weights"] == pytest.approx(2 * ra["weights"])
    for term in ("gradients", "optimizer"):
        assert rb[term] == pytest.approx(ra[term])


def test_megatron_keeps_fp8_weights_under_the_distributed_optimizer_and_exports_the_flag():
    """Megatron's ``--fp8-param-gather`` ("keep the compute param in fp8, do not use any other
    intermediate dtype": megatron-core's DistributedDataParallelConfig) replaces the bf16 weight and its
    FP8 cache by the FP8 weight and its column-wise copy, one byte each: under ``--target megatron`` with
    the distributed optimizer an FP8 plan's weights take what its bf16 weights take (2 bytes a
    parameter), the gradients and the optimizer's fp32 master and moments unchanged; without the
    distributed optimizer (which the flag needs) the dual-precision count stays. The exported script
    names the flag exactly where it is priced, each a field of megatron-core's own configs."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from megatron.core.distributed import DistributedDataParallelConfig

    from autotune.export import megatron as M

    plan = Plan(degrees=Degrees(dp=4, tp=2, pp=2), micro_batch_size=1, zero_stage=1)
    mem = {(dt, z): estimate(plan.replace(dtype=dt, zero_stage=z), PRESETS["llama3-8b"], _cluster(H100), 4096, 64,
                             kernels=M.KERNELS).breakdown["ranks"][0]["memory"]
           for dt in ("bf16", "fp8-current") for z in (0, 1)}
    assert mem["fp8-current", 1]["weights"] == pytest.approx(mem["bf16", 1]["weights"])
    assert mem["fp8-current", 0]["weights"] == pytest.approx(2 * mem["bf16", 0]["weights"])
    for term in ("gradients", "optimizer"):
        assert mem["fp8-current", 1][term] == pytest.approx(mem["bf16", 1][term])
    fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    for dtype, dev in (("fp8-current", H100), ("fp8-mx", CATALOGUE["B200"])):
        ctx = _ctx(dev)
        for z in (0, 1):
            args = export(_resolved(ctx, dtype, zero_stage=z), ctx, "megatron").data["args"]
            flags = {a[2:].replace("-", "_") for a in args if a.startswith("--") and ("fp8" in a or "reuse" in a)}
            want = {"fp8_param_gather"} | ({"reuse_grad_buf_for_mxfp8_param_ag"} if dtype == "fp8-mx" else set())
            assert (want <= flags) == (z == 1) and want <= fields
            assert ("--use-distributed-optimizer" in args) == (z == 1)


def test_auto_never_picks_fp8_and_devices_without_it_refuse_in_one_line():
    h100 = _cluster(H100)
    assert choose_dtype("auto", h100) == "bf16"
    with pytest.raises(PlanError) as e:
        choose_dtype("fp8", _cluster(CATALOGUE["A100-80GB"]))
    assert "\n" not in str(e.value) and "A100-80GB" in str(e.value) and "--dtype bf16" in str(e.value)
    with pytest.raises(PlanError) as e:  # MXFP8 needs Blackwell: the nearest recipe Hopper runs is named
        choose_dtype("fp8-mx", h100)
    assert "--dtype fp8" in str(e.value)
    with pytest.raises(PlanError):
        choose_dtype("fp8", load_cluster("local:2"))  # the CPU has no FP8


def test_autotunes_runtime_refuses_fp8():
    from autotune.runtime.trial import check_runtime_support

    with pytest.raises(PlanError) as e:
        check_runtime_support(Plan(dtype="fp8-current", micro_batch_size=1), PRESETS["tiny"])
    assert "fp8-current" in str(e.value) and "\n" not in str(e.value)


# ---- exports ----------------------------------------------------------------------------------------
def _ctx(dev=H100):
    return ExportContext(model=PRESETS["llama3-8b"], cluster=_cluster(dev), seq_len=4096, global_batch=64)


def _resolved(ctx, dtype, **kw):
    base = dict(degrees=Degrees(dp=8, tp=2), micro_batch_size=1, zero_stage=1, sequence_parallel=True)
    return Plan(**{**base, **kw}, dtype=dtype).resolve(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)


@pytest.mark.parametrize("dtype", list(FP8_RECIPES))
def test_megatron_fp8_flags_read_back_by_megatron_core(dtype):
    mcore = pytest.importorskip("megatron.core", reason="megatron-core not installed")
    import torch
    from megatron.core.enums import Fp8Recipe
    from megatron.core.transformer import TransformerConfig

    ctx = _ctx(CATALOGUE["B200"] if dtype == "fp8-mx" else H100)
    args = export(_resolved(ctx, dtype), ctx, "megatron").data["args"]
    one = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    assert "--bf16" in args
    # megatron/training/arguments.py: --fp8-format choices ['e4m3', 'hybrid']; the recipe is Fp8Recipe
    assert one["--fp8-format"] in ("e4m3", "hybrid")
    recipe = Fp8Recipe(one["--fp8-recipe"])
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, bf16=True,
                            params_dtype=torch.bfloat16, fp8=one["--fp8-format"], fp8_recipe=recipe)
    assert cfg.fp8_recipe == recipe and mcore is not None


def test_torchtitan_writes_float8_and_mx_and_refuses_delayed_and_blockwise():
    ctx = _ctx()
    cfg = tomllib.loads(export(_resolved(ctx, "fp8-current", zero_stage=3), ctx, "torchtitan").text)
    assert cfg["model"]["converters"] == ["quantize.linear.float8"]
    f8 = cfg["quantize"]["linear"]["float8"]
    assert f8["recipe_name"] == "tensorwise" and "output" in f8["filter_fqns"]
    assert cfg["training"]["mixed_precision_param"] == "bfloat16"
    bctx = _ctx(CATALOGUE["B200"])
    mx = tomllib.loads(export(_resolved(bctx, "fp8-mx", zero_stage=3), bctx, "torchtitan").text)
    assert mx["model"]["converters"] == ["quantize.linear.mx"]
    assert mx["quantize"]["linear"]["mx"]["recipe_name"] == "mxfp8_cublas"
    for dt in ("fp8", "fp8-blockwise"):
        with pytest.raises(ExportRefused) as e:
            export(_resolved(ctx, dt, zero_stage=3), ctx, "torchtitan")
        assert e.value.nearest is not None and e.value.nearest.plan.dtype == "fp8-current"


@pytest.mark.parametrize("dtype", ["fp8", "fp8-current", "fp8-mx"])
def test_accelerate_fp8_handler_is_one_accelerate_defines(dtype):
    utils = pytest.importorskip("accelerate.utils", reason="accelerate not installed")
    ctx = _ctx(CATALOGUE["B200"] if dtype == "fp8-mx" else H100)
    out = json.loads(export(_resolved(ctx, dtype, degrees=Degrees(dp=16), zero_stage=3, sequence_parallel=False),
                            ctx, "accelerate").text)
    assert out["accelerator"]["mixed_precision"] == "fp8"
    handler = getattr(utils, out["fp8_recipe"]["handler"])
    fields = {f.name for f in dataclasses.fields(handler)}
    assert set(out["fp8_recipe"]["kwargs"]) <= fields
    fmt = out["fp8_recipe"]["kwargs"].get("fp8_format")
    if fmt is not None:
        assert fmt in typing.get_args(utils.dataclasses.FP8Format)


def test_deepspeed_refuses_fp8_with_bf16_nearest():
    ctx = _ctx()
    with pytest.raises(ExportRefused) as e:
        export(_resolved(ctx, "fp8", degrees=Degrees(dp=16), sequence_parallel=False), ctx, "deepspeed")
    assert e.value.nearest is not None and e.value.nearest.plan.dtype == "bf16"
