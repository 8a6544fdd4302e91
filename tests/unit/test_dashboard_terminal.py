"""The terminal view: the table shows the trials best first with their reasons, and ``watch`` picks up
trials that another writer commits to the same storage while it runs."""

from __future__ import annotations

import threading

import optuna
from rich.console import Console
from test_dashboard_data import DONE, make_study, plan_attrs, resolved

from autotune.dashboard.data import load_view
from autotune.dashboard.terminal import render, shares_text, watch
from autotune.plan import Degrees


def text_of(renderable) -> str:
    c = Console(width=250, record=True, force_terminal=False, color_system=None)
    c.print(renderable)
    return c.export_text()


def test_table_best_first_with_reasons(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    make_study(url)
    out = text_of(render(load_view("s", url)))
    lines = [ln for ln in out.splitlines() if ln.startswith("│")]
    firsts = [ln.split("│")[1].strip() for ln in lines]
    assert firsts == ["1*", "4", "0", "2", "5", "3"]
    assert "1.17x the best even split #4" in out  # 280 / 240 measured
    assert "rank 0 memory 5.0GiB > 2.9GiB" in out and "error on rank 1: cost model raised" in out
    assert "+7.1%" in out  # (300 - 280) / 280
    assert "infeasible" in out and "running" in out and "fail" in out
    assert "layers 3/5" in out


def _sh(shares, **plan):
    return shares_text({"shares": shares, **plan})


def test_shares_text_names_only_uneven_splits():
    assert _sh({"layers": [4, 4], "tokens": [128, 128], "samples": [3, 5]}) == "layers 4/4  samples 3/5"
    assert _sh({"layers": [8], "tokens": [256], "heads": [8], "samples": [16]}) == "even"
    assert _sh({"samples": [12, 12, 12, 12, 4, 4, 4, 4]}) == "samples 12x4/4x4"
    assert _sh({"layers": [2, 2, 3, 3, 3, 2, 2]}) == "layers 2/2/3x3/2/2"
    assert _sh({"samples": list(range(1, 65))}) == "samples 1..64 x64"


def test_shares_text_shows_each_ranks_chunks_in_the_schedules_placement():
    # chunk j of an interleaved plan runs on rank j % pp; a V schedule's chunks turn at the last rank
    # (rank 0 holds the first and the last chunk): the text reads each rank's chunks from the
    # schedule itself, so the search table and the dashboard say the same
    from autotune.schedules import as_schedule

    inter = {"degrees": {"pp": 2}, "virtual_stages": 2, "schedule": "interleaved_1f1b"}
    assert _sh({"layers": [11, 2, 10, 1]}, **inter) == "layers 11+10/2+1"
    v = {"degrees": {"pp": 2}, "virtual_stages": 2, "schedule": "zbv"}
    assert as_schedule("zbv").stages_of_rank(0, 2, 2) == (0, 3)
    assert _sh({"layers": [11, 2, 10, 1]}, **v) == "layers 11+1/2+10"


def test_limit_says_how_many_are_hidden(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    make_study(url)
    out = text_of(render(load_view("s", url), limit=2))
    assert "4 more plans not shown" in out


def test_watch_shows_trials_committed_while_it_runs(tmp_path):
    """A study with no trials yet (a search that has just started): watch waits, and a trial that a
    second writer commits between two refreshes appears in the next frame."""
    url = f"sqlite:///{tmp_path / 'a.db'}"
    optuna.create_study(study_name="live", storage=url, direction="maximize")
    added = threading.Event()

    def writer() -> None:  # another process's search, as far as the storage can tell
        st = optuna.load_study(study_name="live", storage=url)
        plan = resolved(degrees=Degrees(dp=2, pp=4))
        st.add_trial(optuna.trial.create_trial(state=DONE, value=123.0,
                                               user_attrs={"plan": plan_attrs(plan, 123.0, 1.0)}))
        added.set()

    calls = []

    def sleep(_s: float) -> None:
        calls.append(_s)
        if len(calls) == 2:  # between the second and third read
            t = threading.Thread(target=writer)
            t.start()
            t.join()

    console = Console(width=200, record=True, force_terminal=True, color_system=None)
    view = watch("live", url, console, interval=0.5, max_refreshes=4, sleep=sleep)
    assert added.is_set() and calls == [0.5, 0.5, 0.5]
    assert [r.number for r in view.rows] == [0] and view.best.predicted_tps == 123.0
    out = console.export_text()
    assert "no feasible plan yet" in out  # the first frames
    assert "dp=2,pp=4: 123 tok/s" in out  # the last


def test_repeated_plans_are_shown_once(tmp_path):
    """The search records a trial each time its sampler re-proposes a plan: one line per plan."""
    url = f"sqlite:///{tmp_path / 'a.db'}"
    st = make_study(url)
    for _ in range(3):
        st.add_trial(optuna.trial.create_trial(state=DONE, value=300.0, user_attrs=dict(st.trials[1].user_attrs)))
    out = text_of(render(load_view("s", url)))
    firsts = [ln.split("│")[1].strip() for ln in out.splitlines() if ln.startswith("│")]
    assert firsts == ["1* +3", "4", "0", "2", "5", "3"]
    assert "+N: N more trials of the same plan" in out


def test_the_table_fits_80_columns_and_keeps_every_reason(tmp_path):
    url = f"sqlite:///{tmp_path / 'n.db'}"
    make_study(url)
    c = Console(width=80, record=True, force_terminal=False, color_system=None)
    c.print(render(load_view("s", url), console=c))
    out = c.export_text()
    assert max(len(line) for line in out.splitlines()) <= 80 and "…" not in out
    wide = text_of(render(load_view("s", url)))
    reasons = [ln for ln in wide.splitlines() if ln.startswith("#")]
    assert reasons and all(r in out.replace("\n", " ") or r[:60] in out for r in reasons)


def test_the_summary_names_the_best_plan_each_target_can_run(tmp_path):
    url = f"sqlite:///{tmp_path / 't.db'}"
    make_study(url)
    s = optuna.load_study(study_name="s", storage=url)
    s.set_user_attr("best_per_target", {"runtime": {"trial": 1, "tokens_per_s": 280.0, "ratio": 1.0},
                                        "megatron": {"trial": 4, "tokens_per_s": 240.0, "ratio": 240 / 280},
                                        "accelerate": None})
    out = text_of(render(load_view("s", url)))
    assert "runtime 1.00x (#1)" in out and "megatron 0.86x (#4)" in out and "accelerate none" in out
