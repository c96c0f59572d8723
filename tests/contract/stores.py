"""The stores the contract suite runs against: one line per store in STORES.

A factory takes pytest's ``request`` and ``tmp_path`` and returns a Harness. Stores
with a server get it from a session fixture in ``tests/servers/`` (throwaway
servers on free loopback ports, never skipped).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import idemlock
import idemlock.aio
from idemlock import ManualClock
from idemlock.stores.memory import MemoryAsyncStore

from .harness import Harness


def memory(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    clock = ManualClock()

    def open_sync(prefix: str, **options: Any) -> idemlock.Coordinator:
        return idemlock.connect("memory://", key_prefix=prefix, clock=clock, **options)

    def open_async(prefix: str, **options: Any) -> idemlock.aio.AsyncCoordinator:
        return idemlock.aio.connect("memory://", key_prefix=prefix, clock=clock, **options)

    # One in-process store shared by the sync and async faces of a test.
    store = idemlock.connect("memory://", clock=clock).store

    # Options of the coordinator share the store; options of the store make a new one.
    coordinator_options = {"keyring", "tenant", "max_result_bytes", "compress_over"}

    def shared_sync(prefix: str, **options: Any) -> idemlock.Coordinator:
        if set(options) - coordinator_options:
            return open_sync(prefix, **options)
        return idemlock.Coordinator(
            store, key_prefix=prefix, clock=clock, url="memory://", **options
        )

    def shared_async(prefix: str, **options: Any) -> idemlock.aio.AsyncCoordinator:
        if set(options) - coordinator_options:
            return open_async(prefix, **options)
        # The asyncio face idemlock.aio.connect("memory://") opens, over the shared store.
        return idemlock.aio.AsyncCoordinator(
            MemoryAsyncStore(store), key_prefix=prefix, clock=clock, url="memory://", **options
        )

    return Harness("memory", None, shared_sync, shared_async, clock=clock)


def by_url(name: str, url: str) -> Harness:
    """A harness for a store that other processes can open by URL."""

    def open_sync(prefix: str, **options: Any) -> idemlock.Coordinator:
        return idemlock.connect(url, key_prefix=prefix, **options)

    def open_async(prefix: str, **options: Any) -> idemlock.aio.AsyncCoordinator:
        return idemlock.aio.connect(url, key_prefix=prefix, **options)

    return Harness(name, url, open_sync, open_async)


def sqlite(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    return by_url("sqlite", f"sqlite:///{tmp_path / 'idemlock.db'}")


# Stores with a server use the session's throwaway server (tests/servers/); the
# harness's fresh key prefix keeps tests apart on it.


def postgres(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    return by_url("postgres", request.getfixturevalue("postgres_dsn"))


def postgres_pgbouncer(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    # The plain URL of PgBouncer in transaction mode (tests/servers/pgbouncer.py): no
    # listen_url, so waiters are pulsed (the store warns once); see test_pg_pooler.py.
    return by_url("postgres-pgbouncer", request.getfixturevalue("pgbouncer_server").dsn)


def redis(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    return by_url("redis", request.getfixturevalue("redis_server").url)


def redis_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    return by_url("redis_cluster", request.getfixturevalue("redis_cluster").url)


def etcd(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    from ..servers.etcd import etcd_harness

    return etcd_harness("etcd", request.getfixturevalue("etcd_server").url)


def etcd_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    from ..servers.etcd import etcd_harness

    return etcd_harness("etcd_cluster", request.getfixturevalue("etcd_cluster").url)


#: stores that live inside one process (no cross-process race tests)
IN_PROCESS_ONLY = {"memory"}

#: name -> harness factory. A new store is one more line here.
STORES: dict[str, Callable[[pytest.FixtureRequest, Path], Harness]] = {
    "memory": memory,
    "sqlite": sqlite,
    "postgres": postgres,
    "postgres-pgbouncer": postgres_pgbouncer,
    "redis": redis,
    "redis_cluster": redis_cluster,
    "etcd": etcd,
    "etcd_cluster": etcd_cluster,
}
