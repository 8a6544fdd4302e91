"""``--space`` from a Python file or an installed entry point (``autotune.spaces``), not only the
built-in names (autotune/search/spaces.py, docs/spaces.md): the documented example space loaded
both ways builds exactly what the default space builds, less the pipelined points; a search with it
finds no pipelined plan; what does not load is one line naming --space, exit 2, nothing written."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
from helpers.cli import cli

from autotune.errors import InputError
from autotune.search import SearchOptions, load_space, search, space_names
from autotune.search import spaces as S
from autotune.specs import load_cluster, load_model
from search_spaces.base import Infeasible, SearchContext

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "no_pipeline_space.py"
TINY = load_model("tiny")
L4 = load_cluster("local:4")
CTX = SearchContext(model=TINY, cluster=L4, seq_len=256, global_batch=8, dtype="fp32")


def _same_as_default_without_pipelines(module) -> None:
    """The example against the default space itself over the default's baselines and grid."""
    mine, ref = module.space(CTX), load_space("default").space(CTX)
    points = [p for _, p in ref.baselines()] + list(ref.grid_points())[:200]
    pipelined = 0
    for params in points:
        want, got = ref.build(params), mine.build(params)
        if isinstance(want, Infeasible) or want.degrees.pp == 1:
            assert got == want
        else:
            pipelined += 1
            assert isinstance(got, Infeasible) and "no pipeline" in got.reason
    assert pipelined and pipelined < len(points)  # both kinds of point were met
    assert mine.distributions() == ref.distributions()


def test_a_space_from_a_python_file_builds_what_its_code_says():
    module = load_space(str(EXAMPLE))
    assert module.NAME == "no-pipeline" and load_space(str(EXAMPLE)) is module  # loaded once per process
    _same_as_default_without_pipelines(module)


def test_a_search_with_the_file_space_finds_no_pipelined_plan():
    res = search(TINY, L4, 256, 8, study_name="file-space", storage=":memory:",
                 options=SearchOptions(trials=24, space=str(EXAMPLE), dtype="fp32"))
    assert res.best.plan.degrees.pp == 1 and all(r.plan.degrees.pp == 1 for r in res.top)


def _entry_points(monkeypatch, tmp_path, **values: str) -> None:
    """Installed entry points of ``autotune.spaces`` as importlib.metadata would list them."""
    (tmp_path / "my_spaces.py").write_text(EXAMPLE.read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = importlib.metadata.EntryPoints(
        importlib.metadata.EntryPoint(name=n, value=v, group=S.ENTRY_POINT_GROUP) for n, v in values.items())
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **kw: eps.select(**kw) if kw.get("group") == S.ENTRY_POINT_GROUP else real(**kw))


def test_a_space_from_an_installed_entry_point(monkeypatch, tmp_path):
    _entry_points(monkeypatch, tmp_path, **{"no-pipeline": "my_spaces", "as-function": "my_spaces:space",
                                            "broken": "my_spaces_missing", "no-space": "my_spaces:NAME"})
    assert {"default", "no-pipeline", "as-function"} <= set(space_names())
    _same_as_default_without_pipelines(load_space("no-pipeline"))
    _same_as_default_without_pipelines(load_space("as-function"))
    with pytest.raises(InputError, match="entry point 'broken' .* does not load: ModuleNotFoundError") as e:
        load_space("broken")
    assert e.value.field == "--space"
    with pytest.raises(InputError, match="defines no space"):
        load_space("no-space")


@pytest.mark.parametrize("content, message", [
    (None, "no such search space file"),
    ("def space(ctx) return 1\n", "does not load as a search space: SyntaxError"),
    ("import not_a_module_anywhere\n", "does not load as a search space: ModuleNotFoundError"),
    ("NAME = 'x'\n", "defines no space\\(ctx\\) function"),
])
def test_a_bad_space_file_is_one_line_exit_2_and_nothing_written(capsys, tmp_path, content, message):
    path = tmp_path / "space.py"
    if content is not None:
        path.write_text(content)
    db = tmp_path / "s.db"
    code, out, err = cli(capsys, "search", "-m", "tiny", "-c", "local:4", "-s", "256", "-b", "8", "--trials", "5",
                         "--space", str(path), "--storage", f"sqlite:///{db}")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--space" in lines[0], err
    assert re.search(message, lines[0]), lines[0]
    assert not db.exists()


@pytest.mark.parametrize("limit", [(), ("--max-step-time", "1000s")], ids=["plain", "with-a-limit"])
@pytest.mark.parametrize("content, message", [
    ("def space(ctx):\n    return 42\n", "space\\(ctx\\) returned int 42, not a search space"),
    ("def space(ctx):\n    raise ValueError('boom')\n", "space\\(ctx\\) raised ValueError: boom"),
])
def test_a_space_function_that_fails_is_one_line_exit_2_and_nothing_written(capsys, tmp_path, content, message,
                                                                             limit):
    """space(ctx) runs once the workload is known: what it returns or raises is checked before the
    study is written (issue 39 item 8: exit 1 and a stored study), by the plain search and by the
    search an objective's limit takes (search/pool.py; it stored a study 'none feasible'), and the
    error is the only line (no banner naming a study that is never written)."""
    path = tmp_path / "space.py"
    path.write_text(content)
    db = tmp_path / "s.db"
    code, out, err = cli(capsys, "search", "-m", "tiny", "-c", "local:4", "-s", "256", "-b", "8", "--trials", "5",
                         "--space", str(path), "--storage", f"sqlite:///{db}", *limit)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--space" in lines[0] and str(path) in lines[0], err
    assert re.search(message, lines[0]), lines[0]
    assert not db.exists()


def test_an_unknown_name_says_the_known_ones_and_the_file_form():
    with pytest.raises(InputError, match="unknown search space 'defualt'.*default.*space.py"):
        load_space("defualt")
