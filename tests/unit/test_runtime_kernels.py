"""cost/kernels.RUNTIME counts the kernels autotune's runtime really issues: the ops its own block,
final norm, LM head and loss dispatch (TorchDispatchMode on CPU, views left out: they launch
nothing), forward, backward and under full recomputation, so the price and the runtime cannot drift."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.cost.kernels import RUNTIME
from autotune.runtime.model import Block, StageModel, rotary, unsharded_layout
from autotune.specs.model import ModelSpec

NO_KERNEL = {"_unsafe_view", "randint"}
"""Ops that launch no kernel though torch does not flag them as views (the test's own target draw too)."""

SPEC = ModelSpec(name="count", layers=1, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=100,
                 source="test: a small Llama-style block (RMSNorm, rotary, GQA, SwiGLU) as gpu_check's model")


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def kernels(self) -> int:
        return sum(self.ops.values())


def _block_counts(recompute: str) -> tuple[int, int]:
    layout = unsharded_layout()
    layout.recompute = recompute
    block = Block(SPEC, layout).to(torch.bfloat16)
    x = torch.randn(2, 16, SPEC.hidden, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = (t.to(torch.bfloat16) for t in rotary(torch.arange(16), SPEC.head_dim, torch.float32))
    with _Count() as fwd:
        y = block(x, cos, sin)
    grad = torch.ones_like(y)
    with _Count() as bwd:
        y.backward(grad)
    return fwd.kernels, bwd.kernels


def test_block_kernels_match_runtime_counts():
    fwd, bwd = _block_counts("none")
    assert (fwd, bwd) == (RUNTIME.block_fwd, RUNTIME.block_bwd)


def test_full_recomputation_reruns_the_forward():
    """The cost model prices full recomputation as the block's forward again in the backward
    (cost/rank.block_times): the checkpointed backward must dispatch about forward + backward."""
    fwd, bwd = _block_counts("full")
    assert fwd == RUNTIME.block_fwd
    assert bwd == pytest.approx(RUNTIME.block_fwd + RUNTIME.block_bwd, rel=0.05)


def test_head_kernels_match_runtime_counts():
    model = StageModel(SPEC, unsharded_layout(), [], first=False, last=True, seq_len=16).to(torch.bfloat16)
    x = torch.randn(2, 16, SPEC.hidden, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, SPEC.vocab, (2, 16))
    with _Count() as fwd:
        loss = model.token_losses(model(x), target).mean()
    with _Count() as bwd:
        loss.backward()
    assert (fwd.kernels, bwd.kernels) == (RUNTIME.head_fwd, RUNTIME.head_bwd)


def test_profiled_gpu_pays_the_runtime_host_time():
    """A GPU priced from a measured profile adds the runtime's host time per kernel, as the
    datasheet path does: the same block on a stub profile costs exactly kernels x host_s more."""
    from autotune.cost.compute import Rates, head_compute, layer_compute

    def rates(host):
        return Rates(name="stub", flat=1e15, memory_bandwidth=4e12, gemm_fit=(0.0, 5e14), source="measured", host=host)

    kw = dict(tokens=2048.0, tp=1, heads_local=16, keysum=2048 * 2049 / 2.0, block_seq=2048.0, micro_batch=1,
              act_bytes=1e6)
    bare, host = layer_compute(SPEC, rates(None), **kw), layer_compute(SPEC, rates(RUNTIME), **kw)
    assert host.fwd - bare.fwd == pytest.approx(RUNTIME.block_fwd * RUNTIME.host_s)
    assert host.bwd - bare.bwd == pytest.approx(RUNTIME.block_bwd * RUNTIME.host_s)
    (bf, bb), (hf, hb) = head_compute(SPEC, rates(None), tokens=2048.0, tp=1), head_compute(SPEC, rates(RUNTIME),
                                                                                           tokens=2048.0, tp=1)
    assert (hf - bf, hb - bb) == pytest.approx((RUNTIME.head_fwd * RUNTIME.host_s, RUNTIME.head_bwd * RUNTIME.host_s))


def test_profile_rates_carry_the_runtime():
    from autotune.cost.compute import rates_for

    spec = dataclasses.replace(_gpu_spec(), profile={"gemm": {"bf16": {"peak_flops_per_s": 7e14, "overhead_s": 5e-6}}})
    assert rates_for(spec, "bf16", 64).host is RUNTIME


def _gpu_spec():
    from autotune.specs.catalogue import device_from_catalogue

    return device_from_catalogue("H200")


def test_profile_measured_host_time_prices_the_runtime():
    """A profile that timed eager host time per kernel (``overheads.kernel_host_s``) prices the
    runtime's kernels at that figure, not the catalogue's EAGER_HOST_S; another target keeps its own."""
    from autotune.cost.compute import rates_for
    from autotune.cost.kernels import EAGER

    spec = dataclasses.replace(_gpu_spec(), profile={"gemm": {"bf16": {"peak_flops_per_s": 7e14, "overhead_s": 5e-6}},
                                                     "overheads": {"kernel_host_s": 7e-6}})
    host = rates_for(spec, "bf16", 64).host
    assert host.host_s == 7e-6 and host.block_fwd == RUNTIME.block_fwd and "measured by profile" in host.source
    assert rates_for(spec, "bf16", 64, EAGER).host is EAGER
    # the CLI asks the runtime target's kernels by name (targets.kernel_costs): the same measured figure
    from autotune.targets import kernel_costs

    assert rates_for(spec, "bf16", 64, kernel_costs("runtime")).host.host_s == 7e-6


def test_launch_samples_fit_the_median_host_time_per_kernel():
    from profilers.overheads import LAUNCH_OPS, fit_overheads, launch_fns

    samples = [{"kind": "launch", "params": {"op": op, "ops": LAUNCH_OPS}, "work": float(LAUNCH_OPS),
                "timing": {"median_s": us * 1e-6 * LAUNCH_OPS}} for op, us in (("add_", 10.7), ("small_matmul", 20.3),
                                                                                ("layer_norm", 18.4))]
    assert fit_overheads(samples, {})["kernel_host_s"] == pytest.approx(18.4e-6)
    assert "kernel_host_s" not in fit_overheads([], {}) and launch_fns("cpu") == []
