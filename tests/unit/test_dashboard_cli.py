"""`autotune dashboard` end to end through the real CLI (exit codes, one JSON object, clean one-line
errors), and --serve: optuna-dashboard answering on 127.0.0.1 over the same storage."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import optuna
import pytest
from helpers.cli import run_autotune
from test_dashboard_data import make_study

from autotune.dashboard.serve import check_port
from autotune.errors import InputError


def run(*args, cwd, timeout=120):
    return run_autotune("dashboard", *args, cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    d = tmp_path_factory.mktemp("dash")
    url = f"sqlite:///{d / 'autotune.db'}"
    make_study(url)
    make_study(url, "other")
    optuna.create_study(study_name="empty", storage=url)
    return url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_terminal_view(db, tmp_path):
    r = run("--study", "s", "--storage", db, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "best #1 dp=4,pp=2" in r.stdout and "cost model raised" in r.stdout


def test_json_and_html_together(db, tmp_path):
    r = run("--study", "s", "--storage", db, "--html", "out/report.html", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)  # exactly one object on stdout
    assert data["best"]["number"] == 1 and data["even_best"]["number"] == 4
    assert data["speedup_vs_even"] == pytest.approx(280 / 240)
    assert [row["number"] for row in data["rows"]] == [1, 4, 0, 2, 5, 3]
    rep = data["report"]
    assert rep["timeline"] == "study" and len(rep["charts"]) == 6
    assert (tmp_path / "out" / "report.html").stat().st_size == rep["bytes"]


@pytest.mark.parametrize("args, needle", [
    (("--study", "nope"), "studies in this storage: empty, other, s"),
    (("--study", "empty"), "has no trials yet"),
    (("--study", "s", "--watch", "--json"), "--watch"),
    (("--study", "s", "--port", "0", "--serve"), "--port"),
])
def test_bad_input_exits_2_with_one_line(db, tmp_path, args, needle):
    r = run(*args, "--storage", db, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_missing_database_exits_2(tmp_path):
    r = run("--study", "s", "--storage", f"sqlite:///{tmp_path / 'none.db'}", cwd=tmp_path)
    assert r.returncode == 2 and "no such database file" in r.stderr


def test_port_in_use_is_an_input_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(InputError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_port(port)


def test_serve_port_in_use_exits_2(db, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = run("--study", "s", "--storage", db, "--serve", "--port", str(s.getsockname()[1]), cwd=tmp_path)
    assert r.returncode == 2 and "already in use" in r.stderr


def test_serve_answers_on_localhost_over_the_same_storage(db, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_DEBUG"}
    p = subprocess.Popen([sys.executable, "-m", "autotune", "dashboard", "--study", "s", "--storage", db, "--serve",
                          "--port", str(port), "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=tmp_path, env=env)
    try:
        body, deadline = None, time.time() + 60
        while time.time() < deadline and p.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=2) as resp:
                    body = json.loads(resp.read())
                break
            except OSError:
                time.sleep(0.3)
        assert body is not None, p.stderr.read() if p.poll() is not None else "no answer"
        names = {s["study_name"] for s in body["study_summaries"]}
        assert {"s", "other", "empty"} <= names
        sid = next(s["study_id"] for s in body["study_summaries"] if s["study_name"] == "s")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies/{sid}", timeout=5) as resp:
            assert len(json.loads(resp.read())["trials"]) == 6
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    out = p.stdout.read()
    first = json.loads(out)
    assert first["url"] == f"http://127.0.0.1:{port}/dashboard/studies/{sid}"
