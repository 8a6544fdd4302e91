"""`autotune apply`: export a study's best plan (or a plan file) for a framework, or launch it.

    autotune apply (--study NAME | --plan plan.json) [--format json|megatron|torchtitan|deepspeed|accelerate]
                   [-o FILE] [--launch [--dry-run]] [--model M --seq-len S --global-batch B]
                   [--cluster C] [--storage URL] [--json]

A plan the target cannot express is refused (exit 2) with every reason and the nearest plan the
target can express, priced by the cost model; nothing is written then. ``-o`` writes all or nothing
(temp file, checked, renamed).
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from autotune.commands.common import (
    DEFAULT_STORAGE,
    DtypeOpt,
    HostsOpt,
    JsonOpt,
    RemoteShellOpt,
    StorageOpt,
    console,
    emit_json,
    err_console,
)
from autotune.export import FORMATS, ExportRefused
from autotune.export import apply as A
from autotune.export.common import ExportContext, describe, predicted_text
from autotune.export.options import ApplyOptions
from autotune.plan import Plan

HELP = "Export a plan for Megatron, torchtitan, DeepSpeed, Accelerate or JSON, or launch it."


def _say_subset(plan: Plan, ctx: ExportContext) -> None:
    """A plan on a subset of a pool: what it uses, what it leaves out and (from the search) why."""
    from autotune.specs.pool import subset_text

    text = None if getattr(ctx, "cluster_assumed", False) else subset_text(ctx.cluster, plan.uses)
    if text is None:
        return
    err_console.print(text, highlight=False, soft_wrap=True)
    for line in getattr(ctx, "left_out", ()):  # the search's chosen plan: why each left-out group pays
        err_console.print(line, highlight=False, soft_wrap=True)


def command(
    study: Annotated[str | None, typer.Option("--study", help="Study name: export its best trial "
                                              "(the best measured one once validated).")] = None,
    plan_file: Annotated[str | None, typer.Option("--plan", "-p", help="Plan JSON file to export.")] = None,
    trial: Annotated[int | None, typer.Option("--trial", help="With --study: export trial N instead of the best "
                                              "(e.g. a point of the search's Pareto front).", min=0)] = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="Target: " + ", ".join(FORMATS) + ".")] = "json",
    output: Annotated[str | None, typer.Option("--output", "-o", help="Write to FILE (all or nothing); "
                                               "default: print.")] = None,
    launch: Annotated[bool, typer.Option("--launch", help="Run the plan with autotune's runtime under "
                                         "torchrun (prints the command first).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="With --launch: only print the command.")] = False,
    steps: Annotated[int, typer.Option("--steps", help="With --launch: measured steps.", min=1)] = 5,
    timeout: Annotated[float, typer.Option("--timeout", help="With --launch: seconds a rank waits for a silent "
                                           "peer (a dead host) before the launch fails.", min=1)] = 600.0,
    node_rank: Annotated[int | None, typer.Option("--node-rank", help="With --launch: run (or print) only the "
                                                  "command of node-rank K of a multi-node plan.", min=0)] = None,
    hosts: HostsOpt = None,
    remote_shell: RemoteShellOpt = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="With --plan: the model it is for "
                                              "(unless the file records it).")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", "-s", help="With --plan: sequence length.",
                                                min=1)] = None,
    global_batch: Annotated[int | None, typer.Option("--global-batch", "-b", help="With --plan: global batch.",
                                                     min=1)] = None,
    cluster: Annotated[str | None, typer.Option("--cluster", "-c", help="Cluster file, `local` or `local:N` "
                                                "(default: what the study or plan records).")] = None,
    storage: StorageOpt = DEFAULT_STORAGE,
    force: Annotated[bool, typer.Option("--force", help="Write even when the file's extension or content says "
                                        "another format, or the plan does not fit in memory.")] = False,
    dtype: DtypeOpt = "auto",
    json_: JsonOpt = False,
) -> None:
    """Export a plan for Megatron, torchtitan, DeepSpeed, Accelerate or JSON, or launch it."""
    opts = ApplyOptions(study=study, plan_file=plan_file, trial=trial, fmt=fmt, output=output, launch=launch,
                        dry_run=dry_run, steps=steps, timeout_s=timeout, node_rank=node_rank, hosts=hosts,
                        remote_shell=remote_shell, model=model, seq_len=seq_len, global_batch=global_batch,
                        cluster=cluster, storage=storage, force=force, dtype=dtype)
    resolved = A.resolve(opts)
    if not json_:
        _say_subset(resolved.plan, resolved.ctx)
    if launch:
        _launch(opts, resolved, json_)
    else:
        _export(opts, resolved, json_)


def _cost(priced: object, ctx: ExportContext) -> dict | None:
    """What the exported plan costs on the devices it uses (``objective.figures``, as the search
    recorded it) where the cluster has prices or the plan names ``uses``; else None."""
    from autotune.objective import figures
    from autotune.specs.pool import priced as has_prices

    plan = getattr(priced, "plan", None)
    if ctx.cluster_assumed or plan is None or not (has_prices(ctx.cluster) or plan.uses is not None):
        return None
    return figures(ctx.cluster, plan.uses, getattr(priced, "predicted", None) or {}, ctx.seq_len, ctx.global_batch)


def _launch(opts: ApplyOptions, r: A.Resolved, json_: bool) -> None:
    """Print each node's torchrun line; without --dry-run run one of them here (A.launch_lines says
    which) and print what the ranks measured."""
    lines = A.launch_lines(opts, r)
    plan = r.plan
    if not json_:
        for i, (c, line) in enumerate(zip(lines.chosen, lines.shown, strict=True)):
            where = f" on {lines.host_names[i]}" if lines.host_names is not None else ""
            prefix = f"# node {c.node} (node-rank {c.node_rank}){where}\n" if lines.nodes > 1 else ""
            console.print(prefix + line, highlight=False, soft_wrap=True)
    if opts.dry_run:
        if json_:
            emit_json({"commands": lines.shown, "out": str(lines.out), "ran": False, "plan": plan.to_dict()})
        else:
            err_console.print("dry run: nothing written, nothing started", highlight=False)
        return
    summary = A.run_launch(opts, r, lines)
    if json_:
        emit_json({"commands": lines.shown, "out": str(lines.out), "ran": True, "measured": summary,
                   "plan": plan.to_dict()})
    else:
        console.print(f"ran ranks {summary['ranks'][0]}-{summary['ranks'][-1]} of {plan.world}: "
                      f"{summary['step_time_s']:.4g} s/step, {summary['tokens_per_s']:.4g} tokens/s, "
                      f"final loss {summary['losses'][-1]:.4f}", highlight=False)


def _export(opts: ApplyOptions, r: A.Resolved, json_: bool) -> None:
    """Export the plan (A.export_plan) and print it or what was written (a refusal under --json: the
    error object and the refusal, exit 2)."""
    try:
        done = A.export_plan(opts, r)
    except ExportRefused as e:
        if json_:
            err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            emit_json({"error": {"kind": "input", "message": e.message, "source": e.source, "field": e.field},
                       "refused": e.to_dict()})
            sys.exit(2)  # not typer.Exit: click returns its code in non-standalone mode and cli.main drops it
        raise
    cost = _cost(done.priced, r.ctx)
    if json_:
        emit_json({"format": opts.fmt, "output": done.written, "content": done.result.data,
                   "plan": done.priced.to_dict(), "text": None if done.written else done.result.text,
                   **({"cost": cost} if cost else {})})
        return
    if done.written:
        from autotune.objective import cost_text

        priced = ("not priced: no cluster given (pass --cluster for a prediction)" if r.ctx.cluster_assumed
                  else f"{predicted_text(done.priced.predicted)} on {r.ctx.cluster.name}"
                  + (f", costs {cost_text(cost)}" if cost_text(cost) else ""))
        err_console.print(f"wrote {done.written} ({opts.fmt}) for {describe(r.plan)}; {priced}", highlight=False,
                          soft_wrap=True)
    else:
        typer.echo(done.result.text, nl=False)


command.__doc__ = HELP
