"""Mixed precision pieces of the runtime, in one process: the fp16 loss scale against GradScaler's
rules, the optimizer's fp32 masters and fp32 gradient accumulation against a hand computation, and
the per-rank peak memory over its baseline."""

import pytest
import torch

from autotune.runtime import precision as P
from autotune.runtime.mesh import Axis
from autotune.runtime.optimizer import LR, WEIGHT_DECAY, TrainOptimizer
from autotune.runtime.worker import peak_memory, reset_peak_memory


def test_loss_scale_is_one_and_static_outside_fp16():
    for dt in ("bf16", "fp32"):
        s = P.LossScale(dt)
        g = [torch.tensor([float("inf")])]
        assert s.scale == 1.0 and s.unscale_and_check(g) and g[0].isinf().all()  # nothing checked or changed


def test_fp16_loss_scale_unscales_skips_on_overflow_and_grows(monkeypatch):
    s = P.LossScale("fp16")
    assert s.scale == P.INIT_SCALE
    g = [torch.full((3,), 2.0 * s.scale), torch.full((2,), -s.scale)]
    assert s.unscale_and_check(g)
    assert torch.equal(g[0], torch.full((3,), 2.0)) and torch.equal(g[1], torch.full((2,), -1.0))
    before = s.scale
    assert not s.unscale_and_check([torch.tensor([1.0, float("nan")])])
    assert s.scale == before * P.BACKOFF_FACTOR and s.skipped == 1
    monkeypatch.setattr(P, "GROWTH_INTERVAL", 3)
    for _ in range(3):
        assert s.unscale_and_check([torch.ones(1)])
    assert s.scale == before * P.BACKOFF_FACTOR * P.GROWTH_FACTOR


def _one_process_axis():
    return Axis(size=1, index=0, ranks=[0], group=None)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_copies_step_from_fp32_masters_with_fp32_accumulated_gradients(dtype, monkeypatch):
    monkeypatch.setattr(P, "INIT_SCALE", 2.0**4)  # this toy's fp16 gradients overflow at 2^16 (see below)
    torch.manual_seed(0)
    w32 = torch.randn(8, 4) * 0.1
    xs = [torch.randn(5, 4) for _ in range(3)]
    # reference: fp32 master, gradients of the low-precision forward accumulated in fp32, AdamW in fp32
    low = P.TORCH_DTYPES[dtype]
    master = torch.nn.Parameter(w32.clone())
    acc = torch.zeros_like(w32)
    for x in xs:
        wl = w32.to(low).requires_grad_(True)
        (x.to(low) @ wl.t()).float().pow(2).sum().backward()
        acc += wl.grad.float()
    master.grad = acc
    torch.optim.AdamW([master], lr=LR, weight_decay=WEIGHT_DECAY).step()
    # the optimizer under test
    p = torch.nn.Parameter(w32.to(low))
    opt = TrainOptimizer([p], _one_process_axis(), 0, dtype=dtype, masters=[w32])
    assert opt.low_precision and opt.masters[0].dtype == torch.float32
    opt.begin_step()
    scale = opt.loss_scale.scale
    for x in xs:
        ((x.to(low) @ p.t()).float().pow(2).sum() * scale).backward()
        assert p.grad is None  # moved into the fp32 accumulator at once
    opt.reduce_and_step(_NullRegion)
    torch.testing.assert_close(opt.master_weights()[0], master.detach(), rtol=0, atol=1e-7)
    assert p.dtype == low and torch.equal(p.detach(), master.detach().to(low))


class _NullRegion:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_an_fp16_overflow_skips_the_step_and_halves_the_scale():
    p = torch.nn.Parameter(torch.full((4,), 0.5).half())
    opt = TrainOptimizer([p], _one_process_axis(), 0, dtype="fp16")
    opt.begin_step()
    (p.float().sum() * 1e6 * opt.loss_scale.scale).backward()  # d/dp = 6.6e10 > fp16 max: inf
    before = opt.master_weights()[0].clone()
    opt.reduce_and_step(_NullRegion)
    assert torch.equal(opt.master_weights()[0], before) and opt.loss_scale.skipped == 1
    assert opt.loss_scale.scale == P.INIT_SCALE * P.BACKOFF_FACTOR


def test_fp32_parameters_are_their_own_masters():
    p = torch.nn.Parameter(torch.ones(3))
    opt = TrainOptimizer([p], _one_process_axis(), 0, dtype="fp32")
    assert not opt.low_precision and opt.masters[0] is p


def test_peak_memory_is_measured_over_the_baseline():
    cpu = torch.device("cpu")
    baseline = reset_peak_memory(cpu)
    assert baseline > 0
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    x += 1
    peak = peak_memory(cpu) - baseline
    assert 60 * 2**20 <= peak < 1024 * 2**20, peak
    del x
