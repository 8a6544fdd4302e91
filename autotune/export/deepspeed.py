"""DeepSpeed config JSON for a plan (keys from deepspeed/runtime/config.py and its tutorials).

* batch: ``train_batch_size`` = ``train_micro_batch_size_per_gpu`` x
  ``gradient_accumulation_steps`` x data-parallel size, where DeepSpeed's data-parallel size is
  world / (pp x tp x sequence_parallel_size);
* ``zero_optimization.stage`` = ``zero_stage``; ``bf16`` / ``fp16`` ``enabled``;
* Ulysses (hp) -> ``sequence_parallel_size``; tensor parallel -> ``tensor_parallel.autotp_size``;
* pipeline -> ``pipeline.stages`` and the partition: ``PipelineModule(partition_method="uniform")``
  over the transformer blocks, which gives the first ``layers % pp`` stages one extra layer
  (deepspeed.runtime.utils.partition_uniform) — so that is the only uneven split it can express;
* full recomputation -> ``activation_checkpointing`` and ``pipeline.activation_checkpoint_interval 1``;
* experts: the keyword arguments of ``deepspeed.moe.layer.MoE`` (``ep_size``, ``k``, capacity, dropping,
  ``enable_expert_tensor_parallelism``) under ``autotune.moe_layer`` (``moe_layer``): DeepSpeed's config
  has no MoE keys, the model builds its MoE layers with these.

DeepSpeed cannot express: ring context parallelism (cp), uneven token/head/sample shares, layer
splits other than uniform, schedules other than its 1F1B pipeline schedule, ZeRO-2/3 with pipeline
parallelism (its pipeline engine asserts stage <= 1), selective recomputation, Megatron sequence
parallelism, FP8 (nearest: bf16), experts other than over data-parallel ranks split over tp (etp = tp, ep
dividing dp), experts with Ulysses, MoE under ZeRO-3.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from autotune.cost.kernels import EAGER
from autotune.divisibility import even_heads_problem
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
from autotune.plan import FP8_RECIPES, Plan, even_split
from autotune.plan_record import PlanRecord
from autotune.schedules import schedule_of
from autotune.specs.windows import hf_attention

NAME = "deepspeed"

KERNELS = dataclasses.replace(EAGER, name="deepspeed (eager PyTorch)", framework="deepspeed")
"""DeepSpeed runs a Hugging Face-style model eagerly: the cost model\'s kernel costs for ``--target deepspeed``."""
SUFFIX = ".json"

EXPRESSES = ("dp", "pp", "hp", "tp", "ep", "etp")
"""The dimensions it runs (``export.common.unexpressed`` refuses the rest)."""
WHY_NOT = {"cp": "DeepSpeed has no ring (context-parallel) attention; its sequence parallelism is Ulysses "
                   "(sequence_parallel_size)"}
WHY = {
    "experts": "DeepSpeed-MoE gives every expert-parallel rank num_experts/ep_size experts",
    "tokens": "DeepSpeed-Ulysses shards the sequence evenly",
    "heads": "DeepSpeed-Ulysses splits heads evenly over sequence_parallel_size ranks",
    "samples": "DeepSpeed gives every data-parallel rank train_micro_batch_size_per_gpu x accumulation samples",
}


def uniform_parts(layers: int, pp: int) -> list[int]:
    """deepspeed.runtime.utils.partition_uniform: chunk = n // p, the first n % p parts one more."""
    return even_split(layers, pp)


def reasons(plan: Plan, ctx: ExportContext) -> list[str]:
    d = plan.degrees
    r = Collected(even_share_reasons(plan, NAME, ("tokens", "heads", "samples"), WHY))
    r.items += unexpressed(plan, NAME, EXPRESSES, WHY_NOT)
    lay = plan.shares.layers
    r.add(d.pp > 1 and lay is not None and list(lay) != uniform_parts(ctx.model.layers, d.pp),
          f"shares.layers {list(lay or ())}: DeepSpeed's PipelineModule partitions uniformly "
          f"({uniform_parts(ctx.model.layers, d.pp)}) or by parameters, not by an explicit list")
    why = schedule_of(plan).refusal(NAME)
    r.add(d.pp > 1 and why is not None, why or "")
    r.add(d.pp > 1 and plan.zero_stage >= 2, f"zero_stage {plan.zero_stage} with pp({d.pp}): DeepSpeed's "
          "pipeline engine supports ZeRO stage 0 or 1 only")
    r.add(plan.recompute == "selective", "recompute selective: DeepSpeed checkpoints whole layers "
          "(activation_checkpointing), not the attention core alone")
    r.add(plan.sequence_parallel and d.tp > 1, "sequence_parallel: DeepSpeed AutoTP has no Megatron "
          "sequence parallelism for norms and dropout")
    heads = even_heads_problem(ctx.model, d.tp, d.hp, "sequence_parallel_size")  # autotune/divisibility.py
    r.add(heads is not None, heads or "")
    r.add(plan.dtype in FP8_RECIPES, f"dtype {plan.dtype}: a DeepSpeed config trains in bf16 or fp16 (its FP8 comes "
          "from Transformer Engine layers in the model code, which a config cannot turn on)")
    r.items += expert_reasons(plan, ctx)
    r.items += placement_reasons(plan)
    return r.items


def expert_reasons(plan: Plan, ctx: ExportContext) -> list[str]:
    """What DeepSpeed-MoE (deepspeed/moe/layer.py, deepspeed/utils/groups.py) cannot take: it builds
    each expert-parallel group from data-parallel ranks of one tensor-parallel rank
    (``_get_expert_parallel_ranks``), so ep divides dp and the experts are split over tp (etp = tp,
    ``enable_expert_tensor_parallelism``) or not at all; no Ulysses ranks in the expert groups; the
    experts split evenly; ZeRO-3 is refused by its engine ("Native DeepSpeed MoE is not supported with
    ZeRO Stage 3")."""
    if ctx.model.moe is None:
        return []
    d = plan.degrees
    r = Collected(even_share_reasons(plan, NAME, ("experts",), WHY))
    r.add(d.etp != d.tp, f"etp({d.etp}) != tp({d.tp}): DeepSpeed-MoE splits the experts over the tensor-parallel "
          "ranks (enable_expert_tensor_parallelism) or keeps them whole on each, so etp is tp")
    r.add(d.ep > 1 and d.dp % d.ep != 0, f"ep({d.ep}) does not divide dp({d.dp}): DeepSpeed-MoE forms expert "
          "groups from data-parallel ranks")
    r.add(d.ep > 1 and d.hp > 1, f"ep({d.ep}) with hp({d.hp}): DeepSpeed-MoE's expert groups hold no Ulysses ranks")
    r.add(plan.zero_stage >= 3, "zero_stage 3 with experts: DeepSpeed's engine refuses native MoE under ZeRO-3")
    return r.items


def candidates(plan: Plan, ctx: ExportContext) -> list[Plan]:
    d = plan.degrees
    base = even_everything(plan).replace(
        schedule="1f1b", virtual_stages=1, helix_folds=1,
        zero_stage=min(plan.zero_stage, 1) if d.pp > 1 else plan.zero_stage,
        recompute="full" if plan.recompute == "selective" else plan.recompute,
        sequence_parallel=False, dtype="bf16" if plan.dtype in FP8_RECIPES else plan.dtype)
    out = [base]
    if d.cp > 1:
        out = [fold(base, "cp", "hp"), fold(base, "cp", "dp")]
    out += [with_even(p, "layers") for p in out]
    if plan.recompute == "selective":
        out += [p.replace(recompute="none") for p in out]
    if ctx.model.moe is not None:  # experts over data-parallel ranks, split over tp; no ZeRO-3
        out = [q for p in out for q in _deepspeed_experts(p.replace(zero_stage=min(p.zero_stage, 2)), ctx)]
    return out


def _deepspeed_experts(plan: Plan, ctx: ExportContext) -> list[Plan]:
    """``plan`` with etp = tp and the ep nearest its own that divides dp and the experts."""
    d = plan.degrees
    eps = sorted((ep for ep in range(1, d.dp + 1) if d.dp % ep == 0 and ctx.model.moe.experts % ep == 0),
                 key=lambda ep: abs(math.log(ep / d.ep)))
    return [with_even(plan, "experts").replace(degrees=dataclasses.replace(d, ep=ep, etp=d.tp)) for ep in eps[:3]]


def config(plan: Plan, ctx: ExportContext) -> dict[str, Any]:
    d = plan.degrees
    cfg: dict[str, Any] = {
        "train_batch_size": ctx.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.num_microbatches,
        "zero_optimization": {"stage": plan.zero_stage},
        "bf16": {"enabled": plan.dtype == "bf16"},
        "fp16": {"enabled": plan.dtype == "fp16"},
    }
    if d.hp > 1:
        cfg["sequence_parallel_size"] = d.hp
    if d.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": d.tp}
    if d.pp > 1:
        cfg["pipeline"] = {"stages": d.pp, "partition": "uniform",
                           "activation_checkpoint_interval": 1 if plan.recompute == "full" else 0}
    if plan.recompute == "full":
        cfg["activation_checkpointing"] = {"partition_activations": d.tp > 1, "contiguous_memory_optimization": False}
    return cfg


def data_parallel_size(cfg: dict[str, Any], world: int) -> int:
    """DeepSpeed's arithmetic: dp = world / (pp * tp * sp)."""
    pp = cfg.get("pipeline", {}).get("stages", 1)
    tp = cfg.get("tensor_parallel", {}).get("autotp_size", 1)
    sp = cfg.get("sequence_parallel_size", 1)
    return world // (pp * tp * sp)


def render(record: PlanRecord, ctx: ExportContext) -> Export:
    plan = record.plan
    cfg = config(plan, ctx)
    prov = provenance(record, ctx)
    partition = None
    if plan.degrees.pp > 1:
        lay = list(plan.shares.layers or ())
        bounds = [0]
        for n in lay:
            bounds.append(bounds[-1] + n)
        partition = {"partition_method": "uniform", "num_stages": plan.degrees.pp, "layers_per_stage": lay,
                     "parts": bounds}
    out = dict(cfg)
    moe = moe_layer(plan, ctx)
    attention = hf_attention(ctx.model)
    out["autotune"] = {"provenance": prov, "pipeline_module": partition, "world_size": plan.world,
                       "nodes": node_order(plan), **({"moe_layer": moe} if moe else {}),
                       **({"attention": attention} if attention else {})}
    return Export(format=NAME, text=json.dumps(out, indent=2) + "\n",
                  data={"config": cfg, "pipeline_module": partition, "provenance": prov, "moe_layer": moe,
                        "attention": attention}, suffix=SUFFIX)


def moe_layer(plan: Plan, ctx: ExportContext) -> dict[str, Any] | None:
    """The keyword arguments of ``deepspeed.moe.layer.MoE`` for each MoE layer of the model (a
    DeepSpeed config has no MoE keys: the model builds the layer): experts, ep_size, top-k, capacity
    and dropping, expert tensor parallelism. Shared experts and the dense layers are the model's own
    modules beside it."""
    moe = ctx.model.moe
    if moe is None:
        return None
    router = moe.router
    return {"num_experts": moe.experts, "ep_size": plan.degrees.ep, "k": moe.top_k,
            "capacity_factor": router.capacity_factor or 1.0, "eval_capacity_factor": router.capacity_factor or 1.0,
            "drop_tokens": not router.dropless, "use_residual": False,
            "enable_expert_tensor_parallelism": plan.degrees.tp > 1}
