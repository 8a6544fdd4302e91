"""``run_trial``: run a plan for real on local processes and measure it (docs/contracts.md "Runtime").

Everything the runtime cannot take is refused *before* any process starts (an ``InputError``, exit
2 in the CLI): a world that does not match the processes asked for or the machine, shares the model
cannot take, a model feature the runtime does not build, a model too large for the device. A run
that starts and fails is a result: ``TrialResult.failure`` = {"kind": oom|error|timeout, "rank",
"message"}.

Aggregation: a step's time is the same on every rank (it ends at a barrier); ``step_time_s`` is the
median over measured steps of the slowest rank's time, ``tokens_per_s`` = global tokens / that.
``losses`` holds the global mean loss of every step, warm-up steps first (the training is the
same whatever the plan, so they are comparable across plans); ``grad_norms`` the global gradient
norm of every step beside it (after the reduction and the fp16 unscaling, before the update; each
parameter counted once over the ranks' shards and replicas, ``runtime/grad_norm.py``; None for a
step the fp16 loss scale skipped), which a plan reducing its gradients with a wrong factor cannot
match though its losses do.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autotune import machine_load
from autotune.errors import InputError
from autotune.plan import FP8_RECIPES, GRAD_REDUCE_DTYPE, MOMENTS_DTYPE, Plan, PlanError
from autotune.plan_record import PlanRecord
from autotune.specs.model import ModelSpec, load_model
from autotune.stages import on_local_devices

DEFAULT_TIMEOUT_S = 600.0


@dataclass
class TrialResult:
    plan: dict[str, Any]
    measured: dict[str, Any] | None
    losses: list[float] = field(default_factory=list)
    failure: dict[str, Any] | None = None
    grad_norms: list[float | None] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failure is None

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan, "measured": self.measured, "losses": self.losses, "grad_norms": self.grad_norms,
                "failure": self.failure}


def _device_kind(device: str) -> str:
    if device not in ("auto", "cpu", "cuda"):
        raise InputError(f"must be auto, cpu or cuda, got {device!r}", field="device")
    if device == "cpu":
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if device == "cuda":
        raise InputError("no CUDA device is visible", field="device")
    return "cpu"


def check_runtime_support(plan: Plan, spec: ModelSpec) -> None:
    """What this runtime builds (beyond what Plan.resolve already checks); raises PlanError."""
    p: list[str] = []
    # every norm, position kind, activation and bias the spec accepts is built (runtime/model.py)
    if spec.position == "rope" and spec.head_dim % 2:
        p.append(f"model {spec.name}: rotary embeddings need an even head_dim, got {spec.head_dim}")
    seq = sum(plan.shares.tokens) if plan.shares.tokens else 0  # a resolved plan's tokens add up to seq_len
    if spec.position == "learned" and seq > spec.max_positions:
        p.append(f"seq_len: {seq} tokens > the learned position table of model {spec.name} "
                 f"(max_positions: {spec.max_positions})")
    for tp in plan.tp_degrees():  # a per-stage plan: every replica's tp
        if spec.vocab % tp:
            p.append(f"degrees.tp: vocab({spec.vocab}) not divisible by tp({tp})")
        if spec.dense_ffn_width % tp:  # ffn_hidden, or an MoE model's dense layers' width
            p.append(f"degrees.tp: ffn_hidden({spec.dense_ffn_width}) not divisible by tp({tp})")
    if plan.micro_batch_size < 1:
        p.append("micro_batch_size: must be >= 1")
    if plan.dtype in FP8_RECIPES:
        p.append(f"dtype {plan.dtype}: autotune's runtime trains in bf16, fp16 or fp32; FP8 GEMMs need Transformer "
                 "Engine or torchao on a GPU with FP8 tensor cores (price it, or export it to Megatron or torchtitan)")
    if plan.grad_reduce != GRAD_REDUCE_DTYPE:
        p.append(f"grad_reduce: {plan.grad_reduce}: the runtime accumulates and reduces gradients in "
                 f"{GRAD_REDUCE_DTYPE} (price it, or export it to Megatron)")
    if plan.moments != MOMENTS_DTYPE:
        p.append(f"moments: {plan.moments}: the runtime's Adam keeps its moments in {MOMENTS_DTYPE} (price it, or "
                 "export it to Megatron)")
    if plan.moe_a2a_overlap:
        p.append("moe_a2a_overlap: the runtime waits for each MoE all-to-all (price it, or export it to Megatron)")
    if plan.moe_dispatcher != "alltoall":
        p.append(f"moe_dispatcher: {plan.moe_dispatcher}: the runtime sends MoE tokens by all-to-all (price it, or "
                 "export it to Megatron)")
    if plan.cuda_graph_scope:
        p.append("cuda_graph_scope: the runtime issues every kernel eagerly (price it, or export it to Megatron)")
    p += _moe_problems(plan, spec) + _window_problems(plan, spec)
    if p:
        raise PlanError("; ".join(p), field="plan")


def _window_problems(plan: Plan, spec: ModelSpec) -> list[str]:
    """What the runtime's sliding-window layers (``runtime/attention.causal_sdpa``: a mask over the
    whole sequence) and its attention do not run, each with its reason."""
    from autotune.schedules import schedule_of

    p = []
    if spec.sinks:
        p.append(f"model {spec.name}: the runtime's attention has no learned sinks (priced and exported; set "
                 "sinks: false to run its windows)")
    if not spec.window:
        return p
    if plan.degrees.cp > 1:
        p.append(f"degrees.cp: model {spec.name} has sliding-window layers and the runtime's ring attention "
                 f"takes no window (run cp 1, or price and export cp {plan.degrees.cp})")
    if plan.doc_mask:
        p.append(f"doc_mask: model {spec.name} has sliding-window layers; the runtime masks documents or a "
                 "window, not both")
    if not schedule_of(plan).chain:
        p.append(f"schedule {plan.schedule}: its trainer runs attention outside the blocks (runtime/helix.py), "
                 "without sliding windows")
    return p


def _moe_problems(plan: Plan, spec: ModelSpec) -> list[str]:
    """What the runtime's MoE layers (runtime/moe.py, runtime/expert_parallel.py) do not run, each
    with its reason."""
    if spec.mla is not None:
        return [f"model {spec.name}: the runtime does not build Multi-head Latent Attention (priced and "
                "exported only)"]
    if spec.moe is None:
        return []
    p, d = [], plan.degrees
    if plan.disaggregate:
        p.append("disaggregate: expert-only ranks (HeterMoE's disaggregation) are priced and searched, not run: "
                 "every trial rank runs attention and its experts")
    if spec.moe.shared_width % d.tp:
        p.append(f"degrees.tp: the shared experts' width({spec.moe.shared_width}) is not divisible by tp({d.tp})")
    if plan.zero_stage >= 2:
        p.append(f"zero_stage: {plan.zero_stage} would shard expert weights over the dense gradient group; "
                 "the runtime's FSDP2 wrapping has no expert-DP mesh (use ZeRO-0/1 with MoE)")
    samples = plan.shares.samples or ()
    if len(set(samples)) > 1 and d.ep * d.etp > d.cp * d.hp * d.tp:
        p.append(f"shares.samples: {'/'.join(map(str, samples))} gives the dp replicas different micro-batch "
                 f"counts, and ep*etp({d.ep * d.etp}) spans replicas whose all-to-alls would not pair up")
    if d.tp > 1 and not plan.sequence_parallel:
        bad = [t for t in plan.shares.tokens or () if (t // d.hp) * plan.micro_batch_size % d.tp]
        if bad:
            p.append(f"shares.tokens: {bad[0]} tokens a micro-batch do not split over tp({d.tp}) for the "
                     "experts (each tp rank dispatches its part)")
    return p


def _device_memory(kind: str, world: int) -> float:
    if kind == "cuda":
        import torch

        return float(min(torch.cuda.get_device_properties(i).total_memory for i in range(world)))
    from autotune.specs.catalogue import local_cpu

    return float(local_cpu(world).memory_bytes)


def prepare(plan: Plan | dict[str, Any], model: ModelSpec | str, seq_len: int, global_batch: int, *,
            nproc: int | None = None, device: str = "auto") -> tuple[Plan, ModelSpec, str]:
    """Resolve and check a plan for a local trial; raises InputError before anything starts."""
    from autotune.specs.cluster import load_cluster

    spec = model if isinstance(model, ModelSpec) else load_model(model)
    if isinstance(plan, dict):
        plan = Plan.from_dict(plan)
    kind = _device_kind(device)
    # placement names physical devices of the cluster the plan was made for; locally rank r is process r
    # (a per-stage plan made for a larger cluster runs its shape on nproc local processes)
    plan = on_local_devices(plan, nproc, spec)
    world = plan.world
    if nproc is not None and nproc != world:
        raise PlanError(f"degrees: {plan.degrees.product_text()} = {world} != --nproc({nproc})", field="plan")
    if kind == "cuda":
        import torch

        n = torch.cuda.device_count()
        if world > n:
            raise PlanError(f"degrees: {plan.degrees.product_text()} = {world} > visible GPUs({n})", field="plan")
        if plan.dtype == "bf16" and not torch.cuda.is_bf16_supported():
            raise PlanError(f"bf16 is not supported by {torch.cuda.get_device_name(0)}; use --dtype fp16",
                            field="dtype")
    else:
        limit = max(64, 8 * (os.cpu_count() or 1))
        if world > limit:
            raise PlanError(f"degrees: world {world} > {limit} local processes this machine can host",
                            field="plan")
    cluster = load_cluster(f"local:{world}")
    resolved = plan.resolve(spec, cluster, seq_len, global_batch)
    check_runtime_support(resolved, spec)
    _check_memory(resolved, spec, cluster, seq_len, global_batch, kind)
    return resolved, spec, kind


def _check_memory(plan: Plan, spec: ModelSpec, cluster: Any, seq_len: int, global_batch: int, kind: str) -> None:
    """Refuse a plan whose busiest rank needs more memory than a local device has, by the cost
    model's memory (``autotune/cost/memory.py``: the one memory model the search prices with)."""
    from autotune.cost.memory import TERM_NAMES
    from autotune.cost.plan_memory import peak_rank_memory
    from autotune.units import fmt_bytes

    need, rank, terms = peak_rank_memory(plan, spec, cluster, seq_len, global_batch)
    have = _device_memory(kind, plan.world)
    if need > have:
        worst = max(TERM_NAMES, key=lambda k: terms[k])
        raise PlanError(f"model {spec.name} needs about {fmt_bytes(need)} on its busiest rank ({rank}; "
                        f"largest: {worst} {fmt_bytes(terms[worst])}) > {fmt_bytes(have)} per "
                        f"{'GPU' if kind == 'cuda' else 'local worker'}", field="plan")


def run_trial(plan: Plan | dict[str, Any], model: ModelSpec | str, seq_len: int, global_batch: int, *,
              steps: int = 5, warmup: int = 2, seed: int = 0, emulate_slowdown: dict[int, float] | None = None,
              timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "auto", nproc: int | None = None,
              data: str | None = None, data_dtype: str = "auto",
              on_launch: Callable[[Plan], None] | None = None, documents: Any = None) -> TrialResult:
    """Launch ``plan`` on local processes, train ``warmup + steps`` steps, measure the last ``steps``.
    ``data``: a token file (autotune.runtime.data; checked here, before any process starts), else
    the synthetic stream. ``on_launch(plan)`` is called once every check has passed, just before the
    processes start."""
    from autotune.runtime.data import prepare_data
    from autotune.runtime.launcher import launch

    if steps < 1:
        raise InputError(f"must be >= 1, got {steps}", field="steps")
    if warmup < 0:
        raise InputError(f"must be >= 0, got {warmup}", field="warmup")
    resolved, spec, kind = prepare(plan, model, seq_len, global_batch, nproc=nproc, device=device)
    emulate = {int(r): float(f) for r, f in (emulate_slowdown or {}).items()}
    for r, f in emulate.items():
        if not 0 <= r < resolved.world:
            raise InputError(f"rank {r} is not in the plan's world 0..{resolved.world - 1}", field="--emulate-slowdown")
        if not (f >= 1.0 and math.isfinite(f)):
            raise InputError(f"factor must be >= 1, got {f}", field="--emulate-slowdown")
    data_desc = prepare_data(data, spec.vocab, seq_len, global_batch, warmup + steps, dtype=data_dtype)
    payload = {"plan": resolved.to_dict(), "model": spec.to_dict(), "seq_len": seq_len,
               "global_batch": global_batch, "steps": steps, "warmup": warmup, "seed": seed,
               "emulate_slowdown": emulate, "timeout_s": timeout_s, "data": data_desc,
               "documents": _documents_entry(resolved, documents, data_desc)}
    if on_launch is not None:
        on_launch(resolved)
    with machine_load.watch() as load:  # what else ran meanwhile (validate compares it with the profile's)
        res = launch("autotune.runtime.worker:trial_job", payload, resolved.world, timeout_s=timeout_s, device=kind)
    if res.failure is not None:
        return TrialResult(plan=PlanRecord(resolved).to_dict(), measured=None, losses=[], failure=res.failure)
    out = result_from_reports(resolved, res.results, global_batch=global_batch, seq_len=seq_len, steps=steps,
                              warmup=warmup, seed=seed, device=kind, emulate=emulate, data=data_desc,
                              wall_s=res.wall_s)
    if payload["documents"] is not None and out.measured is not None:  # which windows were measured
        out.measured["documents"] = {**documents.dist.brief(), "balance": resolved.balance}
    if out.measured is not None:
        out.measured["load"] = load
    return out


def _documents_entry(plan: Plan, documents: Any, data_desc: dict[str, Any] | None) -> dict[str, Any] | None:
    """The payload's ``documents`` (``runtime/documents.DocumentFeed``) for a plan that masks them:
    ``documents`` is an ``autotune.documents.DocumentSource``; EOD ends and Megatron indexes need
    the very token file the distribution was read from."""
    if not plan.doc_mask:
        return None
    if documents is None:
        raise InputError("the plan masks documents (doc_mask) but no documents were given: --data FILE --eod ID "
                         "or --lengths FILE", field="--doc-mask")
    if documents.data is not None and (data_desc is None or data_desc["path"] != str(documents.data)):
        raise InputError(f"the documents were read from {documents.data}; train on it (--data)", field="--data")
    return documents.payload()


def result_from_reports(resolved: Plan, reports: list[dict[str, Any]], *, global_batch: int, seq_len: int,
                        steps: int, warmup: int, seed: int, device: str, emulate: dict[int, float] | None,
                        data: dict[str, Any] | None, wall_s: float) -> TrialResult:
    """The TrialResult of a run from every rank's report (``runtime.worker.train``), whichever
    launch gathered them: local processes here, or the nodes of a run across hosts
    (``autotune.runtime.control``)."""
    reports = sorted(reports, key=lambda r: r["rank"])
    per_step = [max(r["step_times"][i] for r in reports) for i in range(steps)]
    step_time = statistics.median(per_step)
    measured = {
        "step_time_s": step_time,
        "tokens_per_s": global_batch * seq_len / step_time if step_time > 0 else 0.0,
        # per rank, over the rank's own baseline (autotune/runtime/worker.py reset_peak_memory)
        "peak_memory_bytes": [r["peak_memory_bytes"] for r in reports],
        "memory_baseline_bytes": [r["memory_baseline_bytes"] for r in reports],
        "time_split": [r["time_split"] for r in reports],
        "step_times_s": per_step,
        "steps": steps, "warmup": warmup, "seed": seed, "device": device,
        "emulated_slowdown": {str(k): v for k, v in (emulate or {}).items()} or None,
        "data": data["path"] if data else "synthetic",
        "launch_wall_s": wall_s,
    }
    return TrialResult(plan=PlanRecord(resolved, measured=measured).to_dict(), measured=measured,
                       losses=reports[0]["losses"], grad_norms=reports[0]["grad_norms"], failure=None)
