"""One self-contained HTML report of a study (plotly.js inlined, so it opens offline).

The page draws each chart with ``Plotly.newPlot`` and, once every promise has settled, sets
``data-charts-drawn`` (and ``data-report-errors`` when a script failed) on ``<body>`` and shows any
error in a red banner: a person sees a broken chart, and the browser test reads the same marks.
"""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Any

import plotly.io as pio
from plotly.offline import get_plotlyjs

from autotune import __version__
from autotune.dashboard import charts
from autotune.dashboard.data import StudyView, distinct, speedup
from autotune.dashboard.terminal import per_mtok_text
from autotune.dashboard.terms import stage_times
from autotune.dashboard.timeline import timeline_of
from autotune.errors import InputError
from autotune.objective import cost_of, cost_text
from autotune.stages import shares_text
from autotune.units import fmt_bytes, fmt_count

SECTIONS = (
    ("history", "Optimisation history"),
    ("degrees", "Parallel degrees of every trial"),
    ("accuracy", "Predicted against measured throughput"),
    ("timeline", "Pipeline timeline of the best plan"),
    ("memory", "Per-device memory of the best plan against capacity"),
    ("breakdown", "Time breakdown: best plan against the best even-split plan"),
)
POOL_SECTIONS = (("front", "Which devices: the Pareto front of step time against cost, the chosen plan marked"),)
"""Drawn for a study searched on a pool (it records a ``front``: autotune/search/pool.py)."""

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1200px;color:#222}
h1{font-size:1.5em;margin-bottom:4px} h2{font-size:1.15em;margin-top:32px;border-bottom:1px solid #ddd}
.meta{color:#555} .note{color:#777;font-style:italic;padding:12px;background:#f7f7f7}
.best{background:#eef7ee;padding:10px 14px;border-left:4px solid #54A24B}
table{border-collapse:collapse;font-size:0.85em} td,th{padding:3px 8px;border-bottom:1px solid #eee;text-align:right}
td.l,th.l{text-align:left} tr.b{font-weight:bold;background:#f3faf3}
#report-errors{display:none;background:#fdd;color:#900;padding:10px;border:1px solid #c00;white-space:pre-wrap}
"""

# Collects errors before plotly runs, so a failure inside plotly.js itself is reported too.
_ERROR_HOOK = """
window.__reportErrors = [];
window.addEventListener('error', function (e) { window.__reportErrors.push(String(e.message || e)); });
window.addEventListener('unhandledrejection', function (e) { window.__reportErrors.push(String(e.reason)); });
// plotly reports some failures (no WebGL for the parallel coordinates) only on the console
(function () { var orig = console.error; console.error = function () {
  window.__reportErrors.push(Array.prototype.map.call(arguments, String).join(' ')); orig.apply(console, arguments); }; })();
"""

_DRAW = """
(function () {
  var specs = %s, config = {displaylogo: false, responsive: true};
  var jobs = specs.map(function (s) {
    try { return Plotly.newPlot(s.id, s.fig.data, s.fig.layout || {}, config); }
    catch (e) { window.__reportErrors.push(s.id + ': ' + e); return Promise.resolve(); }
  });
  Promise.allSettled(jobs).then(function (res) {
    res.forEach(function (r, i) { if (r.status === 'rejected') window.__reportErrors.push(specs[i].id + ': ' + r.reason); });
    var drawn = Array.prototype.filter.call(document.querySelectorAll('.js-plotly-plot'),
        function (el) { return el.querySelector('svg.main-svg') !== null; }).length;
    document.body.setAttribute('data-charts-expected', String(specs.length));
    document.body.setAttribute('data-charts-drawn', String(drawn));
    if (window.__reportErrors.length) {
      document.body.setAttribute('data-report-errors', window.__reportErrors.join(' | '));
      var box = document.getElementById('report-errors');
      box.textContent = 'Some charts failed to draw:\\n' + window.__reportErrors.join('\\n');
      box.style.display = 'block';
    }
  });
})();
"""


def _esc(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _tps(x: float | None) -> str:
    return fmt_count(x) if x is not None else "-"


def _script_json(obj: Any) -> str:
    """JSON safe inside <script>: no '</' can close the tag early."""
    return obj.replace("</", "<\\/") if isinstance(obj, str) else json.dumps(obj).replace("</", "<\\/")


def _header(view: StudyView) -> str:
    ua = view.user_attrs
    parts = [f"model <b>{_esc(ua.get('model'))}</b>" if ua.get("model") else "",
             f"cluster <b>{_esc(ua.get('cluster'))}</b>" if ua.get("cluster") else "",
             f"sequence {_esc(ua.get('seq_len'))}" if ua.get("seq_len") else "",
             f"global batch {_esc(ua.get('global_batch'))}" if ua.get("global_batch") else "",
             f"space {_esc(ua.get('space'))}" if ua.get("space") else ""]
    states = ", ".join(f"{n} {s.lower()}" for s, n in sorted(view.states.items()))
    out = [f"<h1>autotune study {_esc(view.name)}</h1>",
           f"<div class='meta'>{' · '.join(p for p in parts if p)}<br>{len(view.rows)} trials ({_esc(states)}) · "
           f"storage {_esc(view.storage)} · generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by autotune "
           f"{__version__}</div>"]
    b, e = view.best, view.even_best
    if b is None:
        out.append("<p class='best'>No feasible plan in this study yet.</p>")
    else:
        which = "measured" if b.measured_tps else "predicted"
        by_cost = (ua.get("objective") or {}).get("kind") == "cost"  # a pool study searched for cost
        line = (f"<b>Best: trial #{b.number}</b> {_esc(b.degrees_text())} — "
                f"{_tps(b.measured_tps or b.predicted_tps)} tokens/s ({which})"
                + (f", {_esc(per_mtok_text(b.cost))} (cheapest per token)" if by_cost else ""))
        sp = speedup(b, e)
        if e is not None and e is not b and sp is not None:
            costs = (cost_of({"cost": b.cost}), cost_of({"cost": e.cost})) if by_cost else (None, None)
            line += (f", <b>{sp:.2f}×</b> the {'speed of the ' if by_cost else ''}best even-split plan #{e.number} "
                     f"{_esc(e.degrees_text())} ({_tps(e.measured_tps or e.predicted_tps)} tokens/s"
                     + (f", {_esc(per_mtok_text(e.cost))}: {costs[0] / costs[1]:.2f}× its cost per token)"
                        if all(costs) else ")"))
        elif e is b:
            line += ", itself an even split"
        else:
            line += "; no feasible even-split plan to compare with"
        out.append(f"<p class='best'>{line}</p>")
    return "\n".join(out)


def _trials_table(view: StudyView, limit: int = 25) -> str:
    head = ("<tr><th>#</th><th class='l'>degrees</th><th class='l'>shares</th><th class='l'>schedule mbs x m</th>"
            "<th>predicted tok/s</th>"
            "<th>measured tok/s</th><th>error</th><th>peak memory / capacity</th><th class='l'>state</th>"
            "<th class='l'>reason</th></tr>")
    body = []
    groups = distinct(view.rows)
    priced = any(cost_text(r.cost) for r, _ in groups[:limit])  # a priced pool search: what each plan costs
    if priced:
        head = head.replace("<th>measured tok/s</th>", "<th>cost per Mtok</th><th>measured tok/s</th>")
    for r, members in groups[:limit]:
        sh = shares_text(r.plan, "; ")
        mem = r.measured_memory_bytes or r.memory_bytes
        m = "-"
        if mem:
            m = fmt_bytes(max(mem))
            if r.memory_fraction is not None:
                m += f" ({r.memory_fraction:.0%})"
        err = f"{r.error:+.1%}" if r.error is not None else "-"
        cls = " class='b'" if any(x is view.best for x in members) else ""
        num = f"{r.number}" + (f" <span class='meta'>+{len(members) - 1}</span>" if len(members) > 1 else "")
        deg = r.degrees_text() + (" (even best)" if any(x is view.even_best for x in members) else "")
        body.append(f"<tr{cls}><td>{num}</td><td class='l'>{_esc(deg)}</td>"
                    f"<td class='l'>{_esc(sh)}</td><td class='l'>{_esc(r.settings_text())}</td>"
                    f"<td>{_tps(r.predicted_tps)}</td>" + (f"<td>{_esc(per_mtok_text(r.cost))}</td>" if priced else "")
                    + f"<td>{_tps(r.measured_tps)}</td><td>{err}</td><td>{_esc(m)}</td>"
                    f"<td class='l'>{r.state_text()}</td><td class='l'>{_esc(r.reason)}</td></tr>")
    notes = []
    if len(groups) > limit:
        notes.append(f"{len(groups) - limit} more plans not listed")
    if len(groups) < len(view.rows):
        notes.append("+N: N more trials of the same plan")
    more = f"<p class='meta'>{'; '.join(notes)}.</p>" if notes else ""
    return (f"<h2>Trials, best first ({len(groups)} distinct plans in {len(view.rows)} trials)</h2>"
            f"<table>{head}{''.join(body)}</table>{more}")


def build_charts(view: StudyView) -> tuple[list[tuple[str, str, Any]], dict[str, Any]]:
    """[(id, title, figure or reason)] in SECTIONS order, and facts for ``--json`` (timeline source)."""
    ctx = view.context
    best_tl, best_why = timeline_of(view.best, ctx)
    if view.even_best is None:
        even_tl, even_why = None, "no feasible even-split plan"
    elif view.even_best is view.best:
        even_tl, even_why = best_tl, best_why
    else:
        even_tl, even_why = timeline_of(view.even_best, ctx)
    figs = {
        "history": charts.history(view),
        "degrees": charts.parallel_degrees(view),
        "accuracy": charts.predicted_vs_measured(view),
        "timeline": charts.gantt(best_tl, best_why, view.best),
        "memory": charts.memory(view.best, ctx),
        "breakdown": charts.breakdown((view.best, *stage_times(view.best, ctx, best_tl)),
                                      (view.even_best, *stage_times(view.even_best, ctx, even_tl))),
    }
    if view.user_attrs.get("front"):
        figs["front"] = _front(view)
    facts = {"timeline": best_tl.source if best_tl else None, "timeline_missing": best_why,
             "charts": [k for k, v in figs.items() if not isinstance(v, str)],
             "notes": {k: v for k, v in figs.items() if isinstance(v, str)}}
    return [(k, title, figs[k]) for k, title in (*SECTIONS, *POOL_SECTIONS) if k in figs], facts


def _front(view: StudyView) -> Any:
    """The pool search's front (autotune/dashboard/front.py), with its left-out lines as the title."""
    from autotune.dashboard.front import front_chart

    fig = front_chart(view.user_attrs.get("front") or [])
    why = view.user_attrs.get("left_out") or []
    if why and not isinstance(fig, str):
        fig.update_layout(title={"text": "<br>".join(_esc(w) for w in why), "font": {"size": 12}},
                          margin={"l": 60, "r": 20, "t": 40 + 18 * len(why), "b": 50})
    return fig


def render_html(view: StudyView) -> tuple[str, dict[str, Any]]:
    sections, facts = build_charts(view)
    specs, blocks = [], []
    for cid, title, fig in sections:
        blocks.append(f"<h2>{_esc(title)}</h2>")
        if isinstance(fig, str):
            blocks.append(f"<p class='note' id='{cid}-note'>{_esc(fig)}</p>")
        else:
            blocks.append(f"<div id='{cid}' class='chart'></div>")
            specs.append(f'{{"id": "{cid}", "fig": {pio.to_json(fig, validate=False)}}}')
    draw = _DRAW % _script_json("[" + ",\n".join(specs) + "]")
    page = (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>autotune study {_esc(view.name)}</title><style>{_CSS}</style>"
            f"<script>{_ERROR_HOOK}</script>\n<script>{get_plotlyjs()}</script></head>\n<body>\n"
            f"<div id='report-errors'></div>\n{_header(view)}\n{_trials_table(view)}\n" + "\n".join(blocks)
            + f"\n<script>{draw}</script>\n</body></html>\n")
    return page, facts


def write_report(view: StudyView, path: str | Path) -> dict[str, Any]:
    """Write the report; returns {"html": path, "bytes", "charts", "notes", "timeline", ...}."""
    p = Path(path)
    page, facts = render_html(view)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot write {str(p)!r}: {exc.strerror or exc}", field="--html") from None
    return {"html": str(p), "bytes": len(page.encode()), **facts}
