"""What a CPU step costs outside the layers: the runtime's own optimizer update and gradient accumulation.

A layer profile (``profilers/layers.py``) times the model's pieces forward and backward; a trial's step
also runs, on every rank, what ``autotune/runtime/optimizer.py``'s ``TrainOptimizer`` does around them:

* **accumulation**, once per micro-batch in bf16 / fp16: every parameter's low-precision gradient moved
  into its fp32 accumulator (``_accumulate``: a cast on the first micro-batch, an add after it);
* **update**, once per step: torch's AdamW over the fp32 masters (on CPU the per-tensor loop, not the
  fused kernel), then the masters copied back into the low-precision parameters.

The cost model priced the update as memory-bound traffic at the copy bandwidth and left the
accumulation out; on this project's machine (``small``, bf16, one thread) the update took ~20 ms
where the bandwidth price said 10, and the accumulation 4-8 ms a micro-batch: a cost per micro-batch
the layer timings cannot contain. So ``tune`` times both here, on the model's whole stage (all its
layers, one rank, no process group: the collectives are priced by the link model), with the calling
thread's CPU clock as the layers are (another process's slices are not counted), and stores seconds
per parameter in the layer profile's ``meta["update"]`` (``autotune/cost/layers.py``: ``LayerTable.update``,
priced by ``update_time``).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

ROUNDS = 6
"""Timed steps (after one thrown away): each two micro-batches' accumulation and one update."""


def measure_update(model: Any, dtype: str, seq: int = 8) -> dict[str, Any]:
    """{"accumulate_s_per_param", "update_s_per_param", "params", "clock"}: the calling thread's CPU
    seconds per parameter of one micro-batch's gradient accumulation (0 in fp32: autograd's gradient
    is the master's) and of one optimizer update, on ``model``'s whole stage in ``dtype``."""
    import torch

    from autotune.runtime.mesh import Axis
    from autotune.runtime.model import Layout, StageModel, build_on_meta, materialize
    from autotune.runtime.optimizer import TrainOptimizer
    from profilers.layers import DTYPES

    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread, as a trial's rank runs
    try:
        layout = Layout(tp=Axis(size=1, index=0, ranks=[0], group=None))
        module = materialize(build_on_meta(lambda: StageModel(model, layout, list(range(model.layers)), True, True,
                                                              seq)), model, 0, torch.device("cpu"),
                             getattr(torch, DTYPES[dtype]))
        params = list(module.parameters())
        opt = TrainOptimizer(params, None, 0, dtype=dtype)
        grads = [torch.full_like(p, 1e-3) for p in params]
        acc, upd = [], []
        for r in range(ROUNDS + 1):
            opt.begin_step()
            spent = 0.0
            for _ in range(2):  # the first micro-batch casts, the next adds: one of each, averaged
                for p, g in zip(params, grads, strict=True):
                    p.grad = g.clone()
                c = time.thread_time()
                for i in range(len(params)):
                    opt._on_grad(i)  # what the post-accumulate hook runs
                spent += time.thread_time() - c
            c = time.thread_time()
            opt.finish_overlap()
            opt.reduce_and_step(contextlib.nullcontext)
            if r:  # the first step allocates AdamW's states
                acc.append(spent / 2)
                upd.append(time.thread_time() - c)
    finally:
        torch.set_num_threads(prev)
    n = sum(p.numel() for p in params)
    return {"accumulate_s_per_param": statistics.median(acc) / n if opt.low_precision else 0.0,
            "update_s_per_param": statistics.median(upd) / n, "params": n, "clock": "thread", "rounds": ROUNDS}
