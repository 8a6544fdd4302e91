"""`autotune studies`: the studies of a storage with their workload and best plan."""

from __future__ import annotations

from autotune.commands.common import DEFAULT_STORAGE, JsonOpt, StorageOpt, WideOpt, console, emit_json
from autotune.dashboard.tables import Col, fit
from autotune.units import fmt_count

HELP = "List the studies of a storage: model, cluster, sequence, batch, trials and the best plan."


def _degrees(plan: dict | None) -> str:
    from autotune.stages import degrees_text

    return degrees_text(plan) if plan else "-"  # the one description of a plan (autotune/stages.py)


def command(storage: StorageOpt = DEFAULT_STORAGE, wide: WideOpt = False, json_: JsonOpt = False) -> None:
    """List the studies of a storage."""
    from autotune.export.source import _check_storage
    from autotune.study import list_studies

    _check_storage(storage)
    data = list_studies(storage)
    if json_:
        emit_json({"storage": storage, "studies": data})
        return
    if not data:
        console.print(f"no studies in {storage}; `autotune search` makes one", highlight=False)
        return
    cols = [Col("study", "left", 0), Col("model", "left", 1), Col("cluster", "left", 1), Col("seq", priority=2),
            Col("batch", priority=2), Col("trials", priority=3), Col("best plan", "left", 0),
            Col("tok/s", priority=0), Col("validated", priority=4)]
    rows = [[r["name"], r["model"] or "-", r["cluster"] or "-", str(r["seq_len"] or "-"),
             str(r["global_batch"] or "-"), str(r["trials"]),
             f"#{r['best_trial']} {_degrees(r['best_plan'])}" if r["best_trial"] is not None else "none feasible",
             fmt_count(r["best_tokens_per_s"]) if r["best_tokens_per_s"] else "-",
             "yes" if r["best_measured_trial"] is not None else "-"] for r in data]
    console.print(fit(console, cols, rows, wide=wide, title=f"Studies in {storage}",
                      caption="tok/s: predicted, best feasible trial; `autotune dashboard --study NAME` shows one"))
