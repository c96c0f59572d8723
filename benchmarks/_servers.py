"""Throwaway loopback servers for the benchmarks and the fault-injection runner.

The same servers as ``tests/servers/`` (which hold the pytest session fixtures), in a
module that does not import pytest, plus what ``benchmarks/chaos.py`` needs on top:

* ``RedisServer``: ``redis-server`` on a loopback port, no persistence
  (``--save '' --appendonly no``), its own directory; ``restart()`` kills it and
  starts it again on the same port with every key gone.
* ``start_cluster(root, announce=...)``: three ``--cluster-enabled`` masters joined
  with ``redis-cli --cluster create``; ``announce`` maps each node to the port it
  announces to clients (``cluster-announce-port``), so clients that follow
  ``CLUSTER SLOTS`` reach the nodes through proxies placed in front of them. A node's
  ``restart()`` keeps ``nodes.conf`` (its slots) and loses its keys.
* ``PgServer`` / ``start_postgres()``: ``initdb`` into a temporary directory and
  ``postgres`` on a loopback port (run as the ``postgres`` OS user when we are root);
  ``restart("immediate")`` is a crash of the server process.

Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "PgServer",
    "RedisCluster",
    "RedisServer",
    "find_pg_bin",
    "find_redis",
    "free_port",
    "start_cluster",
    "start_postgres",
    "start_redis",
]

HOST = "127.0.0.1"


# ---- ports ---------------------------------------------------------------------------


def port_free(port: int, reuse: bool = False) -> bool:
    """Whether ``port`` can be bound; ``reuse`` as servers do (SO_REUSEADDR: sockets
    of closed connections lingering in TIME_WAIT do not count)."""
    with socket.socket() as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port; with ``cluster_bus`` also port + 10000 (the cluster bus)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port: int = s.getsockname()[1]
        if not cluster_bus:
            return port
        if port + 10000 < 65536 and port_free(port + 10000):
            return port
    raise RuntimeError("no free loopback port (pair) found")


def _wait(what: str, ready: Callable[[], bool], timeout: float, died: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        why = died()
        if why:
            raise RuntimeError(f"{what} exited:\n{why}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout:g}s")
        time.sleep(0.02)


# ---- Redis ---------------------------------------------------------------------------


def find_redis() -> tuple[str, str]:
    """Paths of redis-server and redis-cli, or a clear failure."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        raise RuntimeError(
            "redis-server and redis-cli were not found on PATH; install them "
            "(apt-get install redis-server)"
        )
    return server, cli


class RedisServer:
    """One redis-server process without persistence."""

    def __init__(self, root: Path, port: int, extra: tuple[str, ...] = ()) -> None:
        self.root = root
        self.port = port
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self) -> None:
        server, _ = find_redis()
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = [
            server,
            "--port", str(self.port),
            "--bind", HOST,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.root),
            "--logfile", str(self.log),
            "--daemonize", "no",
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait(f"redis-server on port {self.port}", self._pong, 10.0, self._died)

    def _pong(self) -> bool:
        try:
            with socket.create_connection((HOST, self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def _died(self) -> str:
        if self.proc is not None and self.proc.poll() is not None:
            return self.log.read_text() if self.log.exists() else "(no log)"
        return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.kill()  # no persistence: nothing to flush, and nothing survives
        proc.wait(timeout=10)

    def restart(self) -> None:
        """Kill the server and start it again on the same port: every key is lost."""
        self.stop()
        for _ in range(250):
            if port_free(self.port, reuse=True):
                break
            time.sleep(0.02)
        self.start()


def start_redis(root: Path, port: int | None = None) -> RedisServer:
    server = RedisServer(root, port or free_port())
    server.start()
    return server


class RedisCluster:
    """Three masters, no replicas, every slot assigned."""

    def __init__(self, nodes: list[RedisServer], announced: list[int]) -> None:
        self.nodes = nodes
        self.announced = announced

    @property
    def url(self) -> str:
        """The cluster as clients see it (the announced ports)."""
        return "redis+cluster://" + ",".join(f"{HOST}:{p}" for p in self.announced)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def _cluster_ok(port: int, masters: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1) as s:
            s.sendall(b"CLUSTER INFO\r\n")
            data = b""
            while b"cluster_stats_messages" not in data and len(data) < 8192:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return False
    text = data.decode(errors="replace")
    return "cluster_state:ok" in text and f"cluster_known_nodes:{masters}" in text


def start_cluster(
    root: Path, masters: int = 3, announce: Callable[[int], int] | None = None
) -> RedisCluster:
    """Start ``masters`` cluster nodes and join them. ``announce(node_port)`` returns
    the port the node tells clients to use (a proxy in front of it), or None: the
    node's own port. The announced ports must already accept connections."""
    _, cli = find_redis()
    nodes: list[RedisServer] = []
    announced: list[int] = []
    try:
        for i in range(masters):
            port = free_port(cluster_bus=True)
            extra = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "2000",
            ]  # fmt: skip
            shown = announce(port) if announce is not None else port
            if shown != port:
                extra += [
                    "--cluster-announce-ip", HOST,
                    "--cluster-announce-port", str(shown),
                    "--cluster-announce-bus-port", str(port + 10000),
                ]  # fmt: skip
            node = RedisServer(root / f"node{i}", port, tuple(extra))
            node.start()
            nodes.append(node)
            announced.append(shown)
        addrs = [f"{HOST}:{n.port}" for n in nodes]
        proc = subprocess.run(
            [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{proc.stdout}\n{proc.stderr}")
        _wait(
            "the Redis Cluster",
            lambda: all(_cluster_ok(n.port, masters) for n in nodes),
            30.0,
            lambda: "",
        )
    except BaseException:
        for n in nodes:
            n.stop()
        raise
    return RedisCluster(nodes, announced)


# ---- PostgreSQL ------------------------------------------------------------------------

DATABASE = "idemlock_test"
OS_USER = "postgres"
#: the data is thrown away; fsync off survives a crash of the server process (the
#: machine's page cache keeps the writes), not of the machine.
FAST = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",
    "shared_buffers": "64MB",
}


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
        "in /usr/lib/postgresql/*/bin; install the server package (apt-get install postgresql)"
    )


class PgServer:
    """One throwaway cluster; ``dsn`` points at a database made for the caller."""

    def __init__(
        self, root: Path, port: int, bindir: Path, settings: dict[str, str] | None = None
    ) -> None:
        self.root = root
        self.settings = {**FAST, **(settings or {})}
        self.data = root / "data"
        self.port = port
        self.bindir = bindir
        self.log = root / "server.log"

    def dsn_at(self, port: int | None = None, database: str = DATABASE) -> str:
        """The DSN of ``database`` on this server, or on ``port`` (a proxy in front)."""
        return f"postgresql://{OS_USER}@{HOST}:{port or self.port}/{database}"

    @property
    def dsn(self) -> str:
        return self.dsn_at()

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

    def start(self) -> None:
        opts = f"-c listen_addresses={HOST} -p {self.port} -c unix_socket_directories={self.root}"
        opts += "".join(f" -c {name}={value}" for name, value in self.settings.items())
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``mode``: smart, fast or immediate, as pg_ctl)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self, mode: str = "fast") -> None:
        """Stop and start again on the same port and data (``immediate``: a crash)."""
        self.stop(mode)
        self.start()

    def create_database(self, name: str = DATABASE) -> None:
        import psycopg

        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(self.dsn_at(database="postgres"), autocommit=True) as conn:
                    conn.execute(f"CREATE DATABASE {name}")
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
    """initdb + start + create the database; the caller must ``destroy()`` it.
    ``settings`` override server settings (``{"synchronous_commit": "on"}`` when the
    server will be crashed and every acknowledged commit must come back)."""
    bindir = find_pg_bin()
    root = Path(tempfile.mkdtemp(prefix="idemlock-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, OS_USER)
    server = PgServer(root, free_port(), bindir, settings)
    try:
        server.initdb()
        server.start()
        server.create_database()
    except BaseException:
        server.destroy()
        raise
    return server
