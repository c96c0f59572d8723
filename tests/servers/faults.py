"""Servers that fault tests may stall, stop and restart, and the faults on them.

The session servers of ``redis.py`` and ``postgres.py`` are shared by the whole
suite and must stay up; the fault contract gets servers of its own here
(``fault_redis_server``, ``fault_postgres_server``, ``fault_redis_cluster``: one per
session each, started on first use), and each test puts a fresh :class:`TcpProxy`
in front of a standalone server, so a blackhole or a cut never outlives its test.

A :class:`Faults` object is what a harness exposes to a fault test:

* ``stall()``: a context manager during which the store is *silent*: calls hang, no
  error, no EOF, no reset (what a partition or a paused VM looks like);
* ``outage()``: a context manager during which the store is *down* (server stopped:
  connections refused or reset); the server is back on exit, on the same port;
* ``restart()``: stop and start again now (a crash and recovery).

How each server is made silent:

* Redis and PostgreSQL: the store's URL goes through a :class:`TcpProxy`, and
  ``stall()`` blackholes it: both directions stop, both sides stay open.
* Redis Cluster: a proxy in front of a cluster would have to rewrite the addresses
  in ``MOVED`` replies and ``CLUSTER SLOTS``, so instead ``stall()`` sends SIGSTOP to
  every node (SIGCONT on exit). To a client that is the same silence: the kernel still
  accepts connections and ACKs bytes, nothing answers. The nodes run with a long
  ``cluster-node-timeout`` (60 s) so that a stall of a few seconds never makes them
  mark each other failed (with every node stopped at once they would otherwise come
  back into a ``CLUSTERDOWN`` state for a while).

Restarts: Redis (standalone and every Cluster node) is killed and started again on
the same port without persistence, so its keys are gone (Cluster nodes keep their
``nodes.conf``, so slots survive); PostgreSQL is stopped (fast) and started on the same
data directory, so its data survives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import pytest

from ._proc import tempdir
from .postgres import PgServer, start_postgres
from .proxy import TcpProxy
from .redis import RedisCluster, RedisServer, start_cluster, start_redis

__all__ = [
    "ClusterFaults",
    "Faults",
    "STALL_SAFETY",
    "ProxiedFaults",
    "fault_postgres_server",
    "fault_redis_cluster",
    "fault_redis_server",
    "restart_cluster",
    "wait_cluster_ok",
]

#: cluster-node-timeout of the fault cluster (see the module docstring)
CLUSTER_NODE_TIMEOUT_MS = 60_000
#: a stall ends by itself after this long, even if its block has not ended: a call
#: that blocks the test's own thread or event loop (a hang) then returns late and
#: fails its bound, instead of hanging the test until pytest-timeout
STALL_SAFETY = 15.0


@contextlib.contextmanager
def _safety(heal: Callable[[], None], after: float = STALL_SAFETY) -> Iterator[None]:
    """Run ``heal`` when the block ends or after ``after`` seconds, whichever is first
    (and only once)."""
    once = threading.Lock()
    healed = False

    def do_heal() -> None:
        nonlocal healed
        with once:
            if not healed:
                healed = True
                heal()

    timer = threading.Timer(after, do_heal)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        do_heal()


class Faults(Protocol):
    def stall(self) -> contextlib.AbstractContextManager[None]: ...

    def outage(self) -> contextlib.AbstractContextManager[None]: ...

    def restart(self) -> None: ...

    def close(self) -> None: ...


class ProxiedFaults:
    """A server behind a proxy: stall = blackhole the proxy; outage/restart = stop
    and start the server behind it (the proxy stays, on the same port)."""

    def __init__(self, proxy: TcpProxy, stop: Callable[[], None], start: Callable[[], None]):
        self.proxy = proxy
        self._stop = stop
        self._start = start

    @contextlib.contextmanager
    def stall(self) -> Iterator[None]:
        self.proxy.blackhole()
        with _safety(self.proxy.heal):
            yield

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        self._stop()
        try:
            yield
        finally:
            self._start()

    def restart(self) -> None:
        self._stop()
        self._start()

    def close(self) -> None:
        self.proxy.close()


class ClusterFaults:
    """A Redis Cluster: stall = SIGSTOP every node; outage/restart = kill every node
    and start them again (same ports, same ``nodes.conf``, no data)."""

    def __init__(self, cluster: RedisCluster) -> None:
        self.cluster = cluster

    def _signal(self, sig: signal.Signals) -> None:
        for node in self.cluster.nodes:
            if node.proc is not None and node.proc.poll() is None:
                os.kill(node.proc.pid, sig)

    @contextlib.contextmanager
    def stall(self) -> Iterator[None]:
        self._signal(signal.SIGSTOP)
        with _safety(lambda: self._signal(signal.SIGCONT)):
            yield

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        self._signal(signal.SIGCONT)  # a stopped process cannot be waited for cleanly
        for node in self.cluster.nodes:
            node.stop()
        try:
            yield
        finally:
            restart_cluster(self.cluster, stopped=True)

    def restart(self) -> None:
        restart_cluster(self.cluster)

    def close(self) -> None:
        # Leave the session's cluster running and answering.
        self._signal(signal.SIGCONT)


def wait_cluster_ok(cluster: RedisCluster, timeout: float = 30.0) -> None:
    import redis

    deadline = time.monotonic() + timeout
    masters = len(cluster.nodes)
    while True:
        ok = True
        for node in cluster.nodes:
            try:
                with redis.Redis(port=node.port, socket_timeout=1) as r:
                    text = r.execute_command("CLUSTER", "INFO")
            except redis.RedisError:
                ok = False
                break
            text = text.decode() if isinstance(text, bytes) else str(text)
            if "cluster_state:ok" not in text or f"cluster_known_nodes:{masters}" not in text:
                ok = False
                break
        if ok:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the Redis Cluster did not come back to cluster_state:ok")
        time.sleep(0.05)


def restart_cluster(cluster: RedisCluster, *, stopped: bool = False) -> None:
    """Kill every node (unless ``stopped``) and start them again on their ports."""
    if not stopped:
        for node in cluster.nodes:
            if node.proc is not None and node.proc.poll() is None:
                os.kill(node.proc.pid, signal.SIGCONT)
            node.stop()
    for node in cluster.nodes:
        node.restart()  # waits until the port is free, starts, waits for PING
    wait_cluster_ok(cluster)


def redis_faults(server: RedisServer) -> tuple[str, ProxiedFaults]:
    """A per-test proxy in front of ``server``: (URL through the proxy, faults)."""
    if server.proc is None or server.proc.poll() is not None:
        server.restart()  # an earlier test left it down
    proxy = TcpProxy(server.port)
    return f"redis://127.0.0.1:{proxy.port}/0", ProxiedFaults(proxy, server.stop, server.start)


def postgres_faults(server: PgServer) -> tuple[str, ProxiedFaults]:
    proxy = TcpProxy(server.port)
    dsn = server.dsn.replace(f"127.0.0.1:{server.port}/", f"127.0.0.1:{proxy.port}/")
    assert dsn != server.dsn
    return dsn, ProxiedFaults(proxy, lambda: server.stop("fast"), server.start)


def cluster_faults(cluster: RedisCluster) -> tuple[str, ClusterFaults]:
    if any(n.proc is None or n.proc.poll() is not None for n in cluster.nodes):
        restart_cluster(cluster)  # an earlier test left it down
    return cluster.url, ClusterFaults(cluster)


# ---- session fixtures (registered in tests/conftest.py) -----------------------------


@pytest.fixture(scope="session")
def fault_redis_server() -> Iterator[RedisServer]:
    """A redis-server that fault tests may stop and restart (not the shared one)."""
    with tempdir("idemlock-fault-redis-") as tmp:
        server = start_redis(tmp)
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="session")
def fault_postgres_server() -> Iterator[PgServer]:
    """A PostgreSQL server that fault tests may stop and restart (not the shared one)."""
    server = start_postgres()
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture(scope="session")
def fault_redis_cluster() -> Iterator[RedisCluster]:
    """A three-master Redis Cluster that fault tests may stop, pause and restart."""
    with tempdir("idemlock-fault-cluster-") as tmp:
        cluster = start_cluster(tmp, node_timeout_ms=CLUSTER_NODE_TIMEOUT_MS)
        try:
            yield cluster
        finally:
            with contextlib.suppress(Exception):
                for node in cluster.nodes:
                    if node.proc is not None and node.proc.poll() is None:
                        os.kill(node.proc.pid, signal.SIGCONT)
                cluster.stop()
