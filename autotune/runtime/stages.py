"""Running a per-stage plan (``autotune/stages.py``): stages of their own tp, replicas of their own tp.

torch's ``PipelineStage`` pairs each rank with one rank of the neighbouring stage in a pipeline
group, which a hop from a tp=2 stage to a tp=1 stage does not have. So a per-stage plan runs its
schedule here, from the schedule module's own op order (``Schedule.op_order``, the order the cost
model simulates): forwards and backwards of this rank's model chunks, activations and their
gradients sent with ``isend`` (never blocking) and received with ``recv`` when an op needs them,
tagged by (chunk, micro-batch, direction) so interleaved chunks cannot cross.

The hop between a stage at tp a and the next at tp b: without sequence parallelism every tp rank of
a stage holds the whole hidden state (Megatron's row-parallel output is all-reduced), and the
gradient of a stage's input is whole on every tp rank too (the column-parallel input's backward is
all-reduced), so receiver rank k of the next stage takes the activation from sender rank k % a, and
sender rank j takes the gradient back from rank j % b. Uniform stages (a = b) pair rank k with k.
The tensor goes whole (``stages.hop_source``/``hop_targets``, the rule the cost model prices with):
1/tp slices gathered by the receivers, Megatron's old scatter/gather, measured slower on gloo
(docs/architecture.md, "Per-stage degrees": the all-gather costs more than the bytes it saves).

Data parallelism over replicas of different tp (``PieceOptimizer``): every tp-split parameter is cut
into T equal pieces along its split dim (T the stage's largest tp; ``stages.pieces``), and piece g of
every replica (held by tp rank g * t // T of a replica of tp t) forms one gradient group. Each group
is an ordinary ``TrainOptimizer`` over fp32 piece masters: gradients SUM-reduced over the group, or
ZeRO-1 (reduce-scattered, each member updating its slice, all-gathered back), with the same AdamW
arithmetic as the uniform runtime (elementwise, so the pieces' update is the whole tensor's). Whole
(replicated) parameters, the norms, go with piece 0 on tp rank 0 of every replica and are broadcast
to the replica's other tp ranks after the step. Overflow under fp16 is agreed over the world once
per step (one ``LossScale`` for the rank).

Context and head parallelism inside the stages (every replica at the plan's cp and hp): a replica is
cp x hp tp groups ("cells"); tp rank k of its cells forms its cp rings and hp groups
(``StagedMesh.cp``/``hp``), over which the uniform runtime's ring attention and Ulysses all-to-alls
run (``attention.AttentionContext``); each rank reads its own tokens of every window, a hop goes to
the cell of the next stage with the same replica, cp and hp index (it holds the same tokens), and the
piece groups span every cell of the stage (cp and hp ranks saw other tokens: their gradients sum).

Tied embeddings: the first stage's embedding and the last stage's copy of it (the LM head) swap
the gradients of the rows they share before the reduction over replicas, matched row by row since
the two stages may split the vocabulary over different tp (``runtime/tied.py``).

What the cost model does not price here: the piece masters are fp32 copies of the rank's weights
(the uniform runtime's fp32 plans use the module's own weights as masters). Gradients accumulate
over micro-batches in fp32 (``PieceOptimizer.watch``), as the uniform runtime's do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from autotune import stages as ST
from autotune.runtime import data as D
from autotune.runtime import grad_norm as GN
from autotune.runtime.mesh import Axis, _new_group
from autotune.runtime.model import Layout, build_on_meta, materialize, shard_info
from autotune.runtime.optimizer import TrainOptimizer
from autotune.runtime.pipeline import stage_layer_ids
from autotune.runtime.precision import REDUCE_DTYPE, TORCH_DTYPES, LossScale
from autotune.runtime.tied import TIED_NAME, exchange_tied_rows, staged_tied_segments
from autotune.schedules import schedule_of
from autotune.schedules.base import B, F

_TAG_STRIDE = 1 << 16  # micro-batches per (chunk, direction) a tag can tell apart


@dataclass
class StagedMesh:
    """This rank's groups in a per-stage plan (the ``Mesh`` of a uniform one)."""

    plan: Any
    rank: int
    device: torch.device
    slot: Any
    """``stages.RankSlot`` of this rank."""
    tp: Axis
    pieces: list[tuple[int, Axis]] = field(default_factory=list)
    """(piece index, gradient group of that piece over the stage's replicas and their cp x hp cells)
    for each piece held."""
    finest: int = 1
    """The stage's largest tp: pieces per tp-split tensor."""
    cp: Axis = field(default_factory=lambda: _single())
    """The ring of this rank's replica: its tp index in every cp shard (same hp index)."""
    hp: Axis = field(default_factory=lambda: _single())
    """The Ulysses group of this rank's replica: its tp index at every hp index (same cp shard)."""


def _single() -> Axis:
    return Axis(size=1, index=0, ranks=[0], group=None)


def _axis(ranks: list[int], rank: int, timeout_s: float | None, mine: Axis | None) -> Axis | None:
    """Create the group of ``ranks`` (collective: every rank calls it for every group, in one order);
    this rank's ``Axis`` when it is a member, else ``mine`` unchanged."""
    group = _new_group(ranks, timeout_s) if len(ranks) > 1 else None
    if rank in ranks:
        return Axis(size=len(ranks), index=ranks.index(rank), ranks=ranks, group=group)
    return mine


def build_staged_mesh(plan: Any, rank: int, device: torch.device, timeout_s: float | None = None) -> StagedMesh:
    """Create every group of the plan (collective: all ranks call ``new_group`` in the same order):
    each cell's tp group, each replica's cp rings and hp groups (at one tp index: a cell's tp rank k
    talks to tp rank k of the replica's other cells, which share its tp), each stage's piece groups."""
    lay = ST.layout_of(plan.stages)
    if lay.world != dist.get_world_size():
        raise RuntimeError(f"plan world {lay.world} != process group world {dist.get_world_size()}")
    me = lay.slots[rank]
    cp, hp = plan.degrees.cp, plan.degrees.hp
    tp_axis = cp_axis = hp_axis = None
    for s, r, c, h in lay.cell_first:
        tp_axis = _axis(lay.cell_ranks(s, r, c, h), rank, timeout_s, tp_axis)
    for s, st in enumerate(plan.stages):
        for r, rep in enumerate(st.replicas):
            first = {key[2:]: r0 for key, r0 in lay.cell_first.items() if key[:2] == (s, r)}
            for k in range(rep.tp):
                for h in range(hp):
                    cp_axis = _axis([first[(c, h)] + k for c in range(cp)], rank, timeout_s, cp_axis)
                for c in range(cp):
                    hp_axis = _axis([first[(c, h)] + k for h in range(hp)], rank, timeout_s, hp_axis)
    mine: list[tuple[int, Axis]] = []
    finest = 1
    for s, st in enumerate(plan.stages):
        top = max(st.tps)
        for g in range(top):
            ranks = [r0 + g * st.replicas[r].tp // top for (q, r, _, _), r0 in lay.cell_first.items() if q == s]
            got = _axis(ranks, rank, timeout_s, None)
            if got is not None:
                mine.append((g, got))
        if s == me.stage:
            finest = top
    return StagedMesh(plan=plan, rank=rank, device=device, slot=me, tp=tp_axis, pieces=mine, finest=finest,
                      cp=cp_axis, hp=hp_axis)


class PieceOptimizer:
    """AdamW over this rank's parameters, reduced piece by piece over the stage's replicas (module
    docstring). Interface of ``TrainOptimizer`` as the trainer uses it."""

    def __init__(self, modules: list[torch.nn.Module], mesh: StagedMesh, zero_stage: int, dtype: str,
                 tied_segments: list[tuple[int, int, int]] | None = None, tied_counted: bool = True):
        """``tied_segments``: ``tied.staged_tied_segments`` of this rank when the model ties its
        embeddings (None: untied); the copies are the parameters named ``tied.TIED_NAME``;
        ``tied_counted``: this rank's stage holds the embedding (chunk 0), whose copy the gradient
        norm counts (the last stage's holds the same rows' sum, runtime/grad_norm.py)."""
        self.mesh = mesh
        self.loss_scale = LossScale(dtype)
        self.grad_sq = 0.0
        self.params: list[torch.nn.Parameter] = []
        self.infos: list[tuple[int, int] | None] = []
        for m in modules:
            info = shard_info(m)
            for name, p in m.named_parameters():
                self.params.append(p)
                self.infos.append(info[name])
        names = [n for m in modules for n, _ in m.named_parameters()]
        self.tied = [i for i, n in enumerate(names) if n == TIED_NAME] if tied_segments is not None else []
        # the gradient norm counts every piece once: whole parameters go with piece 0 of tp rank 0
        # only, a tied embedding's first copy on the embedding's stage only (runtime/grad_norm.py)
        counted = [True] * len(self.params)
        for j, i in enumerate(self.tied):
            counted[i] = tied_counted and j == 0
        t, k, top = mesh.tp.size, mesh.tp.index, mesh.finest
        self.per = top // t  # pieces per tp shard
        self.whole: dict[int, torch.Tensor] = {}
        """fp32 master of each whole (replicated) parameter, by parameter index."""
        # (piece group, [(param index, dim, start, length) or (param index, None, 0, 0) for whole])
        self.groups: list[tuple[Axis, list[tuple[int, int | None, int, int]], TrainOptimizer]] = []
        for g, axis in mesh.pieces:
            entries = []
            for i, (p, info) in enumerate(zip(self.params, self.infos, strict=True)):
                if info is None:
                    if g == 0 and k == 0:
                        entries.append((i, None, 0, 0))
                    continue
                dim = info[0]
                n = p.shape[dim]
                if n % self.per:
                    raise ValueError(f"parameter {i}: {n} rows along dim {dim} do not split into {self.per} pieces "
                                     f"(tp {t} beside tp {top} in one stage)")
                length = n // self.per
                entries.append((i, dim, (g - k * self.per) * length, length))
            masters = [torch.nn.Parameter(self._piece(self.params[i], d, a, n).detach().to(REDUCE_DTYPE).clone())
                       for i, d, a, n in entries]
            opt = TrainOptimizer(masters, axis if axis.group is not None else None, zero_stage, dtype="fp32",
                                 counted=[counted[i] for i, _, _, _ in entries])
            self.groups.append((axis, entries, opt))
            for (i, d, _, _), m in zip(entries, masters, strict=True):
                if d is None:
                    self.whole[i] = m  # tp rank 0 steps the whole parameters with piece 0
        for i, info in enumerate(self.infos):  # the other tp ranks keep fp32 copies they are sent
            if info is None and i not in self.whole:
                self.whole[i] = self.params[i].detach().to(REDUCE_DTYPE).clone()
        # gradients accumulate over the micro-batches in fp32, as the uniform runtime's do
        self.low_precision = any(p.dtype != REDUCE_DTYPE for p in self.params)
        self.acc: list[torch.Tensor | None] = [None] * len(self.params)
        self.tied_segments = tied_segments or []
        self.tied_start = (self.infos[self.tied[0]] or (0, 0))[1] if self.tied else 0
        """Global row of this rank's first embedding row (its copies are one cell's: the same rows)."""

    @staticmethod
    def _piece(t: torch.Tensor, dim: int | None, start: int, length: int) -> torch.Tensor:
        return t if dim is None else t.narrow(dim, start, length)

    def watch(self) -> None:
        """Under bf16/fp16 move each gradient into an fp32 accumulator as autograd finishes it (call
        after the modules are cast to the compute dtype)."""
        self.low_precision = any(p.dtype != REDUCE_DTYPE for p in self.params)
        if self.low_precision:
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(lambda _p, i=i: self._accumulate(i))

    def _accumulate(self, i: int) -> None:
        p = self.params[i]
        if p.grad is None:
            return
        if self.acc[i] is None:
            self.acc[i] = p.grad.to(REDUCE_DTYPE)
        else:
            self.acc[i].add_(p.grad)
        p.grad = None

    def begin_step(self) -> None:
        for p in self.params:
            p.grad = None
        self.acc = [None] * len(self.params)

    def reduce_and_step(self, step_region) -> None:
        for i in range(len(self.params)):  # whatever the hooks have not moved yet
            self._accumulate(i)
        grads = [a if a is not None else torch.zeros_like(p, dtype=REDUCE_DTYPE) for a, p in zip(self.acc, self.params,
                                                                                                  strict=True)]
        if not self.loss_scale.unscale_and_check(grads):  # every rank calls it once: a world MAX
            self.grad_sq = GN.SKIPPED
            self.begin_step()
            return
        self.grad_sq = 0.0
        # the tied copies' rows summed with the other stage's, before the replicas reduce them
        exchange_tied_rows([grads[i] for i in self.tied], self.tied_start, self.tied_segments)
        for _, entries, opt in self.groups:  # ascending piece index on every rank: collectives match
            for (i, d, a, n), m in zip(entries, opt.params, strict=True):
                m.grad = self._piece(grads[i], d, a, n).contiguous()
            opt.reduce_and_step(step_region)
            self.grad_sq += opt.grad_sq
            with torch.no_grad():
                for (i, d, a, n), m in zip(entries, opt.params, strict=True):
                    self._piece(self.params[i], d, a, n).copy_(m)
        tp = self.mesh.tp
        with torch.no_grad():  # whole parameters: tp rank 0 stepped them, the others take its fp32 values
            for i, m in sorted(self.whole.items()):
                if tp.group is not None:
                    dist.broadcast(m.data, src=tp.ranks[0], group=tp.group)
                self.params[i].copy_(m)
        self.begin_step()

    def master_weights(self) -> list[torch.Tensor]:
        """fp32 master of every parameter (this rank's shard), in ``params`` order."""
        out = [p.detach().to(REDUCE_DTYPE).clone() for p in self.params]
        for i, m in self.whole.items():
            out[i].copy_(m)
        for _, entries, opt in self.groups:
            for (i, d, a, n), m in zip(entries, opt.master_weights(), strict=True):
                self._piece(out[i], d, a, n).copy_(m)
        return out


def _attention_context(plan: Any, spec: Any, mesh: StagedMesh, seq_len: int) -> Any:
    """The CP/HP ``AttentionContext`` of this rank (the uniform runtime's, ``worker.attention_context``,
    over the replica's own groups; the heads of one tp rank split evenly over hp, as the cost model
    prices them: ``cost/stages.cell_heads``); None when the sequence is whole."""
    if mesh.cp.size == 1 and mesh.hp.size == 1:
        return None
    from autotune.plan_parts import even_split
    from autotune.runtime.attention import AttentionContext

    t = mesh.tp.size
    return AttentionContext(
        cp_group=mesh.cp.group, cp_ranks=mesh.cp.ranks, cp_index=mesh.cp.index, cp_tokens=plan.shares.tokens,
        cp_layout=plan.cp_layout, hp_group=mesh.hp.group, hp_ranks=mesh.hp.ranks, hp_index=mesh.hp.index,
        hp_heads=tuple(even_split(spec.heads // t, mesh.hp.size)), heads=spec.heads // t,
        kv_heads=spec.kv_heads // t, seq_len=seq_len)


class StagedTrainer:
    """This rank's chunks, its ``PieceOptimizer`` and the schedule's op order (module docstring)."""

    def __init__(self, plan: Any, spec: Any, mesh: StagedMesh, seq_len: int, global_batch: int, seed: int,
                 data: dict[str, Any] | None = None, clock: Any = None, documents: dict[str, Any] | None = None):
        if documents:  # Plan rules refuse doc_mask with stages (autotune/stages.py); a payload may still carry them
            raise ValueError("document masks are not run with per-stage degrees")
        self.plan, self.spec, self.mesh, self.seq_len, self.global_batch = plan, spec, mesh, seq_len, global_batch
        self.data = D.source_from(data, spec.vocab, seed)
        self.device, self.dtype = mesh.device, TORCH_DTYPES[plan.dtype]
        self.clock = clock
        slot = mesh.slot
        self.lay = ST.layout_of(plan.stages)
        self.sched = schedule_of(plan)
        self.p, self.v = len(plan.stages), plan.virtual_stages
        self.n_chunks = self.p * self.v
        self.attn = _attention_context(plan, spec, mesh, seq_len)
        self.positions = None  # this rank's tokens of each window (its CP shard's hp slice), on the host
        if self.attn is not None:
            from autotune.runtime.attention import local_token_positions

            self.positions = local_token_positions(self.attn, seq_len)
        layout = Layout(tp=mesh.tp, sp=False, attn_ctx=self.attn, recompute=plan.recompute,
                        positions=None if self.positions is None else self.positions.to(self.device))
        ids = stage_layer_ids(plan)
        from autotune.runtime.model import StageModel

        chunks = self.sched.stages_of_rank(slot.stage, self.p, self.v)
        self.chunks = build_on_meta(lambda: {j: StageModel(spec, layout, ids[j], first=j == 0,
                                                          last=j == self.n_chunks - 1, seq_len=seq_len)
                                             for j in chunks})
        for m in self.chunks.values():
            materialize(m, spec, seed, self.device, torch.float32)
        tied, tied_counted = None, True
        if spec.tied_embeddings:  # the stages holding the embedding (chunk 0) and the head (the last chunk)
            ends = (self.sched.stage_rank(0, self.p, self.v), self.sched.stage_rank(self.n_chunks - 1, self.p, self.v))
            tied = staged_tied_segments(plan.stages, mesh.rank, spec.vocab, *ends)
            tied_counted = slot.stage == ends[0]
        self.opt = PieceOptimizer(list(self.chunks.values()), mesh, plan.zero_stage, plan.dtype, tied_segments=tied,
                                  tied_counted=tied_counted)
        for m in self.chunks.values():
            m.to(dtype=self.dtype)
        self.opt.watch()
        self.dp_index = slot.replica
        self.n_micro = plan.microbatches_of_replica(self.dp_index)
        self.total_tokens = global_batch * seq_len
        self.local_tokens = seq_len if self.positions is None else int(self.positions.numel())
        self.last = self.chunks.get(self.n_chunks - 1)
        self._sends: list[Any] = []

    # ---- who talks to whom --------------------------------------------------------------------
    def _cell(self, stage: int) -> tuple[int, int]:
        """(first rank, tp) of this rank's cell's counterpart in ``stage``: the same replica, cp shard
        and hp index (a hop carries this rank's tokens of the sequence to the ranks holding the same)."""
        x = self.mesh.slot
        return (self.lay.cell_first[(stage, x.replica, x.cp_index, x.hp_index)],
                self.plan.stages[stage].replicas[x.replica].tp)

    def _source(self, chunk: int) -> int:
        """The rank this rank receives the input (forward) or output gradient (backward) of a hop from:
        ``stages.hop_source`` in the stage holding ``chunk``."""
        r0, t = self._cell(self.sched.stage_rank(chunk, self.p, self.v))
        return r0 + ST.hop_source(t, self.mesh.slot.tp_index)

    def _targets(self, chunk: int) -> list[int]:
        """Ranks of the stage holding ``chunk`` that take what this rank sends them whole
        (``stages.hop_targets``: what the cost model counts, ``pipeline_parallel.hop_bytes``)."""
        r0, t = self._cell(self.sched.stage_rank(chunk, self.p, self.v))
        return [r0 + k for k in ST.hop_targets(self.mesh.slot.tp, t, self.mesh.slot.tp_index)]

    def _tag(self, chunk: int, mb: int, backward: bool) -> int:
        return (chunk * 2 + int(backward)) * _TAG_STRIDE + mb

    def _send(self, t: torch.Tensor, chunk_to: int, tag: int) -> None:
        t = t.detach().contiguous()
        for dst in self._targets(chunk_to):
            self._sends.append((dist.isend(t, dst, tag=tag), t))

    def _recv(self, chunk_from: int, tag: int, like: tuple[int, ...]) -> torch.Tensor:
        buf = torch.empty(like, dtype=self.dtype, device=self.device)
        dist.recv(buf, self._source(chunk_from), tag=tag)
        return buf

    # ---- one step -----------------------------------------------------------------------------
    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.last.token_losses(logits, target).sum() / self.total_tokens * self.opt.loss_scale.scale

    def _region(self):
        import contextlib

        return self.clock.compute_region() if self.clock is not None else contextlib.nullcontext()

    def step(self, step_index: int) -> float:
        inputs, targets = D.replica_batch(self.data, step_index, self.plan, self.dp_index, self.positions,
                                          self.global_batch, self.seq_len)
        xs = D.split_microbatches(inputs.to(self.device), self.n_micro)
        ys = D.split_microbatches(targets.to(self.device), self.n_micro)
        self.opt.begin_step()
        shape = (self.plan.micro_batch_size, self.local_tokens, self.spec.hidden)
        held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        losses: list[float] = []
        order = self.sched.op_order(self.p, self.v, self.n_micro, self.mesh.slot.stage)
        for op in order:
            j, i = op.stage, op.microbatch
            if op.kind == F:
                if j == 0:
                    x = xs[i]
                elif self.sched.stage_rank(j - 1, self.p, self.v) == self.mesh.slot.stage:
                    raise RuntimeError("a chunk's predecessor on the same rank is not run here (V schedules)")
                else:
                    x = self._recv(j - 1, self._tag(j, i, False), shape).requires_grad_()
                with self._region():
                    out = self.chunks[j](x)
                    if j == self.n_chunks - 1:
                        out = self._loss(out, ys[i])
                        losses.append(float(out.detach()))
                held[(j, i)] = (x, out)
                if j < self.n_chunks - 1 and self.sched.stage_rank(j + 1, self.p, self.v) != self.mesh.slot.stage:
                    self._send(out, j + 1, self._tag(j + 1, i, False))
            elif op.kind == B:
                x, out = held.pop((j, i))
                if j == self.n_chunks - 1:
                    grad = None
                elif self.sched.stage_rank(j + 1, self.p, self.v) == self.mesh.slot.stage:
                    raise RuntimeError("a chunk's successor on the same rank is not run here (V schedules)")
                else:
                    grad = self._recv(j + 1, self._tag(j, i, True), tuple(out.shape))
                with self._region():
                    torch.autograd.backward(out, grad)
                if j > 0:
                    self._send(x.grad, j - 1, self._tag(j - 1, i, True))
            else:
                raise RuntimeError(f"operation {op.kind} is not run with per-stage degrees")
        for work, _ in self._sends:
            work.wait()
        self._sends = []
        scale = self.opt.loss_scale.scale  # the scale these losses were multiplied by
        self.opt.reduce_and_step(self._region)
        return sum(losses) / scale if (self.last is not None and self.mesh.slot.tp_index == 0) else 0.0

    def export_state(self) -> dict[str, tuple[torch.Tensor, tuple[int, int] | None]]:
        names = [(name, shard_info(m)[name]) for m in self.chunks.values() for name, _ in m.named_parameters()]
        weights = self.opt.master_weights()
        return {name: (w.float().cpu().clone(), info) for (name, info), w in zip(names, weights, strict=True)}
