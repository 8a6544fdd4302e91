"""GPU-only checks (skipped without CUDA): the fused ring block, CUDA-event timing, the profiler's
CUDA path and one real trial. Their CPU-testable parts are in tests/unit (test_ring_cuda_kernels,
test_runtime_timing, test_gpu_check)."""

from __future__ import annotations

import pytest
import torch

import autotune.runtime.ring_attention as R
from autotune.runtime.attention import gqa_index
from autotune.runtime.worker import CommClock, CudaStopwatch

pytestmark = pytest.mark.gpu


def _ring(q, k, v, segs):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = R.ring_attention(q, k, v, gqa_index(q.shape[1], k.shape[1], 0, q.shape[1], 0, q.device), segs, 0,
                           None, [0])
    w = torch.ones_like(out)
    grads = torch.autograd.grad((out.float() * w.float()).sum(), (q, k, v))
    return out, grads


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "flash"), (torch.float32, "efficient")])
def test_fused_ring_block_matches_the_matmul_path(dtype, kernel, monkeypatch):
    if kernel == "flash" and torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("flash attention needs sm80+")
    segs = [[(0, 96), (160, 64), (300, 128)]]
    n = sum(x for _, x in segs[0])
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, n, 64, device="cuda", generator=g).to(dtype)
    k = torch.randn(2, 2, n, 64, device="cuda", generator=g).to(dtype)
    v = torch.randn(2, 2, n, 64, device="cuda", generator=g).to(dtype)
    assert R.cuda_kernel(q, None) == kernel
    out, grads = _ring(q, k, v, segs)
    monkeypatch.setattr(R, "USE_FUSED", False)
    ref, refg = _ring(q, k, v, segs)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    for a, b in zip(grads, refg, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=tol * 4, rtol=tol * 4)


def test_cuda_event_timing_measures_gpu_work_without_synchronising(monkeypatch):
    clk = CommClock()
    clk.stopwatch = CudaStopwatch()
    calls = []
    real_sync = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(1) or real_sync(*a, **k))
    torch.cuda._sleep(1000)  # warm the kernel
    real_sync()
    calls.clear()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    with clk.compute_region():
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time, returns at once on the host
        clk.wrap(torch.cuda._sleep)(20_000_000)  # "communication" inside the region
    end.record()
    assert not calls, "no synchronisation inside the step"
    real_sync()
    clk.settle()
    total = start.elapsed_time(end) / 1e3
    assert clk.comm > 0 and clk.compute > 0
    assert clk.compute + clk.comm == pytest.approx(total, rel=0.05)
    assert clk.compute == pytest.approx(clk.comm * 2.5, rel=0.2)


def test_the_profilers_cuda_path():
    from profilers.launch import check_request, launch_local

    result = launch_local(check_request("cuda", 1), 1, quick=True, timeout_s=300.0)
    assert result["device"] == "cuda"
    import json
    import tempfile

    from profilers.store import device_spec_from_profile, save_profile

    with tempfile.TemporaryDirectory() as d:
        url = f"sqlite:///{d}/p.db"
        pid = save_profile(result, url, label="gpu-test", nproc=1)
        spec = device_spec_from_profile(pid, url)
    assert spec.kind == "cuda" and spec.profile["gemm"], json.dumps(spec.profile)[:500]
    dt = "bf16" if "bf16" in spec.peak_flops else "fp32"
    assert spec.peak_flops[dt] > 1e12  # any CUDA GPU does a TFLOP/s in large GEMMs
    # eager host time per tiny kernel (profilers/overheads.py launch_fns): microseconds, not zero
    assert 1e-7 < spec.profile["overheads"]["kernel_host_s"] < 1e-3, spec.profile["overheads"]


def test_a_trial_on_cuda_reports_time_split_and_memory():
    from autotune.runtime.trial import run_trial
    from autotune.specs import load_model

    res = run_trial({"degrees": {}, "dtype": "bf16" if torch.cuda.is_bf16_supported() else "fp32"},
                    load_model("tiny"), 128, 4, steps=2, warmup=1, device="cuda", timeout_s=300)
    assert res.failure is None, res.failure
    m = res.measured
    assert m["device"] == "cuda" and m["peak_memory_bytes"][0] > 0
    split = m["time_split"][0]
    assert split["compute_s"] > 0 and 0.3 < split["coverage"] < 1.5


def test_an_moe_trial_on_cuda_gives_the_losses_of_one_cpu_process():
    """tiny-moe in fp32 (TF32 off: ``fp32-strict``) on the visible GPUs, with expert parallelism over two of
    them where there are two (NCCL's all-to-all with split sizes), against the single-process CPU run."""
    from autotune.runtime.trial import run_trial
    from autotune.runtime.worker import reference_run
    from autotune.specs import load_model

    spec = load_model("tiny-moe")
    degrees = {"dp": 2, "ep": 2} if torch.cuda.device_count() >= 2 else {}
    res = run_trial({"degrees": degrees, "dtype": "fp32-strict"}, spec, 64, 4, steps=2, warmup=1, device="cuda",
                    timeout_s=300)
    assert res.failure is None, res.failure
    ref = reference_run(spec, 64, 4, steps=3, seed=0, dtype="fp32-strict")
    assert res.losses == pytest.approx(ref["losses"], rel=1e-4)
    assert res.grad_norms == pytest.approx(ref["grad_norms"], rel=1e-4)  # experts counted once over edp
