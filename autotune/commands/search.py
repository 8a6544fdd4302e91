"""`autotune search`: Optuna over degrees and uneven shares, priced by the cost model."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.text import Text

from autotune.commands.common import (
    DEFAULT_STORAGE,
    ClusterOpt,
    DataDtypeOpt,
    DataOpt,
    DocMaskOpt,
    DtypeOpt,
    EodOpt,
    GlobalBatchOpt,
    JsonOpt,
    LengthsOpt,
    ModelOpt,
    SeedOpt,
    SeqLenOpt,
    StorageOpt,
    WideOpt,
    console,
    emit_json,
    err_console,
)
from autotune.dashboard.tables import Col, fit
from autotune.objective import Objective, cost_text
from autotune.stages import degrees_text, shares_text
from autotune.units import counted, fmt_bytes, fmt_time

HELP = "Search parallel plans with Optuna over degrees and uneven shares using the cost model."

TrialsOpt = Annotated[int | None, typer.Option("--trials", "-n", help="Sampler trials (baselines, balanced starts "
                                                                      "and the polish, up to 4x, come on top); "
                                                                      "default 100, or the whole grid.")]
TimeoutOpt = Annotated[float | None, typer.Option("--timeout", help="Stop after this many seconds (the notes say "
                                                                   "where it stopped).")]
StudyOpt = Annotated[str | None, typer.Option("--study", help="Study name; the same name resumes (default: "
                                                              "MODEL@CLUSTER-sSEQ-bBATCH).")]
SamplerOpt = Annotated[str, typer.Option("--sampler", help="tpe (default), random or grid (exhaustive where small).")]
WorkersOpt = Annotated[int, typer.Option("--workers", "-w", help="Processes searching one study.")]
TopOpt = Annotated[int, typer.Option("--top", "-k", help="Plans to show and print.")]
SpaceOpt = Annotated[str, typer.Option("--space", help="Search space: a name (built in, or an installed `autotune.spaces` entry point) or a Python file defining space(ctx) (docs/spaces.md).")]
ObjectiveOpt = Annotated[str, typer.Option("--objective", help="time: the fastest plan; cost: the cheapest per "
                                                               "token (needs price on every node group).")]
BudgetOpt = Annotated[str | None, typer.Option("--budget", help="Fastest (or cheapest) within this price per hour "
                                                               "of the devices used, e.g. 40USD/h.")]
MaxStepOpt = Annotated[str | None, typer.Option("--max-step-time", help="Only plans whose step takes at most this "
                                                                       "long, e.g. 2s (cheapest within a time: with "
                                                                       "--objective cost).")]
TargetOpt = Annotated[str, typer.Option("--target", help="Who will run the plan: runtime (autotune's own, "
                                                         "everything the space holds), megatron, torchtitan, "
                                                         "deepspeed or accelerate (only what it can express).")]

GradReduceOpt = Annotated[str, typer.Option("--grad-reduce", help="Gradient reduction of every plan: fp32 (the "
                                                                  "default) or bf16 (Megatron's --grad-reduce-in-bf16: "
                                                                  "cheaper, other numerics; --target megatron).")]


def command(
    model: ModelOpt,
    cluster: ClusterOpt,
    seq_len: SeqLenOpt,
    global_batch: GlobalBatchOpt,
    trials: TrialsOpt = None,
    timeout: TimeoutOpt = None,
    study: StudyOpt = None,
    storage: StorageOpt = DEFAULT_STORAGE,
    sampler: SamplerOpt = "tpe",
    workers: WorkersOpt = 1,
    seed: SeedOpt = 0,
    top: TopOpt = 5,
    space: SpaceOpt = "default",
    wide: WideOpt = False,
    dtype: DtypeOpt = "auto",
    target: TargetOpt = "runtime",
    grad_reduce: GradReduceOpt = "fp32",
    objective: ObjectiveOpt = "time",
    budget: BudgetOpt = None,
    max_step_time: MaxStepOpt = None,
    data: DataOpt = None,
    eod: EodOpt = None,
    lengths: LengthsOpt = None,
    doc_mask: DocMaskOpt = None,
    data_dtype: DataDtypeOpt = "auto",
    json_: JsonOpt = False,
) -> None:
    """Search parallel plans with Optuna over degrees and uneven shares using the cost model.

    Longer than a screen: its options are declared in the signature (typer, 29 lines); the body
    builds ``SearchOptions``, hands the work to ``autotune.search`` and prints."""
    from autotune.documents import documents_from_options
    from autotune.objective import make_objective
    from autotune.plan import choose_dtype
    from autotune.progress import Progress
    from autotune.search import SearchOptions, check_options
    from autotune.search.pool import pool_search
    from autotune.specs import load_cluster, load_model
    from autotune.study import default_study_name

    opts = SearchOptions(trials=trials, timeout_s=timeout, sampler=sampler, workers=workers, seed=seed, top=top,
                         space=space, target=target, grad_reduce=grad_reduce)
    check_options(opts, storage)
    m = load_model(model)
    c = load_cluster(cluster, storage=storage)
    obj = make_objective(objective, budget, max_step_time, c)  # cost without prices: refused here, one line
    docs = documents_from_options(data=data, eod=eod, lengths=lengths, vocab=m.vocab, data_dtype=data_dtype)
    if docs is not None:  # the study records the distribution; the plans are priced with their masks
        mask = doc_mask is not False
        opts = dataclasses.replace(opts, documents={**docs.record(), "doc_mask": mask}, doc_mask=mask)
    elif doc_mask:
        from autotune.errors import InputError

        raise InputError("needs documents: --data FILE --eod ID or --lengths FILE", field="--doc-mask")
    # the precision is chosen (and a device that lacks it refused) before any point is priced; on a
    # pool ``auto`` is chosen per subset (a subset without the pool's V100s trains in bf16)
    chosen = _pool_dtype(dtype, c)
    opts = dataclasses.replace(opts, dtype="auto" if chosen == "auto" else choose_dtype(dtype, c))
    # a study holds one precision and one target: another one is another default study
    name = study or (default_study_name(m, c, seq_len, global_batch) + ("" if chosen == "bf16" else f"-{chosen}")
                     + ("" if target == "runtime" else f"-{target}") + ("" if grad_reduce == "fp32" else "-gradbf16")
                     + ("" if docs is None else f"-docs{docs.dist.digest()[:8]}" + ("" if opts.doc_mask else "-nomask")))
    opening = (f"searching {m.name} on {c.name} ({c.num_devices} devices), seq {seq_len}, batch {global_batch}: "
               f"study {name!r} in {storage}")  # printed once the study is open (Progress.opened)
    with Progress(err_console, enabled=not json_, opening=None if json_ else opening) as live:  # the bar: a terminal
        res = pool_search(m, c, seq_len, global_batch, study_name=name, storage=storage, options=opts, objective=obj,
                          display=live)
    out = res.to_dict()
    if docs is not None:  # which documents priced the plans: the distribution, not its histogram
        out["documents"] = {**docs.dist.brief(), "doc_mask": opts.doc_mask}
    if json_:
        emit_json(out)
        return
    show(out, storage, wide, top=res.layouts)


def _describe(d: dict[str, Any]) -> str:
    from autotune.documents import describe

    return describe(d)


def _pool_dtype(option: str, cluster: Any) -> str:
    """``auto`` on a pool whose device types choose different precisions (each subset then searches
    in its own: search/pool.subset_dtype); else the one precision ``choose_dtype`` gives."""
    from autotune.plan import choose_dtype
    from autotune.specs.pool import is_pool

    whole = choose_dtype(option, cluster)
    if option != "auto" or not is_pool(cluster):
        return whole
    from types import SimpleNamespace

    each = {choose_dtype("auto", SimpleNamespace(name=cluster.name, device_types=lambda g=g: [g.device]))
            for g in cluster.groups}
    return "auto" if len(each) > 1 else whole


def _options(p: dict[str, Any]) -> str:
    vs = p.get("virtual_stages", 1)
    bits = [f"mbs{p['micro_batch_size']}x{p.get('num_microbatches')}"]
    if p["schedule"] != "1f1b" or vs > 1:  # 1f1b is the default: said only in the caption
        bits.append(p["schedule"] + (f"/v{vs}" if vs > 1 else ""))
    if p.get("recompute") != "none":
        bits.append(f"rc:{p['recompute']}")
    if p.get("zero_stage"):
        bits.append(f"zero{p['zero_stage']}")
    if p.get("sequence_parallel"):
        bits.append("sp")
    if p.get("dtype") and p.get("dtype") != "bf16":
        bits.append(p["dtype"])
    return " ".join(bits)


_TERMS = (("compute_s", "compute"), ("experts_s", "routed experts"), ("exposed", "exposed communication"),
          ("a2a", "all-to-all"), ("bubble_s", "pipeline bubble"), ("optimizer_s", "optimizer step"))
"""The step's terms a why-line names; a MoE plan's routed experts and its exposed token all-to-all
(``breakdown["moe"]``) apart from the rest of its compute and exposed communication."""


def _terms(bd: dict[str, Any] | None) -> dict[str, float]:
    bd = bd or {}
    moe = bd.get("moe") or {}
    experts, a2a = float(moe.get("experts_s") or 0.0), float(moe.get("ep_exposed_s") or 0.0)
    return {"compute_s": float(bd.get("compute_s") or 0.0) - experts, "experts_s": experts,
            "exposed": float(bd.get("exposed_comm_s") or 0.0) + float(bd.get("dp_exposed_s") or 0.0) - a2a,
            "a2a": a2a, "bubble_s": float(bd.get("bubble_s") or 0.0), "optimizer_s": float(bd.get("optimizer_s") or 0.0)}


def _label(key: str, label: str, bd: dict[str, Any] | None) -> str:
    """The term's name; the all-to-all says where it runs (across nodes: the EP group leaves the node)."""
    if key == "a2a" and ((bd or {}).get("moe") or {}).get("ep_crosses_nodes"):
        return "all-to-all across nodes"
    return label


def why(p: dict[str, Any], bd: dict[str, Any] | None, best: dict[str, Any], best_bd: dict[str, Any] | None,
        first: str = "fastest") -> str:
    """One line on why a plan sits where it does: the best (``first``: what put it first) names where
    its step goes; every other plan the term that costs it most against the best (a MoE plan's routed
    experts and all-to-all among them, e.g. ``all-to-all across nodes 0.8 s against 0.1 s``)."""
    step = (p.get("predicted") or {}).get("step_time_s")
    best_step = (best.get("predicted") or {}).get("step_time_s")
    if not step or not best_step:
        return "not priced"
    mine = _terms(bd)
    if p is best:
        parts = ", ".join(f"{_label(k, label, bd)} {fmt_time(mine[k])}" for k, label in _TERMS
                          if mine[k] > 0.005 * step)
        return f"{first}: {fmt_time(step)}/step = {parts}"
    theirs = _terms(best_bd)
    key, label = max(_TERMS, key=lambda kl: mine[kl[0]] - theirs[kl[0]])
    extra = mine[key] - theirs[key]
    return (f"{step / best_step:.2f}x the best's step time; {_label(key, label, bd)} {fmt_time(mine[key])} against "
            f"{fmt_time(theirs[key])} (+{fmt_time(extra)})" if extra > 0 else
            f"{step / best_step:.2f}x the best's step time")


def first_place(best: dict[str, Any], others: list[dict[str, Any]], objective: str) -> str:
    """What put the best plan first: the objective (``fastest``, ``cheapest per token``, ``fastest
    within 15USD/h``), or, where another plan of the search is faster, the tie-break (cost/tiebreak.py)."""
    from autotune.cost.tiebreak import TIE_TOLERANCE

    def step(p: dict[str, Any]) -> float:
        return float((p.get("predicted") or {}).get("step_time_s") or 0.0)

    faster = min((p for p in others if 0 < step(p) < step(best)), key=step, default=None)
    if not objective.startswith("fastest") or faster is None:
        return objective
    return (f"chosen ({step(best) / step(faster) - 1:.1%} slower than {degrees_text(faster)} "
            f"{_options(faster)}: within {TIE_TOLERANCE:.0%} plans tie and the simpler one is chosen)")


def priced_from(bd: dict[str, Any] | None) -> str:
    """``; block from layers:3 (measured)`` or ``; block from datasheet x 1.37 (one scale: ...)``
    per device type where a layer profile priced the plan (cost/layers.py), else nothing."""
    src = (bd or {}).get("compute_source") or {}
    parts = []
    for dev, s in src.items():
        blk = s.get("block", "")
        if blk.startswith("layers:"):
            parts.append(f"{dev} block from {blk.split(',')[0]}")
        elif " (one scale: " in blk:  # "<fallback> x R (one scale: layers:ID (origin) / ..."
            head, rest = blk.split(" (one scale: ", 1)
            parts.append(f"{dev} block from {head} (on {rest.split(' / ')[0]}'s scale)")
    return "; " + "; ".join(parts) if parts else ""


def plan_table(plans: list[dict[str, Any]], title: str, measured: bool = False, wide: bool = False,
               breakdowns: list[dict[str, Any] | None] | None = None, first: str = "fastest") -> Group:
    """The plans, fitted to the terminal, with one line per plan under the table on why it is where
    it is (when ``breakdowns`` are given; ``first``: what put the first plan first, ``first_place``)."""
    cols = [Col("#", priority=0), Col("degrees", "left", 0), Col("shares", "left", 1), Col("options", "left", 1),
            Col("pred tok/s", priority=0), Col("MFU", priority=3), Col("peak memory", priority=2)]
    if measured:
        cols += [Col("meas tok/s", priority=0), Col("error", priority=0)]
    priced = any(cost_text(p.get("cost")) for p in plans)  # a priced search: what each plan costs
    if priced:
        cols.append(Col("cost", priority=0))
    rows = []
    for i, p in enumerate(plans):
        pr = p.get("predicted") or {}
        deg = degrees_text(p)  # a per-stage plan: its stages with their own degrees
        mem, cap = pr.get("memory_bytes") or [], pr.get("capacity_bytes") or []
        j = max(range(len(mem)), key=lambda r: mem[r] / cap[r] if cap else mem[r]) if mem else None
        memtxt = f"{fmt_bytes(mem[j])} ({mem[j] / cap[j]:.0%})" if j is not None and cap else "-"
        row = [str(i + 1), deg, shares_text(p, " "), _options(p), f"{pr.get('tokens_per_s', 0):,.0f}",
               f"{pr.get('mfu', 0):.1%}" if isinstance(pr.get("mfu"), (int, float)) else "-", memtxt]
        if priced:
            c = p.get("cost") or {}
            row.append(f"{c['per_mtok']:.4g}{c.get('currency') or ''}/Mtok" if c.get("per_mtok") is not None else "-")
        if measured:
            m = p.get("measured") or {}
            row += [f"{m['tokens_per_s']:,.0f}" if m.get("tokens_per_s") else "failed" if p.get("failure") else "-",
                    f"{p['error']:+.1%}" if isinstance(p.get("error"), (int, float)) else "-"]
        rows.append(row)
    lines = []
    if breakdowns is not None and plans:
        lines = [Text(f"#{i + 1} {why(p, bd, plans[0], breakdowns[0], first)}{priced_from(bd)}", style="dim")
                 for i, (p, bd) in enumerate(zip(plans, breakdowns, strict=True))]
    caption = "options: micro-batch size x micro-batches, schedule when not 1f1b, recompute, ZeRO stage"
    return Group(fit(console, cols, rows, wide=wide, title=title, caption=caption), *lines)


def distinct_layouts(study_name: str, storage: str, n: int) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """The best plan of each of the ``n`` best layouts of a stored study (search.report.best_layouts)."""
    from autotune.search.report import best_layouts
    from autotune.study import iter_trial_plans, open_study

    return best_layouts(iter_trial_plans(open_study(study_name, storage)), n)


def targets_line(targets: dict[str, Any]) -> str:
    """``best plan each target can run, ...: runtime 1.00x (#12), megatron 0.87x (#40), ...``."""
    from autotune.targets import per_target_text

    return per_target_text(targets)


def show(res: dict[str, Any], storage: str | None = None, wide: bool = False,
         top: list[tuple[dict[str, Any], Any]] | None = None) -> None:
    """The search's result for people: one plan per layout (``top``: SearchResult.layouts, from the
    trials the search holds, as the CLI passes it: reading a study of thousands of trials back costs
    more than the search; else read from ``storage``), the best even split, why the best wins, and
    the notes."""
    if top is None:
        top = distinct_layouts(res["study"], storage, len(res["top"])) if storage else []
    if top:
        console.print(plan_table([p for p, _ in top], f"best plan of each of the {counted(len(top), 'best layout')}, of "
                                 f"{counted(res['trials'], 'trial')} (study {res['study']})", wide=wide,
                                 breakdowns=[bd for _, bd in top],
                                 first=first_place(top[0][0], [p for p, _ in top] + res.get("top", []),
                                                   Objective.from_attrs(res.get("objective")).text())))
    else:
        console.print(plan_table(res["top"], f"top {len(res['top'])} of {counted(res['trials'], 'trial')} (study "
                                 f"{res['study']})", wide=wide))
    b = res.get("baseline_best")
    if b:
        console.print(plan_table([b], "best even-split plan", wide=wide))
    if res.get("documents"):
        from autotune.commands.common import documents_line

        d = res["documents"]
        console.print(documents_line(d) if d.get("doc_mask", True) else
                      f"documents: {_describe(d)}; priced as whole causal windows (--no-doc-mask)", highlight=False,
                      soft_wrap=True)
    if res.get("why"):
        console.print(f"why the best wins: {res['why']}", highlight=False)
    if res.get("targets"):
        console.print(targets_line(res["targets"]), highlight=False)
    front = res.get("front") or []
    if len(front) > 1 or any(p.get("uses") for p in front):
        from autotune.dashboard.front import front_table

        console.print(front_table(front, wide=wide))
    for line in res.get("left_out") or []:
        console.print(line, highlight=False)
    for n in res.get("notes") or []:
        console.print(f"[dim]note: {n}[/]", highlight=False)
    console.print(f"{res['new_trials']} new trials in {res['elapsed_s']:.1f} s", highlight=False)
