"""Launcher targets that train plans with one gradient reduction scaled wrongly on purpose (imported
by the spawned workers; tests/distributed/test_grad_norm_teeth.py). Each patches the optimizer for
the job only and restores it: the session's workers run other jobs after it (helpers.pool)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from autotune.runtime import optimizer as O
from autotune.runtime.worker import plans_job


@contextlib.contextmanager
def _patched(cls, name: str, make):
    orig = getattr(cls, name)
    setattr(cls, name, make(orig))
    try:
        yield
    finally:
        setattr(cls, name, orig)


def _dp_average(orig):
    """The dense reduction averages over the gradient group instead of summing (each loss is already
    divided by the global token count, so the sum is right): every gradient is 1/size of its value."""
    def reduce(self) -> list[torch.Tensor]:
        grads = orig(self)
        if self.axis is not None:
            for g in grads:
                g.div_(self.axis.size)
        return grads
    return reduce


def _expert_dp_twice(orig):
    """The expert gradients are summed over expert-DP twice: edp times their value."""
    def reduce_and_step(self, step_region) -> None:
        once = self.expert.reduce

        def twice() -> list[torch.Tensor]:
            grads = once()
            if self.expert.axis is not None:
                for g in grads:
                    dist.all_reduce(g, group=self.expert.axis.group)
            return grads
        self.expert.reduce = twice
        try:
            orig(self, step_region)
        finally:
            del self.expert.reduce
    return reduce_and_step


def dp_average_job(payload, rank, world, device):
    with _patched(O.TrainOptimizer, "reduce", _dp_average):
        return plans_job(payload, rank, world, device)


def expert_dp_twice_job(payload, rank, world, device):
    with _patched(O.ExpertSplitOptimizer, "reduce_and_step", _expert_dp_twice):
        return plans_job(payload, rank, world, device)
