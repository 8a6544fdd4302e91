"""Running the ``autotune`` command from a test: in-process through ``autotune.cli.main`` (its exit
code and one-line errors, without the ~3 s interpreter start) or as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys


def call_main(*args: str) -> int:
    """``autotune ARGS`` in this process; the exit code (0 when main returns)."""
    old = sys.argv
    sys.argv = ["autotune", *args]
    code = 0
    try:
        from autotune.cli import main

        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = old
    return code


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """``autotune ARGS`` in this process: (exit code, stdout, stderr) as pytest's capsys caught them."""
    code = call_main(*args)
    out, err = capsys.readouterr()
    return code, out, err


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without AUTOTUNE_DEBUG (which turns one-line errors into
    tracebacks), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_DEBUG"}
    env.update(extra or {})
    return env


def run_autotune(*args: str, cwd=None, env: dict[str, str] | None = None, timeout: float = 300,
                 **kw) -> subprocess.CompletedProcess:
    """``python -m autotune ARGS`` as a subprocess of this interpreter (so it imports the same
    checkout), text output captured; ``env`` is added to :func:`cli_env`."""
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True, cwd=cwd,
                          env=cli_env(env), timeout=timeout, **kw)
