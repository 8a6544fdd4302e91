"""The `autotune` command line (typer). Each command lives in ``autotune/commands/<name>.py``.

Exit codes: 0 success, 2 bad input (one line naming the file, field and what was wrong), 1 the work
itself failed, 130 interrupted. ``AUTOTUNE_DEBUG=1`` shows tracebacks. With ``--json`` an error
is also printed on stdout as ``{"error": {"kind", "message", "source", "field"}}``.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import sys
import traceback
from typing import Any

import typer
from rich.markup import escape

from autotune import __version__
from autotune.commands.common import emit_json, err_console
from autotune.commands.help_layout import PLAIN_HELP, Command
from autotune.errors import AutotuneError, InputError

# typer >= 0.2x vendors its own click (typer._click, no click dependency) with its own Exit/Abort;
# older typer releases raise click's. Catch whichever exist.
_EXIT: tuple[type[BaseException], ...] = (typer.Exit,)
_ABORT: tuple[type[BaseException], ...] = (typer.Abort,)
_USAGE: tuple[type[BaseException], ...] = ()
_NO_ARGS: tuple[type[BaseException], ...] = ()
try:
    from typer._click import exceptions as _tclick

    _USAGE += (_tclick.ClickException,)
    _NO_ARGS += (_tclick.NoArgsIsHelpError,)
except ImportError:  # pragma: no cover - older typer
    pass
try:
    import click

    _EXIT += (click.exceptions.Exit,)
    _ABORT += (click.exceptions.Abort,)
    _USAGE += (click.ClickException,)
except ImportError:
    pass


_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}
# the commands, in the order the help lists them: each is ``autotune/commands/<name>.py``
COMMANDS = ("profile", "search", "estimate", "trial", "validate", "apply", "dashboard", "tune", "devices", "studies",
            "models")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"autotune {__version__}")
        raise typer.Exit()


def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    pass


def build_app(names: tuple[str, ...] = COMMANDS) -> typer.Typer:
    """The typer app with these commands, each module imported here: ``main`` builds it with the one
    command a process runs (``autotune search`` then never imports the exporters, the dashboard or
    the profilers' command modules: a tenth of its start-up), ``app`` with all of them."""
    out = typer.Typer(
        name="autotune",
        help="Find the fastest way to train a large language model on your cluster: profile the devices and "
             "links, search TP/PP/DP/CP/HP plans with uneven splits, prove the best with real runs, export them.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
        **PLAIN_HELP,
    )
    for name in names:
        mod = importlib.import_module(f"autotune.commands.{name}")
        if hasattr(mod, "app"):  # a command group (e.g. `profile list`)
            out.add_typer(mod.app, name=name, **({"help": mod.HELP} if hasattr(mod, "HELP") else {}))
        else:
            out.command(name, help=mod.HELP, cls=Command,
                        context_settings=_EXTRA if getattr(mod, "PLACEHOLDER", False) else None)(mod.command)
    out.callback()(_root)
    return out


_APP: list[typer.Typer] = []


def __getattr__(name: str) -> Any:
    """``autotune.cli.app``: every command (built on first use: typer's CliRunner, the docs' tools)."""
    if name == "app":
        if not _APP:
            _APP.append(build_app())
        return _APP[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _app_for(argv: list[str]) -> typer.Typer:
    """The app a command line needs: the named command alone, else (help, a typo, options first) all."""
    first = argv[0] if argv else ""
    return build_app((first,)) if first in COMMANDS else __getattr__("app")


def _fail(exc: AutotuneError | None, message: str, code: int, kind: str) -> None:
    # escape: messages quote user input and lists ("[4, 0]") that rich would read as markup
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    if "--json" in sys.argv[1:]:
        emit_json({"error": {"kind": kind, "message": getattr(exc, "message", message),
                             "source": getattr(exc, "source", None), "field": getattr(exc, "field", None)}})
    sys.exit(code)


def _collector_for_a_short_process() -> None:
    """Tune Python's cyclic garbage collector for a process that runs one command and exits.

    A search makes a few hundred thousand small objects (trials, plans, memoised prices) and keeps
    nearly all of them to the end. At the default thresholds the collector rescans them again and
    again, and at exit the interpreter runs full collections over everything once more: together
    0.8-1.0 s of a 3-4 s `autotune search` on this machine. Freezing what the imports made (it lives
    as long as the process), collecting young objects less often and freezing everything at exit
    (the process is about to end: nothing needs collecting) removes that without changing any
    result. Reference counting still frees every object without a cycle at once."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    atexit.register(gc.freeze)  # before the command registers its own: runs after them


def main() -> None:
    debug = os.environ.get("AUTOTUNE_DEBUG") == "1"
    _collector_for_a_short_process()
    try:
        # Outside standalone mode click returns a command's `typer.Exit(n)` code instead of exiting.
        rv = _app_for(sys.argv[1:])(standalone_mode=False)
        if rv == 130:  # typer turns Ctrl-C into a silent return code 130 outside standalone mode
            _fail(None, "interrupted", 130, "interrupted")
        if isinstance(rv, int) and rv:
            sys.exit(rv)
    except _EXIT as e:
        sys.exit(getattr(e, "exit_code", 0))
    except _NO_ARGS as e:  # bare `autotune`: the help, on stdout as --help prints it
        typer.echo(e.format_message())
        sys.exit(0)
    except _ABORT:
        _fail(None, "interrupted", 130, "interrupted")
    except _USAGE as e:  # usage errors: bad option, missing argument
        _fail(InputError(e.format_message()), e.format_message().replace("\n", " "), e.exit_code, "input")
    except AutotuneError as e:
        if debug:
            traceback.print_exc()
        _fail(e, str(e).replace("\n", " "), e.exit_code, e.kind)
    except KeyboardInterrupt:
        _fail(None, "interrupted", 130, "interrupted")
    except Exception as e:  # noqa: BLE001 - one clean line unless debugging
        if debug:
            traceback.print_exc()
        _fail(None, f"internal error: {type(e).__name__}: {e} (AUTOTUNE_DEBUG=1 shows the traceback)".replace(
            "\n", " "), 1, "internal")
    sys.exit(0)


if __name__ == "__main__":
    main()
