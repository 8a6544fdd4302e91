"""HelixPipe's runtime, written by hand on ``torch.distributed.batch_isend_irecv`` (no library has it).

Placement and order come from ``autotune.schedules.helixpipe`` (``rank_order``, ``chain_rank``): this
module only executes them. Each pipeline rank builds the parameter blocks it holds out of the
runtime's own model pieces (the spec's norm, ``MLP``, the column/row-parallel linears, the
vocabulary-parallel embedding, the learned position table and loss of ``autotune/runtime/model.py``)
under the single-process model's parameter names, so ``init_weights`` draws identical numbers and
final weights compare name by name.

Hops (``--transfer-weight``, as the HelixPipe fork): a block sends its residual, its LN1 output and
its layer's QKV weights (this tp rank's shard; with linear biases each row carries its bias as one
more column) to the attention's rank; the attention runs the QKV projection there, rotary (under
rope) and causal attention, and sends the residual and the attention output to the next block. Backward carries the gradients of the same tensors back (the QKV weight gradient
returns to the block that owns the weights and flows into its parameters through ``torch.cat``).

Recomputation (``recompute="full"`` under helixpipe, the fork's ``--checkpoint-without-attn``): every
parameter block is checkpointed (only its inputs are kept, it runs again in backward); the attention
keeps its inputs (LN1 output, weights), its output and the log-sum-exp, and its backward recomputes
only the QKV projection and rotary: the attention forward never runs twice (``KeptAttention``).

Messages between two ranks are received in the order the sender sends them (FIFO per pair, so it
holds on NCCL, which ignores tags, as on gloo): when a rank needs a message it first posts the
receives of every earlier message from that sender (the order is known on every rank: it is a pure
function). Sends are never waited for until the step ends, so no rank blocks another.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from autotune.plan import Plan
from autotune.runtime import data as D
from autotune.runtime import grad_norm as GN
from autotune.runtime.documents import doc_attention_backward, doc_attention_with_lse
from autotune.runtime.mesh import Mesh
from autotune.runtime.model import (
    MLP,
    Layout,
    PositionEmbedding,
    apply_rotary,
    attention_core,
    build_on_meta,
    hidden_positions,
    init_weights,
    make_norm,
    positions_in_documents,
    rotary,
    shard_info,
    tp_replicated,
)
from autotune.runtime.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    enter_parallel,
    vocab_parallel_cross_entropy,
)
from autotune.schedules import helixpipe as H
from autotune.specs.model import ModelSpec


class _Part(nn.Module):
    """The pieces of one layer a rank holds (names as in ``model.Block``)."""


class HelixRankModel(nn.Module):
    """Parameter blocks ``blocks`` of the helix (block j = PostAttn(j-1) + PreAttn(j); block 0 adds
    the embedding, block L the final norm and LM head), named as the single-process model."""

    def __init__(self, spec: ModelSpec, layout: Layout, blocks: tuple[int, ...], seq_len: int):
        super().__init__()
        self.spec, self.layout, self.blocks = spec, layout, blocks
        L, h, d = spec.layers, spec.hidden, spec.head_dim
        tp, sp = layout.tp, layout.sp
        self.heads, self.kv_heads, self.head_dim = spec.heads // tp.size, spec.kv_heads // tp.size, d
        self.layers = nn.ModuleDict()

        def part(i: int) -> _Part:
            if str(i) not in self.layers:
                self.layers[str(i)] = _Part()
                self.layers[str(i)].attn = _Part()
            return self.layers[str(i)]

        self.rope, self.bias = spec.position == "rope", spec.bias
        for j in blocks:
            if j == 0:
                self.embed = VocabParallelEmbedding(spec.vocab, h, tp, sp)
                if not self.rope:
                    self.pos_embed = PositionEmbedding(spec.max_positions, h)
            if j >= 1:  # PostAttn(j - 1)
                q = part(j - 1)
                q.attn.wo = RowParallelLinear(spec.heads * d, h, tp, sp, bias=spec.bias)
                q.mlp_norm = make_norm(spec)
                q.mlp = MLP(spec, layout)
            if j < L:  # PreAttn(j): its norm and the QKV weights it ships to the attention
                q = part(j)
                q.attn_norm = make_norm(spec)
                q.attn.wq = ColumnParallelLinear(h, spec.heads * d, tp, sp, gather_input=False, bias=spec.bias)
                q.attn.wk = ColumnParallelLinear(h, spec.kv_heads * d, tp, sp, gather_input=False, bias=spec.bias)
                q.attn.wv = ColumnParallelLinear(h, spec.kv_heads * d, tp, sp, gather_input=False, bias=spec.bias)
            if j == L:
                self.norm = make_norm(spec)
                if not spec.tied_embeddings:
                    self.head = ColumnParallelLinear(h, spec.vocab, tp, sp)
                self.vocab_start = tp.index * (spec.vocab // tp.size)
        self.seq_len = seq_len
        self.register_buffer("cos", torch.empty(seq_len, d if self.rope else 0), persistent=False)
        self.register_buffer("sin", torch.empty(seq_len, d if self.rope else 0), persistent=False)
        self.register_buffer("pos_ids", torch.zeros(0, dtype=torch.long), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Rotary tables at global positions 0..S-1, or the position ids of this rank's hidden
        states for the learned table (after a meta build, on the model's device)."""
        device = self.cos.device
        if device.type == "meta":
            return
        if self.rope:
            cos, sin = rotary(torch.arange(self.seq_len, device=device), self.head_dim, torch.float32)
            self.cos, self.sin = cos, sin
        elif 0 in self.blocks:
            self.pos_ids = hidden_positions(self.layout, self.seq_len, device)

    # ---- the two kinds of operation -------------------------------------------------------------
    def block(self, j: int, x: torch.Tensor | None, o: torch.Tensor | None, tokens: torch.Tensor | None,
              target: torch.Tensor | None, total_tokens: int, docs: Any = None) -> tuple[torch.Tensor, ...]:
        """Block ``j``: (residual, LN1 output, QKV weights) for the attention, or (loss,) at j = L
        (``docs``: the micro-batch's documents, where a learned position table restarts)."""
        L, tp, sp = self.spec.layers, self.layout.tp, self.layout.sp
        if j == 0:
            x = self.embed(tokens)
            if not self.rope:  # after the embedding's reduction, on this rank's tokens
                pos = self.pos_ids if docs is None else positions_in_documents(self.pos_ids, docs)
                x = x + self.pos_embed(pos).to(x.dtype)
        else:
            q = self.layers[str(j - 1)]
            x = x + q.attn.wo(o)
            x = x + q.mlp(q.mlp_norm(x))
        if j < L:
            q = self.layers[str(j)]
            a = q.attn
            w = torch.cat([a.wq.weight, a.wk.weight, a.wv.weight], dim=0)
            if self.bias:  # each row's bias as one more column: one message, one gradient
                w = torch.cat([w, torch.cat([a.wq.bias, a.wk.bias, a.wv.bias])[:, None]], dim=1)
            return x, q.attn_norm(x), w
        x = self.norm(x)
        if self.spec.tied_embeddings:
            logits = F.linear(enter_parallel(x, tp, sp), self.embed.weight)
        else:
            logits = self.head(x)
        loss = vocab_parallel_cross_entropy(logits, target, self.vocab_start, tp).sum() / total_tokens
        return (loss,)

    def qkv(self, n: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The QKV projection with the shipped weights (and biases), then rotary under rope:
        q ``[B, Hq, S, D]``, k, v."""
        nf = enter_parallel(n, self.layout.tp, self.layout.sp)
        b, s, _ = nf.shape
        dq, dkv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        w, bias = (w[:, :-1], w[:, -1]) if self.bias else (w, None)
        wq, wk, wv = w.split([dq, dkv, dkv], dim=0)
        bq, bk, bv = bias.split([dq, dkv, dkv]) if bias is not None else (None, None, None)
        q = F.linear(nf, wq, bq).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = F.linear(nf, wk, bk).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = F.linear(nf, wv, bv).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if not self.rope:
            return q, k, v
        cos, sin = self.cos.to(q.dtype), self.sin.to(q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attention(self, n: torch.Tensor, w: torch.Tensor, keep: bool, docs: Any = None) -> torch.Tensor:
        """Attention output ``[B, S, Hq/tp * D]`` of one layer for one micro-batch (``docs``: its rows'
        document pieces, attention stopping at their boundaries)."""
        if keep:
            o = KeptAttention.apply(n, w, self, docs)
        else:
            q, k, v = self.qkv(n, w)
            o = attention_core(q, k, v, None, docs)
        b, _, s, _ = o.shape
        return o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)


def _repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return k, v


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention and its log-sum-exp per query (``[B, H, S]``): the CPU flash kernel, or the
    math form on other devices (device-agnostic; fused GPU kernels differ per backend)."""
    if q.device.type == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        return o, lse
    return math_attention_with_lse(q, k, v)


def math_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.float().masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    o = (torch.exp(scores - lse[..., None]).to(v.dtype)) @ v
    return o, lse


def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv from the kept output and log-sum-exp (no attention forward runs again)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.contiguous(), q, k, v, o, lse, 0.0, True)
    return math_attention_backward(do, q, k, v, o, lse)


def math_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                            lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = q.shape[-2]
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    scores = ((q @ k.transpose(-1, -2)) * scale).float().masked_fill(mask, float("-inf"))
    prob = torch.exp(scores - lse[..., None])
    dv = prob.to(do.dtype).transpose(-1, -2) @ do
    dp = (do @ v.transpose(-1, -2)).float()
    ds = prob * (dp - (do.float() * o.float()).sum(-1, keepdim=True))
    dq = (ds.to(q.dtype) @ k) * scale
    dk = (ds.to(q.dtype).transpose(-1, -2) @ q) * scale
    return dq, dk, dv


class KeptAttention(torch.autograd.Function):
    """Attention that keeps (LN1 output, QKV weights, output, log-sum-exp) and in backward
    recomputes only the QKV projection and rotary (the fork's ``--checkpoint-without-attn``)."""

    @staticmethod
    def forward(ctx, n: torch.Tensor, w: torch.Tensor, model: HelixRankModel, docs: Any = None) -> torch.Tensor:
        with torch.no_grad():
            q, k, v = model.qkv(n, w)
            kr, vr = _repeat_kv(q, k, v)
            if docs is None:
                o, lse = attention_with_lse(q, kr, vr)
            else:  # one causal kernel per document piece
                o, lse = doc_attention_with_lse(q, kr, vr, docs, attention_with_lse)
        ctx.model, ctx.docs = model, docs
        ctx.save_for_backward(n, w, o, lse)
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        n, w, o, lse = ctx.saved_tensors
        with torch.enable_grad():
            n_ = n.detach().requires_grad_(True)
            w_ = w.detach().requires_grad_(True)
            q, k, v = ctx.model.qkv(n_, w_)
            kr, vr = _repeat_kv(q, k, v)
        if ctx.docs is None:
            dq, dk, dv = attention_backward(do, q.detach(), kr.detach(), vr.detach(), o, lse)
        else:
            dq, dk, dv = doc_attention_backward(do, q.detach(), kr.detach(), vr.detach(), o, lse, ctx.docs,
                                                attention_backward)
        dn, dw = torch.autograd.grad((q, kr, vr), (n_, w_), (dq, dk, dv))
        return dn, dw, None, None


# ---- messages -----------------------------------------------------------------------------------
class Mailbox:
    """Point-to-point messages of one rank's helix over the pipeline group (see the module
    docstring): ``send`` posts a batch of isends, ``recv`` waits for one message, posting first the
    receives of every earlier message from the same sender (FIFO per pair)."""

    def __init__(self, plan: Plan, mesh: Mesh, spec: ModelSpec, m: int, shapes: dict[str, tuple[int, ...]],
                 dtype: torch.dtype, wait: Any):
        self.p, self.L, self.m, self.F = plan.degrees.pp, spec.layers, m, plan.helix_folds
        self.shares = plan.helix_attention
        self.me = mesh["pp"].index
        self.ranks, self.group = mesh["pp"].ranks, mesh["pp"].group
        self.device, self.dtype, self.shapes, self.wait = mesh.device, dtype, shapes, wait
        # per sender: the messages it sends to this rank, in its order
        self.incoming: dict[int, list[tuple[int, int, int]]] = {}
        for src in range(self.p):
            if src == self.me:
                continue
            seq = []
            for op in H.rank_order(self.p, self.L, m, self.F, src, self.shares):
                if H.peer(op, self.p, self.L, self.F, self.shares) == self.me:
                    seq.append(tuple(op))
            self.incoming[src] = seq
        self.posted: dict[int, int] = {}
        self.pending: dict[tuple[int, int, int], tuple[list[torch.Tensor], list[Any]]] = {}
        self.local: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        self.sends: list[Any] = []

    def reset(self) -> None:
        self.posted = dict.fromkeys(self.incoming, 0)
        self.pending.clear()
        self.local.clear()

    def message_shapes(self, kind: int, k: int) -> list[tuple[int, ...]]:
        """Shapes of what chain position ``k`` sends (FWD: its outputs, BWD: its input gradients)."""
        s = self.shapes
        block = k % 2 == 0
        if kind == H.FWD:
            return [s["x"], s["x"], s["w"]] if block else [s["x"], s["o"]]
        return [s["x"], s["o"]] if block else [s["x"], s["x"], s["w"]]

    def send(self, op: tuple[int, int, int], dst: int, tensors: list[torch.Tensor]) -> None:
        if dst == self.me:
            self.local[op] = [t.detach() for t in tensors]
            return
        ops = [dist.P2POp(dist.isend, t.detach().contiguous(), self.ranks[dst], self.group) for t in tensors]
        self.sends.extend(dist.batch_isend_irecv(ops))

    def _post_next(self, src: int) -> None:
        i = self.posted[src]
        key = self.incoming[src][i]
        bufs = [torch.empty(shape, dtype=self.dtype, device=self.device) for shape in
                self.message_shapes(key[0], key[1])]
        ops = [dist.P2POp(dist.irecv, b, self.ranks[src], self.group) for b in bufs]
        self.pending[key] = (bufs, dist.batch_isend_irecv(ops))
        self.posted[src] = i + 1

    def recv(self, producer: tuple[int, int, int], src: int) -> list[torch.Tensor]:
        if src == self.me:
            return self.local.pop(producer)
        while producer not in self.pending:
            self._post_next(src)
        bufs, works = self.pending.pop(producer)
        for w in works:
            self.wait(w.wait)
        return bufs

    def finish(self) -> None:
        for w in self.sends:
            self.wait(w.wait)
        self.sends.clear()


# ---- one rank's step ----------------------------------------------------------------------------
class HelixRunner:
    """Runs ``rank_order`` for one step: ``step(inputs, targets)`` -> this rank's loss sum."""

    def __init__(self, plan: Plan, spec: ModelSpec, mesh: Mesh, model: HelixRankModel, n_micro: int,
                 micro_batch: int, seq_len: int, total_tokens: int, dtype: torch.dtype, region: Any, wait: Any):
        self.plan, self.spec, self.model, self.m = plan, spec, model, n_micro
        self.p, self.L, self.F = plan.degrees.pp, spec.layers, plan.helix_folds
        self.shares = plan.helix_attention
        self.me = mesh["pp"].index
        self.keep = plan.recompute == "full"
        self.total_tokens, self.region = total_tokens, region
        tp = mesh["tp"]
        sp = model.layout.sp
        s_h = seq_len // tp.size if sp else seq_len
        qkv_rows = (model.heads + 2 * model.kv_heads) * model.head_dim
        shapes = {"x": (micro_batch, s_h, spec.hidden), "w": (qkv_rows, spec.hidden + int(spec.bias)),
                  "o": (micro_batch, seq_len, model.heads * model.head_dim)}
        self.mail = Mailbox(plan, mesh, spec, n_micro, shapes, dtype, wait)
        self.order = H.rank_order(self.p, self.L, n_micro, self.F, self.me, self.shares)
        self.docs_mb: list[Any] | None = None
        """Each micro-batch's document pieces (``runtime.documents``); None: no document masks."""

    def _block(self, j, x, o, tokens, target, docs=None):
        if self.keep:  # checkpointed: only the inputs are kept
            return checkpoint(self.model.block, j, x, o, tokens, target, self.total_tokens, docs,
                              use_reentrant=False)
        return self.model.block(j, x, o, tokens, target, self.total_tokens, docs)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor | None) -> float:
        p, L, F_, sh = self.p, self.L, self.F, self.shares
        mail = self.mail
        mail.reset()
        xs = D.split_microbatches(inputs, self.m) if inputs is not None else None
        ys = D.split_microbatches(targets, self.m) if targets is not None else None
        saved: dict[tuple[int, int], tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
        loss_sum = 0.0
        for op in self.order:
            kind, k, mb = op
            if kind == H.FWD:
                ins: list[torch.Tensor] = []
                if k > 0:
                    src = H.source(op, p, L, F_, sh)
                    ins = [t.requires_grad_(True) for t in mail.recv((H.FWD, k - 1, mb), src)]
                with self.region():
                    if k % 2 == 0:
                        j = k // 2
                        x, o = (ins[0], ins[1]) if ins else (None, None)
                        docs = None if self.docs_mb is None or j else self.docs_mb[mb]  # positions restart
                        outs = self._block(j, x, o, xs[mb] if j == 0 else None, ys[mb] if j == L else None, docs)
                    else:
                        x, n, w = ins
                        docs = None if self.docs_mb is None else self.docs_mb[mb]
                        outs = (x, self.model.attention(n, w, self.keep, docs))
                saved[(k, mb)] = (ins, outs)
                if k == 2 * L:
                    loss_sum += float(outs[0].detach())
                else:
                    mail.send(tuple(op), H.peer(op, p, L, F_, sh), list(outs))
            else:
                ins, outs = saved.pop((k, mb))
                if k == 2 * L:
                    grads = [None]
                else:
                    grads = mail.recv((H.BWD, k + 1, mb), H.source(op, p, L, F_, sh))
                with self.region():
                    if k % 2 == 1:  # the residual passes through the attention untouched
                        x, n, w = ins
                        torch.autograd.backward([outs[1]], [grads[1]])
                        back = [grads[0], n.grad, w.grad]
                    else:
                        torch.autograd.backward(list(outs), grads if grads[0] is not None else None)
                        back = [t.grad for t in ins]
                if k > 0:
                    mail.send(tuple(op), H.peer(op, p, L, F_, sh), back)
        mail.finish()
        return loss_sum


def build_model(spec: ModelSpec, plan: Plan, mesh: Mesh, layout: Layout, seq_len: int, seed: int,
                device: torch.device, dtype: torch.dtype) -> HelixRankModel:
    """This rank's blocks built on the meta device, then allocated and drawn on ``device`` (as the
    chain schedules' ``materialize``: the same numbers as the single-process model on any device)."""
    blocks = H.blocks_of_rank(mesh["pp"].index, plan.degrees.pp, spec.layers)
    model = build_on_meta(lambda: HelixRankModel(spec, layout, blocks, seq_len))
    model.to_empty(device=device)
    init_weights(model, spec, seed)
    model.reset_buffers()
    return model.to(dtype=dtype)


def export_state(model: HelixRankModel) -> dict[str, tuple[torch.Tensor, tuple[int, int] | None]]:
    info = shard_info(model)
    return {name: (p.detach().float().cpu().clone(), info[name]) for name, p in model.named_parameters()}


class HelixTrainer:
    """One rank's helix training (the counterpart of ``worker.RankTrainer`` for helixpipe plans):
    the same data, initialisation, DP/TP gradient reductions and AdamW, the helix order in between."""

    def __init__(self, plan: Plan, spec: ModelSpec, mesh: Mesh, seq_len: int, global_batch: int, seed: int,
                 data: dict[str, Any] | None = None, documents: dict[str, Any] | None = None):
        from autotune.runtime.documents import DocumentFeed
        from autotune.runtime.measure import clock
        from autotune.runtime.optimizer import TrainOptimizer
        from autotune.runtime.precision import TORCH_DTYPES as DTYPES

        problems = runtime_problems(plan, spec)
        if problems:
            raise ValueError("; ".join(problems))
        self.plan, self.spec, self.mesh, self.seq_len, self.global_batch, self.seed = (
            plan, spec, mesh, seq_len, global_batch, seed)
        self.data = D.source_from(data, spec.vocab, seed)  # None: the synthetic stream of ``seed``
        self.feed = DocumentFeed(documents, self.data, seed) if documents else None
        self.device, self.dtype = mesh.device, DTYPES[plan.dtype]
        tp = mesh["tp"]
        self.sp = plan.sequence_parallel and tp.size > 1
        self.local_tokens = seq_len
        layout = Layout(tp=tp, sp=self.sp, recompute="none")
        self.model = build_model(spec, plan, mesh, layout, seq_len, seed, self.device, self.dtype)
        self.params = list(self.model.parameters())
        # the parameters every tp rank holds whole (model.tp_replicated): summed over tp under sequence
        # parallelism, counted once in the gradient norm (runtime/grad_norm.py)
        whole = tp_replicated([self.model])
        held_whole = {i for i, p in enumerate(self.params) if id(p) in whole}
        clk = clock()
        # mixed precision and the tp sum of the sequence-parallel norms' gradients: the optimizer's
        self.opt = TrainOptimizer(self.params, mesh.grad, plan.zero_stage, overlap=False, wait_clock=clk.timed_call,
                                  dtype=plan.dtype, replicated=sorted(held_whole) if self.sp else [], tp_axis=tp,
                                  counted=GN.counted(len(self.params), held_whole, tp, [], None))
        self.dp_index = mesh["dp"].index
        self.n_micro = plan.microbatches_of_replica(self.dp_index)
        self.holds_ends = mesh["pp"].index == 0
        self.runner = HelixRunner(plan, spec, mesh, self.model, self.n_micro, plan.micro_batch_size, seq_len,
                                  global_batch * seq_len, self.dtype, clk.compute_region, clk.timed_call)

    def step(self, step_index: int) -> float:
        from autotune.runtime.documents import replica_step
        from autotune.runtime.measure import clock

        # every attention rank needs the documents of the micro-batches it attends to
        inputs, targets, self.runner.docs_mb = replica_step(self.feed, self.data, step_index, self.plan,
                                                            self.dp_index, self.global_batch, self.seq_len, None,
                                                            self.n_micro)
        self.opt.begin_step()
        scale = self.opt.loss_scale.scale  # fp16: the loss is scaled through its divisor
        self.runner.total_tokens = self.global_batch * self.seq_len / scale
        if self.holds_ends:
            contribution = self.runner.step(inputs.to(self.device), targets.to(self.device)) / scale
        else:
            contribution = self.runner.step(None, None) / scale
        self.opt.reduce_and_step(clock().compute_region)
        return contribution if (self.holds_ends and self.mesh["tp"].index == 0) else 0.0

    def export_state(self) -> dict[str, tuple[torch.Tensor, tuple[int, int] | None]]:
        return export_state(self.model)


def runtime_problems(plan: Plan, spec: ModelSpec) -> list[str]:
    """What this runtime cannot run of a helixpipe plan (besides the schedule's own shape rules)."""
    out = []
    d = plan.degrees
    if d.cp > 1 or d.hp > 1:
        out.append(f"degrees: helixpipe runs attention whole on one rank; cp({d.cp}) and hp({d.hp}) must be 1")
    if plan.recompute == "selective":
        out.append("recompute: helixpipe keeps the attention output (recompute 'full' checkpoints the parameter "
                   "blocks without attention); 'selective' would recompute the attention it exists to keep")
    if plan.zero_stage > 1:
        out.append(f"zero_stage: the helix runtime shards optimizer states only (ZeRO 0 or 1), got {plan.zero_stage}")
    if plan.virtual_stages != 1:
        out.append(f"virtual_stages: helixpipe places one-layer blocks itself, got virtual_stages({plan.virtual_stages})")
    counts = [s // plan.micro_batch_size for s in plan.shares.samples or ()]
    for c in sorted(set(counts)):
        out += [x for x in H.problems(d.pp, spec.layers, c, plan.helix_folds, plan.helix_attention) if x not in out]
    return out


def helix_plans_job(payload: dict[str, Any], rank: int, world: int, device: torch.device) -> list[dict[str, Any]]:
    """Launcher target: many helixpipe plans in one launch (fresh groups each); per plan the global
    mean loss of every step and the final weights (the equivalence tests)."""
    from autotune.runtime.measure import install_comm_timing
    from autotune.runtime.mesh import build_mesh
    from autotune.specs.model import model_from_dict

    install_comm_timing()
    spec = model_from_dict(payload["model"])
    out = []
    for item in payload["plans"]:
        plan = Plan.from_dict(item)
        mesh = build_mesh(plan, rank, device, timeout_s=payload.get("timeout_s"))
        trainer = HelixTrainer(plan, spec, mesh, payload["seq_len"], payload["global_batch"], payload["seed"],
                               data=payload.get("data"))
        losses, grad_norms = [], []
        for i in range(payload["steps"]):
            t = torch.zeros(2, dtype=torch.float64, device=device)
            t[0] = trainer.step(i)
            t[1] = trainer.opt.grad_sq
            dist.all_reduce(t)
            losses.append(float(t[0].item()))
            grad_norms.append(GN.norm_of(float(t[1].item())))
        out.append({"rank": rank, "losses": losses, "grad_norms": grad_norms, "state": trainer.export_state()})
    return out
