"""`autotune estimate`: predict step time, tokens/s, MFU and per-device memory of one plan."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from autotune.commands.common import (
    ClusterOpt,
    DtypeOpt,
    GlobalBatchOpt,
    JsonOpt,
    ModelOpt,
    PlanOpt,
    SeqLenOpt,
    StorageOpt,
    console,
    emit_json,
)
from autotune.units import fmt_bytes, fmt_count, fmt_time

HELP = "Predict step time, tokens/s, MFU and per-device memory of one plan on a cluster."


def command(model: ModelOpt, cluster: ClusterOpt, plan: PlanOpt, seq_len: SeqLenOpt, global_batch: GlobalBatchOpt,
            timeline: bool = typer.Option(False, "--timeline", help="Include the simulated pipeline events "
                                                                    "(breakdown.timeline) in --json output."),
            storage: StorageOpt = "sqlite:///results/autotune.db", dtype: DtypeOpt = "auto",
            json_: JsonOpt = False) -> None:
    """Predict step time, tokens/s, MFU and per-device memory of one plan on a cluster."""
    from autotune.cost import estimate
    from autotune.plan import load_plan_for
    from autotune.specs import load_cluster, load_model

    m = load_model(model)
    c = load_cluster(cluster, storage=storage)
    p = load_plan_for(plan, c, dtype)
    est = estimate(p, m, c, seq_len, global_batch, timeline=timeline)
    if json_:
        emit_json(est.to_dict())
        return
    _print(est, m, c)


def _rank_ranges(rows: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Consecutive ranks with the same figures as one line ("0-7"), so 128 ranks stay readable."""
    keyf = ("stage", "device", "memory_bytes", "compute_s", "comm_s", "exposed_comm_s", "bubble_s")
    out: list[tuple[int, int, dict[str, Any]]] = []
    for r in rows:
        if out and all(out[-1][2][k] == r[k] for k in keyf):
            out[-1] = (out[-1][0], r["rank"], out[-1][2])
        else:
            out.append((r["rank"], r["rank"], r))
    return [(f"{a}" if a == b else f"{a}-{b}", r) for a, b, r in out]


def _print(est: Any, model: Any, cluster: Any) -> None:
    pr, bd, plan = est.predicted, est.breakdown, est.plan
    head = Table(title=f"{model.name} on {cluster.name}: {plan.degrees.inline()} {plan.schedule}, "
                       f"mbs {plan.micro_batch_size} x {plan.num_microbatches} micro-batches, recompute "
                       f"{plan.recompute}, zero {plan.zero_stage}", show_header=False)
    head.add_column("figure")
    head.add_column("value", justify="right")
    head.add_row("step time", fmt_time(pr["step_time_s"]))
    head.add_row("tokens/s", fmt_count(pr["tokens_per_s"]))
    head.add_row("MFU", f"{pr['mfu'] * 100:.1f}%")
    head.add_row("pipeline bubble", f"{pr['bubble_fraction'] * 100:.1f}%")
    head.add_row("peak memory", f"{fmt_bytes(max(pr['memory_bytes']))} (capacity "
                                f"{fmt_bytes(min(pr['capacity_bytes']))} min)")
    head.add_row("feasible", "yes" if pr["feasible"] else f"[red]no[/]: {pr['infeasible_reason']}")
    console.print(head)

    st = Table(title="Per pipeline stage (its slowest rank, per step; exposed = communication compute does not hide)")
    cols = ("stage", "layers", "devices", "fwd/mb", "bwd/mb", "compute", "tp", "cp", "hp", "pp", "dp", "exposed",
            "bubble", "memory")
    for col in cols:
        st.add_column(col, justify="left" if col in ("devices", "layers") else "right")
    for s in bd["stages"]:
        st.add_row(str(s["stage"]), ",".join(map(str, s["layers"])), ",".join(s["devices"]),
                   ",".join(fmt_time(x) for x in s["fwd_s"]), ",".join(fmt_time(x) for x in s["bwd_s"]),
                   *(fmt_time(s[k]) for k in ("compute_s", "tp_comm_s", "cp_comm_s", "hp_comm_s", "pp_comm_s",
                                              "dp_comm_s")), fmt_time(s["exposed_comm_s"] + s["dp_exposed_s"]),
                   f"{fmt_time(s['bubble_s'])} ({s['bubble_fraction'] * 100:.0f}%)", fmt_bytes(s["memory_bytes"]))
    console.print(st)

    rt = Table(title="Per rank (per step)")
    for col in ("ranks", "stage", "device", "compute", "comm", "exposed", "idle", "weights+grads+optim",
                "activations", "logits", "reserve", "memory", "capacity"):
        rt.add_column(col, justify="left" if col in ("ranks", "device") else "right")
    for label, r in _rank_ranges(bd["ranks"]):
        t = r["memory"]
        over = r["memory_bytes"] > r["capacity_bytes"]
        rt.add_row(label, str(r["stage"]), r["device"], fmt_time(r["compute_s"]), fmt_time(r["comm_s"]),
                   fmt_time(r["exposed_comm_s"] + r["dp_exposed_s"]), fmt_time(r["bubble_s"]),
                   fmt_bytes(t["weights"] + t["gradients"] + t["optimizer"]), fmt_bytes(t["activations"]),
                   fmt_bytes(t["logits"]), fmt_bytes(t["reserve"]),
                   f"[red]{fmt_bytes(r['memory_bytes'])}[/]" if over else fmt_bytes(r["memory_bytes"]),
                   fmt_bytes(r["capacity_bytes"]))
    console.print(rt)
    console.print(f"throughput from: {'; '.join(bd['throughput_source'])}", highlight=False)
