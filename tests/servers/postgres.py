"""A throwaway PostgreSQL server for tests and benchmarks.

``start_postgres()`` runs ``initdb`` into a temporary directory and starts
``postgres`` on a free loopback port (unix socket in the same directory, fsync off:
the data is thrown away). As root, the server runs as the ``postgres`` OS user,
because PostgreSQL refuses to run as root. Missing binaries fail loudly: a store
test never skips.

The postmaster is started directly (``tests/servers/_proc.popen``), not through
``pg_ctl``, which daemonizes it: a server started by ``pg_ctl`` is nobody's child
and outlived a killed test run. Started directly, it dies with the process that
started it (its backends follow: they watch the postmaster); it is stopped with the
signals ``pg_ctl`` sends (smart = SIGTERM, fast = SIGINT, immediate = SIGQUIT).

``postgres_server`` is the session fixture (register it by importing it from
``tests/conftest.py``); ``postgres_dsn`` yields just the DSN.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ._proc import mkdtemp, popen

__all__ = ["PgServer", "find_pg_bin", "postgres_dsn", "postgres_server", "start_postgres"]

DATABASE = "idemlock_test"
OS_USER = "postgres"
#: server settings for speed: the data is thrown away, so durability is not needed.
#: (fsync=off still survives a crash of the server process, not of the machine.)
FAST = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",
    "shared_buffers": "64MB",
}


#: pg_ctl's shutdown modes and the signal each sends to the postmaster
MODES = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}


def find_pg_bin() -> Path:
    """The directory holding initdb, pg_ctl and postgres (PATH first, then Debian's
    /usr/lib/postgresql/*/bin, newest first)."""
    found = shutil.which("initdb")
    candidates = [Path(found).parent] if found else []
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for d in candidates:
        if all((d / tool).exists() for tool in ("initdb", "pg_ctl", "postgres")):
            return d
    raise RuntimeError(
        "PostgreSQL server binaries (initdb, pg_ctl, postgres) were not found on PATH nor "
        "in /usr/lib/postgresql/*/bin; the PostgreSQL store tests need them: install the "
        "server package (apt-get install postgresql) - these tests never skip"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PgServer:
    """One throwaway cluster. ``dsn`` points at a database made for the tests."""

    def __init__(
        self, root: Path, port: int, bindir: Path, settings: dict[str, str] | None = None
    ) -> None:
        self.root = root
        self.settings = {**FAST, **(settings or {})}
        self.data = root / "data"
        self.port = port
        self.bindir = bindir
        self.log = root / "server.log"
        self.proc: subprocess.Popen[Any] | None = None
        self.dsn = f"postgresql://{OS_USER}@127.0.0.1:{port}/{DATABASE}"
        self.admin_dsn = f"postgresql://{OS_USER}@127.0.0.1:{port}/postgres"

    def dsn_at(self, port: int | None = None, database: str = DATABASE) -> str:
        """The DSN of ``database`` on this server, or through ``port`` (a proxy in front)."""
        return f"postgresql://{OS_USER}@127.0.0.1:{port or self.port}/{database}"

    def _run(self, *args: str) -> None:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if os.geteuid() == 0:
            # PostgreSQL refuses to run as root; run its tools as an unprivileged user.
            cmd = ["runuser", "-u", OS_USER, "--", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}\n{log}"
            )

    def initdb(self) -> None:
        self._run(
            "initdb", "-D", str(self.data), "-U", OS_USER, "--auth=trust", "-E", "UTF8",
            "--no-sync", "--locale=C",
        )  # fmt: skip

    def start(self, timeout: float = 60.0) -> None:
        """Start the postmaster and wait until it accepts connections."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"PostgreSQL on port {self.port} is already running")
        cmd = [
            str(self.bindir / "postgres"), "-D", str(self.data),
            "-c", "listen_addresses=127.0.0.1", "-p", str(self.port),
            "-c", f"unix_socket_directories={self.root}",
        ]  # fmt: skip
        for name, value in self.settings.items():
            cmd += ["-c", f"{name}={value}"]
        user: dict[str, Any] = {}
        if os.geteuid() == 0:
            # PostgreSQL refuses to run as root (setuid before the exec: the death
            # signal, set after it, survives)
            user = {"user": OS_USER, "group": OS_USER, "extra_groups": []}
        pidfile = self.data / "postmaster.pid"
        with contextlib.suppress(FileNotFoundError):
            pidfile.unlink()  # left by a crash: its "ready" must not count
        with open(self.log, "ab") as log:
            self.proc = popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, **user)
        deadline = time.monotonic() + timeout
        while True:
            # pg_ctl -w's test: the postmaster writes "ready" in its pid file's 8th line
            with contextlib.suppress(FileNotFoundError):
                lines = pidfile.read_text().splitlines()
                if len(lines) >= 8 and lines[7].strip() == "ready":
                    return
            if self.proc.poll() is not None:
                self.proc = None
                log_text = self.log.read_text(errors="replace") if self.log.exists() else ""
                raise RuntimeError(f"postgres on port {self.port} exited:\n{log_text[-3000:]}")
            if time.monotonic() > deadline:
                self.stop("immediate")
                raise RuntimeError(f"postgres on port {self.port} was not ready in {timeout} s")
            time.sleep(0.02)

    def stop(self, mode: str = "fast", timeout: float = 60.0) -> None:
        """Stop the server (``mode``: smart, fast or immediate, as pg_ctl) and wait
        until the postmaster exited (SIGKILL if it takes longer than ``timeout``)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"PostgreSQL on port {self.port} is not running")
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, MODES[mode])
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def restart(self, mode: str = "fast") -> None:
        """Stop and start again on the same port and data (``immediate`` = a crash)."""
        self.stop(mode)
        self.start()

    def create_database(self) -> None:
        import psycopg

        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
                    conn.execute(f"CREATE DATABASE {DATABASE}")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def destroy(self) -> None:
        with contextlib.suppress(RuntimeError):  # already stopped
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def start_postgres(settings: dict[str, str] | None = None) -> PgServer:
    """initdb + start + create the test database; the caller must ``destroy()`` it.
    ``settings`` override server settings (e.g. ``{"synchronous_commit": "on"}`` when a
    test crashes the server and needs every acknowledged commit back)."""
    bindir = find_pg_bin()
    root = mkdtemp("idemlock-pg-")
    if os.geteuid() == 0:
        shutil.chown(root, OS_USER)
    server = PgServer(root, _free_port(), bindir, settings)
    try:
        server.initdb()
        for attempt in range(3):
            try:
                server.start()
                break
            except RuntimeError as exc:
                # The free port was taken between the probe and the bind (other test
                # runs on the machine): the same data directory on another port.
                if "could not bind" not in str(exc) or attempt == 2:
                    raise
                server = PgServer(root, _free_port(), bindir, settings)
        server.create_database()
    except BaseException:
        server.destroy()
        raise
    return server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PgServer]:
    """A PostgreSQL server shared by the whole session. Do not stop it in a test; use
    ``start_postgres()`` for a server a test may restart or stop."""
    server = start_postgres()
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture(scope="session")
def postgres_dsn(postgres_server: PgServer) -> str:
    return postgres_server.dsn
