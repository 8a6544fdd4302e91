"""`autotune models`: list presets, `autotune models show NAME`."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from autotune.commands.common import JsonOpt, WideOpt, console, emit_json
from autotune.commands.help_layout import PLAIN_HELP, Command
from autotune.dashboard.tables import Col, fit
from autotune.specs.model import PRESETS, load_model
from autotune.units import fmt_count

app = typer.Typer(help="List the built-in model presets, or show one (or a model file).",
                  invoke_without_command=True, no_args_is_help=False, **PLAIN_HELP)


@app.callback()
def list_models(ctx: typer.Context, wide: WideOpt = False, json_: JsonOpt = False) -> None:
    """List presets with their parameter counts."""
    if ctx.invoked_subcommand is not None:
        return
    rows = [{"name": m.name, "params": m.param_count(), "active_params": m.active_params(), "layers": m.layers,
             "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads, "ffn_hidden": m.ffn_hidden, "vocab": m.vocab,
             "activation": m.activation, "experts": _experts(m)}
            for m in PRESETS.values()]
    if json_:
        emit_json({"models": rows})
        return
    # a narrow terminal or a pipe (80 columns) drops the least needed columns whole rather than
    # folding every cell: names are never cut (`autotune models | cat` once read "llama...")
    priority = {"name": 0, "params": 0, "active_params": 0, "layers": 0, "experts": 1, "hidden": 2, "heads": 2,
                "kv_heads": 3, "ffn_hidden": 3, "vocab": 3, "activation": 4}
    cols = [Col(c, "left" if c in ("name", "activation", "experts") else "right", priority[c]) for c in _COLUMNS]
    t = fit(console, cols, [[fmt_count(r[c]) if c in ("params", "active_params") else str(r[c]) for c in _COLUMNS]
                            for r in rows], title="Model presets (params: total; active: per token)", wide=wide)
    console.print(t)


_COLUMNS = ("name", "params", "active_params", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab",
            "activation", "experts")


def _experts(m) -> str:
    """'128 top-8' (plus shared experts, and MLA), '-' for a dense model."""
    if m.moe is None:
        return "-"
    e = m.moe
    text = f"{e.experts} top-{e.top_k}" + (f" +{e.shared_experts} shared" if e.shared_experts else "")
    return text + (" MLA" if m.mla is not None else "")


@app.command("show", cls=Command)
def show(name: Annotated[str, typer.Argument(help="Preset name or model file.")], json_: JsonOpt = False) -> None:
    """Show one model: its fields, parameter count and training FLOPs per token."""
    m = load_model(name)
    d = m.summary()
    d["flops_per_token"] = {str(s): m.model_flops_per_token(s) for s in (2048, 8192, 131072)}
    if json_:
        emit_json({"model": d})
        return
    t = Table(title=f"{m.name}", show_header=False)
    t.add_column("field")
    t.add_column("value")
    for k, v in d.items():
        if k == "flops_per_token":
            for s, f in v.items():
                t.add_row(f"train FLOPs/token @ seq {s}", f"{f:.4g}")
        elif k in ("params", "active_params"):
            t.add_row(k, f"{fmt_count(v)} ({v:,})")
        else:
            t.add_row(k, str(v))
    console.print(t)
