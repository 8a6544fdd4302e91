"""`autotune estimate`: predict step time, tokens/s, MFU and per-device memory of one plan."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from autotune.commands.common import (
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
    PlanOpt,
    SeqLenOpt,
    StorageOpt,
    WideOpt,
    console,
    emit_json,
)
from autotune.dashboard.tables import Col, fit
from autotune.stages import degrees_text
from autotune.units import fmt_bytes, fmt_count, fmt_time

HELP = "Predict step time, tokens/s, MFU and per-device memory of one plan on a cluster."


def command(model: ModelOpt, cluster: ClusterOpt, plan: PlanOpt, seq_len: SeqLenOpt, global_batch: GlobalBatchOpt,
            timeline: bool = typer.Option(False, "--timeline", help="Include the simulated pipeline events "
                                                                    "(breakdown.timeline) in --json output."),
            storage: StorageOpt = "sqlite:///results/autotune.db", wide: WideOpt = False,
            dtype: DtypeOpt = "auto",
            target: str = typer.Option("runtime", "--target", help="Who will run the plan: runtime (autotune's "
                                       "own), megatron, torchtitan, deepspeed or accelerate; the price follows "
                                       "that framework's kernels (per-kernel host time, kernels per block)."),
            data: DataOpt = None, eod: EodOpt = None, lengths: LengthsOpt = None, doc_mask: DocMaskOpt = None,
            data_dtype: DataDtypeOpt = "auto",
            json_: JsonOpt = False) -> None:
    """Predict step time, tokens/s, MFU and per-device memory of one plan on a cluster."""
    from autotune.cost import estimate
    from autotune.plan import load_plan_for, located
    from autotune.specs import load_cluster, load_model
    from autotune.targets import check_target, kernel_costs

    kernels = kernel_costs(check_target(target))
    m = load_model(model)
    c = load_cluster(cluster, storage=storage)
    p = load_plan_for(plan, c, dtype)
    from autotune.documents import documents_from_options, plan_masks

    docs = documents_from_options(data=data, eod=eod, lengths=lengths, vocab=m.vocab, data_dtype=data_dtype)
    p = plan_masks(p, docs, doc_mask)
    with located(plan):
        est = estimate(p, m, c, seq_len, global_batch, timeline=timeline, documents=docs.dist if docs else None,
                       kernels=kernels)
    subset = _subset(p, c, plan, est.predicted, seq_len, global_batch)
    refused = _refusals(target, est.plan, m, c, seq_len, global_batch)
    if json_:
        emit_json({**est.to_dict(), **({"subset": subset} if subset else {}),
                   **({"target": {"name": target, "cannot_run": refused}} if target != "runtime" else {})})
        return
    _print(est, m, c, wide)
    if "documents" in est.breakdown:
        from autotune.commands.common import documents_line

        console.print(documents_line(est.breakdown["documents"], est.breakdown.get("flops")), highlight=False,
                      soft_wrap=True)
    for line in [subset["text"], *subset["why"]] if subset else []:
        console.print(line, highlight=False, soft_wrap=True)
    if refused:
        console.print(f"note: {target} cannot run this plan as it is ({'; '.join(refused)}): priced as {target} "
                      "would run it, but `apply --format` will refuse it", highlight=False, soft_wrap=True)


def _refusals(target: str, plan: Any, model: Any, cluster: Any, seq_len: int, global_batch: int) -> list[str]:
    """Why ``target`` cannot run the resolved plan (the exporter's own rules); empty for the runtime."""
    if target == "runtime":
        return []
    from autotune.targets import context, refusals

    return refusals(target, plan, context(model, cluster, seq_len, global_batch))


def _subset(p: Any, cluster: Any, source: str, predicted: dict[str, Any], seq_len: int,
            global_batch: int) -> dict[str, Any] | None:
    """A plan on a subset of a pool: what it uses and leaves out, what it costs (with prices: the
    search's ``objective.figures``), and why that pays when the plan file carries the search's
    reasons (an export of the search's chosen plan: provenance.left_out)."""
    from autotune.objective import cost_text, figures
    from autotune.specs.pool import left_out, subset_text

    text = subset_text(cluster, p.uses)
    if text is None:
        return None
    cost = figures(cluster, p.uses, predicted, seq_len, global_batch)
    if cost_text(cost):
        text += f"; costs {cost_text(cost)}"
    why: list[str] = []
    if "=" not in source:
        from autotune.plan_record import load_record

        prov = load_record(source).provenance or {}
        why = [str(x) for x in prov.get("left_out") or []]
    return {"uses": list(p.uses), "text": text, "why": why, "cost": cost,
            "left_out": [{"group": g, "devices": n, "device": name} for g, n, name in left_out(cluster, p.uses)]}


def _rank_ranges(rows: list[list[Any]]) -> list[list[Any]]:
    """Consecutive ranks whose figures print the same as one line ("0-7"), so 128 ranks stay readable:
    compared as printed, since ranks that differ below the printed digits (a CP shard with a little less
    windowed work) would otherwise each take a line of the same figures. ``rows``: [rank, cells...]."""
    printed = lambda cells: [(str(c), getattr(c, "style", "")) for c in cells]  # noqa: E731 - a red memory stays apart
    out: list[tuple[int, int, list[Any]]] = []
    for rank, *cells in rows:
        if out and printed(out[-1][2]) == printed(cells):
            out[-1] = (out[-1][0], rank, out[-1][2])
        else:
            out.append((rank, rank, cells))
    return [[f"{a}" if a == b else f"{a}-{b}", *cells] for a, b, cells in out]


def _print(est: Any, model: Any, cluster: Any, wide: bool = False) -> None:
    pr, bd, plan = est.predicted, est.breakdown, est.plan
    head = Table(title=f"{model.name} on {cluster.name}: {degrees_text(plan.to_dict())} {plan.schedule}, "
                       f"mbs {plan.micro_batch_size} x {plan.num_microbatches} micro-batches, recompute "
                       f"{plan.recompute}, zero {plan.zero_stage}", show_header=False, title_justify="left")
    head.add_column("figure")
    head.add_column("value", justify="right", overflow="fold")
    head.add_row("step time", fmt_time(pr["step_time_s"]))
    head.add_row("tokens/s", fmt_count(pr["tokens_per_s"]))
    head.add_row("MFU", f"{pr['mfu'] * 100:.1f}%")
    head.add_row("pipeline bubble", f"{pr['bubble_fraction'] * 100:.1f}%")
    head.add_row("peak memory", f"{fmt_bytes(max(pr['memory_bytes']))} (capacity "
                                f"{fmt_bytes(min(pr['capacity_bytes']))} min)")
    head.add_row("feasible", "yes" if pr["feasible"] else f"[red]no[/]: {pr['infeasible_reason']}")
    console.print(head)
    console.print(_stage_table(bd, plan, wide))
    console.print(_rank_table(bd, wide))
    if bd.get("moe"):
        console.print(_moe_line(bd["moe"]), highlight=False, soft_wrap=False)
    console.print(f"throughput from: {'; '.join(bd['throughput_source'])}", highlight=False, soft_wrap=False)
    rt = bd.get("runtime")
    if rt:
        console.print(f"priced as {rt['name']} runs it: {rt['kernels_per_block_fwd']} kernels per block forward, "
                      f"{rt['host_s_per_kernel'] * 1e6:g} us host time each (--target)", highlight=False,
                      soft_wrap=False)
    for dev, src in (bd.get("compute_source") or {}).items():  # a layer profile priced some pieces
        if any("layers:" in v for v in src.values()):
            console.print(f"{dev} pieces from: " + "; ".join(f"{k} {v}" for k, v in src.items()), highlight=False,
                          soft_wrap=False)
    for dev, src in (bd.get("activation_source") or {}).items():
        console.print(f"{dev} activation memory from: {src}", highlight=False, soft_wrap=False)
    for note in bd.get("notes") or []:
        console.print(f"[dim]note: {note}[/]", highlight=False, soft_wrap=False)


def _moe_line(x: dict[str, Any]) -> str:
    """The MoE terms of the rank that ends the step (``breakdown["moe"]``), one paragraph."""
    return (f"MoE ({x['experts']} experts, top-{x['top_k']}; ep {x['ep']} x etp {x['etp']} x edp {x['edp']}, "
            f"{fmt_count(x['active_params'])} of {fmt_count(x['total_params'])} parameters active), per step on the "
            f"rank that ends it: routed experts {fmt_time(x['experts_s'])} (busiest EP rank at "
            f"{x['imbalance']:.3f} x its even load, {x['tokens_per_expert']:.0f} tokens per expert), router "
            f"{fmt_time(x['router_s'])}, all-to-all {fmt_time(x['ep_comm_s'])} of which exposed "
            f"{fmt_time(x['ep_exposed_s'])} (overlap: {x['overlap']}), expert gradients over edp "
            f"{fmt_time(x['expert_grad_sync_s'])}; memory: expert states {fmt_bytes(x['expert_states_bytes'])}, "
            f"dispatch buffers {fmt_bytes(x['dispatch_buffers_bytes'])}")


def _stage_table(bd: dict[str, Any], plan: Any, wide: bool) -> Table:
    """One row per pipeline stage (its slowest rank). Layers are listed per model chunk the stage
    holds: with ``virtual_stages`` v > 1 a stage holds v chunks, so ``4+4`` is 4 layers in each."""
    cols = [Col("stage", priority=0), Col("layers", "left", 0), Col("devices", "left", 0),
            Col("fwd/mb", priority=4), Col("bwd/mb", priority=4), Col("compute", priority=0),
            Col("tp comm", priority=3), Col("cp comm", priority=3), Col("hp comm", priority=3),
            Col("pp comm", priority=3), Col("dp comm", priority=3), Col("exposed comm", priority=1),
            Col("bubble", priority=1), Col("memory", priority=0)]
    rows = []
    for s in bd["stages"]:
        rows.append([str(s["stage"]), "+".join(map(str, s["layers"])), ",".join(s["devices"]),
                     ",".join(fmt_time(x) for x in s["fwd_s"]), ",".join(fmt_time(x) for x in s["bwd_s"]),
                     *(fmt_time(s[k]) for k in ("compute_s", "tp_comm_s", "cp_comm_s", "hp_comm_s", "pp_comm_s",
                                                "dp_comm_s")), fmt_time(s["exposed_comm_s"] + s["dp_exposed_s"]),
                     f"{fmt_time(s['bubble_s'])} ({s['bubble_fraction'] * 100:.0f}%)" if s["bubble_s"] else "-",
                     fmt_bytes(s["memory_bytes"])])
    chunks = f"; layers per model chunk (+ between the {plan.virtual_stages} chunks of a stage)" \
        if plan.virtual_stages > 1 else ""
    return fit(console, cols, rows, wide=wide, title="Per pipeline stage (its slowest rank, per step)",
               caption=f"comm: communication time; exposed: the part compute does not hide{chunks}")


def _rank_table(bd: dict[str, Any], wide: bool) -> Table:
    cols = [Col("ranks", "left", 0), Col("stage", priority=0), Col("device", "left", 0), Col("compute", priority=1),
            Col("comm", priority=2), Col("exposed comm", priority=1), Col("idle", priority=2),
            Col("weights+grads+optim", priority=4), Col("activations", priority=4), Col("logits", priority=5),
            Col("reserve", priority=5), Col("memory", priority=0), Col("capacity", priority=0)]
    rows = []
    for r in bd["ranks"]:
        t = r["memory"]
        over = r["memory_bytes"] > r["capacity_bytes"]
        rows.append([r["rank"], str(r["stage"]), r["device"], fmt_time(r["compute_s"]), fmt_time(r["comm_s"]),
                     fmt_time(r["exposed_comm_s"] + r["dp_exposed_s"]), fmt_time(r["bubble_s"]),
                     fmt_bytes(t["weights"] + t["gradients"] + t["optimizer"]), fmt_bytes(t["activations"]),
                     fmt_bytes(t["logits"]), fmt_bytes(t["reserve"]),
                     Text(fmt_bytes(r["memory_bytes"]), style="red" if over else ""), fmt_bytes(r["capacity_bytes"])])
    return fit(console, cols, _rank_ranges(rows), wide=wide, title="Per rank (per step)")
