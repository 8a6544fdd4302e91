"""Per-stage plans on the four mixed setups of issue 26, all priced by autotune's own cost model.

OPT-350M and GPT-Neo-2.7B (benchmarks/data/*.yaml) on 8 A100-40GB + 8 V100-16GB and 16 + 16 (4 GPUs
per node, 25 Gbit/s per device between nodes: bench_hetero_plans.py's cluster), sequence 2048, global
batch 1024 and 2048, in two pricings:

- ``sailor-fp32``: Sailor's published per-layer measurements (benchmarks/data/sailor, MIT; fp32 =
  TF32 on the A100) imported as ``profile import --format sailor`` imports them
  (profilers/foreign/sailor.py into a layer-profile store, ``layer_profile: layers:ID`` per node
  group); Sailor measured no fp16, so
- ``sheet-fp16``: the size-aware datasheet model in fp16 (autotune/cost/datasheet.py).

Each row prices, per setup and pricing:

- **uniform**: the best plan of the default search with one mesh (``stages = uniform`` trials);
- **per-stage**: the best per-stage plan of the same search (``stages = program``: the stage program,
  search_spaces/_stages.py);
- **uniform cp=1** (with the search): the best uniform plan of the same search that a per-stage plan
  could also be (cp = hp = 1, ZeRO 0/1, no sequence parallelism, a per-stage schedule): what is left
  of the uniform space once context parallelism and the rest per-stage plans refuse are taken away;
- **program, all** (with the search): the stage program over every knob set the search can sample
  (micro-batch 1..16, recomputation none/selective/full, 1F1B, GPipe, interleaved 1F1B with 2
  virtual stages, ZeRO 0/1) with every candidate composition priced exactly (``TOP`` unbounded):
  the best per-stage plan the program can reach, to tell a search that samples too few knob sets or
  a program whose approximate ranking drops the fastest composition from a per-stage plan that is
  really slower;
- **SAILOR-style**: the shape SAILOR publishes for these clusters: the V100s as tp=4 replicas, the
  A100s as tp=1 replicas, dp = the V100 replica count; on 8+8 a V100 stage then A100 stages (the
  issue's GPT-Neo plan: [V100 tp4 x2] then four [A100 tp1 x2]); the mixed-replica variant (the issue's
  OPT plan on 16+16: a first stage of 6 A100 tp=1 replicas beside 4 V100 tp=4 replicas, a second of 10
  A100 tp=1; on 8+8 3 + 2 then 5);
- **Metis-style**: a stage per device type, each at the smallest tp whose replicas fit, the same dp;
  layers by Metis's balancing rule (proportional to each stage's measured throughput),

the hand-built plans at micro-batch 1, 1F1B, ZeRO-1, the first recomputation (none, selective, full)
that fits memory, their layers balanced by the
per-layer times the cost model itself prices for each (device type, tp) (``_stages.option_costs``,
the rule the program uses), the last stage lightened by the LM head. Each plan: step time, tokens/s,
peak predicted memory per device type against capacity.

With ``--cli`` the search is the user's: ``autotune search`` as a process with its default storage
(``results/autotune.db`` in a fresh directory, Sailor's timings imported into it first), its wall
seconds (start-up and all) printed beside its best plan (asked: at most 3 s per setup on a quiet
machine; SAILOR's planner takes 0.04-0.13 s).

Usage: python benchmarks/bench_stages.py [--trials N] [--models opt,neo] [--clusters 8+8,16+16]
       [--batches 1024,2048] [--pricings sailor-fp32,sheet-fp16] [--no-search | --cli]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from bench_hetero_plans import DATA, MODELS, SEQ, cluster_doc, import_sailor, memory_text  # noqa: E402

from autotune import stages as ST  # noqa: E402
from autotune.cost import compute as _compute  # noqa: E402
from autotune.cost.estimate import estimate  # noqa: E402
from autotune.errors import InputError  # noqa: E402
from autotune.plan import Plan, Shares, even_split  # noqa: E402
from autotune.search.options import SearchOptions  # noqa: E402
from autotune.search.run import search  # noqa: E402
from autotune.specs.cluster import cluster_from_dict  # noqa: E402
from autotune.specs.model import load_model  # noqa: E402
from search_spaces import _stages as P  # noqa: E402
from search_spaces.base import SearchContext  # noqa: E402

PRICINGS = ("sailor-fp32", "sheet-fp16")


def devices_of(cluster, name: str) -> list[list[int]]:
    """Device indices of each node of device type ``name``."""
    nodes: dict[int, list[int]] = {}
    for d in cluster.devices:
        if d.spec.name == name:
            nodes.setdefault(d.node, []).append(d.index)
    return list(nodes.values())


def slots(cluster, name: str, tp: int) -> list[tuple[int, ...]]:
    return [tuple(n[k:k + tp]) for n in devices_of(cluster, name) for k in range(0, len(n), tp)]


def per_layer(ctx, cache) -> dict[tuple[str, int], P.Option]:
    return {(o.name, o.tp): o for o in P.option_costs(ctx, (1, "none", ctx.dtype), cache)}


def balance(stage_opts: list[list[P.Option]], layers: int) -> list[int]:
    """Layers per stage proportional to each stage's speed (1 / its slowest replica's per-layer time),
    the last stage lightened by the LM head's time; every stage at least one layer."""
    t = [max(o.layer_s for o in opts) for opts in stage_opts]
    head = max(o.head_s for o in stage_opts[-1])
    w = [1 / x for x in t]
    share = [layers * x / sum(w) for x in w]
    share[-1] = max(1.0, share[-1] - head / t[-1] * (1 - w[-1] / sum(w)))
    n = [max(1, round(x)) for x in share]
    while sum(n) > layers:
        i = max(range(len(n)), key=lambda i: n[i] * t[i])
        n[i] -= 1
    while sum(n) < layers:
        i = min(range(len(n)), key=lambda i: (n[i] + 1) * t[i])
        n[i] += 1
    return n


def staged_plan(cells: list[list[tuple[int, ...]]], layers: list[int], dtype: str, batch: int,
                fit: tuple | None = None) -> Plan:
    """The plan of these cells; with ``fit`` = (model, cluster) the first recomputation (none,
    selective, full) whose plan fits memory under the cost model (else none)."""
    dp = len(cells[0])
    stages = tuple(ST.Stage(layers=n, replicas=tuple(ST.Replica(tp=len(d), devices=d) for d in reps))
                   for n, reps in zip(layers, cells, strict=True))
    plan = Plan(stages=stages, dtype=dtype, zero_stage=1 if dp > 1 else 0,
                shares=Shares(samples=tuple(even_split(batch, dp))))
    for rc in ("none", "selective", "full") if fit else ():
        try:
            if estimate(plan.replace(recompute=rc), fit[0], fit[1], SEQ, batch).predicted["feasible"]:
                return plan.replace(recompute=rc)
        except InputError:
            break
    return plan


def sailor_plans(cluster, model, opts, dtype: str, batch: int) -> dict[str, Plan]:
    a1, v4 = slots(cluster, "A100-40GB", 1), slots(cluster, "V100-16GB", 4)
    dp = len(v4)
    out = {}
    # V100 tp=4 replicas first, then the A100s at tp=1 in stages of dp replicas
    k = len(a1) // dp
    cells = [v4] + [a1[i * dp:(i + 1) * dp] for i in range(k)]
    stage_opts = [[opts[("V100-16GB", 4)]]] + [[opts[("A100-40GB", 1)]]] * k
    out["SAILOR-style"] = staged_plan(cells, balance(stage_opts, model.layers), dtype, batch, (model, cluster))
    # mixed replicas: stage 1 = some A100 tp=1 beside every V100 tp=4 replica, stage 2 = the other A100s
    first_a = (len(a1) - len(v4)) // 2  # 6 of 16 with 4 V100 replicas (the OPT plan); 3 of 8 with 2
    dp2 = first_a + len(v4)
    if len(a1) - first_a == dp2:
        cells = [[*a1[:first_a], *v4], a1[first_a:]]
        stage_opts = [[opts[("A100-40GB", 1)], opts[("V100-16GB", 4)]], [opts[("A100-40GB", 1)]]]
        out["SAILOR-mixed"] = staged_plan(cells, balance(stage_opts, model.layers), dtype, batch, (model, cluster))
    return out


def metis_plan(cluster, model, opts, dtype: str, batch: int) -> Plan | None:
    """A stage per device type (V100 first), each at the smallest tp that fits memory, one dp."""
    for dp_tp in ((1, 1), (2, 2), (4, 4)):  # (V100 tp, A100 tp): the same dp needs the same tp here
        tv, ta = dp_tp
        v, a = slots(cluster, "V100-16GB", tv), slots(cluster, "A100-40GB", ta)
        if len(v) != len(a) or ("V100-16GB", tv) not in opts or ("A100-40GB", ta) not in opts:
            continue
        so = [[opts[("V100-16GB", tv)]], [opts[("A100-40GB", ta)]]]
        plan = staged_plan([v, a], balance(so, model.layers), dtype, batch, (model, cluster))
        try:
            e = estimate(plan, model, cluster, SEQ, batch)
        except InputError:
            continue
        if e.predicted["feasible"]:
            return plan
    return None


def line(label: str, plan: Plan | None, model, cluster, batch: int) -> str:
    if plan is None:
        return f"  {label:13s} none fits"
    try:
        e = estimate(plan, model, cluster, SEQ, batch)
    except InputError as exc:
        return f"  {label:13s} refused: {exc}"
    pr, bd = e.predicted, e.breakdown
    layers = e.plan.shares.layers  # a per-stage plan's text names its stages' layers itself
    text = ST.degrees_text(plan.to_dict())  # (one whose stages share one tp is written as its mesh)
    shape = text + (f" layers {list(layers)}" if layers and not text.startswith("stages ") else "")
    opts = f"mbs {plan.micro_batch_size} {plan.schedule} rc {plan.recompute} zero {plan.zero_stage}"
    return (f"  {label:13s} {pr['step_time_s']:8.2f} s {pr['tokens_per_s'] / 1e3:7.1f}k tok/s  "
            f"{'' if pr['feasible'] else 'INFEASIBLE '}mem GB {memory_text(bd)}  | {shape} | {opts}")


def searched(model, cluster, batch: int, dtype: str, trials: int, url: str, name: str):
    """(best uniform plan, best per-stage plan, seconds) of one default search."""
    import optuna

    from autotune.study import iter_trial_plans

    t = time.perf_counter()
    search(model, cluster, SEQ, batch, study_name=name, storage=url,
           options=SearchOptions(trials=trials, dtype=dtype, seed=0, top=3))
    study = optuna.load_study(study_name=name, storage=url)
    uni = next(iter_trial_plans(study, where=lambda d: not d.get("stages")), None)
    stg = next(iter_trial_plans(study, where=lambda d: bool(d.get("stages"))), None)
    return (uni[1] if uni else None), (stg[1] if stg else None), time.perf_counter() - t


def cli_searched(model_file: Path, doc: dict, batch: int, dtype: str, trials: int | None, tmp: str):
    """(best plan, wall seconds, CPU seconds) of ``autotune search`` run as a user runs it: a fresh
    process in ``tmp`` with the default storage (where the layer profiles the cluster names were
    imported). The CPU seconds are the process's own: on a loaded machine they hold where wall does not."""
    import json
    import resource
    import subprocess

    path = Path(tmp) / "cluster.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    args = [sys.executable, "-m", "autotune", "search", "-m", str(model_file), "-c", str(path), "-s", str(SEQ),
            "-b", str(batch), "--dtype", dtype, "--json"] + (["--trials", str(trials)] if trials else [])
    t, c = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(args, cwd=tmp, capture_output=True, text=True)
    wall = time.perf_counter() - t
    c2 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"autotune search failed: {r.stderr.strip().splitlines()[-1:]}")
    cpu = c2.ru_utime + c2.ru_stime - c.ru_utime - c.ru_stime
    return Plan.from_dict(json.loads(r.stdout)["best"]), wall, cpu


def stage_legal(plan: dict) -> bool:
    """A uniform plan dict a per-stage plan could also be (``stages.problems``' rules on the degrees
    and options)."""
    d = plan.get("degrees") or {}
    return (d.get("cp", 1) == 1 and d.get("hp", 1) == 1 and (plan.get("zero_stage") or 0) <= 1
            and not plan.get("sequence_parallel") and plan.get("schedule", "1f1b") in ST.STAGED_SCHEDULES
            and not plan.get("stages"))


def best_uniform_cp1(url: str, name: str) -> Plan | None:
    import optuna

    from autotune.study import iter_trial_plans

    got = next(iter_trial_plans(optuna.load_study(study_name=name, storage=url), where=stage_legal), None)
    return got[1] if got else None


def program_all(model, cluster, batch: int, dtype: str) -> tuple[Plan | None, float]:
    """The stage program's best plan over every knob set, every candidate priced exactly; seconds."""
    ctx = SearchContext(model=model, cluster=cluster, seq_len=SEQ, global_batch=batch, dtype=dtype)
    top, P.TOP = P.TOP, 10**9
    best, cache, t = None, {}, time.perf_counter()
    try:
        for mbs in (1, 2, 4, 8, 16):
            for rc in ("none", "selective", "full"):
                for sched, vs in (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)):
                    for zero in (0, 1):
                        got = P.best_plan(ctx, mbs=mbs, schedule=sched, vs=vs, recompute=rc, zero=zero, cache=cache)
                        if isinstance(got, Plan):
                            e = estimate(got, model, cluster, SEQ, batch).predicted
                            if e["feasible"] and (best is None or e["step_time_s"] < best[0]):
                                best = (e["step_time_s"], got)
    finally:
        P.TOP = top
    return (best[1] if best else None), time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=None, help="sampler trials per search (default: the search's)")
    ap.add_argument("--models", default="opt,neo")
    ap.add_argument("--clusters", default="8+8,16+16")
    ap.add_argument("--batches", default="1024,2048")
    ap.add_argument("--pricings", default=",".join(PRICINGS))
    ap.add_argument("--no-search", action="store_true", help="the hand-built and program plans only")
    ap.add_argument("--cli", action="store_true", help="search with `autotune search` (default storage), timed")
    a = ap.parse_args()
    walls: list[float] = []
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, seq {SEQ}, materialised attention")
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/results/autotune.db" if a.cli else f"sqlite:///{tmp}/stages.db"
        Path(tmp, "results").mkdir()
        for mk in a.models.split(","):
            fname, key = MODELS[mk]
            model = load_model(str(DATA / fname))
            profiles = import_sailor(model, key, url) if "sailor-fp32" in a.pricings else None
            for cl in a.clusters.split(","):
                nodes = int(cl.split("+")[0]) // 4
                for pricing in a.pricings.split(","):
                    dtype = pricing.split("-")[1]
                    doc = cluster_doc(nodes, profiles if pricing.startswith("sailor") else None)
                    cluster = cluster_from_dict(doc, storage=url)
                    _compute._RATES.clear()
                    ctx = SearchContext(model=model, cluster=cluster, seq_len=SEQ, global_batch=1, dtype=dtype)
                    opts = per_layer(ctx, {})
                    for batch in (int(b) for b in a.batches.split(",")):
                        print(f"\n{model.name}, {cl} A100-40GB + V100-16GB, {pricing}, global batch {batch}")
                        if a.cli:
                            plan, wall, cpu = cli_searched(DATA / fname, doc, batch, dtype, a.trials, tmp)
                            walls.append((wall, cpu))
                            print(line("searched", plan, model, cluster, batch)
                                  + f"  [autotune search {wall:.1f} s wall, {cpu:.1f} s CPU]")
                        elif not a.no_search:
                            uni, stg, wall = searched(model, cluster, batch, dtype, a.trials, url,
                                                      f"{mk}-{cl}-{pricing}-{batch}")
                            print(line("uniform", uni, model, cluster, batch))
                            print(line("per-stage", stg, model, cluster, batch) + f"  [search {wall:.0f} s]")
                            print(line("uniform cp=1", best_uniform_cp1(url, f"{mk}-{cl}-{pricing}-{batch}"), model,
                                       cluster, batch))
                            every, secs = program_all(model, cluster, batch, dtype)
                            print(line("program, all", every, model, cluster, batch) + f"  [{secs:.0f} s]")
                        else:
                            bctx = SearchContext(model=model, cluster=cluster, seq_len=SEQ, global_batch=batch,
                                                 dtype=dtype)
                            best = None
                            cache: dict = {}
                            t = time.perf_counter()
                            for mbs in (1, 2, 4):
                                for rc in ("none", "selective"):
                                    got = P.best_plan(bctx, mbs=mbs, schedule="1f1b", vs=1, recompute=rc, zero=1,
                                                      cache=cache)
                                    if isinstance(got, Plan):
                                        s = estimate(got, model, cluster, SEQ, batch).predicted["step_time_s"]
                                        if best is None or s < best[0]:
                                            best = (s, got)
                            print(line("program", best[1] if best else None, model, cluster, batch)
                                  + f"  [{time.perf_counter() - t:.1f} s]")
                        for label, plan in sailor_plans(cluster, model, opts, dtype, batch).items():
                            print(line(label, plan, model, cluster, batch))
                        print(line("Metis-style", metis_plan(cluster, model, opts, dtype, batch), model, cluster,
                                   batch))
                        sys.stdout.flush()
    if walls:
        w, c = sorted(x for x, _ in walls), sorted(x for _, x in walls)
        print(f"\nautotune search over {len(walls)} searches: wall median {w[len(w) // 2]:.1f} s, max {w[-1]:.1f} s; "
              f"CPU median {c[len(c) // 2]:.1f} s, max {c[-1]:.1f} s; load average "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
