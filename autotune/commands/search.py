"""`autotune search`: Optuna over degrees and uneven shares, priced by the cost model."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from autotune.commands.common import (
    DEFAULT_STORAGE,
    ClusterOpt,
    GlobalBatchOpt,
    JsonOpt,
    ModelOpt,
    SeedOpt,
    SeqLenOpt,
    StorageOpt,
    console,
    emit_json,
    err_console,
)
from autotune.units import fmt_bytes

HELP = "Search parallel plans with Optuna over degrees and uneven shares using the cost model."

TrialsOpt = Annotated[int | None, typer.Option("--trials", "-n", help="Sampler trials (baselines, balanced starts "
                                                                      "and the polish, up to 8x, come on top); "
                                                                      "default 100, or the whole grid.")]
TimeoutOpt = Annotated[float | None, typer.Option("--timeout", help="Stop after this many seconds (the notes say "
                                                                   "where it stopped).")]
StudyOpt = Annotated[str | None, typer.Option("--study", help="Study name; the same name resumes (default: "
                                                              "MODEL@CLUSTER-sSEQ-bBATCH).")]
SamplerOpt = Annotated[str, typer.Option("--sampler", help="tpe (default), random or grid (exhaustive where small).")]
WorkersOpt = Annotated[int, typer.Option("--workers", "-w", help="Processes searching one study.")]
TopOpt = Annotated[int, typer.Option("--top", "-k", help="Plans to show and print.")]
SpaceOpt = Annotated[str, typer.Option("--space", help="Search space module in search_spaces/.")]


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
    json_: JsonOpt = False,
) -> None:
    """Search parallel plans with Optuna over degrees and uneven shares using the cost model."""
    from autotune.progress import Progress
    from autotune.search import SearchOptions, check_options, search
    from autotune.specs import load_cluster, load_model
    from autotune.study import default_study_name

    opts = SearchOptions(trials=trials, timeout_s=timeout, sampler=sampler, workers=workers, seed=seed, top=top,
                         space=space)
    check_options(opts, storage)
    m = load_model(model)
    c = load_cluster(cluster, storage=storage)
    name = study or default_study_name(m, c, seq_len, global_batch)
    if not json_:
        err_console.print(f"searching {m.name} on {c.name} ({c.num_devices} devices), seq {seq_len}, batch "
                          f"{global_batch}: study {name!r} in {storage}", highlight=False)
    with Progress(err_console, enabled=not json_) as live:  # a terminal only; nothing under --json or a pipe
        res = search(m, c, seq_len, global_batch, study_name=name, storage=storage, options=opts, display=live)
    if json_:
        emit_json(res.to_dict())
        return
    show(res.to_dict())


def _shares(p: dict[str, Any]) -> str:
    out = []
    for k in ("layers", "tokens", "heads", "samples"):
        v = (p.get("shares") or {}).get(k)
        if v and len(v) > 1:
            out.append(f"{k[0]}{v}" if len(v) <= 6 else f"{k[0]}[{min(v)}..{max(v)} x{len(v)}]")
    return " ".join(out) or "-"


def _options(p: dict[str, Any]) -> str:
    bits = [f"mbs{p['micro_batch_size']}", p["schedule"] + (f"x{p['virtual_stages']}" if p.get("virtual_stages", 1) > 1
                                                             else "")]
    if p.get("recompute") != "none":
        bits.append(f"rc:{p['recompute']}")
    if p.get("zero_stage"):
        bits.append(f"zero{p['zero_stage']}")
    if p.get("sequence_parallel"):
        bits.append("sp")
    return " ".join(bits)


def plan_table(plans: list[dict[str, Any]], title: str, measured: bool = False) -> Table:
    t = Table(title=title)
    for col in ("#", "degrees", "shares", "options", "pred tok/s", "MFU", "peak mem / capacity"):
        t.add_column(col, justify="right" if col in ("#", "pred tok/s", "MFU") else "left")
    if measured:
        t.add_column("meas tok/s", justify="right")
        t.add_column("error", justify="right")
    for i, p in enumerate(plans):
        pr = p.get("predicted") or {}
        deg = ",".join(f"{k}={v}" for k, v in p["degrees"].items() if v > 1) or "dp=1"
        mem, cap = pr.get("memory_bytes") or [], pr.get("capacity_bytes") or []
        j = max(range(len(mem)), key=lambda r: mem[r] / cap[r] if cap else mem[r]) if mem else None
        memtxt = f"{fmt_bytes(mem[j])} / {fmt_bytes(cap[j])}" if j is not None and cap else "-"
        row = [str(i + 1), deg, _shares(p), _options(p), f"{pr.get('tokens_per_s', 0):,.0f}",
               f"{pr.get('mfu', 0):.1%}" if isinstance(pr.get("mfu"), (int, float)) else "-", memtxt]
        if measured:
            m = p.get("measured") or {}
            row += [f"{m['tokens_per_s']:,.0f}" if m.get("tokens_per_s") else "failed" if p.get("failure") else "-",
                    f"{p['error']:+.1%}" if isinstance(p.get("error"), (int, float)) else "-"]
        t.add_row(*row)
    return t


def show(res: dict[str, Any]) -> None:
    console.print(plan_table(res["top"], f"top {len(res['top'])} of {res['trials']} trials (study {res['study']})"))
    b = res.get("baseline_best")
    if b:
        console.print(plan_table([b], "best even-split plan"))
    if res.get("why"):
        console.print(f"why the best wins: {res['why']}", highlight=False)
    for n in res.get("notes") or []:
        console.print(f"[dim]note: {n}[/]", highlight=False)
    console.print(f"{res['new_trials']} new trials in {res['elapsed_s']:.1f} s", highlight=False)
