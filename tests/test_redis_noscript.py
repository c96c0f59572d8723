"""NOSCRIPT however often Redis's script cache is emptied (issue 21, item 5).

A NOSCRIPT reply means the call did not run: every path that sends EVALSHA runs it
again as EVAL (with the script's text), so a call succeeds within its bound even when
the cache is emptied again and again (a flapping failover: SCRIPT FLUSH after SCRIPT
FLUSH, connections killed). Before, the calls that met NOSCRIPT shared one SCRIPT LOAD
and retried once; a second flush before their EVALSHA failed them together with
StoreUnavailable(NOSCRIPT).

Each test runs a burst of calls while another connection flushes the cache in a loop
(and, once, kills every client connection), on every path: the asyncio store's
pipelined connection and its limited pool's client, the blocking store's own
connections and redis-py's client, a Cluster, and the batched renewal. Waits are
bounded generously; nothing is timed.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio

from idemlock._core.port import Acquired
from idemlock.stores.redis import from_client, open_async, open_sync

from .servers.redis import RedisCluster, RedisServer, start_redis

LONG = 60_000
BURST = 600


def _ns() -> str:
    return "ns" + uuid.uuid4().hex[:10]


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    # A server of its own: the test kills every client connection on it.
    server = start_redis(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()


class Flusher:
    """Another client emptying the script cache of ``ports`` in a loop until stopped;
    :meth:`kill` kills every other client connection of theirs."""

    def __init__(self, ports: list[int]) -> None:
        self._clients = [redis.Redis(port=p) for p in ports]
        self._stop = threading.Event()
        self.flushes = 0
        self.killed = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for c in self._clients:
                try:
                    c.script_flush()
                except redis.ConnectionError:
                    continue  # killed by kill() too (redis-py < 6 does not retry it)
                self.flushes += 1

    def kill(self) -> None:
        with redis.Redis(port=self._clients[0].connection_pool.connection_kwargs["port"]) as c:
            c.script_flush()
            self.killed += int(c.execute_command("CLIENT KILL TYPE normal SKIPME yes"))

    def __enter__(self) -> Flusher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for c in self._clients:
            c.close()


async def _async_burst(store: Any, ns: str, flusher: Flusher, kill: bool, rounds: int = 5) -> None:
    """``rounds`` bursts of BURST calls at once (reads and re-acquires, both safe to
    run again), each answered with its own reply; ``kill``: the connections killed
    while the first burst is on its way."""
    owner = "o"
    for n in range(rounds):
        calls = [store.fence_current(ns, f"r{i}") for i in range(BURST // 2)]
        calls += [store.acquire(ns, f"k{i}", owner, LONG) for i in range(BURST // 2)]
        tasks = [asyncio.ensure_future(c) for c in calls]
        if kill and n == 0:
            await asyncio.sleep(0)  # written
            await asyncio.to_thread(flusher.kill)
        got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
        failed = [g for g in got if isinstance(g, BaseException)]
        assert not failed, f"{len(failed)} of {len(got)} calls failed, first: {failed[0]!r}"
        assert got[: BURST // 2] == [1000 + i for i in range(BURST // 2)]
        assert all(isinstance(g, Acquired) for g in got[BURST // 2 :])


async def _async_setup(store: Any, ns: str) -> None:
    for i in range(BURST // 2):
        assert await store.fence_advance(ns, f"r{i}", 1000 + i) == (True, 1000 + i)


# A killed connection of a client the user built is retried by its own retry policy:
# the kill is for the clients idemlock builds (retried as its default policy says).
@pytest.mark.parametrize(
    ("client", "kill"), [("pipelined", False), ("pipelined", True), ("limited-pool", False)]
)
async def test_an_asyncio_burst_survives_the_cache_emptied_again_and_again(
    own_server: RedisServer, kill: bool, client: str
) -> None:
    if client == "pipelined":
        store: Any = open_async(own_server.url)[0]
    else:  # redis-py's client (execute_command), not the pipelined connection
        pool = redis.asyncio.BlockingConnectionPool.from_url(own_server.url, max_connections=20)
        store = from_client(redis.asyncio.Redis(connection_pool=pool), asynchronous=True)[0]
    ns = _ns()
    try:
        await _async_setup(store, ns)
        with Flusher([own_server.port]) as flusher:
            await _async_burst(store, ns, flusher, kill)
        assert flusher.flushes > 1 and flusher.killed >= int(kill)
    finally:
        await store.aclose()


def _sync_burst(call: Callable[[int], Any], n: int = 2000) -> None:
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(_settled(call), range(n)))
    failed = [g for g in got if isinstance(g, BaseException)]
    assert not failed, f"{len(failed)} of {len(got)} calls failed, first: {failed[0]!r}"


def _settled(call: Callable[[int], Any]) -> Callable[[int], Any]:
    def run(i: int) -> Any:
        try:
            return call(i)
        except Exception as exc:
            return exc

    return run


# A killed connection of a client the user built is retried by its own retry policy:
# the kill is for the clients idemlock builds (retried as its default policy says).
@pytest.mark.parametrize(
    ("client", "kill"), [("direct", False), ("direct", True), ("limited-pool", False)]
)
def test_blocking_calls_survive_the_cache_emptied_again_and_again(
    own_server: RedisServer, kill: bool, client: str
) -> None:
    if client == "direct":  # the store's own connections
        store: Any = open_sync(own_server.url)[0]
    else:  # redis-py's execute_command
        pool = redis.BlockingConnectionPool.from_url(own_server.url, max_connections=20)
        store = from_client(redis.Redis(connection_pool=pool), asynchronous=False)[0]
    ns = _ns()
    try:
        for i in range(100):
            assert store.fence_advance(ns, f"r{i}", 1000 + i) == (True, 1000 + i)

        def call(i: int) -> None:
            if i % 2:
                assert store.fence_current(ns, f"r{i % 100}") == 1000 + i % 100
            else:
                assert isinstance(store.acquire(ns, f"k{i % 100}", "o", LONG), Acquired)

        with Flusher([own_server.port]) as flusher:
            if kill:
                killer = threading.Timer(0.0, flusher.kill)
                killer.start()
            _sync_burst(call)
            if kill:
                killer.join(timeout=30)
        assert flusher.flushes > 1 and flusher.killed >= int(kill)
    finally:
        store.close()


def test_renewals_survive_the_cache_emptied_again_and_again(own_server: RedisServer) -> None:
    store = open_sync(own_server.url)[0]
    ns = _ns()
    try:
        leases = [store.acquire(ns, f"k{i}", "o", LONG) for i in range(50)]
        items = [
            ("lock", ns, f"k{i}", "o", lease.token, LONG)  # type: ignore[union-attr]
            for i, lease in enumerate(leases)
        ]
        with Flusher([own_server.port]):
            for _ in range(200):
                assert all(r is not None and r > 0 for r in store.renew_many(items))
    finally:
        store.close()


async def test_asyncio_renewals_survive_the_cache_emptied_again_and_again(
    own_server: RedisServer,
) -> None:
    store = open_async(own_server.url)[0]
    ns = _ns()
    try:
        leases = [await store.acquire(ns, f"k{i}", "o", LONG) for i in range(50)]
        items = [
            ("lock", ns, f"k{i}", "o", lease.token, LONG)  # type: ignore[union-attr]
            for i, lease in enumerate(leases)
        ]
        with Flusher([own_server.port]):
            for _ in range(200):
                got = await store.renew_many(items)
                assert all(r is not None and r > 0 for r in got)
    finally:
        await store.aclose()


def test_cluster_calls_survive_the_cache_emptied_again_and_again(
    redis_cluster: RedisCluster,
) -> None:
    store = open_sync(redis_cluster.url)[0]
    ns = _ns()
    try:
        for i in range(100):
            assert store.fence_advance(ns, f"r{i}", 1000 + i) == (True, 1000 + i)

        def call(i: int) -> None:
            assert store.fence_current(ns, f"r{i % 100}") == 1000 + i % 100

        with Flusher(redis_cluster.ports) as flusher:
            _sync_burst(call, 1000)
        assert flusher.flushes > 1
    finally:
        store.close()


async def test_asyncio_cluster_calls_survive_the_cache_emptied_again_and_again(
    redis_cluster: RedisCluster,
) -> None:
    store = open_async(redis_cluster.url)[0]
    ns = _ns()
    try:
        for i in range(100):
            assert await store.fence_advance(ns, f"r{i}", 1000 + i) == (True, 1000 + i)
        with Flusher(redis_cluster.ports) as flusher:
            for _ in range(3):
                calls = [store.fence_current(ns, f"r{i}") for i in range(100)]
                got = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 120)
                assert got == [1000 + i for i in range(100)]
        assert flusher.flushes > 1
    finally:
        await store.aclose()
