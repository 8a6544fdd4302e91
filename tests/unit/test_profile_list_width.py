"""`autotune profile list` at 80 columns: whole cells, and the columns left out named (issue 39 item 8's
rule for every table: fit the terminal by leaving columns out, never by cutting a cell to "…")."""

import re

import pytest

ROW = {"id": 12, "label": "node-a quick", "created_at": "2026-12-07T05:48:22.123456+00:00", "device_kind": "cpu",
       "device_name": "AMD EPYC 7B13 64-Core Processor", "nproc": 2, "hosts": ["node-a", "node-a"], "quick": True,
       "emulated": {"1": 2.0}, "origin": "measured", "unstable": 3}
LAYERS = {"id": 3, "label": "tiny on cpu", "created_at": "2026-12-07T06:01:02.345678+00:00", "device_kind": "cpu",
          "device_name": "AMD EPYC 7B13 64-Core Processor", "model": {"name": "tiny"}, "dtype": "fp32",
          "origin": "measured", "points": 48}
CELLS = {"id": "12", "label": "node-a quick", "created": ROW["created_at"], "device": "cpu: AMD EPYC 7B13 64-Core Processor",
         "ranks": "2", "hosts": "node-a", "quick": "yes", "emulated": "1=2x", "origin": "measured", "unstable": "3"}


@pytest.mark.parametrize("wide", [False, True])
def test_profile_list_cuts_no_cell(capsys, monkeypatch, wide):
    from helpers.cli import cli

    from profilers import store

    monkeypatch.setattr(store, "list_profiles", lambda _s: [ROW])
    monkeypatch.setattr(store, "list_layer_profiles", lambda _s: [LAYERS])
    code, out, err = cli(capsys, "profile", "list", *(["--wide"] if wide else []))
    assert code == 0, err
    assert "…" not in out, out
    flat = " ".join(out.split())
    hidden = {h for group in re.findall(r"more columns with --wide \(([^)]*)\)", flat) for h in group.split(", ")}
    if wide:  # every column; a cell wider than its share folds onto the next line (never "…")
        assert not hidden, out
        return
    for header, cell in CELLS.items():
        assert header in hidden or cell in out, f"{header}: {cell!r} is not shown whole:\n{out}"
    assert "layers:3" in out and "tiny" in out
