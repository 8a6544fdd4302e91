"""The HTML report: self-contained, every chart present with the study's data, the Gantt chart and
the time breakdown built from the stored (or recomputed) timeline, and "no timeline" when there is
none rather than a made-up one."""

from __future__ import annotations

import re
import sys
import types

import pytest
from test_dashboard_data import make_study

from autotune.dashboard.data import load_view
from autotune.dashboard.report import SECTIONS, build_charts, render_html, write_report
from autotune.dashboard.timeline import Timeline, time_by_kind
from autotune.errors import InputError


@pytest.fixture
def view(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    make_study(url)
    return load_view("s", url)


@pytest.fixture
def no_cost_model(monkeypatch):
    monkeypatch.setitem(sys.modules, "autotune.cost", None)  # `import autotune.cost` raises ImportError


def test_page_is_self_contained(view):
    page, facts = render_html(view)
    assert not re.search(r"<script[^>]+src=", page) and "<link" not in page and "<iframe" not in page
    assert "Plotly.newPlot" in page and len(page) > 3_000_000  # plotly.js itself is inlined
    assert facts["charts"] == [k for k, _ in SECTIONS] and facts["notes"] == {}
    assert all(f"<div id='{k}' class='chart'>" in page for k, _ in SECTIONS)
    assert "1.17×</b> the best even-split plan #4" in page


def test_gantt_draws_the_stored_timeline(view):
    charts = {cid: fig for cid, _, fig in build_charts(view)[0]}
    events = view.best.breakdown["timeline"]
    fig = charts["timeline"]
    for tr in fig.data:
        ev = [e for e in events if e["kind"] == tr.name]
        assert list(tr.base) == pytest.approx([e["start"] * 1e3 for e in ev])
        assert list(tr.x) == pytest.approx([(e["end"] - e["start"]) * 1e3 for e in ev])
        assert list(tr.y) == [f"stage {e['stage']}" for e in ev]
    assert {tr.name for tr in fig.data} == {"fwd", "bwd", "comm", "bubble"}


def test_time_by_kind_against_hand_computed_gpipe():
    """The fixture's GPipe schedule, fwd [6, 10] ms, bwd [12, 20] ms, 8 micro-batches, by hand:
    stage 1 starts 6 ms late, runs 80 + 160 ms and a 1 ms send; stage 0 waits 58 ms for the first
    backward, then 8 ms before each of the 7 others; the step ends at 86 + 160 + 12 = 258 ms."""
    from test_dashboard_data import gpipe_timeline

    per = time_by_kind(Timeline(gpipe_timeline([0.006, 0.010], [0.012, 0.020], 8), "study"))
    assert per[0] == pytest.approx({"fwd": 0.048, "bwd": 0.096, "wgrad": 0.0, "comm": 0.0, "bubble": 0.114, "idle": 0.0,
                                    "comm_overlapped": 0.0})
    assert per[1] == pytest.approx({"fwd": 0.080, "bwd": 0.160, "wgrad": 0.0, "comm": 0.001, "bubble": 0.006, "idle": 0.011,
                                    "comm_overlapped": 0.0})


def test_sends_overlapped_with_compute_are_not_counted_twice():
    """Stage 0 sends after each forward while the next one runs (as the cost model's simulation
    overlaps p2p): the first send is hidden, the last is exposed; the stack sums to the step."""
    ev = [{"stage": 0, "kind": "fwd", "start": 0.0, "end": 1.0}, {"stage": 0, "kind": "comm", "start": 1.0, "end": 1.5},
          {"stage": 0, "kind": "fwd", "start": 1.0, "end": 2.0}, {"stage": 0, "kind": "comm", "start": 2.0, "end": 2.5},
          {"stage": 1, "kind": "bubble", "start": 0.0, "end": 1.5}, {"stage": 1, "kind": "fwd", "start": 1.5, "end": 2.0}]
    per = time_by_kind(Timeline(ev, "study"))
    assert per[0] == pytest.approx({"fwd": 2.0, "bwd": 0.0, "wgrad": 0.0, "comm": 0.5, "bubble": 0.0, "idle": 0.0,
                                    "comm_overlapped": 0.5})
    assert per[1] == pytest.approx({"fwd": 0.5, "bwd": 0.0, "wgrad": 0.0, "comm": 0.0, "bubble": 1.5, "idle": 0.5,
                                    "comm_overlapped": 0.0})
    for d in per.values():
        assert sum(v for k, v in d.items() if k != "comm_overlapped") == pytest.approx(2.5)


def test_breakdown_compares_best_with_even_split(view):
    charts = {cid: fig for cid, _, fig in build_charts(view)[0]}
    fig = charts["breakdown"]
    groups = {g for tr in fig.data for g in tr.x[0]}
    assert groups == {"best #1 dp=4,pp=2", "even #4 dp=4,pp=2"}
    even = next(r for r in view.rows if r.number == 4)
    ref = time_by_kind(Timeline(even.breakdown["timeline"], "study"))
    fwd = next(tr for tr in fig.data if tr.name == "fwd")
    got = [y for g, y in zip(fwd.x[0], fwd.y, strict=True) if g.startswith("even")]
    assert got == pytest.approx([ref[s]["fwd"] * 1e3 for s in sorted(ref)])


def test_memory_and_accuracy_charts_carry_the_figures(view):
    charts = {cid: fig for cid, _, fig in build_charts(view)[0]}
    mem = {tr.name: tr for tr in charts["memory"].data}
    assert list(mem["predicted"].y) == pytest.approx([m / 2**30 for m in view.best.memory_bytes])
    assert list(mem["capacity"].y) == pytest.approx([c / 2**30 for c in view.best.capacity_bytes])
    acc = charts["accuracy"]
    pts = next(tr for tr in acc.data if tr.name == "trial")
    measured = sorted((r.predicted_tps, r.measured_tps) for r in view.rows if r.measured_tps)
    assert sorted(zip(pts.x, pts.y, strict=True)) == measured
    pc = charts["degrees"].data[0]
    assert [d["label"] for d in pc.dimensions][:5] == ["dp", "pp", "cp", "hp", "tp"]


def test_no_timeline_says_so_instead_of_inventing_one(tmp_path, no_cost_model):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    make_study(url, timelines=False, measured=False)
    page, facts = render_html(load_view("s", url))
    assert "<div id='timeline' class='chart'>" not in page and "timeline-note" in page
    assert facts["timeline"] is None and "cost model" in facts["notes"]["timeline"]
    assert facts["notes"]["timeline"].startswith("no timeline")
    assert "breakdown" in facts["notes"] and "accuracy" in facts["notes"]  # nothing measured either
    assert "history" in facts["charts"] and "memory" in facts["charts"]


def test_timeline_recomputed_through_the_cost_model(tmp_path, monkeypatch):
    """A trial without a timeline: the report asks ``autotune.cost.estimate`` with the trial's plan and
    the study's model, cluster and workload, and draws what it returns."""
    calls = []
    events = [{"stage": 0, "rank": 0, "kind": "fwd", "microbatch": 0, "start": 0.0, "end": 0.5},
              {"stage": 1, "rank": 2, "kind": "bwd", "microbatch": 0, "start": 0.5, "end": 1.5}]

    def estimate(plan, model, cluster, seq_len, global_batch, *, calibration=None):
        calls.append((plan.degrees.to_dict(), plan.shares.layers, model.name, cluster.num_devices, seq_len,
                      global_batch))
        return types.SimpleNamespace(breakdown={"timeline": events}, predicted={})

    monkeypatch.setitem(sys.modules, "autotune.cost", types.SimpleNamespace(estimate=estimate))
    url = f"sqlite:///{tmp_path / 'a.db'}"
    make_study(url, timelines=False)
    charts, facts = build_charts(load_view("s", url))
    assert calls[0] == ({"dp": 4, "pp": 2, "cp": 1, "hp": 1, "tp": 1}, (3, 5), "small", 8, 256, 16)
    assert facts["timeline"] == "recomputed"
    gantt = dict((c, f) for c, _, f in charts)["timeline"]
    assert sum(len(tr.x) for tr in gantt.data) == 2


def test_real_cost_model_timeline_matches_estimate(tmp_path):
    """With the real cost model (when it is installed), the recomputed timeline is estimate()'s own."""
    import autotune.cost as cost
    if not hasattr(cost, "estimate"):
        pytest.skip("autotune.cost has no estimate() yet")
    from autotune.plan import Plan
    from autotune.specs.cluster import load_cluster
    from autotune.specs.model import PRESETS

    url = f"sqlite:///{tmp_path / 'a.db'}"
    make_study(url, timelines=False)
    view = load_view("s", url)
    charts, facts = build_charts(view)
    ref = cost.estimate(Plan.from_dict(view.best.plan), PRESETS["small"], load_cluster("local:8"), 256, 16,
                        timeline=True)
    tl = ref.breakdown.get("timeline")
    if not tl:
        assert facts["timeline"] is None
        return
    assert facts["timeline"] == "recomputed"
    gantt = dict((c, f) for c, _, f in charts)["timeline"]
    assert sum(len(tr.x) for tr in gantt.data) == len(tl)


def test_write_report_to_an_unwritable_path_is_an_input_error(view, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="cannot write"):
        write_report(view, tmp_path / "file" / "r.html")


def test_text_is_escaped(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    st = make_study(url)
    st.set_user_attr("model", "<script>alert(1)</script>")
    page, _ = render_html(load_view("s", url))
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)" in page


def test_long_timeline_is_windowed_with_a_note(monkeypatch):
    from test_dashboard_data import gpipe_timeline

    from autotune.dashboard import charts

    monkeypatch.setattr(charts, "GANTT_LIMIT", 10)
    tl = Timeline(gpipe_timeline([0.001, 0.001], [0.002, 0.002], 16), "study")
    fig = charts.gantt(tl, None, None)
    starts = sorted(e["start"] for e in tl.events)
    drawn = sum(len(tr.x) for tr in fig.data)
    assert drawn == sum(1 for s in starts if s < starts[9]) and drawn < len(tl.events)
    assert f"of {len(tl.events)} events" in fig.layout.title.text


def test_a_refusing_cost_model_leaves_a_note_and_a_crashing_one_is_an_error(tmp_path, monkeypatch):
    from autotune.errors import InputError

    def refuses(*a, **k):
        raise InputError("no such precision on this device", field="dtype")

    def crashes(*a, **k):
        raise KeyError("half-built")

    url = f"sqlite:///{tmp_path / 'a.db'}"
    make_study(url, timelines=False)
    monkeypatch.setitem(sys.modules, "autotune.cost", types.SimpleNamespace(estimate=refuses))
    _, facts = build_charts(load_view("s", url))
    assert "no such precision" in facts["notes"]["timeline"] and facts["timeline"] is None
    monkeypatch.setitem(sys.modules, "autotune.cost", types.SimpleNamespace(estimate=crashes))
    with pytest.raises(KeyError, match="half-built"):  # no chart drawn from a cost model that is broken
        build_charts(load_view("s", url))
