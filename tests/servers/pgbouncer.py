"""A throwaway PgBouncer in front of a test PostgreSQL server.

``start_pgbouncer(server)`` runs Debian's ``pgbouncer`` (``/usr/sbin/pgbouncer``, or
one on PATH) in the foreground on a free loopback port, in ``pool_mode =
transaction`` and otherwise PgBouncer's default settings (but ``max_client_conn``,
raised for the suite's many stores), forwarding every database
to ``server``. Authentication is what the test server needs: ``trust`` (the test
cluster trusts loopback), with the server's user in PgBouncer's ``auth_file``. As
root, PgBouncer runs as the ``postgres`` OS user (it refuses to run as root): set by
``tests/servers/_proc.popen`` before the exec, so the death signal survives.

``pgbouncer_server`` is the session fixture in front of the shared
``postgres_server``; ``fault_pgbouncer_server`` is the one in front of the fault
contract's own server. Each is killed when its fixture ends, whatever happens:
started through ``_proc.popen``, it dies with the process that started it (also a
SIGKILLed one), and its directory lives under that process's run root.
A missing binary fails loudly: these tests never skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ._proc import mkdtemp, popen
from .faults import ProxiedFaults
from .postgres import DATABASE, OS_USER, PgServer
from .proxy import TcpProxy

__all__ = [
    "PgBouncer",
    "fault_pgbouncer_server",
    "find_pgbouncer",
    "pgbouncer_faults",
    "pgbouncer_server",
    "start_pgbouncer",
]


def find_pgbouncer() -> str:
    found = shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None
    )
    if found is None:
        raise RuntimeError(
            "pgbouncer was not found on PATH nor at /usr/sbin/pgbouncer; the PostgreSQL "
            "behind-a-pooler tests need it: apt-get install pgbouncer - these tests never skip"
        )
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PgBouncer:
    """One PgBouncer process; ``dsn`` is the test database through it."""

    def __init__(
        self, root: Path, port: int, server: PgServer, settings: dict[str, str] | None = None
    ) -> None:
        self.settings = settings or {}
        self.root = root
        self.port = port
        self.server = server
        self.log = root / "pgbouncer.log"
        self.dsn = server.dsn_at(port, DATABASE)
        self.proc: subprocess.Popen[bytes] | None = None

    def write_config(self) -> Path:
        (self.root / "users.txt").write_text(f'"{OS_USER}" ""\n')
        ini = self.root / "pgbouncer.ini"
        ini.write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={self.server.port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.root / 'users.txt'}\n"
            "pool_mode = transaction\n"
            # The one change of capacity: the suite's many short-lived stores hold more
            # than the default 100 client connections at once (PgBouncer then stops
            # accepting, and connecting times out). Nothing about the semantics changes.
            "max_client_conn = 500\n"
            f"logfile = {self.log}\n"
            + "".join(f"{name} = {value}\n" for name, value in self.settings.items())
        )
        if os.geteuid() == 0:
            for p in (self.root, self.root / "users.txt", ini):
                shutil.chown(p, OS_USER)
        return ini

    def start(self) -> None:
        ini = self.write_config()
        cmd = [find_pgbouncer(), str(ini)]
        user: dict[str, Any] = {}
        if os.geteuid() == 0:
            # PgBouncer refuses to run as root (setuid before the exec: the death
            # signal, set after it, survives)
            user = {"user": OS_USER, "group": OS_USER, "extra_groups": []}
        # Its output to a file, never a pipe nobody reads: PgBouncer logs every
        # connection to stderr too, and blocks once a pipe's buffer is full.
        with open(self.root / "stderr.txt", "wb") as err:
            self.proc = popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, **user
            )
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                out = (self.root / "stderr.txt").read_text(errors="replace")
                log = self.log.read_text() if self.log.exists() else ""
                raise RuntimeError(f"pgbouncer exited ({self.proc.returncode}):\n{out}\n{log}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1),
            ):
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pgbouncer did not listen on port {self.port} within 30s")
            time.sleep(0.05)

    def wait_served(self, within: float = 30.0) -> None:
        """Wait until a query through PgBouncer is answered (after the server behind it
        came back, PgBouncer refuses clients until its next login attempt succeeds)."""
        import psycopg

        deadline = time.monotonic() + within
        while True:
            try:
                with psycopg.connect(self.dsn, connect_timeout=2, autocommit=True) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.Error:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def start_pgbouncer(server: PgServer, settings: dict[str, str] | None = None) -> PgBouncer:
    """A PgBouncer in front of ``server``; the caller must ``destroy()`` it. ``settings``
    are added to its configuration."""
    root = mkdtemp("idemlock-pgbouncer-")
    bouncer = PgBouncer(root, _free_port(), server, settings)
    try:
        bouncer.start()
    except BaseException:
        bouncer.destroy()
        raise
    return bouncer


def pgbouncer_faults(bouncer: PgBouncer) -> tuple[str, ProxiedFaults]:
    """The fault contract's URL through a fresh proxy in front of ``bouncer``, and its
    faults: stall = blackhole that proxy; outage/restart = stop/start the server behind."""
    proxy = TcpProxy(bouncer.port)
    server = bouncer.server

    def start() -> None:
        server.start()
        bouncer.wait_served()  # the store is back once its pooler serves again

    return server.dsn_at(proxy.port), ProxiedFaults(proxy, lambda: server.stop("fast"), start)


@pytest.fixture(scope="session")
def pgbouncer_server(postgres_server: PgServer) -> Iterator[PgBouncer]:
    """PgBouncer (transaction pooling) in front of the session's PostgreSQL."""
    bouncer = start_pgbouncer(postgres_server)
    try:
        yield bouncer
    finally:
        bouncer.destroy()


@pytest.fixture(scope="session")
def fault_pgbouncer_server(fault_postgres_server: PgServer) -> Iterator[PgBouncer]:
    """PgBouncer in front of the fault contract's PostgreSQL (which tests stop and
    start: PgBouncer stays up and reconnects to it). One setting differs from
    PgBouncer's defaults: ``server_login_retry`` (15 s), how long PgBouncer refuses
    clients after a failed server login, so that a restart costs a test 1 s, not 15."""
    bouncer = start_pgbouncer(fault_postgres_server, {"server_login_retry": "1"})
    try:
        yield bouncer
    finally:
        bouncer.destroy()
