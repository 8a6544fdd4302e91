"""`autotune trial`: run a plan for real on local processes (torch.distributed) and measure it."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.table import Table

from autotune.commands.common import (
    DataDtypeOpt,
    DataOpt,
    DocMaskOpt,
    DtypeOpt,
    EmulateOpt,
    EodOpt,
    GlobalBatchOpt,
    JsonOpt,
    LengthsOpt,
    ModelOpt,
    PlanOpt,
    SeedOpt,
    SeqLenOpt,
    console,
    emit_json,
    err_console,
    parse_emulation,
)
from autotune.errors import WorkError
from autotune.stages import degrees_text
from autotune.units import fmt_bytes, fmt_time

HELP = "Run a plan for real on local processes (torch.distributed) and measure it."


def command(
    plan: PlanOpt,
    model: ModelOpt,
    seq_len: SeqLenOpt,
    global_batch: GlobalBatchOpt,
    steps: Annotated[int, typer.Option("--steps", help="Measured steps.", min=1)] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Warm-up steps before measuring.", min=0)] = 2,
    seed: SeedOpt = 0,
    emulate_slowdown: EmulateOpt = None,
    nproc: Annotated[int | None, typer.Option("--nproc", help="Processes to run; must equal the plan's "
                                                              "world (default: the plan's world).", min=1)] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds before every process is killed.",
                                           min=1)] = 600.0,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    data: DataOpt = None,
    data_dtype: DataDtypeOpt = "auto",
    cluster: Annotated[str | None, typer.Option("--cluster", "-c", help="With --node-rank: the cluster whose "
                                                "nodes run the plan.")] = None,
    node_rank: Annotated[int | None, typer.Option("--node-rank", help="Run node-rank K's ranks of a plan across "
                                                  "hosts (MASTER_ADDR/MASTER_PORT name the rendezvous; run the "
                                                  "same command with each K on its host).", min=0)] = None,
    dtype: DtypeOpt = "auto",
    eod: EodOpt = None,
    lengths: LengthsOpt = None,
    doc_mask: DocMaskOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Run a plan for real on local processes (torch.distributed) and measure it.

    Longer than a screen: its options are declared in the signature (typer, 28 lines); the body
    checks them, hands the run to ``autotune.runtime.trial`` and prints."""
    from autotune.plan import load_plan, load_plan_for, located
    from autotune.runtime.trial import run_trial
    from autotune.specs import load_cluster

    emulate = parse_emulation(emulate_slowdown)
    # local workers take every precision; a GPU without bf16 is refused by run_trial's checks
    p = load_plan_for(plan, load_cluster(f"local:{load_plan(plan).world}"), dtype)
    from autotune.documents import documents_from_options, plan_masks
    from autotune.specs import load_model

    docs = documents_from_options(data=data, eod=eod, lengths=lengths, vocab=load_model(model).vocab,
                                  data_dtype=data_dtype)
    p = plan_masks(p, docs, doc_mask)
    if (node_rank is not None or cluster is not None) and p.doc_mask:
        from autotune.errors import InputError

        raise InputError("document masks run in local trials (not yet across hosts)", field="--doc-mask")
    if node_rank is not None or cluster is not None:
        _across_hosts(p, model, cluster, node_rank, seq_len, global_batch, steps, warmup, seed, timeout, data,
                      data_dtype, emulate, json_)
        return

    def announce(resolved) -> None:
        if not json_:
            err_console.print(f"running {degrees_text(resolved.to_dict())} on {resolved.world} local processes ...",
                              highlight=False)

    with located(plan):
        result = run_trial(p, model, seq_len, global_batch, steps=steps, warmup=warmup, seed=seed,
                           emulate_slowdown=emulate, timeout_s=timeout, device=device, nproc=nproc,
                           data=data, data_dtype=data_dtype, on_launch=announce,
                           documents=docs if p.doc_mask else None)
    out = result.to_dict()
    if json_:
        emit_json(out)
    else:
        _show(out)
    if result.failure is not None:
        f = result.failure
        message = f"trial failed ({f['kind']}) on rank {f['rank']}: {f['message']}"
        if json_:  # the result above is the one JSON object; the reason goes to stderr
            err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
            sys.exit(1)
        raise WorkError(message)


def _across_hosts(p, model, cluster, node_rank, seq_len, global_batch, steps, warmup, seed, timeout, data,
                  data_dtype, emulate, json_) -> None:
    """This host's part of a trial across hosts: node-rank K's line of ``apply --launch`` (one source
    for the commands, autotune.export.launch), run here through torchrun's c10d rendezvous."""
    from autotune.errors import InputError
    from autotune.export import launch as L
    from autotune.export.common import ExportContext
    from autotune.runtime.data import prepare_data
    from autotune.runtime.trial import check_runtime_support
    from autotune.specs import load_cluster, load_model

    if cluster is None or node_rank is None:
        raise InputError("a trial across hosts needs both --cluster and --node-rank", field="--node-rank")
    if emulate:
        raise InputError("emulated slowdowns are for local trials", field="--emulate-slowdown")
    spec, cl = load_model(model), load_cluster(cluster)
    resolved = p.resolve(spec, cl, seq_len, global_batch)
    check_runtime_support(resolved, spec)
    desc = prepare_data(data, spec.vocab, seq_len, global_batch, warmup + steps, dtype=data_dtype)
    ctx = ExportContext(model=spec, cluster=cl, seq_len=seq_len, global_batch=global_batch)
    cmds = L.commands(resolved, ctx, "results/trial/out", steps=steps, warmup=warmup, seed=seed, timeout_s=timeout,
                      run_id="autotune-trial", data=desc)
    if node_rank >= len(cmds):
        raise InputError(f"the plan runs on {len(cmds)} node(s): node-rank 0..{len(cmds) - 1}", field="--node-rank")
    cmd = cmds[node_rank]
    if not json_:
        err_console.print(f"running node-rank {node_rank} of {len(cmds)} ({degrees_text(resolved.to_dict())}) ...",
                          highlight=False)
    from pathlib import Path

    summary = L.run(cmd, Path("results/trial/out"), world=resolved.world, seq_len=seq_len,
                    global_batch=global_batch, steps=steps, timeout_s=timeout, nodes=len(cmds))
    if json_:
        emit_json({"command": cmd.shell(), "measured": summary, "losses": summary["losses"],
                   "grad_norms": summary["grad_norms"]})
        return
    console.print(f"node-rank {node_rank}: ranks {summary['ranks'][0]}-{summary['ranks'][-1]} of {resolved.world}, "
                  f"step time {fmt_time(summary['step_time_s'])}, {summary['tokens_per_s']:,.0f} tokens/s",
                  highlight=False)
    show_losses(summary["losses"], warmup, data, summary["grad_norms"])


def _show(out: dict) -> None:
    m = out["measured"]
    if m is None:
        return
    emu = m.get("emulated_slowdown")
    console.print(f"step time {fmt_time(m['step_time_s'])}, {m['tokens_per_s']:,.0f} tokens/s"
                  + (f"  [yellow](emulated slowdown {emu})[/]" if emu else ""), highlight=False)
    t = Table(title="per rank")
    for col in ("rank", "peak memory", "compute", "comm", "idle", "coverage"):
        t.add_column(col, justify="right")
    for mem, s in zip(m["peak_memory_bytes"], m["time_split"], strict=True):
        t.add_row(str(s["rank"]), fmt_bytes(mem), fmt_time(s["compute_s"]), fmt_time(s["comm_s"]),
                  fmt_time(s["idle_s"]), f"{100 * s['coverage']:.0f}%")
    console.print(t)
    if m.get("documents"):
        from autotune.commands.common import documents_line

        console.print(documents_line(m["documents"]), highlight=False, soft_wrap=True)
    show_losses(out["losses"], m.get("warmup", 0), m.get("data"), out.get("grad_norms"))


SPARKS = "▁▂▃▄▅▆▇█"


def show_losses(losses: list[float], warmup: int, data: str | None, grad_norms: list[float | None] | None = None
                ) -> None:
    """The loss curve: a sparkline of every step (warm-up included), first and last, then the values,
    and the global gradient norm of each step (a skipped fp16 step: -)."""
    if not losses:
        return
    lo, hi = min(losses), max(losses)
    spark = "".join(SPARKS[round((x - lo) / (hi - lo) * (len(SPARKS) - 1)) if hi > lo else 0] for x in losses)
    console.print(f"loss curve ({len(losses)} steps, {warmup} warm-up; data: {data or 'synthetic'}): "
                  f"{spark}  {losses[0]:.4f} -> {losses[-1]:.4f}", highlight=False, soft_wrap=True)
    console.print("losses: " + ", ".join(f"{x:.4f}" for x in losses), highlight=False, soft_wrap=True)
    if grad_norms:
        console.print("grad norms: " + ", ".join("-" if x is None else f"{x:.4g}" for x in grad_norms),
                      highlight=False, soft_wrap=True)
