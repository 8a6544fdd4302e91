"""`autotune profile`: measure this machine's devices and links and store the profile;
`profile list | show ID | export ID -o f.json | import f.json` manage stored profiles.
`profile --layers MODEL` times the model's pieces instead (``profilers/layers.py``), stored as
``layers:ID``; `profile import --format sailor|metis|galvatron FILE...` reads other planners'
per-layer profiles (``profilers/foreign/``).

The measuring lives in ``profilers/`` (timing, compute, links, worker, store); this module only
parses options, draws progress on stderr and prints the summary (a table, or one JSON object).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from autotune.commands.common import (
    DEFAULT_STORAGE,
    EmulateOpt,
    HostsOpt,
    JsonOpt,
    RemoteShellOpt,
    StorageOpt,
    WideOpt,
    console,
    emit_json,
    err_console,
    parse_emulation,
)
from autotune.commands.help_layout import PLAIN_HELP, Command
from autotune.dashboard.tables import Col, fit
from autotune.errors import InputError
from autotune.units import fmt_bandwidth, fmt_bytes, fmt_time
from profilers import run as P
from profilers.options import LayerProfileOptions, ProfileOptions

HELP = "Measure this machine's devices and links (GEMM, attention, p2p matrix, collectives) and store a profile."

app = typer.Typer(help=HELP, invoke_without_command=True, no_args_is_help=False, **PLAIN_HELP)

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
    nnodes: Annotated[int, typer.Option("--nnodes", help="Profile across this many hosts: run the same command on "
                                                         "each, with MASTER_ADDR (and MASTER_PORT) naming one of "
                                                         "them; torchrun's c10d rendezvous joins them and the "
                                                         "host that gets rank 0 stores the profile.", min=1)] = 1,
    node_rank: Annotated[int | None, typer.Option("--node-rank", help="With --nnodes: this host's node-rank K "
                                                   "(node-rank 0 gets rank 0 and stores the profile; default: "
                                                   "the order the hosts join in decides).", min=0)] = None,
    hosts: HostsOpt = None,
    remote_shell: RemoteShellOpt = None,
    layers: Annotated[str | None, typer.Option("--layers", help="Time MODEL's real pieces (embedding, one decoder "
                                                                "layer, norm + LM head + loss; fwd and bwd) over "
                                                                "micro-batches, sequences and tp shards instead.",
                                               metavar="MODEL")] = None,
    mbs: Annotated[str | None, typer.Option("--mbs", help="--layers: micro-batch sizes, e.g. 1,2,4.")] = None,
    seq: Annotated[str | None, typer.Option("--seq", help="--layers: sequence lengths, e.g. 128,256.")] = None,
    tp: Annotated[str | None, typer.Option("--tp", help="--layers: tp shards (a shard's weights on one device).")]
    = None,
    dtype: Annotated[str, typer.Option("--dtype", help="--layers: auto (the dtype trials compute in here: bf16 where "
                                                       "native, else fp32), fp32, bf16 or fp16.")] = "auto",
    attention: Annotated[str, typer.Option("--attention", help="--layers: runtime (what scaled_dot_product_attention "
                                                               "picks, as trials run), fused or materialized "
                                                               "(the math kernel: scores kept for backward).")]
    = "runtime",
    storage: StorageOpt = DEFAULT_STORAGE,
    json_: JsonOpt = False,
) -> None:
    """Run a profile (when no sub-command is given): the options go to profilers/run.py as
    ProfileOptions (LayerProfileOptions with ``--layers``); this prints what it measured.

    Longer than a screen: its 18 options are declared in the signature (typer, 39 lines)."""
    if ctx.invoked_subcommand is not None:
        return
    if layers is not None:
        _run_layers(LayerProfileOptions(model=layers, storage=storage, device=device, mbs=mbs, seq=seq, tp=tp,
                                        dtype=dtype, attention=attention, label=label), json_)
        return
    opts = ProfileOptions(storage=storage, device=device, nproc=nproc, quick=quick, label=label,
                          emulate=parse_emulation(emulate), timeout_s=timeout, nnodes=nnodes, node_rank=node_rank,
                          hosts=hosts, remote_shell=remote_shell)
    req = P.profile_request(opts)
    with _progress("profile", "starting ranks", json_) as on_progress:
        stored = P.run_profile(opts, req, on_progress)
    if stored is None:
        err_console.print("this node's ranks are done; the host that ran rank 0 stores the profile",
                          highlight=False)
        if json_:
            emit_json({"stored": False, "nnodes": req.nnodes, "nproc": req.nproc})
        return
    if json_:
        emit_json(stored.summary)
    else:
        _print_summary(stored.summary)
        err_console.print(f"stored profile {stored.pid} in {storage} ({stored.wall_s:.1f} s); use it in a cluster "
                          f"file as device: profile:{stored.pid}", highlight=False)


@contextmanager
def _progress(name: str, first: str, json_: bool) -> Iterator[P.Progress]:
    """A transient progress bar on stderr (off under --json or off a terminal), as a (done, total,
    what) callback for profilers/run.py."""
    with Progress(TextColumn(f"[bold]{name}[/]"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console,
                  transient=True, disable=json_ or not err_console.is_terminal) as prog:
        task = prog.add_task(first, total=None)
        yield lambda done, total, what: prog.update(task, completed=done, total=total, description=what)


def _run_layers(opts: LayerProfileOptions, json_: bool) -> None:
    prepared = P.prepare_layers(opts)
    with _progress("layers", "building pieces", json_) as on_progress:
        lid, doc = P.run_layers(opts, prepared, on_progress)
    if json_:
        emit_json({"id": f"layers:{lid}", **{k: v for k, v in doc.items() if k != "units"}})
        return
    _print_layers(doc, lid)
    err_console.print(f"stored layer profile layers:{lid} in {opts.storage} ({doc['meta']['measure_s']:.1f} s); use "
                      f"it in a cluster file as layer_profile: layers:{lid}", highlight=False)


def _print_layers(doc: dict[str, Any], lid: int | str) -> None:
    ran = (doc.get("meta") or {}).get("attention")
    t = Table(title=f"layers:{lid}: {doc['model']['name']} on {doc['device_name']} ({doc['device_kind']}, "
                    f"{doc['dtype']}, {doc['origin']}" + (f", {ran} attention" if ran else "") + ")")
    for c in ("piece", "tp", "mbs", "seq", "fwd", "bwd", "activations", ""):
        t.add_column(c, justify="left" if c in ("piece", "") else "right")
    for p in doc["points"]:
        act = p.get("activation_bytes")
        t.add_row(p["piece"] + (f" ep{p['ep']}" if "ep" in p else ""), str(p["tp"]), str(p["micro_batch"]), str(p["seq"]), fmt_time(p["fwd_s"]),
                  fmt_time(p["bwd_s"]), fmt_bytes(act) if act is not None else "-",
                  "unstable" if p.get("unstable") else "")
    console.print(t)
    for note in (doc.get("meta") or {}).get("notes") or []:
        console.print(note, highlight=False, markup=False)
    for note in (doc.get("meta") or {}).get("assumed") or []:
        console.print(f"assumed: {note}", highlight=False, markup=False)


def _print_summary(s: dict[str, Any]) -> None:
    emu = s.get("emulated") or {}
    title = (f"profile {s['id']}" + (f" ({s['label']})" if s.get("label") else "") + f": {s['device']} x{s['nproc']}"
             + f", {s['device_name']}" + (", EMULATED slowdown " + ", ".join(f"rank {r}={f:g}x" for r, f in emu.items())
                                         if emu else ""))
    cols = [Col("rank", priority=0), Col("host", "left", 3), Col("GEMM peak GFLOP/s", priority=0),
            Col("attn fwd/bwd GFLOP/s", priority=1), Col("mem copy", priority=2), Col("memory", priority=2)]
    rows = []
    for rank, c in s["compute"].items():
        peaks = " ".join(f"{dt}:{_gflops(v)}" for dt, v in c["gemm_peak_flops_per_s"].items())
        attn = " ".join(f"d{hd}:{_gflops(a['fwd_flops_per_s'])}/{_gflops(a['bwd_flops_per_s'])}"
                        for hd, a in c["attention"].items())
        mem = c["memory"]
        tag = f" (emulated {c['emulated_slowdown']:g}x)" if c.get("emulated_slowdown") else ""
        rows.append([rank + tag, s["hosts"][int(rank)], peaks, attn,
                     fmt_bandwidth(mem["bandwidth_bytes_per_s"]) if mem.get("bandwidth_bytes_per_s") else "-",
                     fmt_bytes(mem["capacity_bytes"]) if mem.get("capacity_bytes") else "-"])
    console.print(fit(console, cols, rows, title=title))
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


@app.command("list", cls=Command)
def list_cmd(storage: StorageOpt = DEFAULT_STORAGE, wide: WideOpt = False, json_: JsonOpt = False) -> None:
    """List stored profiles."""
    from profilers.store import list_layer_profiles, list_profiles

    rows = list_profiles(storage)
    layer_rows = list_layer_profiles(storage)
    if json_:
        emit_json({"profiles": rows, "layer_profiles": layer_rows})
        return
    # fitted to the terminal by leaving whole columns out (--wide shows them), never by cutting cells
    cols = [Col("id", priority=0), Col("label", "left", 1), Col("created", "left", 3), Col("device", "left", 0),
            Col("ranks", priority=1), Col("hosts", "left", 2), Col("quick", "left", 3), Col("emulated", "left", 2),
            Col("origin", "left", 2), Col("unstable", priority=1)]
    console.print(fit(console, cols, [
        [str(r["id"]), r["label"] or "", r["created_at"], f"{r['device_kind']}: {r['device_name']}", str(r["nproc"]),
         ",".join(sorted(set(r["hosts"]))), "yes" if r["quick"] else "",
         ", ".join(f"{k}={v:g}x" for k, v in (r["emulated"] or {}).items()), r["origin"], str(r["unstable"])]
        for r in rows], title=f"profiles in {storage}", wide=wide))
    if layer_rows:
        cols = [Col("id", "left", 0), Col("label", "left", 1), Col("created", "left", 3), Col("device", "left", 0),
                Col("model", "left", 0), Col("dtype", "left", 1), Col("origin", "left", 2), Col("points", priority=1)]
        console.print(fit(console, cols, [
            [f"layers:{r['id']}", r["label"] or "", r["created_at"], f"{r['device_kind']}: {r['device_name']}",
             r["model"]["name"], r["dtype"], r["origin"], str(r["points"])] for r in layer_rows],
            title=f"layer profiles in {storage}", wide=wide))


@app.command("show", cls=Command)
def show_cmd(profile_id: IdArg, storage: StorageOpt = DEFAULT_STORAGE, json_: JsonOpt = False) -> None:
    """Show one profile: fits per rank, p2p matrix, collectives (or a layer profile, layers:ID)."""
    from profilers.store import LAYER_REF_PREFIX, load_layer_profile, load_profile
    from profilers.summary import summarize_profile

    if profile_id.startswith(LAYER_REF_PREFIX):
        doc = load_layer_profile(profile_id, storage)
        if json_:
            emit_json(doc)
        else:
            _print_layers(doc, doc["id"])
        return

    s = summarize_profile(load_profile(profile_id, storage))
    if json_:
        emit_json(s)
    else:
        _print_summary(s)


@app.command("export", cls=Command)
def export_cmd(profile_id: IdArg,
               out: Annotated[Path, typer.Option("--output", "-o", help="JSON file to write.")],
               storage: StorageOpt = DEFAULT_STORAGE, json_: JsonOpt = False) -> None:
    """Write a profile (samples, fits, units, schema_version) to a JSON file (layers:ID: a layer profile)."""
    from profilers.store import LAYER_REF_PREFIX, load_layer_profile, load_profile

    if profile_id.startswith(LAYER_REF_PREFIX):
        doc = load_layer_profile(profile_id, storage)
        _write_json(doc, out)
        if json_:
            emit_json({"id": f"layers:{doc['id']}", "path": str(out), "points": len(doc["points"])})
        else:
            err_console.print(f"wrote layers:{doc['id']} to {out} ({len(doc['points'])} points)", highlight=False)
        return
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


def _write_json(doc: dict[str, Any], out: Path) -> None:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot write: {e.strerror}", source=str(out), field="--output") from None


FORMATS = ("autotune", "sailor", "metis", "galvatron")


@app.command("import", cls=Command)
def import_cmd(paths: Annotated[list[Path], typer.Argument(help="JSON file(s) written by `autotune profile export`, "
                                                                "or another planner's profile files (--format).")],
               fmt: Annotated[str, typer.Option("--format", help="autotune (an export), or the per-layer profiles of "
                                                                 "sailor, metis or galvatron.")] = "autotune",
               model: Annotated[str | None, typer.Option("--model", help="Foreign formats: the model they were "
                                                                         "measured on (preset or model file).")] = None,
               device: Annotated[str | None, typer.Option("--device", help="Foreign formats: catalogue device they "
                                                                           "were measured on (when the files do not "
                                                                           "say).")] = None,
               seq: Annotated[int | None, typer.Option("--seq", help="Foreign formats: sequence length (Sailor and "
                                                                     "Metis files do not record it).", min=1)] = None,
               dtype: Annotated[str | None, typer.Option("--dtype", help="Foreign formats: precision (bf16, fp16, "
                                                                         "fp32) when the files do not say.")] = None,
               label: Annotated[str | None, typer.Option("--label", help="Name stored with a foreign import.")] = None,
               storage: StorageOpt = DEFAULT_STORAGE, json_: JsonOpt = False) -> None:
    """Store a profile exported elsewhere (it gets a new id here), or import other planners' per-layer profiles."""
    from profilers.store import engine_for, import_any

    if fmt not in FORMATS:
        raise InputError(f"must be one of {', '.join(FORMATS)}, got {fmt!r}", field="--format")
    engine_for(storage)
    if fmt != "autotune":
        _import_foreign(fmt, paths, model, device, seq, dtype, label, storage, json_)
        return
    done = [(str(p), *import_any(p, storage)) for p in paths]
    if json_:
        emit_json({"imported": [{"path": p, "id": f"layers:{i}" if kind == "layers" else i} for p, kind, i in done]}
                  if len(done) > 1 else {"id": f"layers:{done[0][2]}" if done[0][1] == "layers" else done[0][2],
                                         "path": done[0][0]})
        return
    for p, kind, i in done:
        ref = f"layers:{i}" if kind == "layers" else str(i)
        use = f"layer_profile: {ref}" if kind == "layers" else f"device: profile:{i}"
        err_console.print(f"imported {p} as {'layer profile ' if kind == 'layers' else 'profile '}{ref}; use it as "
                          f"{use}", highlight=False)


def _import_foreign(fmt: str, paths: list[Path], model_ref: str | None, device: str | None, seq: int | None,
                    dtype: str | None, label: str | None, storage: str, json_: bool) -> None:
    from autotune.specs.catalogue import device_from_catalogue
    from autotune.specs.model import load_model
    from profilers.foreign import ImportContext, read_foreign
    from profilers.store import save_layer_profile

    if model_ref is None:
        raise InputError(f"{fmt} profiles need the model they were measured on: --model PRESET|FILE", field="--model")
    if dtype is not None and dtype not in ("bf16", "fp16", "fp32"):
        raise InputError(f"must be bf16, fp16 or fp32, got {dtype!r}", field="--dtype")
    if device is not None:
        device = device_from_catalogue(device, field="--device").name
    doc = read_foreign(fmt, paths, ImportContext(model=load_model(model_ref), device=device, seq=seq, dtype=dtype))
    lid = save_layer_profile(doc, storage, label=label, source=str(paths[0]))
    if json_:
        emit_json({"id": f"layers:{lid}", "format": fmt, "device": doc["device_name"], "points": len(doc["points"]),
                   "assumed": doc["meta"]["assumed"]})
        return
    _print_layers({**doc, "origin": fmt}, lid)
    err_console.print(f"imported {len(paths)} {fmt} file(s) as layer profile layers:{lid} ({doc['device_name']}); use "
                      f"it in a cluster file as layer_profile: layers:{lid}", highlight=False)
