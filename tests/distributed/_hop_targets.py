"""Launcher targets of tests/distributed/test_stages_hop.py (imported by the spawned workers): the bytes
a per-stage plan's ranks send between stages, and the hop timed as the runtime sends it against
1/tp slices gathered by the receivers (the scatter/gather the runtime does not run)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from autotune import stages as ST
from autotune.plan import Plan
from autotune.runtime.mesh import _new_group
from autotune.runtime.stages import _TAG_STRIDE
from autotune.runtime.worker import train
from autotune.specs.model import model_from_dict


def sent_bytes(payload: dict[str, Any], rank: int, world: int, device: torch.device) -> list[dict[str, int]]:
    """Per plan, the bytes this rank hands to ``isend`` in one training step, forward (activations)
    and backward (gradients) apart (the runtime's tag says which: ``StagedTrainer._tag``)."""
    spec = model_from_dict(payload["model"])
    out = []
    real = dist.isend
    for item in payload["plans"]:
        count = {"fwd": 0, "bwd": 0}

        def counted(tensor, dst, *args, count=count, **kw):
            tag = kw.get("tag", args[1] if len(args) > 1 else 0)
            count["bwd" if (tag // _TAG_STRIDE) % 2 else "fwd"] += tensor.numel() * tensor.element_size()
            return real(tensor, dst, *args, **kw)

        dist.isend = counted
        try:
            train(Plan.from_dict(item), spec, payload["seq_len"], payload["global_batch"], steps=1, warmup=0,
                  seed=1, device=device, timeout_s=120)
        finally:
            dist.isend = real
        out.append(count)
    return out


def _send_whole(x: torch.Tensor, a: int, b: int, rank: int, tag: int) -> None:
    """Sender side of the runtime's hop: the whole tensor to every receiver ``stages.hop_targets`` names
    (senders are ranks 0 .. a-1, receivers a .. a+b-1)."""
    works = [dist.isend(x, a + k, tag=tag) for k in ST.hop_targets(a, b, rank)]
    for w in works:
        w.wait()


def _send_slices(x: torch.Tensor, a: int, b: int, rank: int, tag: int) -> None:
    """Sender side of the scatter/gather: slice k of b (flattened) to receiver k."""
    pieces = x.reshape(-1).chunk(b)
    works = [dist.isend(pieces[k].contiguous(), a + k, tag=tag) for k in ST.hop_targets(a, b, rank)]
    for w in works:
        w.wait()


def _recv(strategy: str, x: torch.Tensor, a: int, k: int, b: int, group: Any, tag: int) -> torch.Tensor:
    """Receiver ``k``'s side: the whole tensor from ``stages.hop_source``, or its slice gathered with
    the other receivers' (``all_gather_single``, the runtime's gather)."""
    src = ST.hop_source(a, k)
    if strategy == "whole":
        buf = torch.empty_like(x)
        dist.recv(buf, src, tag=tag)
        return buf
    piece = torch.empty(x.numel() // b, dtype=x.dtype)
    dist.recv(piece, src, tag=tag)
    if b == 1:
        return piece
    full = torch.empty(x.numel(), dtype=x.dtype)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(full, piece, group=group)
    return full


def _one_hop(strategy: str, x: torch.Tensor, a: int, b: int, rank: int, group: Any, tag: int) -> float:
    """Seconds of one hop on the slowest rank (every rank of the world takes part in the MAX)."""
    dist.barrier()
    t0 = time.perf_counter()
    if rank < a:
        (_send_whole if strategy == "whole" else _send_slices)(x, a, b, rank, tag)
    elif rank < a + b:
        got = _recv(strategy, x, a, rank - a, b, group, tag)
        assert torch.equal(got.reshape(x.shape), x), "the hop delivered other values"
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def hop_times(payload: dict[str, Any], rank: int, world: int, device: torch.device) -> list[dict[str, Any]]:
    """Per (a, b) of ``payload["pairs"]``: the median seconds of one hop of ``payload["bytes"]`` fp32
    bytes from a stage at tp a to one at tp b, sent whole (the runtime) and as slices gathered by the
    receivers, the two strategies alternating round by round, and the median of the rounds' ratios."""
    out = []
    for a, b in payload["pairs"]:
        group = _new_group(list(range(a, a + b)), None) if b > 1 else None
        n = payload["bytes"] // 4 // (a * b) * (a * b)
        x = torch.arange(n, dtype=torch.float32)  # every rank holds the same tensor (the stage's copy)
        times: dict[str, list[float]] = {"whole": [], "slices": []}
        for r in range(payload["rounds"] + 1):
            order = ("whole", "slices") if r % 2 == 0 else ("slices", "whole")
            got = {s: _one_hop(s, x, a, b, rank, group, tag=2 * r + i) for i, s in enumerate(order)}
            if r:  # the first round warms the connections up
                for s, t in got.items():
                    times[s].append(t)
        out.append({"a": a, "b": b, "bytes": n * 4, "whole_s": statistics.median(times["whole"]),
                    "slices_s": statistics.median(times["slices"]),
                    "ratio": statistics.median(w / s for w, s in zip(times["whole"], times["slices"], strict=True))})
    return out
