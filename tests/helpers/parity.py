"""A parallel run against one process: many plans of one world size trained in ONE job of the
session's workers of that world (helpers.pool: process start-up dominates small runs), each compared with ``reference_run`` (one process, whole
batch, no parallelism, same data, init and AdamW) in fp32."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from autotune.plan import Plan
from autotune.runtime.worker import reference_run
from autotune.specs import ModelSpec, local_cluster

from .pool import run_in_pool

LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-5
"""The global gradient norm (runtime/grad_norm.py) at the losses' tolerance: both are sums over the
same gradients in another order, and a reduction with a wrong factor moves the norm by that factor
(tests/distributed/test_grad_norm_teeth.py) where the losses, through AdamW, barely move."""
LOW_PRECISION_GRAD_NORM_RTOL = {"bf16": 2.0**-7, "fp16": 2.0**-10}
"""The norm in bf16/fp16 against one process in the same precision: every gradient element carries
the compute dtype's roundings, so twice its unit roundoff; measured 2026-12-07 over the 118 default
plans of tests/distributed/test_runtime_enumeration.py: up to 1.1e-3 (bf16, tp4 1F1B with full
recomputation) and 2.8e-4 (fp16, pp2 x tp2 helixpipe)."""
# AdamW divides by sqrt(v): an element whose gradient is ~0 moves by up to lr on rounding noise, so
# weights are compared at an absolute tolerance well below lr * steps = 3e-3.
WEIGHT_ATOL, WEIGHT_RTOL = 1e-4, 1e-4


def run_plans(job: str, spec: ModelSpec, items: list[tuple[str, dict]], world: int, seq: int, batch: int,
              steps: int, seed: int, documents: dict | None = None) -> dict[str, list[dict]]:
    """{name: every rank's report} for the named plan dicts, resolved on ``local:WORLD`` and run by the
    launcher target ``job`` (``module:function``) in one job of the session's pool (``documents``: the payload's
    document entry, ``autotune.runtime.documents.DocumentFeed``; None: no document masks)."""
    plans = [Plan.from_dict(item).resolve(spec, local_cluster(world), seq, batch).to_dict() for _, item in items]
    payload = {"model": spec.to_dict(), "plans": plans, "seq_len": seq, "global_batch": batch,
               "steps": steps, "seed": seed, "timeout_s": 120, "documents": documents}
    res = run_in_pool(job, payload, world, timeout_s=400)
    assert res.failure is None, f"{res.failure}\n{res.extra.get('traceback', '')}"
    return {name: [res.results[r][i] for r in range(world)] for i, (name, _) in enumerate(items)}


def reference(spec: ModelSpec, seq: int, batch: int, steps: int, seed: int, documents: dict | None = None) -> dict:
    """The single-process run (cached for the session: several modules compare against the same one)."""
    return _reference(json.dumps(spec.to_dict(), sort_keys=True), seq, batch, steps, seed,
                      json.dumps(documents, sort_keys=True))


@functools.cache
def _reference(spec_json: str, seq: int, batch: int, steps: int, seed: int, documents_json: str = "null") -> dict:
    from autotune.specs.model import model_from_dict

    return reference_run(model_from_dict(json.loads(spec_json)), seq, batch, steps=steps, seed=seed,
                         documents=json.loads(documents_json))


def assert_losses_match(rep: dict, ref: dict) -> None:
    """Per-step losses equal the single-process run's (rtol LOSS_RTOL)."""
    losses = rep["losses"]
    assert len(losses) == len(ref["losses"])
    for a, b in zip(losses, ref["losses"], strict=True):
        assert a == pytest.approx(b, rel=LOSS_RTOL), (losses, ref["losses"])


def assert_grad_norms_match(rep: dict, ref: dict) -> None:
    """Per-step global gradient norms (every parameter counted once over the ranks' shards and
    replicas) equal the single-process run's (rtol GRAD_NORM_RTOL)."""
    norms = rep["grad_norms"]
    assert len(norms) == len(ref["grad_norms"]) and None not in norms
    for a, b in zip(norms, ref["grad_norms"], strict=True):
        assert a == pytest.approx(b, rel=GRAD_NORM_RTOL), ("grad norms", norms, ref["grad_norms"])


def assert_matches_reference(per_rank: list[dict], ref: dict) -> None:
    """Per-step losses and gradient norms, and every rank's weights (its shard of each parameter)
    after AdamW equal the single-process run's, and every parameter element is held by some rank."""
    assert_losses_match(per_rank[0], ref)
    for rep in per_rank:  # every rank reports the world's sums
        assert rep["grad_norms"] == per_rank[0]["grad_norms"]
    assert_grad_norms_match(per_rank[0], ref)
    seen: dict[str, int] = {}
    for rep in per_rank:
        for name, (local, shard) in rep["state"].items():
            full = ref["state"][name]
            want = full if shard is None else full.narrow(shard[0], shard[1], local.shape[shard[0]])
            assert local.shape == want.shape, name
            torch.testing.assert_close(local, want, atol=WEIGHT_ATOL, rtol=WEIGHT_RTOL,
                                       msg=lambda m, n=name: f"{n}: {m}")
            seen[name] = seen.get(name, 0) + local.numel()
    # every element of every parameter is held by some rank (replicas hold it several times)
    for name, full in ref["state"].items():
        assert seen.get(name, 0) >= full.numel(), f"{name} not covered by the ranks"
