"""What is searched is what runs (issue 13, "Done when"): every combination of degrees, ZeRO stage,
pipeline schedule, recomputation and precision that the default search space can sample on
``local:2`` and ``local:4`` is either priced infeasible by the cost model with its reason, or is
accepted by the runtime (none refused), runs, and trains as one process does.

The space is enumerated with its own grid (``DefaultSpace.grid_points``: every discrete point with
even and speed-balanced shares), once per precision the cluster has. Every plan is priced and
checked by the runtime's own admission (``prepare``). Plans that differ only in options outside the
combination (micro-batch size, sequence parallelism, shares) are grouped, and one representative
per combination runs, the representatives rotating over those options so they are exercised too.
All plans of one world run inside ONE launch of workers (process start-up dominates), each rank
comparing its weights with the single-process reference run in the same precision with the same
mixed-precision recipe (reference_run).

What runs by default, on 2 and on 4 workers (168 and 891 combinations x precisions, about 1-3 s
each on a loaded 2-core machine, the time going to the steps' many small collectives, whatever the
precision): a cover of the combinations, chosen greedily so that every (degrees, ZeRO stage,
precision path), every (schedule, recomputation, precision path) and every pair of values of the five
factors (degrees, schedule, recomputation, ZeRO stage, precision: pairwise coverage, as combinatorial
testing uses it) that some runnable combination has is run; the precision paths are fp32 and low
precision (bf16 and fp16 run the same code but for fp16's loss scale: ``PATH``). That is 35 plans on
2 workers and 83 on 4 (with a triple per precision, not per path, 61 and 132).
``AUTOTUNE_ENUMERATION=full`` runs the complete cross product on both. A combination that one of the
fp32 parity tests (PARITY_TESTS: test_runtime_equivalence, test_pipeline_schedules,
test_helix_equivalence) already runs on the same number of workers against one process, at the same
tolerances, is counted as run (with what it covers) and not run a second time here. ``fp32-strict`` is enumerated, priced and admitted
like the others but runs as ``fp32`` (the two differ only in CUDA's TF32 switch), so it is not run
twice on CPU.

Tolerances. fp32: losses and global gradient norms rtol 1e-5 and weights atol/rtol 1e-4 (as
test_runtime_equivalence); the norms in bf16/fp16 within twice the dtype's unit roundoff
(GRAD_NORM_RTOL).
bf16/fp16 cannot match an fp32 process to 1e-5, and even against a reference in the same precision
the parallel layouts sum partial products in other orders (tp partial sums, cp/hp softmax merges,
micro-batch splits), each sum rounded to the compute dtype. Losses: relative difference within the
dtype's unit roundoff (2^-8 bf16, 2^-11 fp16), one rounding of the loss itself; the measured
differences are 10-100x smaller. Weights: AdamW divides by sqrt(v), so an element whose gradient is
rounding noise moves by up to lr per step whatever its gradient, and the largest absolute difference
says nothing (any gradient, right or wrong, stays within 2*lr*steps). The figure compared is
therefore the size of the difference relative to the size of the reference's update over the whole
model, ||w - w_ref|| / ||w_ref - w_0||, which is ~1 or more for a wrong gradient and small when
only rounding differs (bound WEIGHT_UPDATE_RTOL below).
"""

from __future__ import annotations

import functools
import math
import os
from collections import defaultdict

import pytest
import test_helix_equivalence
import test_pipeline_schedules
import test_runtime_equivalence
from helpers import parity
from helpers.pool import run_in_pool

from autotune.cost import estimate
from autotune.plan import DTYPES, Plan
from autotune.plan_parts import FP8_RECIPES
from autotune.runtime.trial import prepare
from autotune.runtime.worker import reference_run
from autotune.specs import ModelSpec, local_cluster
from search_spaces.base import Infeasible, SearchContext
from search_spaces.default import DefaultSpace

pytestmark = pytest.mark.slow

# 4 layers so pp=2 x 2 virtual stages fits and pp=4 x 2 is priced infeasible; 8 heads / 4 kv heads so
# tp=4 and hp=4 exist; a batch of 6 gives uneven samples per replica (dp=4: 2,2,1,1; mbs 2 on dp=2: 4,2)
SPEC = ModelSpec(name="enum", layers=4, hidden=32, heads=8, kv_heads=4, ffn_hidden=64, vocab=64)
SEQ, BATCH, STEPS, SEED = 16, 6, 2, 4321
FULL = os.environ.get("AUTOTUNE_ENUMERATION") == "full"
WORLDS = (2, 4)
RUN_DTYPES = ("bf16", "fp16", "fp32")  # fp32-strict is fp32 on CPU (module docstring)
CPU_DTYPES = tuple(dt for dt in DTYPES if dt not in FP8_RECIPES)
"""The precisions a CPU cluster holds: every one but FP8 (it needs FP8 tensor cores; the local runtime
refuses it), so the enumeration must meet each of these."""
LOSS_RTOL = {"fp32": parity.LOSS_RTOL, "bf16": 2.0**-8, "fp16": 2.0**-11}
# the global gradient norm (runtime/grad_norm.py; measured here up to 8.6e-8 in fp32, 2026-12-07)
GRAD_NORM_RTOL = {"fp32": parity.GRAD_NORM_RTOL, **parity.LOW_PRECISION_GRAD_NORM_RTOL}
WEIGHT_ATOL, WEIGHT_RTOL = parity.WEIGHT_ATOL, parity.WEIGHT_RTOL  # fp32, element-wise
# The parity tests that run plans of local:2 and local:4 in fp32 against one process with the same
# tolerances (helpers.parity): a combination one of them runs is not run a second time here.
PARITY_TESTS = (test_runtime_equivalence, test_pipeline_schedules, test_helix_equivalence)
WEIGHT_UPDATE_RTOL = {"bf16": 0.25, "fp16": 0.1}  # measured up to 0.073 (bf16), 0.024 (fp16)  # low precision, ||w - w_ref|| / ||w_ref - w_0||


def combination(plan: Plan) -> tuple:
    d = plan.degrees
    return (d.dp, d.pp, d.cp, d.hp, d.tp, plan.schedule, plan.virtual_stages, plan.recompute, plan.zero_stage,
            plan.dtype)


def name_of(key: tuple) -> str:
    dp, pp, cp, hp, tp, sched, vs, rc, zero, dtype = key
    deg = ",".join(f"{k}{v}" for k, v in zip(("dp", "pp", "cp", "hp", "tp"), (dp, pp, cp, hp, tp), strict=True)
                   if v > 1) or "single"
    return f"{deg}-{sched}{'x' + str(vs) if vs > 1 else ''}-rc:{rc}-zero{zero}-{dtype}"


@functools.cache
def run_elsewhere(world: int) -> frozenset[tuple]:
    """The combinations that PARITY_TESTS run on WORLD workers (each test's own model and plans)."""
    keys = set()
    for test in PARITY_TESTS:
        for spec, items in parity_cases(test, world):
            for _, item in items:
                plan = Plan.from_dict({k: v for k, v in item.items() if not k.startswith("_")})
                keys.add(combination(plan.resolve(spec, local_cluster(world), test.SEQ, test.BATCH)))
    return frozenset(keys)


def parity_cases(test, world: int) -> list:
    """[(model, [(name, plan dict)])] that TEST runs on WORLD workers: its ``CASES`` keyed by the world
    size, or by (model name, world size) where it runs several models (``SPECS``)."""
    specs = getattr(test, "SPECS", {test.SPEC.name: test.SPEC})
    out = []
    for key, items in test.CASES.items():
        name, w = key if isinstance(key, tuple) else (test.SPEC.name, key)
        if w == world:
            out.append((specs[name], items))
    return out


_ENUM: dict[int, dict] = {}


def enumerate_space(world: int) -> dict:
    """Every grid point of the default space on local:WORLD in every precision the cluster has:
    {"infeasible": [(params, reason)], "plans": {combination: [plans]}, "refused": [(plan, reason)]}."""
    if world in _ENUM:
        return _ENUM[world]
    cluster = local_cluster(world)
    dtypes = [dt for dt in DTYPES if all(dt in t.peak_flops for t in cluster.device_types())]
    infeasible, refused, plans = [], [], defaultdict(list)
    seen = set()
    for dtype in dtypes:
        space = DefaultSpace(SearchContext(model=SPEC, cluster=cluster, seq_len=SEQ, global_batch=BATCH,
                                           dtype=dtype))
        for params in space.grid_points():
            if params.get("stages") == "program":  # per-stage plans: test_stages_enumeration.py
                continue
            built = space.build(params)
            if isinstance(built, Infeasible):
                infeasible.append((params, f"{built.kind}: {built.reason}"))
                continue
            est = estimate(built, SPEC, cluster, SEQ, BATCH)
            if not est.predicted["feasible"]:
                infeasible.append((params, est.predicted["infeasible_reason"]))
                continue
            if built in seen:  # frozen Plans: the same 440 / 2,384 as keyed by to_json, which took 1/6 of this loop
                continue
            seen.add(built)
            try:
                runnable, _, _ = prepare(built, SPEC, SEQ, BATCH, device="cpu")
            except Exception as exc:  # noqa: BLE001 - a refusal is what this test reports
                refused.append((built, str(exc)))
                continue
            plans[combination(runnable)].append(runnable)
    _ENUM[world] = {"infeasible": infeasible, "plans": dict(plans), "refused": refused, "dtypes": dtypes}
    return _ENUM[world]


def representatives(world: int) -> list[tuple[tuple, Plan]]:
    """One plan per combination that no parity test runs already, rotating over the variants
    (micro-batch size, sp, shares); unless FULL, only the combinations of the cover (``_cover``,
    module docstring)."""
    elsewhere = run_elsewhere(world)
    items = sorted(((k, g) for k, g in enumerate_space(world)["plans"].items()
                    if k[-1] in RUN_DTYPES and k not in elsewhere), key=lambda kv: str(kv[0]))
    if not FULL:  # what the parity tests run counts where the enumeration has it too (the test's ``ran``)
        items = _cover(items, elsewhere & {k for k in enumerate_space(world)["plans"] if k[-1] in RUN_DTYPES})
    out = []
    for i, (key, group) in enumerate(items):
        group = sorted(group, key=lambda p: p.to_json())
        out.append((key, group[i % len(group)]))
    return out


PATH = {"fp32": "fp32", "bf16": "low", "fp16": "low"}
"""The runtime's code path per precision: bf16 and fp16 run the same mixed-precision path
(autotune/runtime/precision.py: low-precision weight copies, fp32 accumulators and master weights);
fp16 adds only the dynamic loss scale, one world-wide overflow flag that each optimizer (one per ZeRO
stage) and the loss divisor see whatever the degrees or the schedule. So the triples (degrees, ZeRO,
path) and (schedule, recomputation, path) are run once per path, and every pair of factor values
with each precision itself (``marks``), so that fp16 meets every degree layout, ZeRO stage,
schedule and recomputation at least once."""

FACTORS = (slice(0, 5), slice(5, 7), slice(7, 8), slice(8, 9), slice(9, 10))
"""A combination's five factors: degrees, schedule (with its virtual stages), recomputation, ZeRO
stage, precision."""


def marks(key: tuple) -> set:
    """What one run of a combination covers: its (degrees, ZeRO, precision path), its (schedule,
    recomputation, precision path) (``PATH``), and every pair of its five factors' values."""
    f = [key[s] for s in FACTORS]
    pairs = {("p", i, f[i], j, f[j]) for i in range(5) for j in range(i + 1, 5)}
    return {("z", key[:5], key[8], PATH[key[9]]), ("s", key[5:8], PATH[key[9]])} | pairs


def _cover(items: list[tuple[tuple, list]], elsewhere: frozenset) -> list[tuple[tuple, list]]:
    """The combinations to run: greedily, the one that covers the most marks (``marks``) not covered
    yet by those chosen or by the parity tests (``elsewhere``), until every mark of every runnable
    combination is covered (ties: the first in ``items``' order)."""
    covered: set = set().union(*(marks(k) for k in elsewhere))
    left = {key: marks(key) - covered for key, _ in items}
    out = []
    while True:
        key = max(left, key=lambda k: len(left[k]), default=None)
        if key is None or not left[key]:
            return [(k, g) for k, g in items if k in {o for o in out}]
        out.append(key)
        got = left.pop(key)
        for k in left:
            left[k] -= got


_REFS: dict = {}


def references(dtypes, mbs_values) -> tuple[dict, dict]:
    """Single-process runs per (precision, micro-batch size), and the initial weights."""
    if not _REFS:
        _REFS["init"] = reference_run(SPEC, SEQ, BATCH, steps=0, seed=SEED)["state"]
    for dt in dtypes:
        for mbs in mbs_values:
            k = f"{dt}/{mbs}"
            if k not in _REFS:
                _REFS[k] = reference_run(SPEC, SEQ, BATCH, steps=STEPS, seed=SEED, dtype=dt, micro_batch_size=mbs)
    return _REFS["init"], {k: v for k, v in _REFS.items() if k != "init"}


_RUNS: dict[int, list] = {}


def run_world(world: int) -> list[tuple[tuple, Plan, list[dict]]]:
    if world not in _RUNS:
        reps = representatives(world)
        init, refs = references({p.dtype for _, p in reps}, {p.micro_batch_size for _, p in reps})
        payload = {"model": SPEC.to_dict(), "plans": [p.to_dict() for _, p in reps], "seq_len": SEQ,
                   "global_batch": BATCH, "steps": STEPS, "seed": SEED, "timeout_s": 120, "init": init,
                   "refs": refs, "weight_atol": WEIGHT_ATOL, "weight_rtol": WEIGHT_RTOL}
        res = run_in_pool("tests.distributed._enumeration_targets:parity_job", payload, world, timeout_s=3000)
        assert res.failure is None, f"{res.failure}\n{res.extra.get('traceback', '')}"
        _RUNS[world] = [(key, plan, [res.results[r][i] for r in range(world)]) for i, (key, plan) in enumerate(reps)]
    return _RUNS[world]


def parity_problems(key: tuple, plan: Plan, per_rank: list[dict]) -> list[str]:
    dtype = plan.dtype
    _, refs = references([dtype], [plan.micro_batch_size])
    ref = refs[f"{dtype}/{plan.micro_batch_size}"]
    out = []
    losses = per_rank[0]["losses"]
    for a, b in zip(losses, ref["losses"], strict=True):
        if not math.isclose(a, b, rel_tol=LOSS_RTOL[dtype]):
            out.append(f"loss {a} vs one process {b} (rtol {LOSS_RTOL[dtype]:.1e})")
    norms = per_rank[0]["grad_norms"]
    for a, b in zip(norms, ref["grad_norms"], strict=True):
        # None: a step fp16's loss scale skipped, which one process must skip too
        if (a is None) != (b is None) or (a is not None and not math.isclose(a, b, rel_tol=GRAD_NORM_RTOL[dtype])):
            out.append(f"grad norm {a} vs one process {b} (rtol {GRAD_NORM_RTOL[dtype]:.1e})")
    if dtype == "fp32":
        bad = sorted({n for r in per_rank for n in r["outside_fp32_tolerance"]})
        if bad:
            out.append(f"weights outside atol/rtol {WEIGHT_ATOL}: {bad[:4]}")
    else:
        rel = math.sqrt(sum(r["diff2"] for r in per_rank) / sum(r["upd2"] for r in per_rank))
        if rel > WEIGHT_UPDATE_RTOL[dtype]:
            out.append(f"||w - w_ref|| / ||w_ref - w_0|| = {rel:.3f} > {WEIGHT_UPDATE_RTOL[dtype]}")
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_every_sampled_plan_is_priced_infeasible_or_accepted_by_the_runtime(world):
    e = enumerate_space(world)
    assert not e["refused"], "\n".join(f"{p.degrees.inline()} zero{p.zero_stage}: {why}" for p, why in e["refused"][:5])
    assert all(reason for _, reason in e["infeasible"])
    keys = set(e["plans"])
    # the enumeration really holds what it claims: every precision, and ZeRO-2/3 composed with every
    # dimension (on 2 devices pp or tp leave no rank to shard over: the space samples ZeRO 0 there)
    assert {k[-1] for k in keys} == set(e["dtypes"]) == set(CPU_DTYPES)
    for zero in (2, 3):
        for dim in (range(5) if world == 4 else (0, 2, 3)):
            assert any(k[8] == zero and k[dim] > 1 for k in keys), (zero, dim)
    # the parity tests' plans are read (their CASES keys once changed form and none were counted)
    assert parity_cases(test_runtime_equivalence, world) and run_elsewhere(world)
    # what runs (here or in a parity test) covers every (degrees, ZeRO, precision path) and (schedule,
    # recomputation, precision path)
    runnable = {k for k in keys if k[-1] in RUN_DTYPES}
    ran = {key for key, _ in representatives(world)} | (run_elsewhere(world) & runnable)
    assert {(k[:5], k[8], PATH[k[9]]) for k in runnable} == {(k[:5], k[8], PATH[k[9]]) for k in ran}
    assert {(k[5:8], PATH[k[9]]) for k in runnable} == {(k[5:8], PATH[k[9]]) for k in ran}
    assert set().union(*map(marks, runnable)) == set().union(*map(marks, ran))  # and every pair of factors
    assert ran == runnable or not FULL


@pytest.mark.parametrize("world", WORLDS)
def test_every_combination_runs_and_matches_one_process(world):
    """One launch per world: every combination's representative against one process."""
    failures = []
    for key, plan, per_rank in run_world(world):
        for problem in parity_problems(key, plan, per_rank):
            failures.append(f"{name_of(key)} ({plan.to_json(indent=None)[:160]}...): {problem}")
    assert not failures, f"{len(failures)} of {len(run_world(world))} combinations differ:\n" + "\n".join(failures[:20])
