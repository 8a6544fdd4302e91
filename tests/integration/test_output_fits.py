"""Output a user can read in a normal terminal: tables fit 80 columns (COLUMNS is followed when
piped), no cell is cut to `A1...`, empty columns are hidden, columns say what they hold, and
`--wide` brings back every column. Inline plans take uneven shares."""

import os

import pytest
from helpers.cli import run_autotune
from rich.console import Console
from rich.text import Text

from autotune.dashboard.tables import Col, fit


def run(*args, columns="80"):
    return run_autotune(*args, env={"COLUMNS": columns}, timeout=120)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    p = tmp_path_factory.mktemp("c") / "mixed.yaml"
    p.write_text("name: mixed\nnodes:\n  - {count: 1, devices_per_node: 4, device: H100-SXM}\n"
                 "  - {count: 1, devices_per_node: 4, device: A100-80GB}\n"
                 "inter_node: {bandwidth: 25GB/s, latency: 10us}\n")
    return str(p)


def _widest(text):
    return max(len(line) for line in text.splitlines())


@pytest.mark.parametrize("columns", ["80", "100"])
def test_estimate_fits_the_width_it_is_given_and_cuts_no_cell(mixed, columns):
    r = run("estimate", "-m", "llama3-8b", "-c", mixed, "-p", "dp=2,pp=2,tp=2,schedule=interleaved_1f1b,vpp=2",
            "-s", "8192", "-b", "16", columns=columns)
    assert r.returncode == 0, r.stderr
    assert _widest(r.stdout) <= int(columns)
    assert "…" not in r.stdout and "..." not in r.stdout
    assert "A100-80GB" in r.stdout and "H100-SXM" in r.stdout
    assert "exposed comm" in r.stdout and "--wide" in r.stdout
    assert "8+8" in r.stdout  # virtual-stage shares: two chunks of 8 layers per stage, labelled


def test_wide_shows_every_nonempty_column_and_hides_the_empty_ones(mixed):
    r = run("estimate", "-m", "llama3-8b", "-c", mixed, "-p", "dp=2,pp=2,tp=2", "-s", "8192", "-b", "16", "--wide",
            columns="400")
    assert r.returncode == 0, r.stderr
    for header in ("tp comm", "pp comm", "dp comm", "fwd/mb", "weights+grads+optim", "activations"):
        assert header in r.stdout
    # no cp or hp in this plan: their communication columns are empty for the whole table
    assert "cp comm" not in r.stdout and "hp comm" not in r.stdout


def test_inline_plan_takes_uneven_shares(mixed):
    import json

    r = run("estimate", "-m", "llama3-8b", "-c", mixed, "-p", "dp=2,pp=2,tp=2,layers=20/12", "-s", "8192",
            "-b", "16", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["plan"]["shares"]["layers"] == [20, 12]
    bad = run("estimate", "-m", "llama3-8b", "-c", mixed, "-p", "dp=2,pp=2,tp=2,layers=20/13", "-s", "8192",
              "-b", "16")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "33" in bad.stderr


def test_fit_drops_the_lowest_priority_columns_first_and_says_so():
    console = Console(width=60, record=True, file=open(os.devnull, "w"))
    cols = [Col("name", "left", 0), Col("a", priority=1), Col("long", priority=3), Col("zero", priority=1)]
    rows = [["A100-80GB", "1ms", "x" * 50, "0ns"], ["H100-SXM", "2ms", "y", "-"]]
    console.print(fit(console, cols, rows, title="t"))
    out = console.export_text()
    assert "A100-80GB" in out and "1ms" in out
    assert "long" not in out.split("\n")[2] and "zero" not in out  # too wide / empty everywhere
    assert "--wide (long)" in out
    assert _widest(out) <= 60
    console = Console(width=60, record=True, file=open(os.devnull, "w"))
    console.print(fit(console, cols, rows, wide=True))
    assert "x" * 20 in console.export_text().replace("\n", "").replace("│", "").replace(" ", "")


def test_styled_cells_count_as_their_text():
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(fit(console, [Col("m", priority=0)], [[Text("1GiB", style="red")]]))
    assert "1GiB" in console.export_text()


def _study_with_layouts(url):
    """Three trials: two share variations of one layout (dp=2,pp=2) and one other layout (dp=4)."""
    import optuna

    from autotune.cost import estimate
    from autotune.plan import Plan
    from autotune.specs import load_cluster, load_model

    model, cluster = load_model("tiny"), load_cluster("local:4")
    s = optuna.create_study(study_name="s", storage=url, direction="maximize")
    for k, v in {"model": "tiny", "cluster": "local:4", "seq_len": 128, "global_batch": 8}.items():
        s.set_user_attr(k, v)
    for inline in ("dp=2,pp=2,layers=3/1", "dp=2,pp=2,layers=2/2", "dp=4"):
        from autotune.plan import load_plan

        est = estimate(load_plan(inline), model, cluster, 128, 8)
        plan = est.record()
        s.add_trial(optuna.trial.create_trial(value=est.predicted["tokens_per_s"], params={}, distributions={},
                                              user_attrs={"plan": plan.to_dict(), "breakdown": est.breakdown}))
    assert isinstance(plan.plan, Plan)
    return s


def test_search_shows_one_plan_per_layout_with_a_line_on_why(tmp_path, monkeypatch):
    import autotune.commands.search as S

    url = f"sqlite:///{tmp_path / 's.db'}"
    study = _study_with_layouts(url)
    top = S.distinct_layouts("s", url, 5)
    assert len(top) == 2  # the two dp=2,pp=2 plans are one layout
    assert {tuple(sorted(p["degrees"].items())) for p, _ in top} == {
        tuple(sorted({"dp": 2, "pp": 2, "cp": 1, "hp": 1, "tp": 1}.items())),
        tuple(sorted({"dp": 4, "pp": 1, "cp": 1, "hp": 1, "tp": 1}.items()))}
    assert top[0][0]["predicted"]["tokens_per_s"] == study.best_value
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    monkeypatch.setattr(S, "console", console)
    S.show({"study": "s", "trials": 3, "top": [p for p, _ in top], "baseline_best": None, "why": None,
            "notes": [], "new_trials": 3, "elapsed_s": 0.1}, url)
    out = console.export_text()
    assert _widest(out) <= 80 and "…" not in out
    assert "#1 fastest:" in out and "#2 " in out and "the best's step time" in out
