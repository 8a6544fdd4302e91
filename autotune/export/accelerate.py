"""Hugging Face Accelerate ``ParallelismConfig`` fields for a plan (accelerate/parallelism_config.py).

* ``dp_replicate_size`` / ``dp_shard_size``: ``zero_stage`` 0 -> replicate (DDP), 2/3 -> shard
  (FSDP2, with ``reshard_after_forward`` false for 2, true for 3); a Ulysses plan (hp) runs under the
  DeepSpeed engine instead (Accelerate 1.16 runs sp only there), ZeRO from ``DeepSpeedPlugin``;
* ``tp_size``; ``cp_size`` (torch ring CP); ``sp_size`` with ``sp_backend "deepspeed"`` (Ulysses/ALST);
* ``total_size`` = dp_replicate x dp_shard x tp x cp x sp must equal the number of processes;
* ``Accelerator(gradient_accumulation_steps=..., mixed_precision=...)`` and the per-device batch; an FP8
  dtype is ``mixed_precision="fp8"`` with its recipe's kwargs handler (``FP8``).

Accelerate cannot express: pipeline parallelism, cp and sp together (its ParallelismConfig rejects
it), tp or cp with pure replication (rejected too), ZeRO-1 alone, uneven shares, selective
recomputation (FSDP's activation_checkpointing is whole blocks), Megatron sequence parallelism, FP8
with blockwise scaling, expert parallelism (ep, etp: the experts are FSDP-sharded weights).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from autotune.cost.kernels import EAGER
from autotune.export.common import (
    Collected,
    Export,
    ExportContext,
    even_everything,
    even_share_reasons,
    fold,
    node_order,
    placement_reasons,
    provenance,
    unexpressed,
    with_even,
)
from autotune.plan import FP8_RECIPES, Plan
from autotune.plan_record import PlanRecord

NAME = "accelerate"

KERNELS = dataclasses.replace(EAGER, name="accelerate (eager PyTorch)", framework="accelerate")
"""Accelerate runs a Hugging Face-style model eagerly: the cost model\'s kernel costs for ``--target accelerate``."""
SUFFIX = ".json"

EXPRESSES = ("dp", "cp", "hp", "tp")
"""The dimensions Accelerate's ParallelismConfig runs (``export.common.unexpressed`` refuses the rest)."""
WHY_NOT = {"pp": "Accelerate's ParallelismConfig has no pipeline parallelism",
           **{n: "Accelerate's ParallelismConfig has no expert parallelism (FSDP shards the experts like any other "
                 "weight)" for n in ("ep", "etp")}}
MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no", "fp32-strict": "no"}
"""``Accelerator(mixed_precision=...)`` of each 16/32-bit dtype; an FP8 dtype is ``"fp8"`` with ``FP8``'s recipe."""
FP8 = {"delayed": {"handler": "TERecipeKwargs", "kwargs": {"fp8_format": "HYBRID"}},
       "mxfp8": {"handler": "TERecipeKwargs", "kwargs": {"fp8_format": "E4M3", "use_mxfp8_block_scaling": True}},
       "current": {"handler": "AORecipeKwargs", "kwargs": {}}}
"""The FP8 recipes Accelerate runs, as the kwargs handler passed to ``Accelerator(mixed_precision="fp8",
kwargs_handlers=[...])`` (accelerate/utils/dataclasses.py): Transformer Engine's delayed scaling
(``TERecipeKwargs``, HYBRID format) and its MXFP8 block scaling, torchao's dynamic (current)
tensorwise scaling (``AORecipeKwargs``). No blockwise (1x128 / 128x128) recipe: refused."""
WHY = {
    "layers": "Accelerate has no pipeline stages",
    "tokens": "Accelerate shards the sequence evenly (cp or sp)",
    "heads": "Accelerate splits heads evenly",
    "samples": "Accelerate gives every data-parallel rank the same per-device batch",
}


def reasons(plan: Plan, ctx: ExportContext) -> list[str]:
    d = plan.degrees
    r = Collected(even_share_reasons(plan, NAME, ("tokens", "heads", "samples"), WHY))
    r.items += unexpressed(plan, NAME, EXPRESSES, WHY_NOT)
    r.add(d.cp > 1 and d.hp > 1, f"cp({d.cp}) with hp({d.hp}): Accelerate's context parallelism (cp_size) and "
          "Ulysses (sp_size) are mutually exclusive")
    r.add(d.cp > 1 and plan.cp_layout == "contiguous",
          "cp_layout contiguous: Accelerate's torch context parallelism load-balances causal shards")
    r.add(plan.zero_stage == 0 and d.dp > 1 and (d.tp > 1 or d.cp > 1),
          f"zero_stage 0 with dp({d.dp}) and tp/cp: Accelerate rejects tp or cp with pure replication "
          "(dp_replicate_size > 1, dp_shard_size == 1)")
    r.add(plan.zero_stage == 1 and d.hp == 1, "zero_stage 1: Accelerate's FSDP2 shards parameters too; there "
          "is no optimizer-state-only sharding (only Ulysses plans run under the DeepSpeed engine here)")
    r.add(plan.recompute == "selective", "recompute selective: FSDP activation_checkpointing recomputes "
          "whole blocks")
    r.add(plan.sequence_parallel and d.tp > 1, "sequence_parallel: Accelerate's tensor parallelism has no "
          "Megatron sequence parallelism")
    r.add(plan.dtype in FP8_RECIPES and FP8_RECIPES[plan.dtype] not in FP8,
          f"dtype {plan.dtype}: Accelerate's FP8 backends (Transformer Engine, torchao) have no "
          f"{FP8_RECIPES.get(plan.dtype)} scaling recipe")
    r.add(d.cp > 1 and bool(ctx.model.window), f"cp({d.cp}): model {ctx.model.name} has sliding-window layers and "
          "Accelerate's context parallelism (torch's context_parallel) shards causal SDPA, which takes no window mask")
    r.items += placement_reasons(plan)
    return r.items


def candidates(plan: Plan, ctx: ExportContext) -> list[Plan]:
    d = plan.degrees
    zero = plan.zero_stage if d.hp > 1 else {1: 2}.get(plan.zero_stage, plan.zero_stage)
    base = even_everything(plan).replace(
        schedule="1f1b", virtual_stages=1, helix_folds=1, cp_layout="zigzag", sequence_parallel=False,
        recompute="full" if plan.recompute == "selective" else plan.recompute)
    starts = [base]
    if d.pp > 1:
        starts = [fold(base, "pp", "dp")]
    if d.cp > 1 and d.hp > 1:
        starts = [fold(p, "hp", "cp") for p in starts] + [fold(p, "cp", "hp") for p in starts]
    out = []
    for p in starts:
        z = zero
        if z == 0 and p.degrees.dp > 1 and (p.degrees.tp > 1 or p.degrees.cp > 1):
            z = 3
        out.append(p.replace(zero_stage=z))
    if plan.recompute == "selective":
        out += [p.replace(recompute="none") for p in out]
    if plan.dtype in FP8_RECIPES and FP8_RECIPES[plan.dtype] not in FP8:  # another recipe it runs
        out = [p.replace(dtype=dt) for p in out for dt in FP8_RECIPES if FP8_RECIPES[dt] in FP8]
    if d.ep > 1 or d.etp > 1:  # experts replicated, sharded by FSDP
        out = [with_even(p, "experts").replace(degrees=dataclasses.replace(p.degrees, ep=1, etp=1)) for p in out]
    return out


def config(plan: Plan, ctx: ExportContext) -> dict[str, Any]:
    d = plan.degrees
    # Ulysses (sp_size) runs under the DeepSpeed engine (ALST): ZeRO comes from the DeepSpeed plugin
    # and DeepSpeed owns the data-parallel groups; otherwise FSDP2 shards for ZeRO 2/3
    deepspeed_engine = d.hp > 1
    shard = plan.zero_stage >= 2 and not deepspeed_engine
    pc: dict[str, Any] = {
        # under DeepSpeed, ZeRO partitions over all data-parallel ranks: they are the shard axis
        "dp_replicate_size": 1 if shard or deepspeed_engine else d.dp,
        "dp_shard_size": d.dp if shard or deepspeed_engine else 1,
        "tp_size": d.tp,
        "cp_size": d.cp,
        "sp_size": d.hp,
    }
    if d.hp > 1:
        # "deepspeed" (ALST/Ulysses under the DeepSpeed engine) is the one value every Accelerate with
        # sp_size accepts (1.16 accepts only it; later versions add a native "accelerate" backend)
        pc["sp_backend"] = "deepspeed"
    fsdp = ds = None
    if deepspeed_engine:
        ds = {"zero_stage": plan.zero_stage, "gradient_accumulation_steps": plan.num_microbatches}
    if shard:
        fsdp = {"fsdp_version": 2, "reshard_after_forward": plan.zero_stage == 3,
                "activation_checkpointing": plan.recompute == "full"}
    return {
        "parallelism_config": pc,
        "accelerator": {"mixed_precision": MIXED_PRECISION.get(plan.dtype, "fp8"),
                        "gradient_accumulation_steps": plan.num_microbatches},
        **({"fp8_recipe": FP8[FP8_RECIPES[plan.dtype]]} if plan.dtype in FP8_RECIPES else {}),
        "fsdp_plugin": fsdp,
        "deepspeed_plugin": ds,
        "per_device_train_batch_size": plan.micro_batch_size,
    }


def total_size(pc: dict[str, Any]) -> int:
    """ParallelismConfig.total_size: the product of all sizes (must equal num_processes)."""
    return pc["dp_replicate_size"] * pc["dp_shard_size"] * pc["tp_size"] * pc["cp_size"] * pc["sp_size"]


def snippet(cfg: dict[str, Any]) -> str:
    pc = ", ".join(f"{k}={v!r}" for k, v in cfg["parallelism_config"].items())
    acc = cfg["accelerator"]
    lines = ["from accelerate import Accelerator", "from accelerate.parallelism_config import ParallelismConfig"]
    if cfg["fsdp_plugin"]:
        f = cfg["fsdp_plugin"]
        lines.append("from accelerate.utils import FullyShardedDataParallelPlugin")
        lines.append(f"fsdp = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward="
                     f"{f['reshard_after_forward']}, activation_checkpointing={f['activation_checkpointing']})")
    if cfg["deepspeed_plugin"]:
        z = cfg["deepspeed_plugin"]["zero_stage"]
        lines.append("from accelerate.utils import DeepSpeedPlugin")
        lines.append(f"ds = DeepSpeedPlugin(zero_stage={z}, gradient_accumulation_steps="
                     f"{cfg['deepspeed_plugin']['gradient_accumulation_steps']})")
    lines.append(f"pc = ParallelismConfig({pc})")
    if cfg.get("fp8_recipe"):
        h = cfg["fp8_recipe"]
        lines.append(f"from accelerate.utils import {h['handler']}")
        lines.append(f"fp8 = {h['handler']}(" + ", ".join(f"{k}={v!r}" for k, v in h["kwargs"].items()) + ")")
    lines.append(f"accelerator = Accelerator(parallelism_config=pc, mixed_precision={acc['mixed_precision']!r}, "
                 f"gradient_accumulation_steps={acc['gradient_accumulation_steps']}"
                 + (", fsdp_plugin=fsdp" if cfg["fsdp_plugin"] else "")
                 + (", deepspeed_plugin=ds" if cfg["deepspeed_plugin"] else "")
                 + (", kwargs_handlers=[fp8]" if cfg.get("fp8_recipe") else "") + ")")
    lines.append(f"# per-device batch: {cfg['per_device_train_batch_size']}")
    return "\n".join(lines)


def render(record: PlanRecord, ctx: ExportContext) -> Export:
    plan = record.plan
    cfg = config(plan, ctx)
    prov = provenance(record, ctx)
    out = {**cfg, "python": snippet(cfg), "world_size": plan.world, "nodes": node_order(plan), "provenance": prov}
    return Export(format=NAME, text=json.dumps(out, indent=2) + "\n", data=out, suffix=SUFFIX)
