"""One rank of a trial: build its part of the plan, warm up, measure steps, report.

Measurement (per measured step, every rank; on CUDA with CUDA events on the working stream, read
after the step's one synchronisation, so no region or call waits for the GPU: ``CudaStopwatch``):

* step time: from a barrier before the step to the end of a barrier after it (all ranks agree);
* ``comm_s``: wall time inside torch.distributed calls (collectives, pipeline p2p waits), patched in
  this process only (``CommClock``);
* ``compute_s``: wall time of forward/backward chunks and the optimizer step minus the communication
  inside them, plus the emulated slowdown (a rank emulated ``F`` times slower stays busy
  ``(F-1) x`` its measured compute after every chunk, as ``autotune.runtime.emulation`` does);
* ``idle_s``: waiting at the end-of-step barrier for slower ranks (load imbalance);
* ``compute_cpu_s``: the main thread's CPU seconds in the compute regions (communication taken
  out), the clock the layer profile is timed with; ``cpu_s``: the process's CPU seconds over the
  step (every thread, gloo's included, kernel time too). Neither counts slices the cores gave to
  other processes, so on a shared machine they say what the step cost where the wall clock cannot.

What none of the three covers is Python glue of the schedules; ``coverage`` reports the share covered.
Peak memory (``peak_memory_bytes``, per rank): the peak over the rank's own baseline taken after its
process groups exist and before its model is built; CUDA ``max_memory_allocated``, CPU the process
high-water mark ``VmHWM`` after resetting it through ``/proc/self/clear_refs`` (tracemalloc does not
see torch's allocations).

Entry points: ``train(...)`` (one plan inside an initialised process group, many per launch in the
tests) and ``python -m autotune.runtime.worker --job JOB --out DIR`` under torchrun.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from autotune.plan import Plan
from autotune.runtime import data as D
from autotune.runtime import grad_norm as GN
from autotune.runtime.documents import DocumentFeed, replica_step
from autotune.runtime.helix import HelixTrainer
from autotune.runtime.measure import (  # noqa: F401  (CommClock, the stopwatches: their old home)
    CommClock,
    CudaStopwatch,
    WallStopwatch,
    _no_sync,
    clock,
    emulate_busy,
    install_comm_timing,
    peak_memory,
    reset_peak_memory,
)
from autotune.runtime.mesh import Mesh, build_mesh
from autotune.runtime.model import (
    Block,
    Layout,
    build_on_meta,
    hidden_positions,
    materialize,
    shard_info,
    tp_replicated,
)
from autotune.runtime.moe import MoEContext, expert_params
from autotune.runtime.optimizer import (  # noqa: F401  (LR, WEIGHT_DECAY: their old home)
    LR,
    WEIGHT_DECAY,
    ExpertSplitOptimizer,
    ShardedOptimizer,
    TrainOptimizer,
)
from autotune.runtime.pipeline import build_schedule, build_stage_models
from autotune.runtime.precision import TORCH_DTYPES
from autotune.runtime.sharding import shard_stage_modules
from autotune.runtime.tied import TIED_NAME, tied_axis
from autotune.schedules import schedule_of
from autotune.specs.model import ModelSpec

DTYPES = TORCH_DTYPES
# ---- attention context --------------------------------------------------------------------------
def attention_context(plan: Plan, mesh: Mesh, spec: ModelSpec, seq_len: int) -> Any:
    """The CP/HP AttentionContext of this rank (None when the sequence is whole: plain SDPA)."""
    if plan.degrees.cp == 1 and plan.degrees.hp == 1:
        return None
    from autotune.runtime.attention import AttentionContext

    cp, hp, tp = mesh["cp"], mesh["hp"], mesh["tp"]
    return AttentionContext(
        cp_group=cp.group, cp_ranks=cp.ranks, cp_index=cp.index, cp_tokens=plan.shares.tokens,
        cp_layout=plan.cp_layout, hp_group=hp.group, hp_ranks=hp.ranks, hp_index=hp.index,
        hp_heads=plan.shares.heads, heads=spec.heads // tp.size, kv_heads=spec.kv_heads // tp.size,
        seq_len=seq_len)


def local_positions(ctx: Any, seq_len: int) -> torch.Tensor | None:
    if ctx is None:
        return None
    from autotune.runtime.attention import local_token_positions

    return local_token_positions(ctx, seq_len)


def moe_context(plan: Plan, spec: ModelSpec, mesh: Mesh, layout: Layout, seq_len: int) -> MoEContext | None:
    """An MoE model's expert groups (``runtime/expert_parallel.py``) and the global positions of the
    hidden states' tokens (the router's per-sequence statistics); None for a dense model."""
    if spec.moe is None:
        return None
    from autotune.runtime.expert_parallel import build_expert_groups, single_groups

    if plan.world == 1:
        groups = single_groups(spec.moe.experts)
    else:
        groups = build_expert_groups(plan, mesh.rank, spec.moe.experts, timeout_s=mesh.timeout_s)
    return MoEContext(groups=groups, seq_len=seq_len, positions=hidden_positions(layout, seq_len, mesh.device))


# ---- one rank's training ------------------------------------------------------------------------
class RankTrainer:
    """This rank's model chunks, optimizer and (with pp > 1) pipeline schedule."""

    def __init__(self, plan: Plan, spec: ModelSpec, mesh: Mesh, seq_len: int, global_batch: int, seed: int,
                 data: dict[str, Any] | None = None, documents: dict[str, Any] | None = None):
        # Longer than a screen: the chunks are built on meta, sharded (FSDP2), materialised and wrapped
        # in pipeline stages in the one order torch accepts, each step reading what the last made.
        self.plan, self.spec, self.mesh, self.seq_len, self.global_batch, self.seed = (
            plan, spec, mesh, seq_len, global_batch, seed)
        self.data = D.source_from(data, spec.vocab, seed)  # None: the synthetic stream of ``seed``
        # documents: attention stops at their boundaries (None: one causal sequence per window)
        self.feed = DocumentFeed(documents, self.data, seed) if documents else None
        self.docs_mb: list[Any] | None = None
        self.device = mesh.device
        self.dtype = DTYPES[plan.dtype]
        if plan.dtype.startswith("fp32") and torch.device(self.device).type == "cuda":
            # fp32 runs its GEMMs in TF32 where the GPU has it, as the catalogue prices it
            torch.backends.cuda.matmul.allow_tf32 = plan.dtype == "fp32"
        tp = mesh["tp"]
        self.sp = plan.sequence_parallel and tp.size > 1
        self.ctx = attention_context(plan, mesh, spec, seq_len)
        self.positions = local_positions(self.ctx, seq_len)
        if self.positions is not None:  # the data are sliced on the host
            self.positions = self.positions.cpu()
        local_tokens = seq_len if self.positions is None else int(self.positions.numel())
        self.local_tokens = local_tokens
        layout = Layout(tp=tp, sp=self.sp, attn_ctx=self.ctx,
                        positions=None if self.positions is None else self.positions.to(self.device),
                        recompute=plan.recompute)
        # an MoE model's expert groups and the aux loss's gradient scale (runtime/moe.py)
        self.moe = moe_context(plan, spec, mesh, layout, seq_len)
        layout.moe = self.moe
        # shapes on the meta device, then only this rank's shards are allocated and drawn, on its device
        # (in fp32: the initial values of the fp32 master weights)
        self.stages = build_on_meta(lambda: build_stage_models(spec, plan, mesh, layout, seq_len))
        for _, m in self.stages:
            materialize(m, spec, seed, self.device, torch.float32)
        self._build_optimizer([m for _, m in self.stages])
        self.dp_index = mesh["dp"].index
        self.n_micro = plan.microbatches_of_replica(self.dp_index)
        self.total_tokens = global_batch * seq_len
        last = [m for j, m in self.stages if m.last]
        self.last = last[0] if last else None
        self.first = any(m.first for _, m in self.stages)
        self.schedule = None
        if plan.degrees.pp > 1:
            hidden_tokens = local_tokens // tp.size if self.sp else local_tokens
            self.schedule, self.pstages = build_schedule(
                plan, mesh, self.stages, self.n_micro, plan.micro_batch_size, local_tokens, hidden_tokens,
                self.dtype, self._loss)
            clk = clock()
            if self.sharded and plan.zero_stage == 3 and not self.gather_per_microbatch:
                for st in self.pstages:  # ZeRO-3 gathering per step: free before the last backward
                    st.backward_one_chunk = _reshard_before_last(st.backward_one_chunk, st.submod, self.n_micro)
            elif self.sharded and plan.zero_stage == 3:
                for st in self.pstages:  # ZeRO-3 gathering per micro-batch: free in every backward
                    _reshard_in_every_backward(st.submod)
            for st in self.pstages:  # the micro-batch's documents reach the stage before its forward
                st.forward_one_chunk = _with_docs(st.forward_one_chunk, st.submod, self)
            for st in self.pstages:  # time every chunk as a compute region
                for meth in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                    if hasattr(st, meth):
                        setattr(st, meth, _timed_region(clk, getattr(st, meth)))

    def _build_optimizer(self, modules: list[torch.nn.Module]) -> None:
        """AdamW over this rank's parameters: FSDP2-sharded (ZeRO-2/3) or a TrainOptimizer (ZeRO-0/1);
        an MoE model's expert weights in a TrainOptimizer of their own over expert-DP."""
        plan, spec, mesh, tp = self.plan, self.spec, self.mesh, self.mesh["tp"]
        experts = expert_params(modules)
        # with sequence parallelism the parameters every tp rank holds whole (norms, row-parallel
        # biases, the position table) saw different tokens on each: their gradients are summed over
        # tp too (by the optimizer, on the fp32 gradients)
        whole = tp_replicated(modules)
        held_whole = {i for i, p in enumerate(p for m in modules for p in m.parameters()) if id(p) in whole}
        replicated = sorted(held_whole) if self.sp else []
        # a tied embedding held by the first and the last stage: one weight in two copies (runtime/tied.py)
        tied_ax = tied_axis(plan, spec.tied_embeddings, mesh.rank, timeout_s=mesh.timeout_s)
        tied = [i for i, (name, _) in enumerate((n, p) for m in modules for n, p in m.named_parameters())
                if name == TIED_NAME] if tied_ax is not None else []
        # which parameters this rank counts in the global gradient norm (runtime/grad_norm.py)
        n_params = sum(1 for m in modules for _ in m.parameters())
        counted = GN.counted(n_params, held_whole, tp, tied, tied_ax)
        self.sharded = plan.zero_stage >= 2 and mesh.grad.group is not None
        if self.sharded and experts:  # plan checks refuse it first (trial.check_runtime_support)
            raise RuntimeError("ZeRO-2/3 would shard expert weights over the dense gradient group")
        if self.sharded:  # ZeRO-2/3: FSDP2 keeps fp32 shards and computes in the plan's dtype
            # replicas with different micro-batch counts gather per step (autotune/runtime/sharding.py)
            self.gather_per_microbatch = len(set(plan.shares.samples)) == 1
            roots = shard_stage_modules(modules, Block, mesh.grad, plan.zero_stage, self.dtype, self.device,
                                        gather_per_microbatch=self.gather_per_microbatch)
            self.params = [p for m in modules for p in m.parameters()]
            self.opt = ShardedOptimizer(roots, self.params, dtype=plan.dtype, replicated=replicated,
                                        tp_axis=tp, own_loop=plan.degrees.pp == 1, zero_stage=plan.zero_stage,
                                        gather_per_microbatch=self.gather_per_microbatch, tied=tied,
                                        tied_axis=tied_ax, counted=counted)
        else:  # low-precision module copies; the optimizer keeps the fp32 masters
            masters = [p.detach().clone() for m in modules for p in m.parameters()]
            for m in modules:
                m.to(dtype=self.dtype)
            self.params = [p for m in modules for p in m.parameters()]
            # DDP-style overlap of the gradient all-reduce with backward where backward is ours (pp = 1)
            make = functools.partial(TrainOptimizer, zero_stage=min(plan.zero_stage, 1), overlap=plan.degrees.pp == 1,
                                     wait_clock=clock().timed_call, dtype=plan.dtype)
            if not experts:
                self.opt = make(self.params, mesh.grad, replicated=replicated, tp_axis=tp, masters=masters, tied=tied,
                                tied_axis=tied_ax, counted=counted)
                return
            # expert weights sum their gradients over expert-DP, the rest over the gradient group
            is_expert = [id(p) in experts for p in self.params]
            dense_at = {i: j for j, i in enumerate(i for i, e in enumerate(is_expert) if not e)}
            split = [[m for m, e in zip(masters, is_expert, strict=True) if e == want] for want in (False, True)]
            self.opt = ExpertSplitOptimizer(
                make([p for p, e in zip(self.params, is_expert, strict=True) if not e], mesh.grad,
                     replicated=[dense_at[i] for i in replicated], tp_axis=tp, masters=split[0],
                     tied=[dense_at[i] for i in tied], tied_axis=tied_ax,
                     counted=[c for c, e in zip(counted, is_expert, strict=True) if not e]),
                # every rank holds its own experts' slices (ep x etp): only expert-DP replicates them
                make([p for p, e in zip(self.params, is_expert, strict=True) if e], self.moe.groups.edp,
                     masters=split[1]),
                is_expert)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Sum of this micro-batch's token losses over the global token count (exact weighted mean),
        times the fp16 loss scale (1 otherwise)."""
        return self.last.token_losses(logits, target).sum() / self.total_tokens * self.opt.loss_scale.scale

    def step(self, step_index: int) -> float:
        """One optimizer step; returns this rank's contribution to the global mean loss."""
        clk = clock()
        inputs, targets, self.docs_mb = replica_step(self.feed, self.data, step_index, self.plan, self.dp_index,
                                                     self.global_batch, self.seq_len, self.positions, self.n_micro)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        self.opt.begin_step()
        scale = self.opt.loss_scale.scale
        if self.moe is not None:  # the aux loss's share of the objective: the mean over the global batch
            self.moe.aux_grad_scale = scale / self.global_batch
        contribution = 0.0
        if self.schedule is None:
            model = self.stages[0][1]
            for j, (x, y) in enumerate(zip(D.split_microbatches(inputs, self.n_micro),
                                           D.split_microbatches(targets, self.n_micro), strict=True)):
                if j == self.n_micro - 1:
                    self.opt.before_last_backward()
                model.docs = None if self.docs_mb is None else self.docs_mb[j]
                with clk.compute_region():
                    loss = self._loss(model(x), y)
                    if j == self.n_micro - 1:
                        self.opt.after_last_forward()
                    loss.backward()
                contribution += float(loss.detach()) / scale
        else:
            losses: list[torch.Tensor] = []
            args = (inputs,) if self.first else ()
            self.schedule.step(*args, target=targets if self.last is not None else None,
                               losses=losses if self.last is not None else None)
            contribution = float(sum(float(x.detach()) for x in losses)) / scale
        self.opt.finish_overlap()
        self.opt.reduce_and_step(clk.compute_region)
        # every tp rank holds the same loss: count it once
        return contribution if (self.last is not None and self.mesh["tp"].index == 0) else 0.0

    def export_state(self) -> dict[str, tuple[torch.Tensor, tuple[int, int] | None]]:
        """{name: (fp32 master weight, (dim, offset) of its tp shard in the full tensor or None)} for
        comparisons (collective under ZeRO: every rank of the gradient group must call it)."""
        names = [(name, shard_info(m)[name]) for _, m in self.stages for name, _ in m.named_parameters()]
        weights = self.opt.master_weights()
        return {name: (w.float().cpu().clone(), info) for (name, info), w in zip(names, weights, strict=True)}


def _with_docs(forward_one_chunk, module, trainer):
    """Wrap a pipeline stage's ``forward_one_chunk`` so its module runs micro-batch ``fwd_chunk_id``
    with that micro-batch's documents (recomputation takes them from the checkpoint's arguments)."""
    @functools.wraps(forward_one_chunk)
    def run(fwd_chunk_id, *a, **k):
        module.docs = None if trainer.docs_mb is None else trainer.docs_mb[fwd_chunk_id]
        return forward_one_chunk(fwd_chunk_id, *a, **k)
    return run


def _reshard_before_last(backward_one_chunk, module, n_micro: int):
    """Wrap a pipeline stage's ``backward_one_chunk`` so the last micro-batch's backward starts from
    freed parameters (ZeRO-3 with per-step gathering, autotune/runtime/sharding.py)."""
    from autotune.runtime.sharding import reshard_units

    @functools.wraps(backward_one_chunk)
    def run(bwd_chunk_id, *a, **k):
        if bwd_chunk_id == n_micro - 1:
            reshard_units(module)
        return backward_one_chunk(bwd_chunk_id, *a, **k)
    return run


def _reshard_in_every_backward(root) -> None:
    """ZeRO-3 gathering per micro-batch under pipelining: every unit frees its gathered weights after
    its backward. torch's pipeline stages call ``set_reshard_after_backward(False)`` on their FSDP
    root before every backward (to keep what a non-last backward gathered), which would keep the
    whole stage gathered from a backward until the next forward frees it block by block and skip
    that forward's gathers: ZeRO-2's memory under ZeRO-3's name. Holding the flag at True keeps
    ZeRO-3 what autotune/cost/data_parallel.py prices: every micro-batch gathers each block for its
    forward and again for its backward, two blocks gathered at a time. FSDP2 keeps the accumulated
    gradients apart from the freed weights (its supported accumulate-while-resharding mode), so the
    reduction after the last backward still finds them."""
    keep_true = root.set_reshard_after_backward

    def set_reshard_after_backward(_flag: bool, *, recurse: bool = True) -> None:
        keep_true(True, recurse=recurse)

    root.set_reshard_after_backward = set_reshard_after_backward
    keep_true(True)


def _timed_region(clk: CommClock, fn):
    @functools.wraps(fn)
    def run(*a, **k):
        with clk.compute_region():
            return fn(*a, **k)
    return run


def train(plan: Plan, spec: ModelSpec, seq_len: int, global_batch: int, *, steps: int, warmup: int, seed: int,
          device: torch.device, emulate_slowdown: dict[int, float] | None = None, export_state: bool = False,
          timeout_s: float | None = None, data: dict[str, Any] | None = None,
          documents: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one resolved plan on the initialised default process group; returns this rank's report."""
    rank = dist.get_rank()
    install_comm_timing()
    clk = clock()
    clk.slowdown = float((emulate_slowdown or {}).get(rank, 1.0))
    cuda_events = device.type == "cuda" and clk.slowdown == 1.0
    clk.stopwatch = CudaStopwatch() if cuda_events else WallStopwatch()
    clk.sync = functools.partial(torch.cuda.synchronize, device) if (
        device.type == "cuda" and not cuda_events) else _no_sync
    build, trainer_of = _runtime(plan, clk)
    mesh = build(plan, rank, device, timeout_s=timeout_s)
    # the peak is measured over this baseline (imports, process groups): what the plan itself needs
    # (weights, gradients, optimizer states, activations, communication buffers)
    baseline = reset_peak_memory(device)
    trainer = trainer_of(plan, spec, mesh, seq_len, global_batch, seed, data=data, documents=documents)
    if (feed := getattr(trainer, "feed", None)) is not None:  # every step's documents, before any clock starts
        feed.prepare(range(warmup + steps), global_batch, seq_len)
    losses, grad_norms, times, splits = [], [], [], []
    for i in range(warmup + steps):
        dist.barrier()
        clk.reset()
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        contribution = trainer.step(i)
        if device.type == "cuda":  # the step's one synchronisation; its event spans are readable now
            torch.cuda.synchronize(device)
        clk.settle()
        t_idle = time.perf_counter()
        cpu_s = time.process_time() - cpu0
        comm_before = clk.comm
        dist.barrier()
        t1 = time.perf_counter()
        clk.comm = comm_before  # the end barrier is waiting, not communication
        idle = t1 - t_idle
        # the global mean loss and the squared gradient norm, each rank's part summed (runtime/grad_norm.py)
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # NCCL needs device tensors
        sums[0], sums[1] = contribution, trainer.opt.grad_sq
        dist.all_reduce(sums)  # outside the timed step
        losses.append(float(sums[0].item()))
        grad_norms.append(GN.norm_of(float(sums[1].item())))
        if i >= warmup:
            times.append(t1 - t0)
            splits.append(_split(clk, idle, cpu_s))
    report: dict[str, Any] = {
        "rank": rank, "losses": losses, "grad_norms": grad_norms, "step_times": times,
        "peak_memory_bytes": max(0, peak_memory(device) - baseline),
        "memory_baseline_bytes": baseline,
        "time_split": _median_split(splits, times, rank),
        "local_tokens": trainer.local_tokens,
    }
    if export_state:
        report["state"] = trainer.export_state()
    return report


def _runtime(plan: Plan, clk: CommClock) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The mesh builder and the trainer that run ``plan``: the runtime's one dispatch on the plan's
    form (a per-stage plan: autotune/runtime/stages.py, each stage its own degrees), then on its
    schedule (a data flow that is no chain of stages, HelixPipe: its hand-written runtime)."""
    if plan.per_stage:
        from autotune.runtime.stages import StagedTrainer, build_staged_mesh

        return build_staged_mesh, functools.partial(StagedTrainer, clock=clk)
    return build_mesh, RankTrainer if schedule_of(plan).chain else HelixTrainer


def _split(clk: CommClock, idle: float, cpu_s: float) -> dict[str, float]:
    """One measured step's split (the module docstring says what each holds)."""
    return {"compute_s": clk.compute + clk.emulated, "comm_s": clk.comm, "idle_s": idle, "emulated_s": clk.emulated,
            "compute_cpu_s": clk.compute_cpu, "cpu_s": cpu_s}


def _median_split(splits: list[dict[str, float]], times: list[float], rank: int) -> dict[str, float]:
    if not splits:
        return {"rank": rank, "compute_s": 0.0, "comm_s": 0.0, "idle_s": 0.0, "emulated_s": 0.0, "coverage": 0.0}
    out: dict[str, Any] = {"rank": rank}
    for k in ("compute_s", "comm_s", "idle_s", "emulated_s", "compute_cpu_s", "cpu_s"):
        out[k] = statistics.median(s[k] for s in splits)
    covered = [(s["compute_s"] + s["comm_s"] + s["idle_s"]) / t for s, t in zip(splits, times, strict=True) if t > 0]
    out["coverage"] = statistics.median(covered) if covered else 0.0
    return out


def reference_run(spec: ModelSpec, seq_len: int, global_batch: int, *, steps: int, seed: int,
                  dtype: str = "fp32", micro_batch_size: int = 1, data: dict[str, Any] | None = None,
                  documents: dict[str, Any] | None = None) -> dict[str, Any]:
    """The single-process training every plan must reproduce: same data, same init, same AdamW."""
    from autotune.plan import Degrees, Shares
    from autotune.runtime.mesh import single_process_mesh

    plan = Plan(degrees=Degrees(), dtype=dtype, micro_batch_size=micro_batch_size,
                num_microbatches=global_batch // micro_batch_size,
                shares=Shares(layers=(spec.layers,), tokens=(seq_len,), heads=(spec.heads,),
                              samples=(global_batch,)))
    trainer = RankTrainer(plan, spec, single_process_mesh(plan, torch.device("cpu")), seq_len, global_batch, seed,
                          data=data, documents=documents)
    losses, grad_norms = [], []
    for i in range(steps):
        losses.append(trainer.step(i))
        grad_norms.append(GN.norm_of(trainer.opt.grad_sq))
    return {"losses": losses, "grad_norms": grad_norms,
            "state": {k: v[0] for k, v in trainer.export_state().items()}}


def trial_job(payload: dict[str, Any], rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """Launcher target for `autotune trial`: one plan."""
    from autotune.specs.model import model_from_dict

    plan = Plan.from_dict(payload["plan"])
    spec = model_from_dict(payload["model"])
    emulate = {int(k): float(v) for k, v in (payload.get("emulate_slowdown") or {}).items()}
    return train(plan, spec, payload["seq_len"], payload["global_batch"], steps=payload["steps"],
                 warmup=payload["warmup"], seed=payload["seed"], device=device, emulate_slowdown=emulate,
                 timeout_s=payload.get("timeout_s"), data=payload.get("data"),
                 documents=payload.get("documents"))


def plans_job(payload: dict[str, Any], rank: int, world: int, device: torch.device) -> list[dict[str, Any]]:
    """Launcher target that runs many plans in one launch (the equivalence tests): fresh groups per
    plan, losses and final weights of each (a plan that raises ends the launch with its message)."""
    from autotune.specs.model import model_from_dict

    spec = model_from_dict(payload["model"])
    out = []
    for item in payload["plans"]:
        plan = Plan.from_dict(item)
        out.append(train(plan, spec, payload["seq_len"], payload["global_batch"], steps=payload["steps"],
                         warmup=0, seed=payload["seed"], device=device, export_state=True,
                         timeout_s=payload.get("timeout_s"), documents=payload.get("documents")))
    return out


def main(argv: list[str] | None = None) -> None:
    """torchrun entry: ``torchrun --nproc-per-node N -m autotune.runtime.worker --job JOB --out DIR``."""
    from autotune.runtime.launcher import worker_entry

    ap = argparse.ArgumentParser(prog="autotune.runtime.worker")
    ap.add_argument("--job", required=True, help="job file written by the launcher (torch.save)")
    ap.add_argument("--out", required=True, help="directory for per-rank results")
    args = ap.parse_args(argv)
    env = os.environ
    worker_entry(int(env.get("LOCAL_RANK", env.get("RANK", "0"))), args.job, args.out,
                 rank=int(env["RANK"]), world=int(env["WORLD_SIZE"]), init_from_env=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
