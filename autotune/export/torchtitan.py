"""torchtitan job-config TOML for a plan (keys from torchtitan/config/job_config.py).

* ``[parallelism]``: ``data_parallel_replicate_degree`` / ``data_parallel_shard_degree`` (DDP,
  FSDP or HSDP by ``zero_stage``: 0 -> replicate, 3 -> shard, 2 -> shard with
  ``fsdp_reshard_after_forward = "never"``, i.e. parameters stay gathered through backward as in
  ZeRO-2), ``tensor_parallel_degree``, ``pipeline_parallel_degree``, ``context_parallel_degree``,
  ``pipeline_parallel_schedule`` (the name each schedule module gives for torchtitan: GPipe, 1F1B,
  Interleaved1F1B, ZBVZeroBubble), ``pipeline_parallel_microbatch_size`` and
  ``module_fqns_per_model_part`` (one list of module names per (virtual) stage in model order, so
  uneven stages are exact; torchtitan places them on pp ranks looped, or as a V for ZBVZeroBubble and
  DualPipeV, as the schedule modules do);
* ``[training]``: ``local_batch_size`` (per DP rank), ``global_batch_size`` (accumulation when it
  exceeds local x dp), ``seq_len``, ``mixed_precision_param``;
* ``[activation_checkpoint]``: ``mode`` none|selective|full (selective per op);
* FP8: ``[model] converters`` and ``[quantize.linear.float8]`` (``fp8-current``: dynamic tensorwise
  scaling) or ``[quantize.linear.mx]`` (``fp8-mx``), the LM head left in bf16 (``FLOAT8``), and the
  experts' grouped GEMMs (``[quantize.grouped_mm.*]``) for an MoE model;
* experts: ``expert_parallel_degree`` and ``expert_tensor_parallel_degree`` (``expert_reasons`` holds
  what torchtitan accepts); ``[debug] moe_force_load_balance`` for a force-balanced router. The MoE
  architecture itself (experts, top-k, shared experts, MLA) is torchtitan's model flavor, not a job key.

torchtitan cannot express: Ulysses (hp), uneven token/head/sample shares, a contiguous CP layout
(its causal CP load-balances), ZeRO-1 alone, DDP together with another parallelism, tensor
parallelism without sequence parallelism (its TP plan always shards norms along the sequence), fp16,
FP8 with delayed or blockwise scaling, uneven expert shares, an etp other than 1 or tp, an ep outside the
FSDP-shard x cp (x tp) ranks, token dropping.
"""

from __future__ import annotations

import json
from typing import Any

from autotune.cost.kernels import COMPILED_HOST_S, KernelCosts
from autotune.export.common import (
    Collected,
    Export,
    ExportContext,
    comment_lines,
    even_everything,
    even_experts,
    even_share_reasons,
    fold,
    placement_comment,
    placement_reasons,
    provenance,
    unexpressed,
    with_even,
)
from autotune.plan import FP8_RECIPES, Plan
from autotune.plan_record import PlanRecord
from autotune.schedules import schedule_of

NAME = "torchtitan"

KERNELS = KernelCosts(
    name="torchtitan", framework="torchtitan", host_s=COMPILED_HOST_S, block_fwd=12, head_fwd=3,
    source="torchtitan with torch.compile per block ([compile] enable, which this exporter writes): the 7 GEMMs "
           "and SDPA stay library kernels, Inductor fuses the norms, rotary, SiLU-gate and residuals into about 4 "
           "Triton kernels; host time per kernel COMPILED_HOST_S")
"""How torchtitan runs an exported plan (compiled): the cost model's kernel costs for ``--target torchtitan``."""
SUFFIX = ".toml"

PRECISION = {"bf16": "bfloat16", "fp32": "float32", "fp32-strict": "float32",
             **{dt: "bfloat16" for dt in FP8_RECIPES}}  # Training.mixed_precision_param
FLOAT8 = {"current": ("quantize.linear.float8", {"recipe_name": "tensorwise"}),
          "mxfp8": ("quantize.linear.mx", {"recipe_name": "mxfp8_cublas"})}
"""The FP8 recipes torchtitan runs (``[quantize.linear.float8]`` / ``[quantize.linear.mx]`` of its job
config, torchao underneath), as (model converter, section keys): dynamic tensorwise scaling is
``current`` scaling; MXFP8 on Blackwell. torchao dropped delayed scaling and has no DeepSeek-style
blockwise recipe for training, so those are refused with ``fp8-current`` as the nearest."""
EXPRESSES = ("dp", "pp", "cp", "tp", "ep", "etp")
"""The dimensions torchtitan's ParallelDims runs (``export.common.unexpressed`` refuses the rest)."""
WHY_NOT = {"hp": "torchtitan has no Ulysses (all-to-all head) parallelism; its context parallelism is ring attention"}
WHY = {
    "experts": "torchtitan gives every expert-parallel rank num_experts/ep experts",
    "tokens": "torchtitan context parallelism shards the sequence evenly",
    "heads": "torchtitan splits heads evenly over tensor-parallel ranks",
    "samples": "torchtitan gives every data-parallel rank local_batch_size samples",
}


def reasons(plan: Plan, ctx: ExportContext) -> list[str]:
    d = plan.degrees
    r = Collected(even_share_reasons(plan, NAME, ("tokens", "heads", "samples"), WHY))
    r.items += unexpressed(plan, NAME, EXPRESSES, WHY_NOT)
    r.add(d.cp > 1 and plan.cp_layout == "contiguous",
          "cp_layout contiguous: torchtitan's causal context parallelism always load-balances the shards")
    r.add(plan.zero_stage == 1, "zero_stage 1: torchtitan shards with FSDP2 (parameters too); there is no "
          "optimizer-state-only sharding")
    others = [k for k in ("pp", "cp", "tp") if getattr(d, k) > 1]
    r.add(plan.zero_stage == 0 and d.dp > 1 and bool(others),
          f"zero_stage 0 with dp({d.dp}) and {', '.join(others)}: torchtitan's DDP does not compose with other "
          "parallelisms (use FSDP/HSDP)")
    r.add(d.tp > 1 and not plan.sequence_parallel,
          "sequence_parallel false with tp: torchtitan's tensor-parallel plan always shards norms along the sequence")
    r.add(plan.dtype == "fp16", "dtype fp16: torchtitan's training.mixed_precision_param is bfloat16 or float32")
    r.add(bool(plan.recompute_modules), "recompute_modules: torchtitan's selective activation checkpointing "
          "saves per op or per layer, not per named module")
    r.add(plan.dtype in FP8_RECIPES and FP8_RECIPES[plan.dtype] not in FLOAT8,
          f"dtype {plan.dtype}: torchtitan's float8 (torchao) has dynamic tensorwise/rowwise scaling and MXFP8, "
          f"no {FP8_RECIPES.get(plan.dtype)} scaling")
    why = schedule_of(plan).refusal(NAME)
    r.add(d.pp > 1 and why is not None, why or "")
    r.items += expert_reasons(plan, ctx)
    r.items += window_reasons(plan, ctx)
    r.items += placement_reasons(plan)
    return r.items


def window_reasons(plan: Plan, ctx: ExportContext) -> list[str]:
    """Sliding windows and sinks are the model flavor's (torchtitan's ``gpt_oss`` model, as experts
    are), not job keys; that model runs FSDP/HSDP, TP, EP and ETP, with CP and PP on its to-do list
    (torchtitan/models/gpt_oss/README.md)."""
    m = ctx.model
    if not (m.window or m.sinks):
        return []
    d = plan.degrees
    used = [f"{k}({getattr(d, k)})" for k in ("pp", "cp") if getattr(d, k) > 1]
    return [f"{', '.join(used)}: model {m.name} has sliding-window layers or sinks, which torchtitan runs in its "
            "gpt_oss model, and that model has no pipeline or context parallelism"] if used else []


def expert_reasons(plan: Plan, ctx: ExportContext) -> list[str]:
    """torchtitan's expert parallelism (job_config.py, Parallelism.expert_parallel_degree and
    expert_tensor_parallel_degree): experts split evenly; etp is 1 or the dense tp; EP borrows the
    FSDP shard ranks and cp (and, at etp 1, tp), so ep is a multiple of cp (cp*tp) and divides
    dp_shard*cp (dp_shard*cp*tp); its MoE is dropless."""
    moe = ctx.model.moe
    if moe is None:
        return []
    d = plan.degrees
    r = Collected(even_share_reasons(plan, NAME, ("experts",), WHY))
    r.add(d.etp not in (1, d.tp), f"etp({d.etp}): torchtitan's expert tensor parallelism is 1 or the dense "
          f"tp({d.tp})")
    if d.ep > 1 and d.etp in (1, d.tp):
        shard = d.dp if plan.zero_stage >= 2 else 1
        inner = d.cp * (d.tp if d.etp == 1 and d.tp > 1 else 1)
        r.add(d.ep % inner != 0 or (shard * inner) % d.ep != 0,
              f"ep({d.ep}): torchtitan builds expert parallelism from the FSDP shard ranks ({shard}) times "
              f"{'cp*tp' if inner != d.cp else 'cp'} ({inner}): ep must be a multiple of {inner} dividing {shard * inner}")
    r.add(not moe.router.dropless, f"moe.router.capacity_factor {moe.router.capacity_factor}: torchtitan's "
          "MoE routes dropless (no capacity, no token dropping)")
    return r.items


def candidates(plan: Plan, ctx: ExportContext) -> list[Plan]:
    d = plan.degrees
    zero = plan.zero_stage
    if zero == 1:
        zero = 2
    if zero == 0 and d.dp > 1 and (d.pp > 1 or d.cp > 1 or d.tp > 1 or d.hp > 1 or d.ep > 1):
        zero = 3  # FSDP: torchtitan's DDP composes with nothing, and its EP borrows the shard ranks
    base = with_even(plan, "tokens", "heads", "samples")
    if d.pp > 1 and schedule_of(plan).refusal(NAME):
        base = with_even(base, "layers").replace(schedule="1f1b", virtual_stages=1)
    base = base.replace(
        cp_layout="zigzag", zero_stage=zero, sequence_parallel=plan.sequence_parallel or d.tp > 1,
        helix_folds=1,
        dtype={"fp16": "bf16", **{dt: "fp8-current" for dt, r in FP8_RECIPES.items() if r not in FLOAT8}}.get(
            plan.dtype, plan.dtype))
    out = [base, even_everything(base)]
    if d.hp > 1:
        out = [fold(base, "hp", "cp"), fold(base, "hp", "dp"), fold(base, "hp", "tp")]
        out = [p.replace(sequence_parallel=p.degrees.tp > 1 or p.sequence_parallel) for p in out]
    if window_reasons(plan, ctx):  # its gpt_oss model: the pipeline and the ring folded into the data ranks
        out = [fold(p, "pp", "dp") if p.degrees.pp > 1 else p for p in out]
        out = [fold(p, "cp", "dp") if p.degrees.cp > 1 else p for p in out]
    return [q for p in out for q in even_experts(p, ctx, etps=(1, p.degrees.tp))]


def module_parts(plan: Plan, ctx: ExportContext) -> list[list[str]]:
    """Module names per (virtual) stage in model order; embeddings first, final norm and output last."""
    layers = plan.shares.layers
    assert layers is not None
    parts, start = [], 0
    for j, n in enumerate(layers):
        names = [f"layers.{i}" for i in range(start, start + n)]
        start += n
        if j == 0:
            names.insert(0, "tok_embeddings")
        if j == len(layers) - 1:
            names += ["norm", "output"]
        parts.append(names)
    return parts


def config(plan: Plan, ctx: ExportContext) -> dict[str, dict[str, Any]]:
    d = plan.degrees
    shard = d.dp if plan.zero_stage >= 2 else 1
    replicate = 1 if plan.zero_stage >= 2 else d.dp
    par: dict[str, Any] = {
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
        "tensor_parallel_degree": d.tp,
        "pipeline_parallel_degree": d.pp,
        "context_parallel_degree": d.cp,
    }
    if ctx.model.moe is not None:
        par["expert_parallel_degree"] = d.ep
        par["expert_tensor_parallel_degree"] = d.etp
    if plan.zero_stage == 2:
        par["fsdp_reshard_after_forward"] = "never"
    elif plan.zero_stage == 3:
        par["fsdp_reshard_after_forward"] = "always"
    local = ctx.global_batch // d.dp
    if d.pp > 1:
        par["pipeline_parallel_schedule"] = schedule_of(plan).targets[NAME]
        par["pipeline_parallel_microbatch_size"] = plan.micro_batch_size
        par["module_fqns_per_model_part"] = module_parts(plan, ctx)
        local_batch = local  # the schedule splits it into local / microbatch_size micro-batches
    else:
        local_batch = plan.micro_batch_size  # micro-batches become gradient accumulation steps
    ac = {"none": {"mode": "none"}, "selective": {"mode": "selective", "selective_ac_option": "op"},
          "full": {"mode": "full"}}[plan.recompute]
    cfg = {
        "parallelism": par,
        "training": {"local_batch_size": local_batch, "global_batch_size": ctx.global_batch,
                     "seq_len": ctx.seq_len, "mixed_precision_param": PRECISION[plan.dtype]},
        "activation_checkpoint": ac,
        "compile": {"enable": True, "components": ["model", "loss"]},
    }
    cfg.update(float8_sections(plan, ctx))
    if ctx.model.moe is not None and ctx.model.moe.router.force_balance:
        cfg["debug"] = {"moe_force_load_balance": True}
    return cfg


def float8_sections(plan: Plan, ctx: ExportContext) -> dict[str, dict[str, Any]]:
    """An FP8 plan's model converters and ``[quantize.*]`` sections (``FLOAT8``): the linear layers,
    and for an MoE model the experts' grouped GEMMs (``[quantize.grouped_mm.*]``, fqns ``experts``);
    the LM head (``output``) stays in bf16, as the cost model prices it; under FSDP tensorwise scaling
    gathers the weights in float8 (torchtitan's recommendation for it)."""
    if plan.dtype not in FP8_RECIPES:
        return {}
    recipe = FP8_RECIPES[plan.dtype]
    converter, keys = FLOAT8[recipe]
    section = {**keys, "filter_fqns": ["output"]}
    if recipe == "current" and plan.zero_stage >= 2:
        section.update(enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True)
    _, _, kind = converter.split(".")
    quantize: dict[str, Any] = {"linear": {kind: section}}
    converters = [converter]
    if ctx.model.moe is not None:
        quantize["grouped_mm"] = {kind: {"fqns": ["experts"], **({"recipe_name": "mxfp8"} if kind == "mx" else {})}}
        converters.append(f"quantize.grouped_mm.{kind}")
    return {"model": {"converters": converters}, "quantize": quantize}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string is a JSON string for these characters
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def to_toml(cfg: dict[str, dict[str, Any]], header: list[str]) -> str:
    lines = list(header)
    for section, keys in cfg.items():
        lines += _table(section, keys)
    return "\n".join(lines) + "\n"


def _table(name: str, keys: dict[str, Any]) -> list[str]:
    """``[name]`` with its values, then each nested mapping as ``[name.key]`` (``[quantize.linear.float8]``)."""
    values = {k: v for k, v in keys.items() if not isinstance(v, dict)}
    lines = ["", f"[{name}]", *(f"{k} = {_toml_value(v)}" for k, v in values.items())] if values else []
    for k, v in keys.items():
        if isinstance(v, dict):
            lines += _table(f"{name}.{k}", v)
    return lines


def render(record: PlanRecord, ctx: ExportContext) -> Export:
    plan = record.plan
    cfg = config(plan, ctx)
    prov = provenance(record, ctx)
    header = ["# torchtitan job config: merge these sections into your train config TOML"]
    header += comment_lines(prov)
    header.append(f"# world size {plan.world} = {plan.degrees.product_text()} (NGPU={plan.world})")
    header += placement_comment(plan)
    return Export(format=NAME, text=to_toml(cfg, header), data={"config": cfg, "provenance": prov}, suffix=SUFFIX)
