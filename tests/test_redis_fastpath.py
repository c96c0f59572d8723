"""The blocking Redis store's direct path: scripts sent pre-encoded over connections
of the store's own (a free list), beside redis-py's command layer.

What it must keep from ``execute_command``: a reply that arrives after a timeout is
never read as the next call's; a forked child never writes to its parent's sockets;
``SCRIPT FLUSH`` is survived; closing closes the connections; a client whose pool
limits its connections (or a single-connection client) keeps redis-py's path.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from typing import Any

import pytest
import redis
import redis.asyncio

from idemlock import StoreUnavailable
from idemlock._core.port import Acquired
from idemlock.stores.redis import AsyncRedisStore, RedisStore, from_client, open_async, open_sync

from .servers._proc import waitpid
from .servers.redis import RedisServer

LONG = 60_000
#: keeps Redis busy 0.8 s (longer than the stores' timeouts below)
BUSY_LUA = (
    "local t0 = redis.call('TIME') local s = tonumber(t0[1]) * 1e6 + t0[2] "
    "repeat local t = redis.call('TIME') until tonumber(t[1]) * 1e6 + t[2] - s > 800000"
)


def _ns() -> str:
    return "fp" + uuid.uuid4().hex[:10]


def _clients(server: RedisServer, name: str) -> int:
    raw: Any = server.client()
    try:
        return sum(1 for c in raw.client_list() if c.get("name") == name)
    finally:
        raw.close()


def _store(server: RedisServer, **options: Any) -> RedisStore:
    store, _ = open_sync(server.url, **options)
    return store


def test_a_reply_after_a_timeout_is_never_read_by_the_next_call(
    redis_server: RedisServer,
) -> None:
    store, ns = _store(redis_server, timeout=0.3), _ns()
    blocker: Any = redis_server.client()
    # A script that keeps Redis busy past the store's timeout: the acquire queued
    # behind it is answered late, on the connection that timed out.
    busy = threading.Thread(target=blocker.eval, args=(BUSY_LUA, 0))
    try:
        assert isinstance(store.acquire(ns, "warm", "w", LONG), Acquired)
        busy.start()
        threading.Event().wait(0.1)
        with pytest.raises(StoreUnavailable, match="timeout"):
            store.acquire(ns, "late", "first", LONG)
        busy.join(timeout=60)
        assert not busy.is_alive(), "still running after 60 s"
        # The late reply (to "late") must not stand for this call's.
        for key in ("a", "b", "c"):
            got = store.acquire(ns, key, "second", LONG)
            assert isinstance(got, Acquired)
            row = store.lock(ns, key)
            assert row is not None and row.owner == "second" and row.token == got.token
        late = store.lock(ns, "late")
        assert late is not None and late.owner == "first"  # it was applied, late
    finally:
        busy.join(timeout=60)
        assert not busy.is_alive(), "still running after 60 s"
        blocker.close()
        store.close()


def test_script_flush_between_calls_on_the_same_connection(redis_server: RedisServer) -> None:
    store, ns = _store(redis_server), _ns()
    raw: Any = redis_server.client()
    try:
        for i in range(3):
            raw.script_flush()
            got = store.acquire(ns, f"k{i}", "o", LONG)
            assert isinstance(got, Acquired)
            assert store.release(ns, f"k{i}", "o", got.token)
    finally:
        raw.close()
        store.close()


def test_forked_child_uses_connections_of_its_own(redis_server: RedisServer) -> None:
    """Parent and child run calls at the same time right after the fork; had the child
    kept the parent's pooled socket, replies would cross between them."""
    store, ns = _store(redis_server), _ns()
    assert isinstance(store.acquire(ns, "warm", "p", LONG), Acquired)  # a pooled socket

    def run(who: str) -> None:
        for i in range(150):
            got = store.acquire(ns, f"{who}{i}", who, LONG)
            assert isinstance(got, Acquired)
            row = store.lock(ns, f"{who}{i}")
            assert row is not None and row.owner == who and row.token == got.token
            assert store.release(ns, f"{who}{i}", who, got.token)

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports by its exit code
        code = 1
        try:
            run("child")
            code = 0
        finally:
            os._exit(code)
    try:
        run("parent")
    finally:
        _, status = waitpid(pid)
        store.close()
    assert os.waitstatus_to_exitcode(status) == 0


def test_threads_share_a_few_connections_and_close_closes_them(
    redis_server: RedisServer,
) -> None:
    name = "fp" + uuid.uuid4().hex[:8]
    store, ns = _store(redis_server, client_name=name), _ns()
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(50):
                got = store.acquire(ns, f"{t}-{i}", f"o{t}", LONG)
                assert isinstance(got, Acquired)
                assert store.release(ns, f"{t}-{i}", f"o{t}", got.token)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
        assert not th.is_alive(), "still running after 60 s"
    assert not errors
    # At most one connection per thread that called at once (and the pub/sub one
    # is not opened: nobody waited).
    assert 1 <= _clients(redis_server, name) <= 4
    store.close()
    assert _clients(redis_server, name) == 0


@pytest.mark.parametrize("kind", ["blocking", "single"])
def test_limited_pools_keep_redis_py_s_path(redis_server: RedisServer, kind: str) -> None:
    """A BlockingConnectionPool's limit, or a single-connection client, is the user's
    choice: the store goes through execute_command and opens nothing of its own."""
    name = "fq" + uuid.uuid4().hex[:8]
    if kind == "blocking":
        pool = redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]
            port=redis_server.port, max_connections=1, client_name=name
        )
        client: Any = redis.Redis(connection_pool=pool)
    else:
        client = redis.Redis(port=redis_server.port, single_connection_client=True,
                             client_name=name)  # fmt: skip
    store, _ = from_client(client, asynchronous=False)
    assert isinstance(store, RedisStore)
    ns = _ns()
    try:
        threads = [
            threading.Thread(target=lambda t=t: store.acquire(ns, f"k{t}", "o", LONG))
            for t in range(3)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
            assert not th.is_alive(), "still running after 60 s"
        assert _clients(redis_server, name) == 1
        assert store.lock(ns, "k2") is not None
    finally:
        store.close()
        client.close()


# ---- asyncio ---------------------------------------------------------------------------


async def _busy(server: RedisServer) -> tuple[Any, asyncio.Task[Any]]:
    """Redis kept busy 0.8 s by a script: calls sent meanwhile are answered late."""
    blocker: Any = redis.asyncio.Redis(port=server.port)
    task = asyncio.ensure_future(blocker.eval(BUSY_LUA, 0))
    await asyncio.sleep(0.1)
    return blocker, task


async def _check_fresh(store: AsyncRedisStore, ns: str, owner: str) -> None:
    for key in ("a", "b", "c"):
        got = await store.acquire(ns, key, owner, LONG)
        assert isinstance(got, Acquired)
        row = await store.lock(ns, key)
        assert row is not None and row.owner == owner and row.token == got.token


async def test_async_late_and_cancelled_replies_are_never_read_by_the_next_call(
    redis_server: RedisServer,
) -> None:
    store, _ = open_async(redis_server.url, timeout=0.3)
    ns = _ns()
    try:
        assert isinstance(await store.acquire(ns, "warm", "w", LONG), Acquired)
        blocker, busy = await _busy(redis_server)
        with pytest.raises(StoreUnavailable, match="timeout"):
            await store.record(ns, "late")  # cancelled at the deadline
        call = asyncio.ensure_future(store.lock(ns, "gone"))
        await asyncio.sleep(0.05)
        call.cancel()  # cancelled by its caller mid-call
        with pytest.raises(asyncio.CancelledError):
            await call
        await busy
        await blocker.aclose()
        await _check_fresh(store, ns, "second")
    finally:
        await store.aclose()


async def test_async_script_flush_and_aclose_closes_the_connections(
    redis_server: RedisServer,
) -> None:
    name = "fa" + uuid.uuid4().hex[:8]
    store, _ = open_async(redis_server.url, client_name=name)
    ns = _ns()
    raw: Any = redis_server.client()
    try:

        async def pair(i: int) -> None:
            got = await store.acquire(ns, f"k{i}", f"o{i}", LONG)
            assert isinstance(got, Acquired)
            assert await store.release(ns, f"k{i}", f"o{i}", got.token)

        raw.script_flush()
        await asyncio.gather(*(pair(i) for i in range(20)))
        raw.script_flush()
        await pair(99)
        assert _clients(redis_server, name) >= 1
        await store.aclose()
        assert _clients(redis_server, name) == 0
    finally:
        raw.close()


async def test_async_limited_pool_keeps_redis_py_s_path(redis_server: RedisServer) -> None:
    name = "fb" + uuid.uuid4().hex[:8]
    pool = redis.asyncio.BlockingConnectionPool(
        port=redis_server.port, max_connections=1, client_name=name
    )
    client = redis.asyncio.Redis(connection_pool=pool)
    store, _ = from_client(client, asynchronous=True)
    assert isinstance(store, AsyncRedisStore)
    ns = _ns()
    try:
        got = await asyncio.gather(*(store.acquire(ns, f"k{i}", "o", LONG) for i in range(5)))
        assert all(isinstance(g, Acquired) for g in got)
        assert _clients(redis_server, name) == 1
    finally:
        await store.aclose()
        await client.aclose()
