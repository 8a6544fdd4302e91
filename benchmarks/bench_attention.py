"""Sharded attention (CP ring x Ulysses HP) on 4 local gloo processes: time and causal balance.

For causal attention over S = 2048 tokens (B 1, 8 query heads, 2 kv heads, d 64, fp32), prints per
layout the visible query-key pairs per rank (the causal work, counted from the positions; max/mean
is the imbalance the layout leaves), the measured forward+backward time of ``sharded_attention`` per
rank (median of 3 after a warm-up; the slowest rank sets the step), the ring's block kernels of
every rank replayed one rank at a time on rank 0 alone (the balance without 4 processes sharing
this machine's 2 cores) and the single-process SDPA reference on the whole sequence (rank 0 alone,
the others waiting). The uneven contiguous shares balance the causal area: boundary i at
S * sqrt((i+1)/cp).

    python benchmarks/bench_attention.py
"""

from __future__ import annotations

import math
import statistics
import time

S, B, HEADS, KV, D = 2048, 1, 8, 2, 64
REPS = 3


def balanced_contiguous(cp: int) -> list[int]:
    bounds = [0] + [round(S * math.sqrt((i + 1) / cp)) for i in range(cp)]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


CONFIGS = [
    ("cp4 contiguous even", 4, 1, "contiguous", [S // 4] * 4),
    ("cp4 contiguous balanced", 4, 1, "contiguous", balanced_contiguous(4)),
    ("cp4 zigzag even", 4, 1, "zigzag", [S // 4] * 4),
    ("cp2 x hp2 zigzag even", 2, 2, "zigzag", [S // 2] * 2),
    ("hp4", 1, 4, "contiguous", [S]),
]


def replay_kernels(tokens: list[int], layout: str, hp: int, me: int) -> float:
    """Seconds of the ring's forward+backward block kernels of CP rank ``me`` (no communication)."""
    import torch

    from autotune.runtime import ring_attention as R
    from autotune.runtime.attention import shard_segments

    segs = shard_segments(tokens, layout if len(tokens) > 1 else "contiguous")
    heads = HEADS // hp
    qs = R._split(torch.randn(B, heads, tokens[me], D), segs[me])
    t0 = time.perf_counter()
    for j in range(len(tokens)):
        ke, ve = R._kv_segments(torch.randn(2, B, heads, tokens[j], D), torch.arange(heads), segs[j])
        for a, c, kind in R._pairs(segs[me], segs[j]):
            o, lse = R.block_forward(qs[a], ke[c], ve[c], 1 / math.sqrt(D), kind)
            R.block_backward(qs[a], qs[a], ke[c], ve[c], o, lse, lse, 1 / math.sqrt(D), kind)
    return time.perf_counter() - t0


def work(payload, rank, world, device):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from autotune.runtime.attention import (
        AttentionContext,
        local_token_positions,
        shard_segments,
        sharded_attention,
    )

    out = {}
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HEADS, S, D, generator=g)
    k = torch.randn(B, KV, S, D, generator=g)
    v = torch.randn(B, KV, S, D, generator=g)
    dist.barrier()
    if rank == 0:  # the reference alone on the machine
        times = []
        for _ in range(REPS + 1):
            qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
            t0 = time.perf_counter()
            o = F.scaled_dot_product_attention(qr, kr.repeat_interleave(HEADS // KV, 1),
                                               vr.repeat_interleave(HEADS // KV, 1), is_causal=True)
            o.sum().backward()
            times.append(time.perf_counter() - t0)
        out["reference_s"] = statistics.median(times[1:])
        for name, cp, hp, layout, tokens in CONFIGS:
            out[f"kernels {name}"] = [min(replay_kernels(tokens, layout, hp, i) for _ in range(2)) for i in range(cp)]
    dist.barrier()
    for name, cp, hp, layout, tokens in CONFIGS:
        dp = world // (cp * hp)
        groups = {}
        for dim, size in (("cp", cp), ("hp", hp)):
            groups[dim] = (None, [rank])
            if size == 1:
                continue
            for di in range(dp):
                for other in range(hp if dim == "cp" else cp):
                    ranks = ([(di * cp + i) * hp + other for i in range(cp)] if dim == "cp"
                             else [(di * cp + other) * hp + i for i in range(hp)])
                    grp = dist.new_group(ranks)
                    if rank in ranks:
                        groups[dim] = (grp, ranks)
        cp_i, hp_i = (rank // hp) % cp, rank % hp
        ctx = AttentionContext(cp_group=groups["cp"][0], cp_ranks=groups["cp"][1], cp_index=cp_i, cp_tokens=tokens,
                               cp_layout=layout, hp_group=groups["hp"][0], hp_ranks=groups["hp"][1], hp_index=hp_i,
                               hp_heads=[HEADS // hp] * hp)
        pos = local_token_positions(ctx)
        # causal work of this rank after Ulysses: its whole shard's queries x all earlier keys, its heads
        shard = torch.cat([torch.arange(s, s + n) for s, n in shard_segments(tokens, ctx.layout)[cp_i]])
        pairs = int((shard + 1).sum()) * (HEADS // hp)
        times = []
        for _ in range(REPS + 1):
            ql, kl, vl = (t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
            dist.barrier()
            t0 = time.perf_counter()
            sharded_attention(ql, kl, vl, ctx).sum().backward()
            times.append(time.perf_counter() - t0)
        out[name] = {"time_s": statistics.median(times[1:]), "pairs": pairs}
    return out


def main() -> None:
    from autotune.runtime.launcher import launch

    res = launch("bench_attention:work", {}, 4, timeout_s=600, device="cpu", threads=1)
    if res.failure is not None:
        raise SystemExit(f"benchmark failed: {res.failure} {res.extra.get('traceback', '')}")
    r = res.results
    print(f"causal attention S={S} B={B} heads={HEADS} kv_heads={KV} d={D} fp32, 4 gloo processes, 1 thread each")
    print(f"single-process SDPA fwd+bwd (whole sequence): {r[0]['reference_s'] * 1e3:8.1f} ms")
    print(f"{'layout':26s} {'tokens':22s} {'pairs max/mean':>14s} {'fwd+bwd per rank (ms)':>30s} {'slowest':>8s}"
          f" {'kernels alone per cp rank (ms)':>31s}")
    for name, _cp, _hp, _layout, tokens in CONFIGS:
        pairs = [x[name]["pairs"] for x in r]
        times = [x[name]["time_s"] * 1e3 for x in r]
        alone = " ".join(f"{t * 1e3:6.0f}" for t in r[0][f"kernels {name}"])
        print(f"{name:26s} {str(tokens):22s} {max(pairs) / statistics.mean(pairs):14.2f} "
              f"{' '.join(f'{t:7.1f}' for t in times):>30s} {max(times):8.1f} {alone:>31s}")
    print(f"(launch wall {res.wall_s:.1f} s)")


if __name__ == "__main__":
    main()
