"""optuna-dashboard over the study's storage, on 127.0.0.1 only (the dashboard can edit and delete
studies and has no authentication, so it is never exposed beyond this machine by default)."""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from typing import Any

from autotune.dashboard.data import open_study, optuna_storage
from autotune.errors import InputError

HOST = "127.0.0.1"


def check_port(port: int, host: str = HOST) -> None:
    """InputError when ``port`` cannot be bound. SO_REUSEADDR as wsgiref's server sets it, so a port
    left in TIME_WAIT counts as free and only one somebody listens on counts as in use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise _port_error(port, host, exc) from None


def _port_error(port: int, host: str, exc: OSError) -> InputError:
    if exc.errno == errno.EADDRINUSE:
        return InputError(f"port {port} on {host} is already in use; pass another with --port", field="--port")
    if exc.errno == errno.EACCES:
        return InputError(f"no permission to listen on port {port} on {host}; use a port above 1023",
                          field="--port")
    return InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}", field="--port")


def study_url(name: str, storage_url: str, port: int, host: str = HOST) -> str:
    storage = optuna_storage(storage_url)
    return f"http://{host}:{port}/dashboard/studies/{storage.get_study_id_from_name(name)}"


def serve(name: str, storage_url: str, port: int, *, host: str = HOST,
          on_ready: Callable[[str], Any] | None = None, run_server: Callable[..., Any] | None = None) -> None:
    """Check the study and the port, then block serving optuna-dashboard until Ctrl-C."""
    open_study(name, storage_url)  # a missing study is an input error listing those that exist
    check_port(port, host)
    url = study_url(name, storage_url, port, host)
    if run_server is None:
        from optuna_dashboard import run_server
    if on_ready is not None:
        on_ready(url)
    try:
        run_server(optuna_storage(storage_url), host=host, port=port)
    except OSError as exc:  # lost a race for the port between the check and the bind
        raise _port_error(port, host, exc) from None
    except KeyboardInterrupt:  # the normal way to stop the server
        pass
