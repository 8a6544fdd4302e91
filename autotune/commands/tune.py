"""`autotune tune`: the whole loop on this machine with defaults (the README's first command).

profile this machine (quick) -> search the model on ``local`` -> validate the top 3 for real ->
export the best measured plan to ``results/plans/``. A failing step fails the loop with its message
(a machine that cannot be profiled as asked is the one step skipped, with a note).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from autotune.commands.common import (
    DEFAULT_STORAGE,
    DataDtypeOpt,
    DataOpt,
    DtypeOpt,
    HostsOpt,
    JsonOpt,
    RemoteShellOpt,
    SeedOpt,
    StorageOpt,
    console,
    emit_json,
    err_console,
)
from autotune.errors import InputError, WorkError

HELP = "The whole loop on this machine: profile, search, validate the top 3, export the best plan."


def profile_quick(storage: str, nproc: int, say: Any) -> tuple[str | None, str]:
    """Profile this machine with the profiler's library (quick mode); skip with a note if absent."""
    from profilers.launch import check_request, launch_local
    from profilers.store import save_profile

    say(f"profiling this machine (quick, {nproc} ranks) ...")
    t0 = time.perf_counter()
    try:
        kind = check_request("auto", nproc)
        result = launch_local(kind, nproc, quick=True, timeout_s=60.0)
        pid = save_profile(result, storage, label="tune", nproc=nproc, wall_s=time.perf_counter() - t0)
    except InputError as e:  # this machine cannot be profiled as asked: said, the loop uses `local`
        return None, f"profile skipped: {e}"
    return str(pid), f"profiled this machine: profile {pid} ({time.perf_counter() - t0:.1f} s)"


def measured_cluster(profile_id: str, storage: str, nodes: int = 1, per_node: int | None = None,
                     layers: tuple[str, ...] = ()) -> Any:
    """`local` with its device replaced by the measured profile (falls back to `local`); ``nodes``
    such hosts of ``per_node`` devices each (``--hosts``); ``layers``: its layer profiles."""
    return _like_this_machine(f"profile:{profile_id}", "measured-local", storage, nodes, per_node, layers)


def _like_this_machine(device: str, name: str, storage: str, nodes: int, per_node: int | None,
                       layers: tuple[str, ...] = ()) -> Any:
    from autotune.specs.cluster import cluster_from_dict, load_cluster

    g = load_cluster("local").groups[0]
    per_node = per_node or g.devices_per_node
    if nodes > 1:
        name = f"{name}-{nodes}x{per_node}"
    d = {"name": name, "nodes": [{"count": nodes, "devices_per_node": per_node, "device": device,
                                  # cluster files write every figure with its unit
                                  "intra_node": {"bandwidth": f"{g.intra_node.bandwidth!r}B/s",
                                                 "latency": f"{g.intra_node.latency!r}s"},
                                  **({"layer_profile": list(layers)} if layers else {})}]}
    return cluster_from_dict(d, source=f"{name} (this machine)", storage=storage)


def host_slots(hosts_file: str) -> int | None:
    """The ranks a host of ``tune --hosts FILE`` runs: the file's slots (all the same: tune searches
    hosts alike, and torchrun runs one count a node), or None (as many as ``local`` has)."""
    from autotune.hostfile import read_hosts

    slots = {h.slots for h in read_hosts(hosts_file) if h.slots is not None}
    if len(slots) > 1:
        raise InputError(f"tune searches hosts alike; the file gives slots {sorted(slots)}", source=hosts_file,
                         field="--hosts")
    return slots.pop() if slots else None


def hosts_cluster(device: str, hosts_file: str, storage: str, per_node: int | None,
                  layers: tuple[str, ...] = ()) -> Any:
    """``tune --hosts FILE``: the file's hosts, each with this machine's ``device`` (its measured
    profile, else ``local``'s) and ``per_node`` devices (``host_slots``)."""
    from autotune.hostfile import read_hosts

    return _like_this_machine(device, "hosts", storage, len(read_hosts(hosts_file)), per_node, layers)


def export_best(plan_dict: dict[str, Any], study: str, storage: str, out_dir: Path) -> Path:
    from autotune.plan_record import PlanRecord

    record = PlanRecord.from_dict(plan_dict)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", study)
    path = out_dir / f"{safe}.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    from autotune.export import ExportContext, export, write_atomic
    from autotune.export.json_plan import check_file
    from autotune.study import open_study, study_workload

    model, cluster, seq_len, gb = study_workload(open_study(study, storage), storage)
    ctx = ExportContext(model=model, cluster=cluster, seq_len=seq_len, global_batch=gb, study=study,
                        storage=storage, source=f"study {study}", cluster_digest=cluster.digest)
    ex = export(record, ctx, "json")
    write_atomic(path, ex.text, check=check_file)
    return path


def command(
    model: Annotated[str, typer.Option("--model", "-m", help="Model preset or file.")] = "small",
    seq_len: Annotated[int, typer.Option("--seq-len", "-s", help="Sequence length.", min=1)] = 256,
    global_batch: Annotated[int, typer.Option("--global-batch", "-b", help="Global batch.", min=1)] = 8,
    trials: Annotated[int, typer.Option("--trials", "-n", help="Search trials.", min=1)] = 150,
    top: Annotated[int, typer.Option("--top", "-k", help="Plans to validate for real.", min=1)] = 3,
    steps: Annotated[int, typer.Option("--steps", help="Measured steps per real trial.", min=1)] = 3,
    profile: Annotated[bool, typer.Option("--profile/--no-profile", help="Profile this machine first.")] = True,
    layers: Annotated[bool, typer.Option("--layers/--no-layers", help="CPU: time the model's own layers first "
                                         "(and, with --dtype auto, pick the precision it trains fastest in).")] = True,
    storage: StorageOpt = DEFAULT_STORAGE,
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Where the best plan JSON goes.")] = Path("results/plans"),
    seed: SeedOpt = 0,
    data: DataOpt = None,
    data_dtype: DataDtypeOpt = "auto",
    dtype: DtypeOpt = "auto",
    hosts: HostsOpt = None,
    remote_shell: RemoteShellOpt = None,
    json_: JsonOpt = False,
) -> None:
    """The whole loop on this machine: profile, search, validate the top 3, export the best plan.

    Longer than a screen: its options are declared in the signature (typer); each step of the loop
    is one call (``_cluster``, ``search``, ``validate`` or ``lead``, ``export_best``)."""
    from autotune.search import SearchOptions, search
    from autotune.specs import load_model
    from autotune.study import default_study_name
    from autotune.validate import ValidateOptions, validate

    say = (lambda _m: None) if json_ else (lambda s: err_console.print(s, highlight=False))
    notes: list[str] = []
    m = load_model(model)
    if data is not None or data_dtype != "auto":  # a bad token file fails before the profile and search
        from autotune.runtime.data import prepare_data

        prepare_data(data, m.vocab, seq_len, global_batch, ValidateOptions().warmup + steps, dtype=data_dtype)
    cluster, profile_id, layer_id, precision = _cluster(m, seq_len, global_batch, hosts, remote_shell, profile,
                                                         layers, storage, dtype, say, notes)
    name = ("tune-" + default_study_name(m, cluster, seq_len, global_batch) + (f"-p{profile_id}" if profile_id else "")
            + (f"-l{layer_id}" if layer_id is not None else ""))
    if precision != "bf16":  # a study holds one precision: another one is another study (as `search` names it)
        name += f"-{precision}"
    say(f"searching {m.name} on {cluster.name} ({cluster.num_devices} workers) ...")
    res = search(m, cluster, seq_len, global_batch, study_name=name, storage=storage,
                 options=SearchOptions(trials=trials, seed=seed, top=top, dtype=precision), progress=say)
    notes += res.notes
    say(f"validating the top {top} for real ...")
    vopts = ValidateOptions(top=top, steps=steps, seed=seed, data=data, data_dtype=data_dtype)
    if hosts is not None:  # across the hosts, started from here (autotune.runtime.control)
        from autotune.runtime.control import lead

        val = lead(name, storage, vopts, hosts_file=hosts, shell=remote_shell, progress=say)
    else:
        val = validate(name, storage, options=vopts, progress=say)
    if val["best_measured"] is None:
        raise WorkError("every validated plan failed: " + "; ".join(
            f"trial {r['trial']}: {(r['failure'] or {}).get('message')}" for r in val["validated"]))
    best = val["best_measured"]
    path = export_best(best, name, storage, out_dir)
    out = _summary(best, path, name, storage, profile_id, layer_id, precision, val, res, notes)
    if json_:
        emit_json(out)
        return
    from autotune.commands.validate import show as show_validate

    show_validate(val)
    for n in notes:
        console.print(f"[dim]note: {n}[/]", highlight=False)
    console.print(f"best plan written to {path}", highlight=False)


def _cluster(m: Any, seq_len: int, global_batch: int, hosts: str | None, remote_shell: str | None, profile: bool,
             layers: bool, storage: str, dtype: str, say: Any, notes: list[str]) -> tuple[Any, Any, Any, str]:
    """(cluster, profile id, layer-profile id, precision) the loop searches: this machine (or every
    host of --hosts), measured first unless --no-profile, its layers timed on CPU; notes say what fell
    back to the catalogue and which precision was chosen and why."""
    from autotune.plan import choose_dtype
    from autotune.specs import load_cluster

    if remote_shell is not None and hosts is None:
        raise InputError("--remote-shell only goes with --hosts", field="--remote-shell")
    per_node = None
    if hosts is not None:  # a bad file fails before the profile and search
        from autotune import hostfile

        hostfile.remote_shell(remote_shell)
        per_node = host_slots(hosts)
    cluster = load_cluster("local" if per_node is None else f"local:{per_node}")
    device = cluster.groups[0].device.name  # what every host of --hosts is, as searched
    profile_id = None
    if profile:
        profile_id, note = profile_quick(storage, cluster.num_devices, say)
        notes.append(note)
        if profile_id is not None:
            try:
                cluster = measured_cluster(profile_id, storage, per_node=per_node)
                device = f"profile:{profile_id}"
            except InputError as e:
                notes.append(f"measured profile not usable ({e}); searching on the catalogue `local`")
    if hosts is not None:
        cluster = hosts_cluster(device, hosts, storage, per_node)
    precision = choose_dtype(dtype, cluster)  # searched, validated (as searched) and exported in it
    layer_id = None
    if layers and all(t.kind == "cpu" for t in cluster.device_types()):
        from autotune.commands import tune_layers as TL

        if dtype == "auto":
            chosen = TL.choose_precision(m, seq_len, global_batch, TL.candidate_dtypes(cluster), say,
                                         cluster.groups[0].devices_per_node)
            precision = chosen.dtype
            notes.append(chosen.note)  # the one line that says which precision and why
        layer_id = TL.measure_layers(m, seq_len, global_batch, cluster.groups[0].devices_per_node, precision,
                                     storage, say)
        refs = (f"layers:{layer_id}",)
        if hosts is not None:
            cluster = hosts_cluster(device, hosts, storage, per_node, refs)
        elif profile_id is not None:
            cluster = measured_cluster(profile_id, storage, per_node=per_node, layers=refs)
        else:
            cluster = _like_this_machine(device, "local", storage, 1, per_node, refs)
    return cluster, profile_id, layer_id, precision


def _summary(best: dict[str, Any], path: Path, name: str, storage: str, profile_id: Any, layer_id: Any,
             precision: str, val: dict[str, Any], res: Any, notes: list[str]) -> dict[str, Any]:
    """What --json prints: the best plan, where it went, the errors before / after / held out."""
    errors = val.get("calibration_errors") or {}
    out = {"best": best, "plan_file": str(path), "study": name, "storage": storage, "profile": profile_id,
           "layers": f"layers:{layer_id}" if layer_id is not None else None, "dtype": precision,
           # median |predicted - measured| / measured of the validated plans: before calibration,
           # after (fitted on them) and held out (leave-one-out, from 3 plans)
           "errors": {"before": errors.get("before"), "after": errors.get("after"),
                      "held_out": errors.get("held_out"), "plans": errors.get("plans")},
           "search": {k: v for k, v in res.to_dict().items() if k not in ("top",)}, "validate": val, "notes": notes}
    return out
