"""validate's live display: on a terminal the plans done of --top and each message above it; on a pipe
the plain lines as before (nothing drawn); under --json nothing at all."""

import io

from rich.console import Console

import autotune.commands.validate as V
from autotune.progress import Progress

MESSAGES = ["trial 3: running dp=2 for real (1+3 steps)", "trial 7: running pp=2 for real (1+3 steps)"]


def test_terminal_counts_finished_plans_and_keeps_the_messages():
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=100, color_system=None)
    with Progress(con, unit="plans") as live:
        say = V._reporter(live, top=3)
        for m in MESSAGES:
            say(m)
        live._rich.refresh()
        frame = buf.getvalue()
    assert "validating" in frame and "1/3" in frame and all(m in frame for m in MESSAGES)


def test_a_pipe_gets_the_plain_lines_and_no_display(monkeypatch):
    buf = io.StringIO()
    plain = Console(file=buf, force_terminal=False, width=100)
    monkeypatch.setattr(V, "err_console", plain)
    with Progress(plain, unit="plans") as live:
        assert not live.on
        say = V._reporter(live, top=3)
        for m in MESSAGES:
            say(m)
    assert buf.getvalue().splitlines() == MESSAGES
