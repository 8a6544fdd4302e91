"""Synthetic training data from a fixed seed, sliced by the plan's shares.

Every rank draws the same global batch ``[global_batch, seq_len + 1]`` of token ids (so any layout
trains on the same numbers as the single-process reference), then keeps its part: the samples of
its DP replica (``shares.samples``, replicas in index order) and the tokens at its global positions
(CP shard and Ulysses slice, from ``local_token_positions``). Targets are the next tokens.
"""

from __future__ import annotations

import torch

from autotune.plan import Plan


def synthetic_tokens(seed: int, vocab: int, global_batch: int, seq_len: int, step: int = 0) -> torch.Tensor:
    """Token ids ``[global_batch, seq_len + 1]`` for training step ``step`` (a fresh batch per step)."""
    g = torch.Generator().manual_seed(seed * 7919 + step)
    return torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)


def replica_range(plan: Plan, dp_index: int) -> tuple[int, int]:
    """``[start, end)`` of the global batch that DP replica ``dp_index`` trains on."""
    samples = plan.shares.samples
    assert samples is not None, "resolve the plan first"
    start = sum(samples[:dp_index])
    return start, start + samples[dp_index]


def local_batch(tokens: torch.Tensor, plan: Plan, dp_index: int,
                positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each ``[samples of the replica, S_local]``: this rank's slice of a step."""
    start, end = replica_range(plan, dp_index)
    inputs, targets = tokens[start:end, :-1], tokens[start:end, 1:]
    if positions is not None:
        inputs, targets = inputs[:, positions], targets[:, positions]
    return inputs.contiguous(), targets.contiguous()


def split_microbatches(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``n`` equal micro-batches along the batch dimension (as the pipeline schedules split)."""
    return list(x.tensor_split(n, dim=0))
