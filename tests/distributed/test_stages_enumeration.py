"""What is searched is what runs, for per-stage plans (issue 26, "Done when"): every per-stage point
the default space can sample on ``local:4`` (the stage program's plan for each micro-batch size,
schedule, virtual stages, recomputation and ZeRO stage, in every precision the cluster has) is either
priced infeasible with its reason, or is accepted by the runtime (none refused) and trains as one
process does. The distinct plans run in ONE launch of four workers, each rank comparing its weights
with the single-process reference of the same precision (test_runtime_enumeration's model, workload,
references and tolerances)."""

from __future__ import annotations

import functools

import pytest
import test_runtime_enumeration as E
from helpers.pool import run_in_pool

from autotune import stages as ST
from autotune.cost import estimate
from autotune.plan import DTYPES
from autotune.runtime.trial import prepare
from autotune.specs import local_cluster
from search_spaces.base import Infeasible, SearchContext
from search_spaces.default import DefaultSpace

pytestmark = pytest.mark.slow
WORLD = 4


@functools.cache
def enumerate_staged() -> dict:
    cluster = local_cluster(WORLD)
    infeasible, refused, plans = [], [], {}
    for dtype in [dt for dt in DTYPES if all(dt in t.peak_flops for t in cluster.device_types())]:
        space = DefaultSpace(SearchContext(model=E.SPEC, cluster=cluster, seq_len=E.SEQ, global_batch=E.BATCH,
                                           dtype=dtype))
        for params in space._staged_grid():
            built = space.build(params)
            if isinstance(built, Infeasible):
                infeasible.append((params, f"{built.kind}: {built.reason}"))
                continue
            est = estimate(built, E.SPEC, cluster, E.SEQ, E.BATCH)
            if not est.predicted["feasible"]:
                infeasible.append((params, est.predicted["infeasible_reason"]))
                continue
            try:
                runnable, _, _ = prepare(built, E.SPEC, E.SEQ, E.BATCH, device="cpu")
            except Exception as exc:  # noqa: BLE001 - a refusal is what this test reports
                refused.append((built, str(exc)))
                continue
            if runnable.dtype == "fp32-strict":  # runs as fp32 on CPU (test_runtime_enumeration)
                continue
            plans.setdefault(runnable.to_json(), runnable)
    return {"infeasible": infeasible, "refused": refused, "plans": list(plans.values())}


def _marks(p) -> set:
    """What one run covers: its stage structure with its schedule, its precision with its ZeRO stage,
    its recomputation with its precision."""
    return {("s", ST.inline(p.stages), p.schedule, p.virtual_stages, p.micro_batch_size), ("z", p.dtype, p.zero_stage),
            ("r", p.recompute, p.dtype)}


def representatives() -> list:
    """A greedy cover of every plan's marks (``_marks``): each stage structure and schedule, every
    (precision, ZeRO stage) and (recomputation, precision) runs at least once (63 distinct plans on
    local:4, about a tenth of them run)."""
    plans = sorted(enumerate_staged()["plans"], key=lambda p: p.to_json())
    todo = set().union(*(_marks(p) for p in plans))
    out = []
    while todo:
        best = max(plans, key=lambda p: len(_marks(p) & todo))
        out.append(best)
        todo -= _marks(best)
    return out


@functools.cache
def run_all() -> list:
    plans = representatives()
    init, refs = E.references({p.dtype for p in plans}, {p.micro_batch_size for p in plans})
    payload = {"model": E.SPEC.to_dict(), "plans": [p.to_dict() for p in plans], "seq_len": E.SEQ,
               "global_batch": E.BATCH, "steps": E.STEPS, "seed": E.SEED, "timeout_s": 120, "init": init,
               "refs": refs, "weight_atol": E.WEIGHT_ATOL, "weight_rtol": E.WEIGHT_RTOL}
    res = run_in_pool("tests.distributed._enumeration_targets:parity_job", payload, WORLD, timeout_s=3000)
    assert res.failure is None, f"{res.failure}\n{res.extra.get('traceback', '')}"
    return [(p, [res.results[r][i] for r in range(WORLD)]) for i, p in enumerate(plans)]


def test_every_sampled_per_stage_plan_is_priced_infeasible_or_accepted():
    e = enumerate_staged()
    assert not e["refused"], e["refused"][:3]
    assert all(reason for _, reason in e["infeasible"])
    plans = e["plans"]
    assert plans and all(p.stages is not None for p in plans)
    # the enumeration holds pipelines of several shapes, ZeRO-1 over replicas, every runnable precision
    assert len({ST.inline(p.stages) for p in plans}) > 1 and any(len(p.stages) > 1 for p in plans)
    assert any(p.zero_stage == 1 and p.degrees.dp > 1 for p in plans)
    assert {p.dtype for p in plans} == set(E.RUN_DTYPES)


def test_every_per_stage_plan_runs_like_one_process():
    failures = []
    for plan, per_rank in run_all():
        key = (*E.combination(plan), "stages")
        for problem in E.parity_problems(key, plan, per_rank):
            failures.append(f"{plan.to_json(indent=None)[:200]}: {problem}")
    assert not failures, f"{len(failures)} of {len(run_all())} plans differ:\n" + "\n".join(failures[:20])
