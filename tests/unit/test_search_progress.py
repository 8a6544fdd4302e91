"""The live progress display (autotune/progress.py) through rich's own console: drawn on a terminal,
silent on a pipe and under --json; the search drives it phase by phase and says where --timeout
stopped it."""

from __future__ import annotations

import io
import time

from _search_helpers import toy_estimate
from rich.console import Console

from autotune.progress import Progress
from autotune.search import SearchOptions, search
from autotune.specs import load_cluster, load_model

TINY = load_model("tiny")
L8 = load_cluster("local:8")


def terminal() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=True, width=120, color_system=None), buf


def test_a_terminal_shows_phase_count_best_elapsed_and_eta():
    con, buf = terminal()
    with Progress(con) as p:
        p.phase("sampler", total=10)
        for v in (1000, 1234):
            p.advance(best=f"{v:,} tok/s")
        p.advance()
        p.deadline(time.monotonic() + 30)
        p.say("baselines: 24 trials")
        p._rich.refresh()
        frame = buf.getvalue()
    for text in ("sampler", "3/10", "trials", "best 1,234 tok/s", "elapsed 0:0", "ETA 0:", "baselines: 24 trials"):
        assert text in frame, (text, frame)


def test_eta_follows_the_deadline_when_the_total_is_unknown():
    con, _ = terminal()
    with Progress(con) as p:
        p.phase("polish")
        p.advance()
        task = p._rich.tasks[-1]
        assert p.eta(task) is None
        p.deadline(time.monotonic() + 100)
        assert 90 < p.eta(task) <= 100


def test_a_pipe_and_json_print_nothing():
    for con, buf, enabled in ((Console(file=io.StringIO()), None, None), (*terminal(), False)):
        buf = buf or con.file
        with Progress(con, enabled=enabled) as p:
            p.phase("sampler", total=3)
            p.advance(best="1 tok/s")
            p.say("baselines: 3 trials")
        assert buf.getvalue() == ""


def test_the_search_drives_the_display_through_its_phases():
    con, buf = terminal()
    with Progress(con) as p:
        search(TINY, L8, 256, 16, study_name="live", storage=":memory:", options=SearchOptions(trials=12),
               estimator=toy_estimate, display=p)
    out = buf.getvalue()
    for text in ("baselines", "balanced starts", "sampler", "polish", "best ", "tok/s", "sampler done"):
        assert text in out, text


def test_timeout_says_where_it_stopped_and_how_far_it_got():
    t = time.monotonic()
    res = search(TINY, L8, 256, 16, study_name="stop", storage=":memory:",
                 options=SearchOptions(trials=100000, timeout_s=1.0), estimator=toy_estimate)
    assert time.monotonic() - t < 6 and res.stopped == "timeout"
    note = next(n for n in res.notes if n.startswith("--timeout"))
    assert "stopped the search during the" in note and "baselines" in note and "sampler" in note
    assert res.to_dict()["stopped"] == "timeout"
    done = search(TINY, L8, 256, 16, study_name="nostop", storage=":memory:", options=SearchOptions(trials=5),
                  estimator=toy_estimate)
    assert done.stopped is None and not any(n.startswith("--timeout") for n in done.notes)
