"""`autotune models | cat` (80 columns) shows every preset's name whole (issue 39 item 8: "llama…")."""

import re


def test_models_piped_keeps_every_name(capsys, monkeypatch):
    from helpers.cli import cli

    from autotune.specs.model import PRESETS

    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = cli(capsys, "models")
    assert code == 0
    for name in PRESETS:
        assert re.search(rf"\b{re.escape(name)}\b", out), name
