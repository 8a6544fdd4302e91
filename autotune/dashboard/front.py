"""The Pareto front of a pool search (step time against cost, or devices used without prices) for
people: a terminal table (``search``, ``dashboard``) and a plotly chart (the HTML report) with the
chosen plan marked. The front itself is computed by the search (autotune/search/pool.py) and
stored on the study (``front``, ``left_out``)."""

from __future__ import annotations

from typing import Any

from autotune.stages import degrees_text
from autotune.units import fmt_time


def _cost_text(c: dict[str, Any], currency: str) -> str:
    if c.get("per_mtok") is not None:
        return f"{c['per_mtok']:.4g}{currency}/Mtok"
    return "-"


def front_table(front: list[dict[str, Any]], wide: bool = False, currency: str = "") -> Any:
    """One row per point of the front, fastest first; the chosen plan marked ``*``."""
    from autotune.consoles import console
    from autotune.dashboard.tables import Col, fit

    currency = currency or _currency(front)
    cols = [Col("", priority=0), Col("trial", priority=0), Col("devices used", "left", 0), Col("step", priority=0),
            Col("per hour", priority=1), Col("cost per Mtok", priority=0), Col("device-h/Mtok", priority=2),
            Col("precision", "left", 1), Col("degrees", "left", 1)]
    rows = []
    for p in front:
        c = p.get("cost") or {}
        deg = degrees_text(p.get("plan"))
        rows.append(["*" if p.get("chosen") else "", f"#{p['trial']}", p.get("using") or f"{p.get('devices')} devices",
                     fmt_time(p["step_time_s"]) if p.get("step_time_s") else "-",
                     f"{c['per_hour']:.4g}{currency}/h" if c.get("per_hour") is not None else "-",
                     _cost_text(c, currency),
                     f"{c['device_hours_per_mtok']:.4g}" if c.get("device_hours_per_mtok") is not None else "-",
                     str((p.get("plan") or {}).get("dtype") or "-"), deg])
    against = "cost per million tokens" if any((p.get("cost") or {}).get("per_mtok") is not None for p in front) \
        else "devices used"
    return fit(console, cols, rows, wide=wide, title=f"Pareto front: step time against {against} ({len(front)} "
               "plans; * chosen)", caption="each is a plan: autotune apply --study S --trial N exports it")


def _currency(front: list[dict[str, Any]]) -> str:
    for p in front:
        cur = (p.get("cost") or {}).get("currency")
        if cur:
            return str(cur)
    return ""


def front_chart(front: list[dict[str, Any]], currency: str = "") -> Any:
    """Step time against cost per million tokens (or devices used), the chosen plan marked."""
    import plotly.graph_objects as go

    if not front:
        return "no front: this study was not searched on a pool (autotune search on a cluster file with available)"
    priced = all((p.get("cost") or {}).get("per_mtok") is not None for p in front)
    xs = [(p["cost"]["per_mtok"] if priced else p.get("devices")) for p in front]
    ys = [p["step_time_s"] for p in front]
    text = [f"#{p['trial']} {p.get('using') or ''}" for p in front]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name="front", text=text, line={"shape": "hv"},
                             hovertemplate="%{text}<br>step %{y:.4g} s<br>%{x:.4g}<extra></extra>",
                             marker={"color": "#4C78A8", "size": 9}))
    chosen = [i for i, p in enumerate(front) if p.get("chosen")]
    if chosen:
        i = chosen[0]
        fig.add_trace(go.Scatter(x=[xs[i]], y=[ys[i]], mode="markers+text", name="chosen", text=[text[i]],
                                 textposition="top right", marker={"color": "#E45756", "size": 16, "symbol": "star"}))
    fig.update_layout(template="plotly_white", height=420, margin={"l": 60, "r": 20, "t": 30, "b": 50},
                      legend={"orientation": "h", "y": -0.2},
                      xaxis_title=f"cost per million tokens ({currency or _currency(front) or 'price units'})" if priced
                      else "devices used", yaxis_title="step time (s)")
    return fig
