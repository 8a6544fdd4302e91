"""fp16 MoE training: the dense and the expert gradient groups (``ExpertSplitOptimizer``) decide one
skip together. Two dynamic loss scales once let an overflow in the experts skip their step while the
dense half stepped (and halved only one scale), so fp16 MoE plans were refused; now an overflow in
either group skips both and both step on finite gradients, as one optimizer over all parameters."""

from __future__ import annotations

import contextlib

import pytest
import torch

from autotune.runtime.optimizer import ExpertSplitOptimizer, TrainOptimizer


def _pair(zero_stage: int = 0):
    torch.manual_seed(0)
    dense = torch.nn.Parameter(torch.randn(4, dtype=torch.float16))
    expert = torch.nn.Parameter(torch.randn(3, dtype=torch.float16))
    opt = ExpertSplitOptimizer(TrainOptimizer([dense], None, zero_stage, dtype="fp16"),
                               TrainOptimizer([expert], None, zero_stage, dtype="fp16"), [False, True])
    return dense, expert, opt


def _step(opt, dense, expert, expert_input: float) -> None:
    opt.begin_step()
    scale = opt.loss_scale.scale
    loss = (dense.float().sum() * 0.25 + (expert.float() * expert_input).sum()) * scale  # 0.25: fp16 holds scale/4
    loss.backward()
    opt.reduce_and_step(contextlib.nullcontext)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_an_overflow_in_the_experts_skips_the_dense_step_too(bad):
    dense, expert, opt = _pair()
    before = (dense.detach().clone(), expert.detach().clone(), opt.loss_scale.scale)
    _step(opt, dense, expert, bad)
    assert torch.equal(dense.detach(), before[0]) and torch.equal(expert.detach(), before[1])
    assert opt.loss_scale.scale == before[2] / 2 and opt.loss_scale.skipped == 1
    assert opt.expert.loss_scale is opt.dense.loss_scale  # one scale multiplies the loss and unscales both


def test_finite_gradients_step_both_groups_as_one_optimizer_does():
    dense, expert, opt = _pair()
    ref_d = torch.nn.Parameter(dense.detach().float().clone())
    ref_e = torch.nn.Parameter(expert.detach().float().clone())
    ref = torch.optim.AdamW([ref_d, ref_e], lr=opt.dense.opt.defaults["lr"],
                            weight_decay=opt.dense.opt.defaults["weight_decay"])
    for _ in range(2):
        _step(opt, dense, expert, 0.25)
        ref.zero_grad()
        (ref_d.sum() * 0.25 + (ref_e * 0.25).sum()).backward()
        ref.step()
    assert opt.loss_scale.skipped == 0
    torch.testing.assert_close(opt.dense.masters[0].detach(), ref_d.detach())
    torch.testing.assert_close(opt.expert.masters[0].detach(), ref_e.detach())
