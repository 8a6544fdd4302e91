"""Pipeline parallelism with ``torch.distributed.pipelining``: one ``PipelineStage`` per model chunk.

Each rank builds only its own chunks (which virtual stages live on which pp rank is the schedule's
placement, ``Plan.stages_of_rank``: ``j % pp`` for the looped schedules, a V for ZB-V), with the uneven layer counts of ``shares.layers``; the embedding
sits on stage 0 and the final norm, LM head and loss on the last stage. Stage shapes are given
statically (``input_args``/``output_args``) so no metadata inference runs a forward that would
issue tensor-parallel collectives on meta tensors.

The schedule object comes from the plan's schedule module (``autotune/schedules``,
``Schedule.build_runtime``: torch's GPipe, 1F1B, interleaved 1F1B, ZB-V, ...). The loss function returns a *sum* over tokens divided by the global token
count and ``scale_grads=False``, so micro-batches and DP replicas of different sizes add up to the
exact global mean (weighted DP).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.pipelining import PipelineStage

from autotune.plan import Plan
from autotune.runtime.mesh import Mesh
from autotune.runtime.model import Layout, StageModel
from autotune.schedules import schedule_of
from autotune.specs.model import ModelSpec


def stage_layer_ids(plan: Plan) -> list[list[int]]:
    """Global layer indices of every virtual stage, in model order."""
    assert plan.shares.layers is not None, "resolve the plan first"
    out, start = [], 0
    for n in plan.shares.layers:
        out.append(list(range(start, start + n)))
        start += n
    return out


def local_stage_indices(plan: Plan, pp_index: int) -> list[int]:
    """Virtual stages on pp rank ``pp_index``, in model order (the schedule's placement)."""
    return list(plan.stages_of_rank(pp_index))


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
    return schedule_of(plan).build_runtime(pstages, n_microbatches, loss_fn), pstages
