"""Pipeline parallelism with ``torch.distributed.pipelining``: one ``PipelineStage`` per model chunk.

Each rank builds only its own chunks (virtual stage ``j`` lives on pp rank ``j % pp``, as
``Plan.layers_of_stage`` says), with the uneven layer counts of ``shares.layers``; the embedding
sits on stage 0 and the final norm, LM head and loss on the last stage. Stage shapes are given
statically (``input_args``/``output_args``) so no metadata inference runs a forward that would
issue tensor-parallel collectives on meta tensors.

Schedules: GPipe (Huang et al. 2019), 1F1B (Narayanan et al. 2021, PipeDream-Flush; bubble
``(p-1)/(m+p-1)``) and interleaved 1F1B (Narayanan et al. 2021, section 2.2; bubble divided by the
number of virtual stages). The loss function returns a *sum* over tokens divided by the global token
count and ``scale_grads=False``, so micro-batches and DP replicas of different sizes add up to the
exact global mean (weighted DP).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from autotune.plan import Plan
from autotune.runtime.mesh import Mesh
from autotune.runtime.model import Layout, StageModel
from autotune.specs.model import ModelSpec

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def stage_layer_ids(plan: Plan) -> list[list[int]]:
    """Global layer indices of every virtual stage, in model order."""
    assert plan.shares.layers is not None, "resolve the plan first"
    out, start = [], 0
    for n in plan.shares.layers:
        out.append(list(range(start, start + n)))
        start += n
    return out


def local_stage_indices(plan: Plan, pp_index: int) -> list[int]:
    """Virtual stages on pp rank ``pp_index``: ``pp_index, pp_index + pp, ...``."""
    total = plan.degrees.pp * plan.virtual_stages
    return list(range(pp_index, total, plan.degrees.pp))


def build_stage_models(spec: ModelSpec, plan: Plan, mesh: Mesh, layout: Layout, seq_len: int) -> list[
        tuple[int, StageModel]]:
    """This rank's model chunks as (virtual stage index, module); the whole model when pp = 1."""
    ids = stage_layer_ids(plan)
    total = len(ids)
    return [(j, StageModel(spec, layout, ids[j], first=(j == 0), last=(j == total - 1), seq_len=seq_len))
            for j in local_stage_indices(plan, mesh["pp"].index)]


def build_schedule(plan: Plan, mesh: Mesh, stages: list[tuple[int, StageModel]], n_microbatches: int,
                   microbatch_size: int, local_tokens: int, hidden_tokens: int, dtype: torch.dtype,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """A schedule over this rank's ``PipelineStage`` objects (static shapes; see module docstring).

    ``local_tokens``: tokens of this rank's sequence slice (the LM head's output length);
    ``hidden_tokens``: tokens of the hidden state passed between stages (``local/tp`` with sp)."""
    total = plan.degrees.pp * plan.virtual_stages
    device = mesh.device
    spec = stages[0][1].spec
    vocab_local = spec.vocab // mesh["tp"].size
    pstages = []
    for j, module in stages:
        if j == 0:
            inp = torch.zeros(microbatch_size, local_tokens, dtype=torch.long, device=device)
        else:
            inp = torch.zeros(microbatch_size, hidden_tokens, spec.hidden, dtype=dtype, device=device,
                              requires_grad=True)  # so the stage sends its input gradient back
        if j == total - 1:
            out = torch.zeros(microbatch_size, local_tokens, vocab_local, dtype=dtype, device=device,
                              requires_grad=True)
        else:
            out = torch.zeros(microbatch_size, hidden_tokens, spec.hidden, dtype=dtype, device=device,
                              requires_grad=True)
        pstages.append(PipelineStage(module, j, total, device, input_args=(inp,), output_args=(out,),
                                     group=mesh["pp"].group))
    cls = SCHEDULE_CLASSES[plan.schedule]
    if plan.schedule == "interleaved_1f1b":
        return cls(pstages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False), pstages
    return cls(pstages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False), pstages
