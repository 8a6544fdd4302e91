"""Ring attention over the CP group (Liu et al. 2023, "Ring Attention with Blockwise Transformers"),
with uneven shards and causal masking by global positions.

Every CP rank holds its shard's queries; the K/V blocks of all shards pass once around the ring
(``batch_isend_irecv`` to the next rank, from the previous one), the next block's transfer overlapping
the current block's compute. Each block's partial result is merged with the online softmax
(Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022): with running ``(o, lse)`` and a block's
``(o_b, lse_b)``::

    lse' = log(exp(lse) + exp(lse_b)),   o' = o * exp(lse - lse') + o_b * exp(lse_b - lse')

The backward is our own autograd Function (FlashAttention-2's backward, Dao 2023, eqs. in Alg. 2):
with ``P = exp(S - lse)`` from the final lse and ``Delta = rowsum(dO * O)``::

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - Delta),   dQ = scale dS K,   dK = scale dS^T Q

K/V go around the ring again; each block's dK/dV accumulator travels with it (one step behind, so
its send overlaps the next block's compute) and arrives back at its owner after a full turn.

Masking uses segments ``(start, length)`` of global positions (``attention.shard_segments``):
a key segment entirely before a query segment is fully visible, one entirely after is skipped,
and a rank's own segment against itself gets the causal mask ``q_pos >= k_pos``. Sizes are known on
every rank from the segments, so no size exchange is needed. Blocks run in a fused attention
kernel that returns the log-sum-exp and takes the final one back in its backward (the FlashAttention
interface): torch's flash kernel for CPU, on CUDA its flash kernel (fp16/bf16, sm80+) or its
memory-efficient kernel (fp32, older GPUs); the plain matmuls below are the reference and the
fallback (a partially masked block, an unsupported head dim). The merge and the accumulators are fp32
whatever the input dtype.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from autotune.runtime.documents import CAUSAL, Docs, block_pairs  # CAUSAL: a segment against itself

Segments = list[list[tuple[int, int]]]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_index: torch.Tensor, segs: Segments,
                   me: int, group, ranks: tuple[int, ...] | list[int], docs: Docs | None = None) -> torch.Tensor:
    """q ``[B, Hq, T_me, D]`` (this shard, position order of ``segs[me]``), k/v ``[B, Hk, T_me, D]``;
    ``kv_index[a]`` is the local kv head of query head a; ``docs``: each row's document lengths
    (``documents.Docs``) when attention stops at document boundaries. Returns ``[B, Hq, T_me, D]``."""
    return _RingAttention.apply(q, k, v, kv_index, segs, me, group, tuple(ranks), docs)


def _sub_blocks(qsegs, ksegs, docs: Docs | None):
    """(query segment, key segment, row slice, query range, key range, kind) of every block to run:
    whole blocks without documents, their per-document pieces with them (``documents.block_pairs``)."""
    for a, c, kind in _pairs(qsegs, ksegs):
        if docs is None:
            yield a, c, slice(None), slice(None), slice(None), kind
            continue
        for b, (q0, q1), (k0, k1), sub in block_pairs(qsegs[a], ksegs[c], kind, docs):
            yield a, c, slice(b, b + 1), slice(q0, q1), slice(k0, k1), sub


# ---- blocks -------------------------------------------------------------------------------------

# torch's fused attention kernels return the log-sum-exp and take it back in their backward (the
# FlashAttention interface), which is all a ring block needs: on this machine's CPUs 2-6x faster than
# the matmuls below; on CUDA the kernel that the cost model's attention figures were measured with.
_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_CPU_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward", None)
_EFFICIENT = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)
_EFFICIENT_BWD = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention_backward", None)
USE_FUSED = True
"""Use the fused kernels where they apply (tests switch it off to check the matmul path)."""


def _pairs(qsegs: list[tuple[int, int]], ksegs: list[tuple[int, int]]):
    """(query segment index, key segment index, kind) for every visible pair; kind is None (all keys
    visible), ``CAUSAL`` (the same segment) or a boolean mask ``q_pos >= k_pos``."""
    for a, (qs, ql) in enumerate(qsegs):
        for c, (ks, kl) in enumerate(ksegs):
            if ql and kl and ks < qs + ql:  # some key at or before some query
                if ks + kl <= qs + 1:  # the last key is at or before the first query: all visible
                    yield a, c, None
                elif ks == qs and kl == ql:
                    yield a, c, CAUSAL
                else:  # a partial overlap (no layout of ours makes one; kept general)
                    qp = torch.arange(qs, qs + ql)
                    kp = torch.arange(ks, ks + kl)
                    yield a, c, (qp[:, None] >= kp[None, :])


def _split(x: torch.Tensor, segs: list[tuple[int, int]], dim: int = 2) -> list[torch.Tensor]:
    """x cut along the token dim into one contiguous tensor per segment (the kernels want them dense)."""
    return [p.contiguous() for p in torch.split(x, [n for _, n in segs], dim=dim)]


def _kv_segments(kv: torch.Tensor, kv_index: torch.Tensor, segs: list[tuple[int, int]]):
    """Per key segment: k and v expanded to the query heads (GQA: ``index_select`` copies densely)."""
    ks = torch.split(kv[0], [n for _, n in segs], dim=2)
    vs = torch.split(kv[1], [n for _, n in segs], dim=2)
    return [k.index_select(1, kv_index) for k in ks], [v.index_select(1, kv_index) for v in vs]


def _fused(q: torch.Tensor, kind) -> bool:
    return USE_FUSED and _FUSED_CPU is not None and q.device.type == "cpu" and (kind is None or kind is CAUSAL)


def cuda_kernel(q: torch.Tensor, kind) -> str | None:
    """The fused CUDA kernel a block runs in: ``flash`` (fp16/bf16 on sm80+, head dim a multiple of
    8 up to 256), ``efficient`` (any of fp32/fp16/bf16, head dim a multiple of 8 up to 128), or None
    (not on CUDA, a partially masked block, another head dim: the matmul path)."""
    if not USE_FUSED or q.device.type != "cuda" or not (kind is None or kind is CAUSAL):
        return None
    d = q.shape[-1]
    if (_FLASH is not None and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256
            and torch.cuda.get_device_capability(q.device)[0] >= 8):
        return "flash"
    if _EFFICIENT is not None and d % 8 == 0 and d <= 128:
        return "efficient"
    return None


def _cuda_forward(name: str, q, k, v, scale: float, causal: bool):
    """(out, lse [B, H, T] fp32, aux for the backward) of one block in CUDA kernel ``name``."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if name == "flash":
        o, lse, cq, ck, mq, mk, seed, offset, _ = _FLASH(q, k, v, 0.0, causal, False, scale=scale)
        return o, lse, ("flash", cq, ck, mq, mk, seed, offset, lse.shape[-1])
    o, lse, seed, offset = _EFFICIENT(q, k, v, None, True, 0.0, causal, scale=scale)
    return o, lse, ("efficient", seed, offset, lse.shape[-1])  # lse may be padded (to 32 rows)


def _cuda_backward(aux, do, q, k, v, out, lse, scale: float, causal: bool):
    """dq, dk, dv of one block with the rows' *final* out and lse, in the kernel ``aux`` came from."""
    t = lse.shape[-1]
    if aux[-1] > t:  # the kernel's lse layout is padded: give it back in that layout
        lse = torch.nn.functional.pad(lse, (0, aux[-1] - t))
    c = [x.contiguous() for x in (do, q, k, v, out)]
    if aux[0] == "flash":
        _, cq, ck, mq, mk, seed, offset, _ = aux
        return _FLASH_BWD(*c, lse.contiguous(), cq, ck, mq, mk, 0.0, causal, seed, offset, scale=scale)
    _, seed, offset, _ = aux
    dq, dk, dv, _ = _EFFICIENT_BWD(c[0], c[1], c[2], c[3], None, c[4], lse.contiguous(), seed, offset, 0.0,
                                   [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, kind, row0: int = 0) -> torch.Tensor:
    """Scaled scores of query rows ``row0 ..`` of a block, masked by the block's kind."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if kind is CAUSAL:  # the same segment: row i (of the block) sees keys 0..i
        rows = torch.arange(row0, row0 + s.shape[-2], device=s.device)
        kind = rows[:, None] >= torch.arange(s.shape[-1], device=s.device)[None, :]
    elif kind is not None:
        kind = kind[row0:row0 + s.shape[-2]].to(s.device)
    if kind is not None:
        s = s.masked_fill(~kind, float("-inf"))
    return s


SCORE_ELEMENTS = 1 << 26
"""The matmul path materialises at most this many fp32 scores at once (256 MiB): it walks the
query rows in chunks, so a long shard on a device without the fused kernel does not run out of memory."""


def _row_chunks(q: torch.Tensor, keys: int):
    rows = q.shape[-2]
    step = max(1, SCORE_ELEMENTS // max(1, q.shape[0] * q.shape[1] * keys))
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _safe(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a row that sees no key) replaced by 0 so exp(s - lse) is 0, not nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def block_forward(q, k, v, scale: float, kind) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output (fp32) and log-sum-exp of the scaled scores (fp32)."""
    o, lse, _ = block_forward_aux(q, k, v, scale, kind)
    return o, lse


def block_forward_aux(q, k, v, scale: float, kind):
    """``block_forward`` plus what the block's kernel needs back in its backward (None but on CUDA)."""
    name = cuda_kernel(q, kind)
    if name is not None:
        o, lse, aux = _cuda_forward(name, q, k, v, scale, kind is CAUSAL)
        return o.float(), lse[..., :q.shape[-2]].float(), aux
    if _fused(q, kind):
        o, lse = _FUSED_CPU(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, kind is CAUSAL, scale=scale)
        return o.float(), lse.float(), None
    kf, vf = k.float(), v.float()
    outs, lses = [], []
    for r0, r1 in _row_chunks(q, k.shape[-2]):
        s = _scores(q[:, :, r0:r1].float(), kf, scale, kind, r0)
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.matmul(torch.exp(s - _safe(lse)[..., None]), vf))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2), None


def block_backward(do, q, k, v, out, lse, delta, scale: float, kind, aux=None):
    """dq, dk, dv (fp32) of one block given the *final* out and lse of the rows (FlashAttention-2);
    ``aux``: what ``block_forward_aux`` returned for the block (its CUDA kernel's state)."""
    if aux is not None:
        dq, dk, dv = _cuda_backward(aux, do, q, k, v, out, lse.float(), scale, kind is CAUSAL)
        return dq.float(), dk.float(), dv.float()
    if _fused(q, kind):
        lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)  # the kernel's lse dtype
        c = [t.contiguous() for t in (do, q, k, v, out, lse)]
        dq, dk, dv = _FUSED_CPU_BWD(*c, 0.0, kind is CAUSAL, scale=scale)
        return dq.float(), dk.float(), dv.float()
    kf, vf = k.float(), v.float()
    dqs, dk, dv = [], torch.zeros_like(kf), torch.zeros_like(vf)
    for r0, r1 in _row_chunks(q, k.shape[-2]):
        qf, dof = q[:, :, r0:r1].float(), do[:, :, r0:r1].float()
        p = torch.exp(_scores(qf, kf, scale, kind, r0) - _safe(lse[:, :, r0:r1])[..., None])
        dv += torch.matmul(p.transpose(-1, -2), dof)
        ds = p * (torch.matmul(dof, vf.transpose(-1, -2)) - delta[:, :, r0:r1, None])
        dqs.append(torch.matmul(ds, kf) * scale)
        dk += torch.matmul(ds.transpose(-1, -2), qf) * scale
    return torch.cat(dqs, dim=2), dk, dv


def _merge(o: torch.Tensor, lse: torch.Tensor, ob: torch.Tensor, lseb: torch.Tensor) -> None:
    """In place: the online-softmax merge of the module docstring (rows that saw nothing stay 0/-inf)."""
    new = torch.logaddexp(lse, lseb)
    safe = _safe(new)
    wa = torch.exp(lse - safe)
    wb = torch.exp(lseb - safe)
    o.mul_(wa[..., None]).add_(ob * wb[..., None])
    lse.copy_(new)


# ---- ring communication -------------------------------------------------------------------------
def _exchange(send: torch.Tensor, recv: torch.Tensor, me: int, group, ranks) -> list:
    """Post: ``send`` to the next rank, ``recv`` from the previous one; returns the requests."""
    n = len(ranks)
    ops = [dist.P2POp(dist.isend, send, ranks[(me + 1) % n], group),
           dist.P2POp(dist.irecv, recv, ranks[(me - 1) % n], group)]
    return dist.batch_isend_irecv(ops)


def _wait(reqs: list) -> None:
    """Wait for the ring's requests; inside a runtime worker the wait counts as communication
    (its ``CommClock`` times ``dist``'s calls, and a request's ``wait`` is not one of them)."""
    worker = sys.modules.get("autotune.runtime.worker")  # loaded by the runtime, never imported here
    if worker is not None and hasattr(worker, "clock"):
        worker.clock().timed_call(_wait_all, reqs)
    else:
        _wait_all(reqs)


def _wait_all(reqs: list) -> None:
    for r in reqs:
        r.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kv_index, segs, me, group, ranks, docs):
        n = len(ranks)
        b, hq, _, d = q.shape
        hk = k.shape[1]
        scale = 1.0 / math.sqrt(d)
        qs = _split(q, segs[me])
        o = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in qs]
        lse = [torch.full(x.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device) for x in qs]
        kv = torch.stack([k, v]).contiguous()
        aux = {}  # (step, query segment, key segment) -> the block kernel's state for its backward
        for step in range(n):
            j = (me - step) % n  # owner of the block held now
            if step < n - 1:  # overlap: the next block travels while this one is computed
                nxt = kv.new_empty((2, b, hk, sum(x for _, x in segs[(me - step - 1) % n]), d))
                reqs = _exchange(kv, nxt, me, group, ranks)
            ke, ve = _kv_segments(kv, kv_index, segs[j])
            for i, (a, c, rb, rq, rk, kind) in enumerate(_sub_blocks(segs[me], segs[j], docs)):
                ob, lb, aux[step, i] = block_forward_aux(qs[a][rb, :, rq], ke[c][rb, :, rk], ve[c][rb, :, rk],
                                                         scale, kind)
                _merge(o[a][rb, :, rq], lse[a][rb, :, rq], ob, lb)
            if step < n - 1:
                _wait(reqs)
                kv = nxt
        out = torch.cat(o, dim=2).to(q.dtype)
        ctx.save_for_backward(q, k, v, kv_index, out, torch.cat(lse, dim=2))
        ctx.segs, ctx.me, ctx.group, ctx.ranks, ctx.scale, ctx.aux = segs, me, group, ranks, scale, aux
        ctx.docs = docs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, kv_index, out, lse = ctx.saved_tensors
        segs, me, group, ranks, scale = ctx.segs, ctx.me, ctx.group, ctx.ranks, ctx.scale
        n = len(ranks)
        b, hq, _, d = q.shape
        hk = k.shape[1]
        delta = (dout.float() * out.float()).sum(-1)  # Delta = rowsum(dO * O), for the matmul path
        mine = segs[me]
        qs, dos, outs = _split(q, mine), _split(dout.to(q.dtype), mine), _split(out, mine)
        lses, deltas = _split(lse, mine), _split(delta, mine)
        dq = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in qs]
        kv = torch.stack([k, v]).contiguous()
        acc_reqs, acc_in, acc_sent = None, None, None
        for step in range(n):
            j = (me - step) % n
            if step < n - 1:
                nxt = kv.new_empty((2, b, hk, sum(x for _, x in segs[(me - step - 1) % n]), d))
                reqs = _exchange(kv, nxt, me, group, ranks)
            ke, ve = _kv_segments(kv, kv_index, segs[j])
            dke = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in ke]
            dve = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in ve]
            for i, (a, c, rb, rq, rk, kind) in enumerate(_sub_blocks(mine, segs[j], ctx.docs)):
                dqb, dkb, dvb = block_backward(dos[a][rb, :, rq], qs[a][rb, :, rq], ke[c][rb, :, rk], ve[c][rb, :, rk],
                                               outs[a][rb, :, rq], lses[a][rb, :, rq], deltas[a][rb, :, rq], scale,
                                               kind, ctx.aux.get((step, i)))
                dq[a][rb, :, rq] += dqb
                dke[c][rb, :, rk] += dkb
                dve[c][rb, :, rk] += dvb
            # query heads -> their kv heads (GQA: a kv head sums the gradients of its group)
            dkv = torch.zeros(2, b, hk, kv.shape[3], d, dtype=torch.float32, device=q.device)
            dkv[0].index_add_(1, kv_index, torch.cat(dke, dim=2))
            dkv[1].index_add_(1, kv_index, torch.cat(dve, dim=2))
            if acc_reqs is not None:  # the accumulator of block j from the previous rank
                _wait(acc_reqs)
                dkv += acc_in
            if n == 1:  # one shard: nothing travels (single-process use and tests)
                acc_in, acc_reqs = dkv, []
                break
            # pass block j's accumulator on; after the last step we receive our own block's
            acc_in = torch.empty(2, b, hk, sum(x for _, x in segs[(me - step - 1) % n]), d,
                                 dtype=torch.float32, device=q.device)
            acc_reqs = _exchange(dkv, acc_in, me, group, ranks)
            acc_sent = dkv  # the send buffer lives until its request is waited (next step or the end)
            if step < n - 1:
                _wait(reqs)
                kv = nxt
        _wait(acc_reqs)
        del acc_sent
        dq = torch.cat(dq, dim=2).to(q.dtype)
        return dq, acc_in[0].to(k.dtype), acc_in[1].to(v.dtype), None, None, None, None, None, None
