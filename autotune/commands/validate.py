"""`autotune validate`: run a study's best plans for real, store measured beside predicted, calibrate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer

from autotune.commands.common import (
    DEFAULT_STORAGE,
    DataDtypeOpt,
    DataOpt,
    DtypeOpt,
    HostsOpt,
    JsonOpt,
    NodeRankOpt,
    RemoteShellOpt,
    SeedOpt,
    StorageOpt,
    console,
    emit_json,
    err_console,
)
from autotune.errors import InputError
from autotune.progress import Progress
from autotune.units import counted

HELP = "Run the study's top plans for real, store measured beside predicted, calibrate the cost model, re-rank."


def command(
    study: Annotated[str, typer.Option("--study", help="Study name (see `autotune search`).")],
    storage: StorageOpt = DEFAULT_STORAGE,
    top: Annotated[int, typer.Option("--top", "-k", help="Plans to run for real.", min=1)] = 3,
    steps: Annotated[int, typer.Option("--steps", help="Measured steps per plan.", min=1)] = 3,
    warmup: Annotated[int, typer.Option("--warmup", help="Warm-up steps per plan.", min=0)] = 1,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds per real trial.", min=1)] = 300.0,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    seed: SeedOpt = 0,
    diverse: Annotated[bool, typer.Option("--diverse/--no-diverse", help="Best plan of each distinct layout "
                                          "(degrees, schedule, micro-batch) first, then near-copies.")] = True,
    data: DataOpt = None,
    data_dtype: DataDtypeOpt = "auto",
    dtype: DtypeOpt = "auto",
    node_rank: NodeRankOpt = None,
    hosts: HostsOpt = None,
    remote_shell: RemoteShellOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Run the study's top plans for real, store measured beside predicted, calibrate the cost model, re-rank."""
    from autotune.validate import ValidateOptions, validate

    if node_rank is not None and hosts is not None:
        raise InputError("--hosts starts every node from node-rank 0; drop --node-rank", field="--node-rank")
    if remote_shell is not None and hosts is None:
        raise InputError("--remote-shell only goes with --hosts", field="--remote-shell")
    if node_rank:  # another host's part: no storage here, node-rank 0 sends the trials
        from autotune.runtime.control import follow, master_from_env

        addr, port = master_from_env()
        say = (lambda _m: None) if json_ else (lambda m: err_console.print(m, highlight=False))
        done = follow(study, node_rank, addr=addr, port=port, say=say)
        if json_:
            emit_json(done)
        else:
            console.print(f"node-rank {node_rank}: ran its part of {done['trials_run']} trial(s); node-rank 0 "
                          "stores them", highlight=False)
        return
    check_study_dtype(study, storage, dtype)

    opts = ValidateOptions(top=top, steps=steps, warmup=warmup, timeout_s=timeout, device=device, seed=seed,
                           diverse=diverse, data=data, data_dtype=data_dtype)
    with Progress(err_console, enabled=not json_, unit="plans") as live:
        report = None if json_ else _reporter(live, top)
        if node_rank == 0 or hosts is not None:
            from autotune.runtime.control import lead

            out = lead(study, storage, opts, hosts_file=hosts, shell=remote_shell, progress=report)
        else:
            out = validate(study, storage, options=opts, progress=report)
    if json_:
        emit_json(out)
        return
    show(out)


def check_study_dtype(study: str, storage: str, dtype: str) -> None:
    """``--dtype`` on validate: ``auto`` runs the plans in the precision they were searched (and priced)
    in; an explicit precision must be the study's, else one line says to search again with it."""
    import itertools

    from autotune.errors import InputError
    from autotune.plan import choose_dtype
    from autotune.study import iter_trial_plans, open_study, study_workload

    if dtype == "auto":
        return
    st = open_study(study, storage)
    choose_dtype(dtype, study_workload(st, storage)[1])  # the cluster must have it at all
    searched = sorted({plan.dtype for _, plan in itertools.islice(iter_trial_plans(st), 200)})
    if searched and searched != [dtype]:
        raise InputError(f"study {study!r} was searched and priced in {', '.join(searched)}; validating it in "
                         f"{dtype} would measure plans nobody priced: run `autotune search --dtype {dtype}` "
                         "into a new study", field="--dtype")


def _reporter(live: Progress, top: int) -> Callable[[str], None]:
    """validate's messages: on a terminal a live display (plans done of ``top``, elapsed, ETA from the
    plans so far) with each message kept above it; elsewhere the plain lines, as before. Each
    "running" message means the plan before it has finished."""
    started = 0

    def say(message: str) -> None:
        nonlocal started
        if not live.on:
            err_console.print(message, highlight=False)
            return
        if message.startswith("trial ") and ": running " in message:
            if started == 0:
                live.phase("validating", total=top)
            else:
                live.advance()
            started += 1
        live.say(message)

    return say


def show(out: dict[str, Any]) -> None:
    from autotune.commands.search import plan_table
    from autotune.stages import degrees_text

    plans = [{**r["plan"], "predicted": r["predicted"], "measured": r["measured"], "failure": r["failure"],
              "error": r["error"]} for r in out["validated"]]
    console.print(plan_table(plans, f"validated plans of study {out['study']}", measured=True))
    memory_table(out)
    for r in out["validated"]:
        if r["failure"]:
            console.print(f"trial {r['trial']} failed ({r['failure']['kind']}): {r['failure']['message']}",
                          highlight=False)
    for s in out.get("skipped") or []:
        console.print(f"[dim]skipped trial {s['trial']} ({s['degrees']}): {s['reason']}[/]", highlight=False)
    if out.get("load_note"):
        console.print(out["load_note"], highlight=False)
    if out.get("median_error_before") is not None:
        after, held = out.get("median_error_after"), out.get("median_error_held_out")
        n = len([r for r in out["validated"] if r.get("measured") and not r.get("failure")])
        console.print(f"median |predicted - measured| / measured over {counted(n, 'plan')}: {out['median_error_before']:.1%} "
                      f"before calibration, " + (f"{after:.1%} after (fitted on these plans), " if after is not None
                                                 else "n/a after, ")
                      + (f"{held:.1%} held out (leave-one-out)" if held is not None
                         else "held out n/a (needs 3 validated plans)"), highlight=False)
        key = out.get("calibration_measured") or {}
        console.print(f"calibration: {out['calibration']} (measured on {key.get('machine')}, "
                      f"{key.get('precision')}, {key.get('runtime')}; applied to {key.get('precision')} plans "
                      f"on {', '.join(key.get('devices') or [])} only)", highlight=False)
    if out.get("best_measured"):
        m = out["best_measured"]["measured"]
        console.print(f"best measured: trial {out['best_measured_trial']} "
                      f"({degrees_text(out['best_measured'])}) "
                      f"{m['tokens_per_s']:,.0f} tokens/s", highlight=False)


def memory_table(out: dict[str, Any]) -> None:
    """Predicted vs measured peak memory per rank of every validated plan, and the median error."""
    from rich.table import Table

    from autotune.stages import degrees_text
    from autotune.units import fmt_bytes

    rows = [r for r in out["validated"] if r.get("memory")]
    if not rows:
        return
    t = Table(title="memory per rank: predicted / measured peak (error)", title_justify="left")
    t.add_column("trial", justify="right")
    t.add_column("degrees")
    t.add_column("per rank")
    t.add_column("median |err|", justify="right")
    for r in rows:
        m = r["memory"]
        cells = [f"{fmt_bytes(p)} / {fmt_bytes(q)} ({e:+.0%})" if e is not None else f"{fmt_bytes(p)} / -"
                 for p, q, e in zip(m["predicted_bytes"], m["measured_bytes"], m["error"], strict=True)]
        degrees = degrees_text(r["plan"])
        med = m["median_error"]
        t.add_row(str(r["trial"]), degrees, "; ".join(cells), f"{med:.1%}" if med is not None else "n/a")
    console.print(t)
    if out.get("median_memory_error") is not None:
        console.print(f"median memory error over {counted(len(rows), 'plan')}: {out['median_memory_error']:.1%} "
                      f"(measured on {out['measured_on']['machine']}; see docs/validation.md for what a CPU "
                      "figure says about GPU memory)", highlight=False)
