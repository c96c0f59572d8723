"""Throwaway Redis servers for tests and benchmarks.

``start_redis(root)`` runs ``redis-server`` on a free loopback port with no
persistence (``--save '' --appendonly no``) and its own directory;
``RedisServer.restart()`` brings it back on the same port with every key gone (what
a crash of an unpersisted server or a failover to an empty replica looks like).
``start_cluster(root)`` starts three ``--cluster-enabled`` servers, joins them with
``redis-cli --cluster create ... --cluster-replicas 0`` and waits until every node
reports ``cluster_state:ok``.

``redis_server`` and ``redis_cluster`` are session fixtures (registered by importing
them from ``tests/conftest.py``). A missing ``redis-server`` fails loudly: a store
test never skips.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ._proc import popen, tempdir

__all__ = [
    "RedisCluster",
    "RedisServer",
    "find_redis",
    "redis_cluster",
    "redis_server",
    "start_cluster",
    "start_redis",
    "start_unix_redis",
]


def find_redis() -> tuple[str, str]:
    """Paths of redis-server and redis-cli, or a clear failure."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        raise RuntimeError(
            "redis-server and redis-cli were not found on PATH; the Redis store tests "
            "start their own throwaway servers and need them: apt-get install redis-server "
            "(these tests never skip)"
        )
    return server, cli


def _port_free(port: int, reuse: bool = False) -> bool:
    """Whether ``port`` can be bound; ``reuse`` as servers do (SO_REUSEADDR: sockets of
    closed connections lingering in TIME_WAIT do not count)."""
    with socket.socket() as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port; with ``cluster_bus`` also port + 10000 (the bus)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if not cluster_bus:
            return port
        if port + 10000 < 65536 and _port_free(port + 10000):
            return port
    raise RuntimeError("no free loopback port pair for a Redis Cluster node")


class RedisServer:
    """One redis-server process."""

    def __init__(self, root: Path, port: int, extra: tuple[str, ...] = ()) -> None:
        self.root = root
        self.port = port
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        server, _ = find_redis()
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = [
            server,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.root),
            "--logfile", str(self.log),
            "--daemonize", "no",
            *self.extra,
        ]  # fmt: skip
        self.proc = popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ping()

    def _wait_ping(self, timeout: float = 60.0) -> None:
        import redis

        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                log = self.log.read_text() if self.log.exists() else ""
                raise RuntimeError(f"redis-server on port {self.port} exited:\n{log}")
            try:
                with redis.Redis(port=self.port, socket_timeout=1) as r:
                    if r.ping():
                        return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
            time.sleep(0.02)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.kill()  # no persistence: nothing to flush
        proc.wait(timeout=10)

    def restart(self) -> None:
        """Kill the server and start it again on the same port: every key is lost."""
        self.stop()
        for _ in range(250):
            if _port_free(self.port, reuse=True):
                break
            time.sleep(0.02)
        self.start()

    def client(self, **options: object) -> object:
        import redis

        return redis.Redis(port=self.port, **options)  # type: ignore[arg-type]


def _port_taken(exc: RuntimeError) -> bool:
    """A start failed because the free port was taken before the server bound it (other
    test runs on the machine start servers too)."""
    return "address already in use" in str(exc).lower()


def start_redis(root: Path) -> RedisServer:
    for attempt in range(3):
        server = RedisServer(root, free_port())
        try:
            server.start()
            return server
        except RuntimeError as exc:
            server.stop()
            if not _port_taken(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def start_unix_redis(root: Path) -> tuple[RedisServer, str]:
    """A server on a free loopback port that also listens on a unix socket in ``root``
    (keep ``root`` short: a socket path has at most 107 bytes); (server, unix:// URL)."""
    sock = root / "r.sock"
    server = RedisServer(root, free_port(), ("--unixsocket", str(sock), "--unixsocketperm", "700"))
    server.start()
    return server, f"unix://{sock}"


class RedisCluster:
    """Three masters, no replicas, every slot assigned. ``announced``: the port each node
    tells clients to use (a proxy in front of it; by default its own)."""

    def __init__(self, nodes: list[RedisServer], announced: list[int] | None = None) -> None:
        self.nodes = nodes
        self.announced = announced or [n.port for n in nodes]

    @property
    def url(self) -> str:
        """The cluster as clients see it (the announced ports)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.announced)

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def start_cluster(
    root: Path,
    masters: int = 3,
    node_timeout_ms: int = 2000,
    announce: Callable[[int], int] | None = None,
) -> RedisCluster:
    """``announce(node_port)`` returns the port the node tells clients to use (a proxy
    in front of it, already accepting connections); by default the node's own."""
    import redis

    _, cli = find_redis()
    nodes = []
    announced = []
    try:
        for i in range(masters):
            port = free_port(cluster_bus=True)
            extra = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms),
            ]  # fmt: skip
            shown = announce(port) if announce is not None else port
            if shown != port:
                extra += [
                    "--cluster-announce-ip", "127.0.0.1",
                    "--cluster-announce-port", str(shown),
                    "--cluster-announce-bus-port", str(port + 10000),
                ]  # fmt: skip
            node = RedisServer(root / f"node{i}", port, tuple(extra))
            node.start()
            nodes.append(node)
            announced.append(shown)
        addrs = [f"127.0.0.1:{n.port}" for n in nodes]
        proc = subprocess.run(
            [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{proc.stdout}\n{proc.stderr}")
        deadline = time.monotonic() + 30
        while True:
            states = []
            for n in nodes:
                with redis.Redis(port=n.port, socket_timeout=1) as r:
                    info = r.execute_command("CLUSTER", "INFO")
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    states.append(
                        "cluster_state:ok" in text and f"cluster_known_nodes:{masters}" in text
                    )
            if all(states):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.05)
    except BaseException:
        for n in nodes:
            n.stop()
        raise
    return RedisCluster(nodes, announced)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A throwaway redis-server for the whole session."""
    with tempdir("idemlock-redis-") as tmp:
        server = start_redis(tmp)
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A throwaway three-master Redis Cluster for the whole session."""
    with tempdir("idemlock-cluster-") as tmp:
        cluster = start_cluster(tmp)
        try:
            yield cluster
        finally:
            with contextlib.suppress(Exception):
                cluster.stop()
