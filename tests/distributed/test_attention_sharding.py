"""Sharded attention (CP ring x Ulysses HP) against plain causal SDPA on the whole sequence.

One job of the session's 4 workers (helpers.pool) runs every configuration: (cp, hp) in (2,1), (4,1), (1,2), (1,4), (2,2)
(a degree product of 2 runs as two independent replicas), even and uneven token and head shares,
zigzag and contiguous, MHA and GQA, with the ring's fused CPU block kernel and with its matmul
kernel (the one other devices use); forward output and the gradients of q, k and v (fp32).
"""

from __future__ import annotations

import pytest
from helpers.pool import run_in_pool

pytestmark = pytest.mark.slow

B, HEADS, S, D = 2, 8, 48, 16
UNEVEN_TOKENS = {  # per (cp, granule): uneven shares summing to S, each a multiple of the granule
    (2, 1): [17, 31], (2, 2): [18, 30], (2, 4): [20, 28],
    (4, 1): [5, 17, 11, 15], (4, 2): [6, 16, 10, 16],
}
UNEVEN_HEADS = {2: [3, 5], 4: [1, 3, 3, 1]}
SHAPES = [(2, 1), (4, 1), (1, 2), (1, 4), (2, 2)]


def configurations():
    """Every (cp, hp, layout, tokens, heads, kv_heads) the suite checks."""
    out = []
    for cp, hp in SHAPES:
        for layout in (("zigzag", "contiguous") if cp > 1 else ("contiguous",)):
            g = (2 if layout == "zigzag" else 1) * hp
            token_sets = [[S // cp] * cp] + ([UNEVEN_TOKENS[(cp, g)]] if cp > 1 else [])
            head_sets = [[HEADS // hp] * hp] + ([UNEVEN_HEADS[hp]] if hp > 1 else [])
            for tokens in token_sets:
                for heads in head_sets:
                    for kv in (HEADS, 2):
                        for fused in (True, False) if cp > 1 else (True,):
                            out.append({"cp": cp, "hp": hp, "layout": layout, "tokens": tokens,
                                        "heads": heads, "kv": kv, "fused": fused, "dtype": "fp32"})
    # bf16 (the runtime's default dtype) on the mixed shapes, uneven, GQA, both kernels
    for cp, hp in ((2, 2), (4, 1)):
        for fused in (True, False):
            out.append({"cp": cp, "hp": hp, "layout": "zigzag", "tokens": UNEVEN_TOKENS[(cp, 2 * hp)],
                        "heads": UNEVEN_HEADS.get(hp, [HEADS]), "kv": 2, "fused": fused, "dtype": "bf16"})
    return out


TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2}


def _name(c):
    return (f"cp{c['cp']}xhp{c['hp']} {c['layout']} tokens={c['tokens']} heads={c['heads']} kv={c['kv']}"
            f" {'fused' if c['fused'] else 'matmul'} {c['dtype']}")


def check_all(payload, rank, world, device):
    """Worker: for every configuration, the sharded result vs the whole-sequence reference."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from autotune.runtime import ring_attention
    from autotune.runtime.attention import AttentionContext, local_token_positions, sharded_attention

    groups = {}
    for cp, hp in SHAPES:  # new_group is collective: every rank creates every group in one order
        dp = world // (cp * hp)
        coord = {}
        for r in range(world):
            coord[r] = (r // (cp * hp), (r // hp) % cp, r % hp)  # rank = (dp_i * cp + cp_i) * hp + hp_i
        mine = {}
        for dim in ("cp", "hp"):
            size = cp if dim == "cp" else hp
            if size == 1:
                mine[dim] = (None, [rank])
                continue
            for di in range(dp):
                for other in range(hp if dim == "cp" else cp):
                    if dim == "cp":
                        ranks = [(di * cp + i) * hp + other for i in range(cp)]
                    else:
                        ranks = [(di * cp + other) * hp + i for i in range(hp)]
                    grp = dist.new_group(ranks)
                    if rank in ranks:
                        mine[dim] = (grp, ranks)
        groups[(cp, hp)] = (coord[rank], mine)
    errors = {}
    for n, c in enumerate(payload["configs"]):
        (_, cp_i, hp_i), mine = groups[(c["cp"], c["hp"])]
        ctx = AttentionContext(cp_group=mine["cp"][0], cp_ranks=mine["cp"][1], cp_index=cp_i, cp_tokens=c["tokens"],
                               cp_layout=c["layout"], hp_group=mine["hp"][0], hp_ranks=mine["hp"][1],
                               hp_index=hp_i, hp_heads=c["heads"], heads=HEADS, kv_heads=c["kv"], seq_len=S)
        ring_attention.USE_FUSED = c["fused"]
        g = torch.Generator().manual_seed(1000 + n)
        dtype = torch.bfloat16 if c["dtype"] == "bf16" else torch.float32
        # inputs representable in the dtype; the reference runs on them in fp32
        q = torch.randn(B, HEADS, S, D, generator=g).to(dtype).float()
        k = torch.randn(B, c["kv"], S, D, generator=g).to(dtype).float()
        v = torch.randn(B, c["kv"], S, D, generator=g).to(dtype).float()
        w = torch.randn(B, HEADS, S, D, generator=g).to(dtype).float()  # loss = sum(out * w): dOut = w
        qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
        rep = HEADS // c["kv"]
        ref = F.scaled_dot_product_attention(qr, kr.repeat_interleave(rep, 1), vr.repeat_interleave(rep, 1),
                                             is_causal=True)
        (ref * w).sum().backward()
        pos = local_token_positions(ctx).to(device)
        ql, kl, vl = (t.to(device, dtype)[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
        out = sharded_attention(ql, kl, vl, ctx)
        assert out.dtype == dtype and ql.grad is None
        (out * w.to(device, dtype)[:, :, pos]).sum().backward()
        errors[_name(c)] = {
            "out": (out.detach().cpu().float() - ref.detach()[:, :, pos.cpu()]).abs().max().item(),
            "dq": (ql.grad.cpu().float() - qr.grad[:, :, pos.cpu()]).abs().max().item(),
            "dk": (kl.grad.cpu().float() - kr.grad[:, :, pos.cpu()]).abs().max().item(),
            "dv": (vl.grad.cpu().float() - vr.grad[:, :, pos.cpu()]).abs().max().item(),
            "positions": pos.cpu().tolist(),
        }
    return errors


def test_sharded_attention_matches_whole_sequence_sdpa():
    configs = configurations()
    res = run_in_pool("test_attention_sharding:check_all", {"configs": configs}, 4, timeout_s=240)
    assert res.failure is None, (res.failure, res.extra.get("traceback"))
    bad = []
    for c in configs:
        name = _name(c)
        held = sorted(p for r in res.results for p in r[name]["positions"])
        # every position held by exactly one rank per replica (dp = 4 / (cp * hp) replicas)
        assert held == sorted(list(range(S)) * (4 // (c["cp"] * c["hp"]))), name
        for rank, r in enumerate(res.results):
            for key in ("out", "dq", "dk", "dv"):
                if not r[name][key] < TOLERANCE[c["dtype"]]:
                    bad.append((name, rank, key, r[name][key]))
    assert not bad, bad
