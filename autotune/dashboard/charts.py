"""The report's plotly figures, one function per chart. Each returns a figure, or a text saying why
there is nothing to draw (no measured trial yet, no timeline), which the report shows instead."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from autotune.dashboard.data import DIMS, StudyView, TrialRow
from autotune.dashboard.timeline import COMPUTE_KINDS, KINDS, Timeline

COLOURS = {"fwd": "#4C78A8", "bwd": "#F58518", "wgrad": "#FFBF79", "comm": "#54A24B", "bubble": "#E45756", "idle": "#BAB0AC"}
GiB = 1024 ** 3
GANTT_LIMIT = 20_000
"""Most events drawn in the Gantt chart (plotly stays responsive up to about this many bars)."""


def _layout(fig: go.Figure, title: str, **kw: Any) -> go.Figure:
    fig.update_layout(title=title, template="plotly_white", margin=kw.pop("margin", {"l": 60, "r": 20, "t": 50, "b": 50}),
                      height=kw.pop("height", 420), legend={"orientation": "h", "y": -0.2}, **kw)
    return fig


def history(view: StudyView) -> go.Figure | str:
    """Predicted tokens/s per trial (infeasible trials at their predicted value, greyed), measured
    points where validated, and the best feasible prediction so far."""
    rows = sorted((r for r in view.rows if r.state == "COMPLETE"), key=lambda r: r.number)
    if not rows:
        return "no completed trial yet"
    fig = go.Figure()
    ok = [r for r in rows if r.feasible]
    bad = [r for r in rows if not r.feasible]
    hover = "trial %{x}<br>%{y:,.0f} tok/s<br>%{text}<extra></extra>"
    fig.add_trace(go.Scatter(x=[r.number for r in ok], y=[r.predicted_tps for r in ok], mode="markers",
                             name="predicted (feasible)", text=[r.degrees_text() for r in ok], hovertemplate=hover,
                             marker={"color": "#4C78A8", "size": 7}))
    if bad:
        fig.add_trace(go.Scatter(x=[r.number for r in bad], y=[r.predicted_tps or 0 for r in bad], mode="markers",
                                 name="infeasible", text=[f"{r.degrees_text()}: {r.reason}" for r in bad],
                                 hovertemplate=hover, marker={"color": "#BAB0AC", "symbol": "x", "size": 7}))
    meas = [r for r in rows if r.measured_tps is not None]
    if meas:
        fig.add_trace(go.Scatter(x=[r.number for r in meas], y=[r.measured_tps for r in meas], mode="markers",
                                 name="measured", text=[r.degrees_text() for r in meas], hovertemplate=hover,
                                 marker={"color": "#F58518", "symbol": "diamond", "size": 9}))
    best, xs, ys = None, [], []
    for r in rows:
        if r.feasible and r.predicted_tps is not None and (best is None or r.predicted_tps > best):
            best = r.predicted_tps
        if best is not None:
            xs.append(r.number)
            ys.append(best)
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name="best so far", line={"shape": "hv", "color": "#E45756"}))
    return _layout(fig, "", xaxis_title="trial", yaxis_title="tokens/s")


def parallel_degrees(view: StudyView) -> go.Figure | str:
    rows = [r for r in view.rows if r.state == "COMPLETE" and r.degrees]
    if not rows:
        return "no completed trial with a plan yet"
    dims = [{"label": d, "values": [r.degrees[d] for r in rows]} for d in DIMS]
    dims.append({"label": "micro-batches", "values": [(r.plan or {}).get("num_microbatches") or 0 for r in rows]})
    dims.append({"label": "pred. tok/s", "values": [r.predicted_tps or 0 for r in rows]})
    dims.append({"label": "feasible", "values": [1 if r.feasible else 0 for r in rows],
                 "tickvals": [0, 1], "ticktext": ["no", "yes"]})
    fig = go.Figure(go.Parcoords(dimensions=dims, line={"color": [r.predicted_tps or 0 for r in rows],
                                                        "colorscale": "Viridis", "showscale": True,
                                                        "colorbar": {"title": {"text": "tok/s"}}}))
    return _layout(fig, "", height=460, margin={"l": 60, "r": 60, "t": 60, "b": 30})


def predicted_vs_measured(view: StudyView) -> go.Figure | str:
    rows = [r for r in view.rows if r.measured_tps is not None and r.predicted_tps is not None]
    if not rows:
        return "no trial has been measured yet (run `autotune validate` on the study)"
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4],
                        subplot_titles=("measured against predicted", "prediction error per trial"))
    lo = min(min(r.measured_tps for r in rows), min(r.predicted_tps for r in rows)) * 0.9
    hi = max(max(r.measured_tps for r in rows), max(r.predicted_tps for r in rows)) * 1.1
    fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="exact", line={"dash": "dot", "color": "#888"}),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=[r.predicted_tps for r in rows], y=[r.measured_tps for r in rows], mode="markers+text",
                             name="trial", text=[f"#{r.number}" for r in rows], textposition="top center",
                             customdata=[[r.degrees_text(), f"{r.error:+.1%}"] for r in rows],
                             hovertemplate="predicted %{x:,.0f}<br>measured %{y:,.0f}<br>%{customdata[0]}"
                                           "<br>error %{customdata[1]}<extra></extra>",
                             marker={"size": 10, "color": [abs(r.error) for r in rows], "colorscale": "OrRd",
                                     "cmin": 0, "cmax": max(0.3, max(abs(r.error) for r in rows))}),
                  row=1, col=1)
    fig.add_trace(go.Bar(x=[f"#{r.number}" for r in rows], y=[r.error * 100 for r in rows], name="error %",
                         marker={"color": ["#E45756" if r.error > 0 else "#4C78A8" for r in rows]},
                         hovertemplate="%{x}: %{y:+.1f}%<extra></extra>"), row=1, col=2)
    fig.update_xaxes(title_text="predicted tokens/s", row=1, col=1)
    fig.update_yaxes(title_text="measured tokens/s", row=1, col=1)
    fig.update_yaxes(title_text="(predicted - measured) / measured, %", row=1, col=2)
    return _layout(fig, "", showlegend=False)


def gantt(tl: Timeline | None, why: str | None, row: TrialRow | None) -> go.Figure | str:
    """One horizontal bar per event: y = stage (and rank when several ranks of a stage are listed),
    x from start to end, one trace per kind so the legend names them."""
    if tl is None:
        return f"no timeline: {why}"
    shown, note = _window(tl)
    ranks_per_stage: dict[int, set] = {}
    for e in shown:
        ranks_per_stage.setdefault(int(e["stage"]), set()).add(e.get("rank"))
    multi = any(len(v) > 1 for v in ranks_per_stage.values())

    def label(e: dict[str, Any]) -> str:
        return f"stage {int(e['stage'])} rank {e.get('rank')}" if multi else f"stage {int(e['stage'])}"

    order = sorted({(int(e["stage"]), str(e.get("rank")), label(e)) for e in shown})
    fig = go.Figure()
    kinds = [k for k in KINDS if any(e["kind"] == k for e in shown)]
    kinds += sorted({e["kind"] for e in shown} - set(KINDS))
    for kind in kinds:
        ev = [e for e in shown if e["kind"] == kind]
        fig.add_trace(go.Bar(
            orientation="h", name=kind, y=[label(e) for e in ev], base=[float(e["start"]) * 1e3 for e in ev],
            x=[(float(e["end"]) - float(e["start"])) * 1e3 for e in ev],
            text=[str(e.get("microbatch", "")) if e.get("microbatch") is not None else "" for e in ev],
            textposition="inside", insidetextanchor="middle", marker={"color": COLOURS.get(kind, "#999")},
            # sends overlap the next operation in the simulation: a thin bar drawn over the compute
            width=0.3 if kind not in (*COMPUTE_KINDS, "bubble") else 0.8,
            customdata=[[e.get("microbatch"), float(e["start"]) * 1e3, float(e["end"]) * 1e3] for e in ev],
            hovertemplate=f"{kind} mb %{{customdata[0]}}<br>%{{customdata[1]:.3f}}–%{{customdata[2]:.3f}} ms"
                          "<extra>%{y}</extra>"))
    fig.update_yaxes(categoryorder="array", categoryarray=[o[2] for o in reversed(order)], title_text="")
    src = "stored with the trial" if tl.source == "study" else "recomputed with autotune.cost.estimate"
    sub = f"trial #{row.number} {row.degrees_text()}, {(row.plan or {}).get('schedule', '')}; {src}" if row else src
    sub += f"; {note}" if note else ""
    return _layout(fig, sub, barmode="overlay", xaxis_title="time in the step (ms)",
                   height=max(260, 60 + 40 * len(order)), bargap=0.25, title_font_size=13)


def _window(tl: Timeline) -> tuple[list[dict[str, Any]], str | None]:
    """All events, or for a very long simulation the ones that start in the first part of the step
    (so the browser stays responsive), with a note saying how much is shown."""
    if len(tl.events) <= GANTT_LIMIT:
        return tl.events, None
    starts = sorted(float(e["start"]) for e in tl.events)
    cutoff = starts[GANTT_LIMIT - 1]
    shown = [e for e in tl.events if float(e["start"]) < cutoff]
    return shown, (f"showing the first {cutoff * 1e3:.3g} ms of {tl.makespan * 1e3:.4g} ms "
                   f"({len(shown)} of {len(tl.events)} events)")


def memory(row: TrialRow | None, context: Any = None) -> go.Figure | str:
    if row is None:
        return "no feasible plan"
    if not row.memory_bytes and not row.measured_memory_bytes:
        return "the best plan records no per-device memory"
    n = max(len(row.memory_bytes), len(row.measured_memory_bytes), len(row.capacity_bytes))
    ranks = (context.rank_labels(row.plan or {}, n) if context is not None
             else [f"rank {i}" for i in range(n)])
    fig = go.Figure()
    if row.memory_bytes:
        fig.add_trace(go.Bar(x=ranks, y=[m / GiB for m in row.memory_bytes], name="predicted",
                             marker={"color": "#4C78A8"}, hovertemplate="%{x}: %{y:.2f} GiB<extra>predicted</extra>"))
    if row.measured_memory_bytes:
        fig.add_trace(go.Bar(x=ranks, y=[m / GiB for m in row.measured_memory_bytes], name="measured peak",
                             marker={"color": "#F58518"}, hovertemplate="%{x}: %{y:.2f} GiB<extra>measured</extra>"))
    if row.capacity_bytes:
        fig.add_trace(go.Scatter(x=ranks, y=[c / GiB for c in row.capacity_bytes], name="capacity",
                                 mode="lines+markers", line={"color": "#E45756", "shape": "hvh"},
                                 hovertemplate="%{x}: %{y:.2f} GiB<extra>capacity</extra>"))
    return _layout(fig, f"trial #{row.number} {row.degrees_text()}", barmode="group", yaxis_title="GiB",
                   title_font_size=13)


def breakdown(best: tuple[TrialRow | None, dict[int, dict[str, float]] | None, str],
              even: tuple[TrialRow | None, dict[int, dict[str, float]] | None, str]) -> go.Figure | str:
    """Stacked seconds per stage of the best plan and of the best even-split plan, side by side
    (``terms.stage_times``: the cost model's terms, or the timeline's kinds)."""
    from autotune.dashboard.terms import COST_TERMS, DETAIL, TIMELINE_TERMS

    groups, notes = [], []
    for tag, (row, per, src) in (("best", best), ("even", even)):
        if row is None:
            notes.append(f"{tag}: no feasible {'even-split ' if tag == 'even' else ''}plan")
        elif per is None:
            notes.append(f"{tag} #{row.number}: no breakdown ({src})")
        else:
            groups.append((f"{tag} #{row.number} {row.degrees_text()}", per, src))
        if tag == "best" and row is not None and even[0] is row:
            notes.append("the best plan is itself an even split")
            break
    if not groups:
        return "no timeline or breakdown: " + "; ".join(notes)
    fig = go.Figure()
    xs_outer = [name for name, per, _ in groups for _s in per]
    xs_inner = [f"stage {s}" for _, per, _ in groups for s in per]
    detail = [" · ".join(f"{k[:-7]} {per[s][k] * 1e3:.3g} ms" for k in DETAIL if per[s].get(k)) or "-"
              for _, per, _ in groups for s in per]
    terms = COST_TERMS if any("compute" in next(iter(per.values())) for _, per, _ in groups) else ()
    terms = tuple(dict.fromkeys((*terms, *TIMELINE_TERMS)))
    colours = {"compute": "#4C78A8", "comm (exposed)": "#54A24B", "dp sync (exposed)": "#72B7B2",
               "optimizer": "#B279A2", **COLOURS}
    for term in terms:
        ys = [per[s].get(term, 0.0) * 1e3 for _, per, _ in groups for s in per]
        if any(ys):
            fig.add_trace(go.Bar(x=[xs_outer, xs_inner], y=ys, name=term, marker={"color": colours.get(term, "#999")},
                                 customdata=detail,
                                 hovertemplate="%{x}: %{y:.3f} ms<br>total comm: %{customdata}<extra>" + term
                                               + "</extra>"))
    hidden = [f"{name.split(' ')[0]}: {sum(per[s].get('comm_overlapped', 0.0) for s in per) / len(per) * 1e3:.3g} "
              "ms of sends overlapped with compute per stage" for name, per, _ in groups
              if any(per[s].get("comm_overlapped") for s in per)]
    sources = sorted({src for _, _, src in groups})
    return _layout(fig, "; ".join(notes + hidden + ["from the " + " and ".join(sources)]), barmode="stack",
                   yaxis_title="ms per step", title_font_size=13)
