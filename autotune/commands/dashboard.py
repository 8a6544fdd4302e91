"""`autotune dashboard`: show a study in the terminal (live with --watch), as one self-contained HTML
report (--html), or through optuna-dashboard on 127.0.0.1 (--serve)."""

from __future__ import annotations

from typing import Annotated

import typer

from autotune.commands.common import (
    DEFAULT_STORAGE,
    JsonOpt,
    StorageOpt,
    WideOpt,
    console,
    emit_json,
    err_console,
)
from autotune.errors import InputError

HELP = "Show a study: terminal view (live with --watch), self-contained HTML report, or optuna-dashboard."


def command(
    study: Annotated[str, typer.Option("--study", help="Study name (as given to `autotune search`).")],
    storage: StorageOpt = DEFAULT_STORAGE,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh the terminal view while a search writes the "
                                                        "same storage (Ctrl-C stops).")] = False,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between refreshes with --watch.",
                                            min=0.2)] = 2.0,
    limit: Annotated[int, typer.Option("--limit", help="Trials shown in the terminal (best first).", min=1)] = 30,
    html: Annotated[str | None, typer.Option("--html", help="Write a self-contained HTML report (opens offline) "
                                                           "to this file.")] = None,
    serve: Annotated[bool, typer.Option("--serve", help="Start optuna-dashboard on 127.0.0.1 over the storage "
                                                        "(Ctrl-C stops).")] = False,
    port: Annotated[int, typer.Option("--port", help="Port for --serve.", min=1, max=65535)] = 8080,
    wide: WideOpt = False,
    json_: JsonOpt = False,
) -> None:
    from autotune.dashboard import serve as serve_mod
    from autotune.dashboard import terminal
    from autotune.dashboard.data import load_view
    from autotune.dashboard.report import write_report

    if watch and (json_ or html or serve):
        other = "--json" if json_ else ("--html" if html else "--serve")
        raise InputError(f"--watch redraws the terminal and cannot be combined with {other}", field="--watch")

    if watch:
        terminal.watch(study, storage, console, interval=interval, limit=limit)
        return

    out: dict = {}
    if not serve or html or json_:
        view = load_view(study, storage)
        out = view.to_dict()
        if html:
            out["report"] = write_report(view, html)
        if json_ and not serve:
            emit_json(out)
            return
        if not json_:
            console.print(terminal.render(view, limit if not html else min(limit, 10), console, wide))
            if html:
                rep = out["report"]
                notes = "".join(f"\n  {k}: {v}" for k, v in rep["notes"].items())
                err_console.print(f"wrote {rep['html']} ({rep['bytes'] / 1e6:.1f} MB, {len(rep['charts'])} charts)"
                                  + (f"; not drawn:{notes}" if notes else ""), highlight=False)

    if serve:
        def ready(url: str) -> None:
            if json_:
                emit_json({**out, "url": url})
            else:
                err_console.print(f"optuna-dashboard for study {study!r} at {url} (Ctrl-C stops)", highlight=False)

        serve_mod.serve(study, storage, port, on_ready=ready)


command.__doc__ = HELP
