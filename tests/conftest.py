"""Shared test setup: run from a temp dir so no test writes into the checkout's results/."""

import os

import pytest


def pytest_report_header(config):
    """The CPU's vector capability and whether it has native bf16 (what the CPU profiles measure and
    local trials train in): the suite must pass either way, and CI runs it with native bf16 hidden
    (ONEDNN_MAX_CPU_ISA=AVX2 in .ci/run), so a log says which machine it was."""
    import torch

    from profilers.dtypes import trial_dtype

    return (f"cpu: {torch.backends.cpu.get_cpu_capability()}, native bf16: "
            f"{'yes' if trial_dtype('cpu') == 'bf16' else 'no'} (local trials train in {trial_dtype('cpu')})")


def pytest_configure(config):
    """torch runs on one thread in the test process, as each rank of a local trial does (the launcher
    gives a rank cores // world threads: one for every parity world here). The single-process
    references, the layer and kernel tests and the cost model's CPU checks make the same checks, and
    the tiny operators they run no longer pay OpenMP's fork and join on each call: on this 2-core
    machine under load a reference run of tests/distributed/test_runtime_enumeration.py took 10x the
    CPU on two threads (1.2 s against 0.12 s), nine runtime unit-test files 26 against 18 CPU s. The processes the
    suite starts (trials, profiles, ``python -m autotune``) keep the product's own thread choice: this
    sets no environment variable. A test that needs another count sets it and puts it back
    (tests/unit/test_cost_cpu_context.py)."""
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    import torch  # a dependency of the project: a broken torch fails the suite, it does not skip

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def pytest_runtest_teardown(item, nextitem):
    """The parity tests' kept workers (helpers.pool) go when no test of tests/distributed follows: the
    rest of the suite need not share the machine with idle ranks."""
    import sys

    pool = sys.modules.get("helpers.pool")
    if pool is not None and (nextitem is None or nextitem.path.parent.name != "distributed"):
        pool.close_all()


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run the test with the working directory in a fresh temp dir (results/ lands there)."""
    monkeypatch.chdir(tmp_path)
    os.makedirs("results", exist_ok=True)
    return tmp_path


# ---- a throw-away PostgreSQL server -------------------------------------------------------------
REQUIRE_POSTGRES = "AUTOTUNE_REQUIRE_POSTGRES"
"""Set to 1 (CI does) to make a server that cannot be started a failure instead of a skip."""


def _pg_bindir():
    """Debian's server binaries (/usr/lib/postgresql/<major>/bin, newest first), else initdb on PATH."""
    import glob
    import shutil

    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(p.split("/")[-3]) if p.split("/")[-3].isdigit() else 0)
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


class _PostgresServer:
    """initdb + pg_ctl in a temporary folder, on a free TCP port of 127.0.0.1, its unix socket in the
    same folder. initdb refuses to run as root, so as root the server runs as the ``postgres`` user
    that Debian's package creates (through runuser)."""

    def __init__(self):
        import socket
        import subprocess
        import tempfile

        self.bindir = _pg_bindir()
        if self.bindir is None:
            raise RuntimeError("no PostgreSQL server binaries (initdb) found; install Debian's postgresql package")
        try:
            import psycopg  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(f"the psycopg driver is not installed ({exc}); pip install 'psycopg[binary]'") from None
        self.as_user = None
        if os.geteuid() == 0:
            import pwd

            try:
                pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root and there is no 'postgres' user to run the server as") from None
            self.as_user = "postgres"
        self.dir = tempfile.mkdtemp(prefix="autotune-pg-")
        if self.as_user:
            import shutil

            shutil.chown(self.dir, user=self.as_user)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.data = os.path.join(self.dir, "data")
        self._run("initdb", "-D", self.data, "-A", "trust", "-U", "autotune", "--no-sync", "-E", "UTF8")
        # fsync off: a throw-away cluster need not survive a power cut
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -F -c max_connections=200"
        self._run("pg_ctl", "-D", self.data, "-o", opts, "-l", os.path.join(self.dir, "server.log"), "-w",
                  "-t", "60", "start")
        self.subprocess = subprocess

    def _run(self, tool, *args):
        import subprocess

        cmd = [os.path.join(self.bindir, tool), *args]
        if self.as_user:
            cmd = ["runuser", "-u", self.as_user, "--", *cmd]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            log = os.path.join(self.dir, "server.log")
            tail = open(log).read()[-500:] if os.path.exists(log) else ""
            raise RuntimeError(f"{tool} failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-500:]} {tail}")

    def url(self, database="postgres"):
        return f"postgresql+psycopg://autotune@127.0.0.1:{self.port}/{database}"

    def create_database(self, name):
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user="autotune", dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self):
        import shutil

        try:
            self._run("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server():
    """One server for the session; the tests skip with the reason where none can be started (and
    fail instead when AUTOTUNE_REQUIRE_POSTGRES=1, as in CI)."""
    try:
        server = _PostgresServer()
    except (RuntimeError, OSError) as exc:
        reason = f"no PostgreSQL server could be started: {exc}"
        if os.environ.get(REQUIRE_POSTGRES) == "1":
            pytest.fail(f"{reason} ({REQUIRE_POSTGRES}=1)")
        pytest.skip(reason)
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server, request):
    """A fresh database of the session's server for this test."""
    import re

    name = "t_" + re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[:40] + f"_{os.getpid()}"
    return postgres_server.create_database(name)
