"""The work `autotune apply` starts, given its ApplyOptions (autotune/export/options.py): check the
flags, read the plan (a study's trial or a plan file), resolve it on its cluster, then either price
and export it (``export_plan``) or build and run its torchrun lines (``launch_lines``, ``run_launch``).
Nothing here prints: the command does (autotune/commands/apply.py). It sits in the validate layer
with export/source.py, whose study reading it needs."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.errors import InputError
from autotune.export import FORMATS, export, exporter, write_atomic
from autotune.export import launch as L
from autotune.export.common import Export, ExportContext, predict
from autotune.export.options import ApplyOptions
from autotune.export.source import from_plan_file, from_study
from autotune.plan import Plan, choose_dtype, located
from autotune.plan_record import PlanRecord


@dataclass(frozen=True)
class Resolved:
    """The plan to apply: as read (``record``), resolved in its precision on its cluster (``plan``)."""

    record: PlanRecord
    plan: Plan
    ctx: ExportContext


@dataclass(frozen=True)
class Exported:
    priced: PlanRecord
    """The plan priced afresh on its cluster, with where it came from and what was measured."""
    result: Export
    written: str | None
    """The file written, None when the export is to be printed."""


@dataclass(frozen=True)
class LaunchLines:
    out: Path
    """Where the ranks write their results."""
    nodes: int
    """Nodes the plan runs on (one torchrun command each)."""
    chosen: list[L.NodeCommand]
    """The commands shown and, without a dry run, the first of them run here."""
    shown: list[str]
    """Their shell lines (with ``hosts``: those that start every node from here)."""
    host_names: list[str] | None = None
    """With ``hosts``: the host of each chosen command."""
    remote: list[L.RemoteLine] = field(default_factory=list)


def tag(ctx: ExportContext) -> str:
    raw = f"{ctx.study}-t{ctx.trial}" if ctx.study else Path(ctx.source).stem or "plan"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", raw)


def check_flags(o: ApplyOptions) -> None:
    """The options that only go together, checked before anything is read."""
    if (o.study is None) == (o.plan_file is None):
        raise InputError("give exactly one of --study NAME or --plan FILE", field="--study/--plan")
    if o.trial is not None and o.study is None:
        raise InputError("--trial goes with --study", field="--trial")
    if o.dry_run and not o.launch:
        raise InputError("--dry-run only goes with --launch", field="--dry-run")
    if o.node_rank is not None and not o.launch:
        raise InputError("--node-rank only goes with --launch", field="--node-rank")
    if o.hosts is not None and (not o.launch or o.node_rank is not None):
        raise InputError("--hosts goes with --launch and starts every node from here (no --node-rank)",
                         field="--hosts")
    if o.remote_shell is not None and o.hosts is None:
        raise InputError("--remote-shell only goes with --hosts", field="--remote-shell")
    if o.launch and (o.output or o.fmt != "json"):
        raise InputError("--launch runs the plan with autotune's own runtime; it writes no export "
                         "(drop -o/--format, or export without --launch)", field="--launch")


def check_output(output: str, fmt: str, force: bool) -> None:
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


def resolve(o: ApplyOptions) -> Resolved:
    """Check the flags and the output file, read the plan and resolve it in its precision on its cluster."""
    check_flags(o)
    exporter(o.fmt)  # an unknown format is refused before anything is read
    if o.output:
        check_output(o.output, o.fmt, o.force)
    if o.study is not None:
        for opt, v in (("--model", o.model), ("--seq-len", o.seq_len), ("--global-batch", o.global_batch)):
            if v is not None:
                raise InputError("the study records what its plans are for; drop it or use --plan", field=opt)
        record, ctx = from_study(o.study, o.storage, o.cluster, o.trial)
    else:
        assert o.plan_file is not None
        record, ctx = from_plan_file(o.plan_file, o.model, o.seq_len, o.global_batch, o.cluster, o.storage)
    plan = record.plan
    # auto: the plan's own precision; checked against the devices it uses when a cluster is known (a
    # pool's subset without its V100s was searched in bf16)
    from autotune.specs.pool import plan_cluster

    precision = (plan.dtype if o.dtype == "auto" else o.dtype) if getattr(ctx, "cluster_assumed", False) else (
        choose_dtype(o.dtype, plan_cluster(plan, ctx.cluster), plan.dtype))
    with located(o.plan_file or f"study {o.study}"):
        plan = plan.replace(dtype=precision).resolve(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)
    return Resolved(record, plan, ctx)


def price(plan: Plan, ctx: ExportContext, force: bool, kernels: Any = None) -> PlanRecord:
    """The plan priced on the cluster it is exported for, never with the prediction it carried in (a
    file can hold a stale or hand-edited ``predicted``). No cluster given: no prediction at all,
    rather than figures for a cluster nobody has. What the cluster cannot run (a device it lacks, a
    precision its devices lack) is an InputError from the cost model: exit 2, nothing written; a plan
    that does not fit in memory is refused too unless ``--force``."""
    if ctx.cluster_assumed:
        return PlanRecord(plan)
    priced, _ = predict(plan, ctx, kernels=kernels)  # as the target runs it (its exporter's KERNELS)
    p = priced.predicted or {}
    if p.get("feasible") is False and not force:
        raise InputError(f"the plan does not fit {ctx.cluster.name}: {p.get('infeasible_reason')}; pass --force "
                         "to export it anyway", field="--plan")
    return priced


def export_plan(o: ApplyOptions, r: Resolved) -> Exported:
    """Price the resolved plan on its cluster, export it and write it when ``output`` says so
    (ExportRefused: the target cannot express it, nothing written)."""
    # priced afresh on the cluster it is exported for (the file's or trial's prediction is not carried);
    # where the plan came from is, and what was measured unless it ran in another precision
    measured = r.record.measured if r.plan.dtype == r.record.plan.dtype else None
    kernels = getattr(exporter(o.fmt), "KERNELS", None)
    priced = price(r.plan, r.ctx, o.force, kernels).replace(measured=measured, provenance=r.record.provenance)
    result = export(priced, r.ctx, o.fmt)
    written = None
    if o.output:
        check = getattr(exporter(o.fmt), "check_file", None)
        written = str(write_atomic(o.output, result.text, check=check))
    return Exported(priced, result, written)


def launch_lines(o: ApplyOptions, r: Resolved) -> LaunchLines:
    """Each node's torchrun line (autotune.export.launch), checked against the runtime: the only one,
    or node-rank K's (``node_rank``). With ``hosts`` the lines are those that start every node from
    here (node-rank 0's as it is, the others' through the remote shell, autotune.hostfile)."""
    plan, ctx = r.plan, r.ctx
    out = Path("results") / "launch" / tag(ctx) / "out"
    cmds = L.commands(plan, ctx, out, steps=o.steps, run_id=tag(ctx), timeout_s=o.timeout_s)
    if o.node_rank is not None and not 0 <= o.node_rank < len(cmds):
        raise InputError(f"the plan runs on {len(cmds)} node(s): node-rank 0..{len(cmds) - 1}", field="--node-rank")
    if not o.dry_run and len(cmds) > 1 and o.node_rank is None and o.hosts is None:
        raise InputError(f"the plan spans {len(cmds)} nodes: on each host run `autotune apply ... --launch "
                         "--node-rank K` with MASTER_ADDR set to node-rank 0's host, or start them all from here "
                         "with --hosts FILE (or --dry-run to print the command of each node)", field="--launch")
    from autotune.runtime.trial import check_runtime_support

    check_runtime_support(plan, ctx.model)
    if not o.dry_run and len(cmds) == 1:
        L.check_runnable(plan, ctx)
    chosen = cmds if o.node_rank is None else [cmds[o.node_rank]]
    shown = [c.shell() for c in chosen]
    if o.hosts is None:
        return LaunchLines(out, len(cmds), chosen, shown)
    from autotune import hostfile

    hosts = hostfile.read_hosts(o.hosts)
    if plan.uses is not None and len(hosts) == ctx.cluster.num_nodes != len(cmds):
        hosts = [hosts[c.node] for c in cmds]  # a hosts file of the whole pool: the used nodes' hosts
    hostfile.check_hosts(hosts, [int(c.argv[c.argv.index("--nproc-per-node") + 1]) for c in cmds], "the plan",
                         o.hosts)
    addr, port = hostfile.rendezvous(hosts)
    shown = hostfile.node_lines(hosts, shown, hostfile.remote_shell(o.remote_shell), addr, port)
    remote = [L.RemoteLine(c.node, c.node_rank, h.name, line)
              for c, h, line in zip(cmds[1:], hosts[1:], shown[1:], strict=True)]
    return LaunchLines(out, len(cmds), chosen, shown, [h.name for h in hosts], remote)


def run_launch(o: ApplyOptions, r: Resolved, lines: LaunchLines) -> dict[str, Any]:
    """Run the first chosen command here (with ``hosts``: every node, the others through the remote
    shell) and answer the ranks' summary (autotune.export.launch.run)."""
    return L.run(lines.chosen[0], lines.out, world=r.plan.world, seq_len=r.ctx.seq_len,
                 global_batch=r.ctx.global_batch, steps=o.steps, timeout_s=o.timeout_s, nodes=lines.nodes,
                 line=lines.shown[0] if o.hosts else None, remote=lines.remote)
