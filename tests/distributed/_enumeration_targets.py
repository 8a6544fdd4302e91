"""Launcher target of the enumeration test: many plans in one launch, each compared on its rank with
the single-process reference of the same precision, so only figures (not weights) come back."""

from __future__ import annotations

import time

import torch

from autotune.plan import Plan
from autotune.runtime.worker import train


def parity_job(payload, rank, world, device):
    """For every plan: the global losses, and this rank's weight differences against the reference
    (``refs[dtype/mbs]``): the largest absolute one, and the squared norms of (weights - reference)
    and of the reference's update (reference - initial weights) over the elements this rank holds."""
    from autotune.specs.model import model_from_dict

    spec = model_from_dict(payload["model"])
    init = payload["init"]
    out = []
    for item in payload["plans"]:
        plan = Plan.from_dict(item)
        ref = payload["refs"][f"{plan.dtype}/{plan.micro_batch_size}"]
        t0 = time.perf_counter()
        rep = train(plan, spec, payload["seq_len"], payload["global_batch"], steps=payload["steps"], warmup=0,
                    seed=payload["seed"], device=device, export_state=True, timeout_s=payload.get("timeout_s"))
        max_abs, diff2, upd2, fp32_bad = 0.0, 0.0, 0.0, []
        for name, (local, shard) in rep["state"].items():
            def cut(full, local=local, shard=shard):
                return full if shard is None else full.narrow(shard[0], shard[1], local.shape[shard[0]])
            want, start = cut(ref["state"][name]), cut(init[name])
            d = (local - want).abs()
            max_abs = max(max_abs, float(d.max()))
            diff2 += float((d.double() ** 2).sum())
            upd2 += float(((want - start).double() ** 2).sum())
            if not torch.allclose(local, want, atol=payload["weight_atol"], rtol=payload["weight_rtol"]):
                fp32_bad.append(name)
        out.append({"losses": rep["losses"], "grad_norms": rep["grad_norms"], "max_abs": max_abs, "diff2": diff2,
                    "upd2": upd2,
                    "outside_fp32_tolerance": fp32_bad, "peak_memory_bytes": rep["peak_memory_bytes"],
                    "wall_s": time.perf_counter() - t0, "step_s": sum(rep["step_times"])})
    return out
