"""The CLI contract: help everywhere, --json prints one object, exit 2 on bad input, no tracebacks."""

import json

import pytest
from helpers.cli import run_autotune

from autotune.specs.model import PRESETS

COMMANDS = ["profile", "search", "estimate", "trial", "validate", "apply", "dashboard", "models", "tune"]


def run(*args, env=None):
    return run_autotune(*args, env=env, timeout=120)


def test_root_help_lists_every_command():
    r = run("--help")
    assert r.returncode == 0
    for c in COMMANDS:
        assert c in r.stdout


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_subcommand_has_help(cmd):
    r = run(cmd, "--help")
    assert r.returncode == 0, r.stderr
    assert "Usage" in r.stdout


def test_models_json_is_one_object_with_presets():
    r = run("models", "--json")
    assert r.returncode == 0
    data = json.loads(r.stdout)
    assert {m["name"]: m["params"] for m in data["models"]} == {k: v.param_count() for k, v in PRESETS.items()}


def test_bad_input_exits_2_with_one_line_and_no_traceback():
    r = run("models", "show", "llama3-9b")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "did you mean" in r.stderr


def test_bad_input_with_json_prints_error_object():
    r = run("models", "show", "nope", "--json")
    assert r.returncode == 2
    assert json.loads(r.stdout)["error"]["kind"] == "input"


def test_unknown_option_is_exit_2():
    r = run("models", "--bogus")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_model_file_with_bad_yaml(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("layers: [1,\n")
    r = run("models", "show", str(p))
    assert r.returncode == 2 and str(p) in r.stderr and "Traceback" not in r.stderr


def test_debug_shows_traceback(tmp_path):
    r = run("models", "show", "nope", env={"AUTOTUNE_DEBUG": "1"})
    assert r.returncode == 2 and "Traceback" in r.stderr
