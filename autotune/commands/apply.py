"""`autotune apply`: export a study's best plan (or a plan file) for a framework, or launch it.

    autotune apply (--study NAME | --plan plan.json) [--format json|megatron|torchtitan|deepspeed|accelerate]
                   [-o FILE] [--launch [--dry-run]] [--model M --seq-len S --global-batch B]
                   [--cluster C] [--storage URL] [--json]

A plan the target cannot express is refused (exit 2) with every reason and the nearest plan the
target can express, priced by the cost model; nothing is written then. ``-o`` writes all or nothing
(temp file, checked, renamed).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Annotated, Any

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
from autotune.errors import InputError
from autotune.export import FORMATS, ExportRefused, export, exporter, write_atomic
from autotune.export import launch as L
from autotune.export.common import ExportContext, describe, predict, predicted_text
from autotune.export.source import from_plan_file, from_study
from autotune.plan import Plan, choose_dtype
from autotune.plan_record import PlanRecord

HELP = "Export a plan for Megatron, torchtitan, DeepSpeed, Accelerate or JSON, or launch it."


def _tag(ctx: ExportContext) -> str:
    raw = f"{ctx.study}-t{ctx.trial}" if ctx.study else Path(ctx.source).stem or "plan"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", raw)


def _price(plan: Plan, ctx: ExportContext, force: bool) -> PlanRecord:
    """The plan priced on the cluster it is exported for, never with the prediction it carried in (a
    file can hold a stale or hand-edited ``predicted``). No cluster given: no prediction at all,
    rather than figures for a cluster nobody has. What the cluster cannot run (a device it lacks, a
    precision its devices lack) is an InputError from the cost model: exit 2, nothing written; a plan
    that does not fit in memory is refused too unless ``--force``."""
    if ctx.cluster_assumed:
        return PlanRecord(plan)
    priced, _ = predict(plan, ctx)
    p = priced.predicted or {}
    if p.get("feasible") is False and not force:
        raise InputError(f"the plan does not fit {ctx.cluster.name}: {p.get('infeasible_reason')}; pass --force "
                         "to export it anyway", field="--plan")
    return priced


def _check_output(output: str, fmt: str, force: bool) -> None:
    """Refuse a file whose extension (or content) says it holds another format, unless ``--force``:
    ``-o best.json -f torchtitan`` once overwrote a plan JSON with TOML."""
    if force:
        return
    suffix = Path(output).suffix.lower()
    want = exporter(fmt).SUFFIX
    claimed = {exporter(f).SUFFIX for f in FORMATS} | {".yaml", ".yml"}
    if suffix in claimed and suffix != want:
        raise InputError(f"{output!r} says {suffix} but --format {fmt} writes {want}; name the file *{want} or "
                         "pass --force", field="--output")
    p = Path(output)
    if fmt != "json" and p.is_file():
        try:
            head = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return
        if isinstance(head, dict) and "degrees" in head and "schema_version" in head:
            raise InputError(f"{output!r} holds an autotune plan; --format {fmt} would overwrite it (pass --force "
                             "to do so, or pick another file)", field="--output")


def _launch(plan: Plan, ctx: ExportContext, dry_run: bool, steps: int, json_: bool, node_rank: int | None,
            timeout_s: float = 600.0, hosts_file: str | None = None, remote_shell: str | None = None) -> None:
    """Print each node's torchrun line (autotune.export.launch); without --dry-run run one of them here:
    the only one, or node-rank K's (``--node-rank K``, on each host of a multi-node plan). With
    ``--hosts FILE`` the lines are those that start every node from here (node-rank 0's as it is,
    the others' through the remote shell, autotune.hostfile), and a real launch runs them all."""
    out = Path("results") / "launch" / _tag(ctx) / "out"
    cmds = L.commands(plan, ctx, out, steps=steps, run_id=_tag(ctx), timeout_s=timeout_s)
    if node_rank is not None and not 0 <= node_rank < len(cmds):
        raise InputError(f"the plan runs on {len(cmds)} node(s): node-rank 0..{len(cmds) - 1}", field="--node-rank")
    if not dry_run and len(cmds) > 1 and node_rank is None and hosts_file is None:
        raise InputError(f"the plan spans {len(cmds)} nodes: on each host run `autotune apply ... --launch "
                         "--node-rank K` with MASTER_ADDR set to node-rank 0's host, or start them all from here "
                         "with --hosts FILE (or --dry-run to print the command of each node)", field="--launch")
    from autotune.runtime.trial import check_runtime_support

    check_runtime_support(plan, ctx.model)
    if not dry_run and len(cmds) == 1:
        L.check_runnable(plan, ctx)
    chosen = cmds if node_rank is None else [cmds[node_rank]]
    shown = [c.shell() for c in chosen]
    remote: list[L.RemoteLine] = []
    if hosts_file is not None:
        from autotune import hostfile

        hosts = hostfile.read_hosts(hosts_file)
        if plan.uses is not None and len(hosts) == ctx.cluster.num_nodes != len(cmds):
            hosts = [hosts[c.node] for c in cmds]  # a hosts file of the whole pool: the used nodes' hosts
        hostfile.check_hosts(hosts, [int(c.argv[c.argv.index("--nproc-per-node") + 1]) for c in cmds], "the plan",
                             hosts_file)
        addr, port = hostfile.rendezvous(hosts)
        shown = hostfile.node_lines(hosts, shown, hostfile.remote_shell(remote_shell), addr, port)
        remote = [L.RemoteLine(c.node, c.node_rank, h.name, line)
                  for c, h, line in zip(cmds[1:], hosts[1:], shown[1:], strict=True)]
    if not json_:
        for i, (c, line) in enumerate(zip(chosen, shown, strict=True)):
            where = f" on {hosts[i].name}" if hosts_file is not None else ""
            prefix = f"# node {c.node} (node-rank {c.node_rank}){where}\n" if len(cmds) > 1 else ""
            console.print(prefix + line, highlight=False, soft_wrap=True)
    if dry_run:
        if json_:
            emit_json({"commands": shown, "out": str(out), "ran": False, "plan": plan.to_dict()})
        else:
            err_console.print("dry run: nothing written, nothing started", highlight=False)
        return
    summary = L.run(chosen[0], out, world=plan.world, seq_len=ctx.seq_len, global_batch=ctx.global_batch,
                    steps=steps, timeout_s=timeout_s, nodes=len(cmds), line=shown[0] if hosts_file else None,
                    remote=remote)
    if json_:
        emit_json({"commands": shown, "out": str(out), "ran": True, "measured": summary, "plan": plan.to_dict()})
    else:
        console.print(f"ran ranks {summary['ranks'][0]}-{summary['ranks'][-1]} of {plan.world}: "
                      f"{summary['step_time_s']:.4g} s/step, {summary['tokens_per_s']:.4g} tokens/s, "
                      f"final loss {summary['losses'][-1]:.4f}", highlight=False)


def _say_subset(plan: Plan, ctx: ExportContext) -> None:
    """A plan on a subset of a pool: what it uses, what it leaves out and (from the search) why."""
    from autotune.specs.pool import subset_text

    text = None if getattr(ctx, "cluster_assumed", False) else subset_text(ctx.cluster, plan.uses)
    if text is None:
        return
    err_console.print(text, highlight=False, soft_wrap=True)
    for line in getattr(ctx, "left_out", ()):  # the search's chosen plan: why each left-out group pays
        err_console.print(line, highlight=False, soft_wrap=True)


def _check_flags(study: str | None, plan_file: str | None, trial: int | None, dry_run: bool, launch: bool,
                 node_rank: int | None, hosts: str | None, remote_shell: str | None, output: str | None,
                 fmt: str) -> None:
    """The options that only go together, checked before anything is read."""
    if (study is None) == (plan_file is None):
        raise InputError("give exactly one of --study NAME or --plan FILE", field="--study/--plan")
    if trial is not None and study is None:
        raise InputError("--trial goes with --study", field="--trial")
    if dry_run and not launch:
        raise InputError("--dry-run only goes with --launch", field="--dry-run")
    if node_rank is not None and not launch:
        raise InputError("--node-rank only goes with --launch", field="--node-rank")
    if hosts is not None and (not launch or node_rank is not None):
        raise InputError("--hosts goes with --launch and starts every node from here (no --node-rank)",
                         field="--hosts")
    if remote_shell is not None and hosts is None:
        raise InputError("--remote-shell only goes with --hosts", field="--remote-shell")
    if launch and (output or fmt != "json"):
        raise InputError("--launch runs the plan with autotune's own runtime; it writes no export "
                         "(drop -o/--format, or export without --launch)", field="--launch")


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
    _check_flags(study, plan_file, trial, dry_run, launch, node_rank, hosts, remote_shell, output, fmt)
    mod = exporter(fmt)
    if output:
        _check_output(output, fmt, force)
    if study is not None:
        for opt, v in (("--model", model), ("--seq-len", seq_len), ("--global-batch", global_batch)):
            if v is not None:
                raise InputError("the study records what its plans are for; drop it or use --plan", field=opt)
        record, ctx = from_study(study, storage, cluster, trial)
    else:
        assert plan_file is not None
        record, ctx = from_plan_file(plan_file, model, seq_len, global_batch, cluster, storage)
    plan = record.plan
    # auto: the plan's own precision; checked against the cluster's devices when one is known
    precision = (plan.dtype if dtype == "auto" else dtype) if getattr(ctx, "cluster_assumed", False) else (
        choose_dtype(dtype, ctx.cluster, plan.dtype))
    plan = plan.replace(dtype=precision).resolve(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)
    if not json_:
        _say_subset(plan, ctx)
    if launch:
        _launch(plan, ctx, dry_run, steps, json_, node_rank, timeout, hosts, remote_shell)
        return
    _export(record, plan, ctx, mod, fmt, output, force, json_)


def _export(record: PlanRecord, plan: Plan, ctx: ExportContext, mod: Any, fmt: str, output: str | None,
            force: bool, json_: bool) -> None:
    """Price the resolved plan on its cluster, export it, write or print it (a refusal under --json:
    the error object and the refusal, exit 2)."""
    # priced afresh on the cluster it is exported for (the file's or trial's prediction is not carried);
    # where the plan came from is, and what was measured unless it ran in another precision
    measured = record.measured if plan.dtype == record.plan.dtype else None
    priced = _price(plan, ctx, force).replace(measured=measured, provenance=record.provenance)
    try:
        result = export(priced, ctx, fmt)
    except ExportRefused as e:
        if json_:
            err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            emit_json({"error": {"kind": "input", "message": e.message, "source": e.source, "field": e.field},
                       "refused": e.to_dict()})
            sys.exit(2)  # not typer.Exit: click returns its code in non-standalone mode and cli.main drops it
        raise
    written = None
    if output:
        check = getattr(mod, "check_file", None)
        written = str(write_atomic(output, result.text, check=check))
    if json_:
        emit_json({"format": fmt, "output": written, "content": result.data, "plan": priced.to_dict(),
                   "text": None if written else result.text})
        return
    if written:
        priced = ("not priced: no cluster given (pass --cluster for a prediction)" if ctx.cluster_assumed
                  else f"{predicted_text(priced.predicted)} on {ctx.cluster.name}")
        err_console.print(f"wrote {written} ({fmt}) for {describe(plan)}; {priced}", highlight=False, soft_wrap=True)
    else:
        typer.echo(result.text, nl=False)



command.__doc__ = HELP
