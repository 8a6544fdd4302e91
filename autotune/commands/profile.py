"""`autotune profile`: measure this machine's devices and links and store the profile;
`profile list | show ID | export ID -o f.json | import f.json` manage stored profiles.

The measuring lives in ``profilers/`` (timing, compute, links, worker, store); this module only
parses options, draws progress on stderr and prints the summary (a table, or one JSON object).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from autotune.commands.common import (
    DEFAULT_STORAGE,
    EmulateOpt,
    JsonOpt,
    StorageOpt,
    console,
    emit_json,
    err_console,
    parse_emulation,
)
from autotune.errors import InputError
from autotune.units import fmt_bandwidth, fmt_bytes, fmt_time

HELP = "Measure this machine's devices and links (GEMM, attention, p2p matrix, collectives) and store a profile."

app = typer.Typer(help=HELP, invoke_without_command=True, no_args_is_help=False)

IdArg = Annotated[str, typer.Argument(help="Profile id (see `autotune profile list`).")]


def _gflops(x: Any) -> str:
    return f"{x / 1e9:.1f}" if isinstance(x, (int, float)) else "-"


@app.callback()
def run(
    ctx: typer.Context,
    device: Annotated[str, typer.Option("--device", help="auto (CUDA when available), cpu or cuda.")] = "auto",
    nproc: Annotated[int | None, typer.Option("--nproc", "-n", help="Local ranks to start (default: one per GPU, "
                                                                    "or one per CPU core; on CPU at most one per "
                                                                    "core).")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Fewer sizes and repeats (seconds instead of a minute).")]
    = False,
    label: Annotated[str | None, typer.Option("--label", help="Name stored with the profile.")] = None,
    emulate: EmulateOpt = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds a rank may stay silent before it counts as "
                                                             "hung (then all ranks are stopped).", min=1.0)] = 60.0,
    storage: StorageOpt = DEFAULT_STORAGE,
    json_: JsonOpt = False,
) -> None:
    """Run a profile (when no sub-command is given)."""
    if ctx.invoked_subcommand is not None:
        return
    from profilers.launch import check_request, default_nproc, launch_local
    from profilers.store import engine_for, load_profile, save_profile
    from profilers.summary import summarize_profile

    slow = parse_emulation(emulate)
    engine_for(storage)  # a bad --storage fails before minutes of measuring
    kind = check_request(device, nproc)
    nproc = nproc or default_nproc(kind)
    t0 = time.perf_counter()
    with Progress(TextColumn("[bold]profile[/]"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console,
                  transient=True, disable=not err_console.is_terminal and json_) as prog:
        task = prog.add_task("starting ranks", total=None)

        def on_progress(done: int, total: int, what: str) -> None:
            prog.update(task, completed=done, total=total, description=what)

        result = launch_local(kind, nproc, quick=quick, emulate=slow, timeout_s=timeout, progress=on_progress)
    wall = time.perf_counter() - t0
    pid = save_profile(result, storage, label=label, nproc=nproc, wall_s=wall)
    summary = summarize_profile(load_profile(pid, storage))
    if json_:
        emit_json(summary)
    else:
        _print_summary(summary)
        err_console.print(f"stored profile {pid} in {storage} ({wall:.1f} s); use it in a cluster file as "
                          f"device: profile:{pid}", highlight=False)


def _print_summary(s: dict[str, Any]) -> None:
    emu = s.get("emulated") or {}
    title = (f"profile {s['id']}" + (f" ({s['label']})" if s.get("label") else "") + f": {s['device']} x{s['nproc']}"
             + f", {s['device_name']}" + (", EMULATED slowdown " + ", ".join(f"rank {r}={f:g}x" for r, f in emu.items())
                                         if emu else ""))
    t = Table(title=title)
    for c in ("rank", "host", "GEMM peak GFLOP/s", "attn fwd/bwd GFLOP/s", "mem copy", "memory"):
        t.add_column(c, justify="left" if c in ("host",) else "right")
    for rank, c in s["compute"].items():
        peaks = " ".join(f"{dt}:{_gflops(v)}" for dt, v in c["gemm_peak_flops_per_s"].items())
        attn = " ".join(f"d{hd}:{_gflops(a['fwd_flops_per_s'])}/{_gflops(a['bwd_flops_per_s'])}"
                        for hd, a in c["attention"].items())
        mem = c["memory"]
        tag = f" (emulated {c['emulated_slowdown']:g}x)" if c.get("emulated_slowdown") else ""
        t.add_row(rank + tag, s["hosts"][int(rank)], peaks, attn,
                  fmt_bandwidth(mem["bandwidth_bytes_per_s"]) if mem.get("bandwidth_bytes_per_s") else "-",
                  fmt_bytes(mem["capacity_bytes"]) if mem.get("capacity_bytes") else "-")
    console.print(t)
    for rank, c in s["compute"].items():
        for dt, why in (c.get("gemm_unsupported") or {}).items():
            console.print(f"rank {rank}: {dt} GEMM not measured: {why}", highlight=False, markup=False)
    p2p = s["links"]["p2p"]
    if p2p:
        m = Table(title="p2p bandwidth GB/s / one-way latency (ping-pong)")
        m.add_column("rank")
        for j in range(len(p2p)):
            m.add_column(str(j), justify="right")
        lat = s["links"]["p2p_latency_us"]
        for i, row in enumerate(p2p):
            m.add_row(str(i), *["-" if v is None else f"{v:.2f} / {lat[i][j]:.0f}us" for j, v in enumerate(row)])
        console.print(m)
        ab = s["links"]["alpha_beta"]
        for cls, f in ab.items():
            console.print(f"alpha-beta {cls}: alpha {fmt_time(f['alpha_s'])}, beta "
                          f"{fmt_bandwidth(f['beta_bytes_per_s']) if f['beta_bytes_per_s'] else '-'}", highlight=False)
        c = Table(title="collectives (nccl-tests convention: algbw = bytes/time, busbw = algbw x factor)")
        for col in ("op", "ranks", "size", "time", "algbw", "busbw", "factor", ""):
            c.add_column(col, justify="left" if col in ("op", "") else "right")
        for r in s["links"]["collectives"]:
            c.add_row(r["op"], str(r["group_size"]), fmt_bytes(r["bytes"]), fmt_time(r["time_s"]),
                      fmt_bandwidth(r["algbw_bytes_per_s"]), fmt_bandwidth(r["busbw_bytes_per_s"]),
                      f"{r['bus_factor']:.2f}",
                      "WRONG RESULT" if not r.get("verified", True) else ("unstable" if r["unstable"] else ""))
        console.print(c)
    if s["unstable"]:
        console.print(f"[yellow]{len(s['unstable'])} of {s['samples']} points varied more than the allowed spread "
                      "(flagged unstable in the store)[/]")


@app.command("list")
def list_cmd(storage: StorageOpt = DEFAULT_STORAGE, json_: JsonOpt = False) -> None:
    """List stored profiles."""
    from profilers.store import list_profiles

    rows = list_profiles(storage)
    if json_:
        emit_json({"profiles": rows})
        return
    t = Table(title=f"profiles in {storage}")
    for c in ("id", "label", "created", "device", "ranks", "hosts", "quick", "emulated", "origin", "unstable"):
        t.add_column(c)
    for r in rows:
        t.add_row(str(r["id"]), r["label"] or "", r["created_at"], f"{r['device_kind']}: {r['device_name']}",
                  str(r["nproc"]), ",".join(sorted(set(r["hosts"]))), "yes" if r["quick"] else "",
                  ", ".join(f"{k}={v:g}x" for k, v in (r["emulated"] or {}).items()), r["origin"], str(r["unstable"]))
    console.print(t)


@app.command("show")
def show_cmd(profile_id: IdArg, storage: StorageOpt = DEFAULT_STORAGE, json_: JsonOpt = False) -> None:
    """Show one profile: fits per rank, p2p matrix, collectives."""
    from profilers.store import load_profile
    from profilers.summary import summarize_profile

    s = summarize_profile(load_profile(profile_id, storage))
    if json_:
        emit_json(s)
    else:
        _print_summary(s)


@app.command("export")
def export_cmd(profile_id: IdArg,
               out: Annotated[Path, typer.Option("--output", "-o", help="JSON file to write.")],
               storage: StorageOpt = DEFAULT_STORAGE, json_: JsonOpt = False) -> None:
    """Write a profile (samples, fits, units, schema_version) to a JSON file."""
    from profilers.store import load_profile

    doc = load_profile(profile_id, storage)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot write: {e.strerror}", source=str(out), field="--output") from None
    if json_:
        emit_json({"id": doc["run"]["id"], "path": str(out), "samples": len(doc["samples"])})
    else:
        err_console.print(f"wrote profile {doc['run']['id']} to {out} ({len(doc['samples'])} samples)", highlight=False)


@app.command("import")
def import_cmd(path: Annotated[Path, typer.Argument(help="JSON file written by `autotune profile export`.")],
               storage: StorageOpt = DEFAULT_STORAGE, json_: JsonOpt = False) -> None:
    """Store a profile exported elsewhere (it gets a new id here)."""
    from profilers.store import import_file

    pid = import_file(path, storage)
    if json_:
        emit_json({"id": pid, "path": str(path)})
    else:
        err_console.print(f"imported {path} as profile {pid}; use it as device: profile:{pid}", highlight=False)
