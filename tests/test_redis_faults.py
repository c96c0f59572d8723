"""The Redis store on the failure paths of issue 10: late completion, very long
ttls, corrupt values in listings, no hiredis, bounded calls, fork, several event
loops and bursts. Every test runs against throwaway redis-server processes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.cluster

import idemlock
import idemlock.aio
from idemlock import (
    Claimed,
    ConfigurationError,
    IdempotencySpec,
    InFlight,
    LockSpec,
    StoreUnavailable,
)
from idemlock._core.port import Acquired, Channel, Granted
from idemlock.stores.redis import RedisStore, from_client, open_async, open_sync
from idemlock.stores.redis import _common as C
from idemlock.stores.redis._compat import aclose_client

from . import redis_wait_script
from .servers._proc import mkdtemp, popen
from .servers.proxy import TcpProxy
from .servers.redis import RedisServer, find_redis, free_port, start_unix_redis

LONG = 60_000  # ms: outlives every test


def _ns() -> str:
    return "f" + uuid.uuid4().hex[:10] + ":job"


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[RedisStore]:
    s = open_sync(redis_server.url)[0]
    yield s
    s.close()


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    r = redis.Redis(port=redis_server.port)
    yield r
    r.close()


# ---- A2: late completion -------------------------------------------------------------


def test_complete_and_abandon_after_the_lease_ended_are_accepted(store: RedisStore) -> None:
    ns = _ns()
    first = store.claim(ns, "done", None, "aa", 30)
    second = store.claim(ns, "gone", None, "bb", 30)
    assert isinstance(first, Granted) and isinstance(second, Granted)
    time.sleep(0.08)  # both leases are over; nobody took the keys over
    assert store.complete(ns, "done", "aa", b"r", LONG) is True
    row = store.record(ns, "done")
    assert row is not None and row.state == "completed" and row.fence == first.fence
    assert store.abandon(ns, "gone", "bb") is True
    assert store.record(ns, "gone") is None
    # The lease of a claim that is not completed stays lost for extend.
    third = store.claim(ns, "ext", None, "cc", 30)
    assert isinstance(third, Granted)
    time.sleep(0.08)
    assert store.extend(ns, "ext", "cc", LONG) is None


def test_late_completion_is_stale_once_another_attempt_took_the_key(store: RedisStore) -> None:
    ns = _ns()
    assert isinstance(store.claim(ns, "k", None, "aa", 30), Granted)
    time.sleep(0.08)
    taken = store.claim(ns, "k", None, "bb", LONG)
    assert isinstance(taken, Granted)
    assert store.complete(ns, "k", "aa", b"old", LONG) is False
    assert store.abandon(ns, "k", "aa") is False
    assert store.complete(ns, "k", "bb", b"new", LONG) is True


async def test_async_late_completion(redis_server: RedisServer) -> None:
    astore = open_async(redis_server.url)[0]
    try:
        ns = _ns()
        assert isinstance(await astore.claim(ns, "k", None, "aa", 30), Granted)
        await asyncio.sleep(0.08)
        assert await astore.complete(ns, "k", "aa", b"r", LONG) is True
    finally:
        await astore.aclose()


# ---- expiries past the 6-byte field ----------------------------------------------------


@pytest.mark.parametrize("ttl_ms", [2**48, 2**53, 2**63 - 1])
def test_an_expiry_past_the_record_field_is_refused_not_wrapped(
    store: RedisStore, ttl_ms: int
) -> None:
    ns = _ns()
    claimed = store.claim(ns, "k", None, "aa", LONG)
    assert isinstance(claimed, Granted)
    with pytest.raises(ConfigurationError, match="MAX_TTL"):
        store.complete(ns, "k", "aa", b"r", ttl_ms)
    row = store.record(ns, "k")  # untouched: still in flight with its lease
    assert row is not None and row.state == "in_flight"
    with pytest.raises(ConfigurationError, match="MAX_TTL"):
        store.claim(ns, "other", None, "bb", ttl_ms)
    with pytest.raises(ConfigurationError, match="MAX_TTL"):
        store.extend(ns, "k", "aa", ttl_ms)
    with pytest.raises(ConfigurationError, match="MAX_TTL"):
        store.acquire(ns, "lk", "me", ttl_ms)
    held = store.acquire(ns, "lk", "me", LONG)
    with pytest.raises(ConfigurationError, match="MAX_TTL"):
        store.renew(ns, "lk", "me", held.token, ttl_ms)  # type: ignore[union-attr]


def test_a_century_ttl_keeps_a_completed_record(store: RedisStore) -> None:
    ns = _ns()
    century = 100 * 366 * 24 * 3600 * 1000
    assert isinstance(store.claim(ns, "k", None, "aa", LONG), Granted)
    assert store.complete(ns, "k", "aa", b"r", century) is True
    row = store.record(ns, "k")
    assert row is not None and row.state == "completed"
    assert row.expires_ms > int(time.time() * 1000) + century - LONG


# ---- A3: corrupt values in listings ----------------------------------------------------


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_a_corrupt_value_is_listed_as_such_and_the_rest_still_listed(
    where: str,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if where == "standalone":
        server = request.getfixturevalue("redis_server")
        s = open_sync(server.url)[0]
        rawc: Any = redis.Redis(port=server.port)
    else:
        cluster = request.getfixturevalue("redis_cluster")
        s = open_sync(cluster.url)[0]
        rawc = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    try:
        ns = _ns()
        for k in ("good1", "good2"):
            assert isinstance(s.claim(ns, k, None, "aa", LONG), Granted)
            assert isinstance(s.acquire(ns, k, "me", LONG), Acquired)
        rawc.set(C.names(ns, "junk").claim, b"not a record")
        rawc.rpush(C.names(ns, "list").claim, b"x")  # wrong type
        rawc.set(C.names(ns, "junk").lock, b"a string where a hash belongs")
        rawc.hset(C.names(ns, "bad").lock, mapping={"o": "x", "t": "abc", "x": "1"})
        with caplog.at_level(logging.WARNING, logger="idemlock"):
            records = {r.key: r for r in s.records(ns)}
            locks = {r.key: r for r in s.locks(ns)}
        assert {k: r.state for k, r in records.items()} == {
            "good1": "in_flight",
            "good2": "in_flight",
            "junk": "corrupt",
            "list": "corrupt",
        }
        assert {k: r.corrupt for k, r in locks.items()} == {
            "good1": False,
            "good2": False,
            "junk": True,
            "bad": True,
        }
        assert locks["good1"].owner == "me"
        warnings = [r for r in caplog.records if r.name == "idemlock"]
        assert len(warnings) >= 2 and all("corrupt" in r.getMessage() for r in warnings)
    finally:
        s.close()
        rawc.close()


async def test_async_listing_lists_corrupt_values(redis_server: RedisServer) -> None:
    astore = open_async(redis_server.url)[0]
    rawc = redis.Redis(port=redis_server.port)
    try:
        ns = _ns()
        assert isinstance(await astore.claim(ns, "good", None, "aa", LONG), Granted)
        rawc.set(C.names(ns, "junk").claim, b"\x00garbage")
        rows = {r.key: r.state for r in await astore.records(ns)}
        assert rows == {"good": "in_flight", "junk": "corrupt"}
    finally:
        await astore.aclose()
        rawc.close()


# ---- waits with and without hiredis, over TCP and a unix socket ------------------------


@pytest.fixture(scope="module")
def unix_redis() -> Iterator[tuple[RedisServer, str]]:
    """A throwaway server on TCP and a unix socket (short path: sun_path is small)."""
    root = mkdtemp("ilr-")
    server, url = start_unix_redis(root)
    try:
        yield server, url
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_every_wait_over_tcp_and_unix_socket(
    unix_redis: tuple[RedisServer, str], transport: str
) -> None:
    """Run here with hiredis (the test extra has it) and, by the test below, without."""
    url = unix_redis[0].url if transport == "tcp" else unix_redis[1]
    redis_wait_script.main(url)


@pytest.mark.timeout(330)  # the run below has 300 s; 55 s of it at load 20 alone
def test_redis_waits_and_contract_without_hiredis() -> None:
    """``pip install 'idemlock[redis]'`` has no hiredis: every waiting path (the contract's
    waits on standalone and Cluster, and the waits above over TCP and a unix socket) runs
    again in a subprocess where hiredis cannot be imported (tests/no_hiredis.py)."""
    root = Path(__file__).resolve().parent.parent
    cmd = [
        sys.executable, "-m", "pytest", "-p", "tests.no_hiredis", "-p", "no:cacheprovider",
        "-q", "-x",
        "tests/contract/test_locks.py", "tests/contract/test_idempotency.py",
        "tests/contract/test_wrap.py",
        "-k", "redis and (wait or hold or waiter or in_flight)",
        "tests/test_redis_faults.py::test_every_wait_over_tcp_and_unix_socket",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert "hiredis: made unimportable" in out, out[-3000:]
    assert proc.returncode == 0, out[-5000:]
    assert " passed" in out and "skipped" not in out, out[-3000:]


# ---- A7: any event loop, and bursts ------------------------------------------------------


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_async_coordinator_works_on_one_loop_after_another(
    where: str, request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue("redis_server" if where == "standalone" else "redis_cluster")
    coord = idemlock.aio.connect(server.url, key_prefix=_ns())
    locks = coord.lock(LockSpec("l", ttl=timedelta(seconds=30)))
    port = coord.idempotency(IdempotencySpec("j"))

    async def round_trip(i: int) -> None:
        lease = await locks.acquire(f"k{i}")
        assert lease is not None
        claim = await port.claim(f"job{i}")
        assert isinstance(claim, Claimed)
        await port.complete(claim.token, i)
        # A wait subscribes on this loop's listener and is woken through it.
        other = asyncio.ensure_future(locks.acquire(f"k{i}", owner="other", wait=20))
        await asyncio.sleep(0.05)
        assert await locks.release(lease)
        got = await other
        assert got is not None and got.owner == "other"

    for i in range(4):  # loops one after another, as asyncio.run() in a script
        asyncio.run(round_trip(i))
    # What belonged to the loops that are over is dropped, not kept per loop forever.
    assert len(coord.store._states) <= 2

    async def close() -> None:
        await coord.close()

    asyncio.run(close())


async def test_a_client_passed_in_is_copied_for_another_loop(redis_server: RedisServer) -> None:
    import redis.asyncio

    client = redis.asyncio.Redis(port=redis_server.port)
    coord = idemlock.aio.connect(client, key_prefix=_ns())
    port = coord.idempotency(IdempotencySpec("j"))
    first = await port.claim("a")
    assert isinstance(first, Claimed)

    def elsewhere() -> Any:
        async def go() -> Any:
            return await port.claim("b")

        return asyncio.run(go())  # another loop, in another thread

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        assert isinstance(ex.submit(elsewhere).result(timeout=30), Claimed)
    assert isinstance(await port.claim("a"), InFlight)  # the first loop still works
    await coord.close()
    await aclose_client(client)


@pytest.mark.parametrize("where", ["standalone", "cluster"])
async def test_a_burst_of_1000_calls_queues_for_a_connection(
    where: str, request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue("redis_server" if where == "standalone" else "redis_cluster")
    coord = idemlock.aio.connect(server.url, key_prefix=_ns())
    try:
        port = coord.idempotency(IdempotencySpec("j"))
        locks = coord.lock(LockSpec("l", ttl=timedelta(seconds=30)))
        calls: list[Any] = [port.claim(f"c{i}") for i in range(500)]
        calls += [locks.acquire(f"l{i}") for i in range(500)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors == []
        assert all(isinstance(r, Claimed) for r in results[:500])
        assert all(r is not None for r in results[500:])
    finally:
        await coord.close()


# ---- A1: the timeout option bounds every call ----------------------------------------------


def _socket_kwargs(store: Any) -> dict[str, Any]:
    client = store.client
    if store.cluster:
        if hasattr(client, "nodes_manager") and not hasattr(client, "get_connection_kwargs"):
            kw: dict[str, Any] = client.nodes_manager.connection_kwargs
            return kw
        return dict(client.get_connection_kwargs())
    return dict(client.connection_pool.connection_kwargs)


@pytest.mark.parametrize("where", ["standalone", "cluster"])
async def test_timeout_option_drives_socket_timeouts_and_is_exposed(
    where: str, request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue("redis_server" if where == "standalone" else "redis_cluster")
    sep = "&" if "?" in server.url else "?"
    opened: list[Any] = [
        open_sync(server.url, timeout=1.5)[0],
        open_sync(server.url + f"{sep}timeout=1.5")[0],
        open_async(server.url, timeout=1.5)[0],
    ]
    default = open_sync(server.url)[0]
    try:
        for s in opened:
            assert s.timeout == 1.5
            kw = _socket_kwargs(s)
            assert kw["socket_timeout"] == 1.5 and kw["socket_connect_timeout"] == 1.5
        assert default.timeout == 5.0
        coord = idemlock.connect(server.url, timeout=0.75)
        assert coord.store.timeout == 0.75
        coord.close()
    finally:
        for s in opened:
            if isinstance(s, RedisStore):
                s.close()
            else:
                await s.aclose()
        default.close()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1, 0, "soon", True, "nan"])
def test_bad_timeouts_are_configuration_errors(redis_server: RedisServer, bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="timeout"):
        open_sync(redis_server.url, timeout=bad)
    with pytest.raises(ConfigurationError, match="timeout"):
        open_sync(f"{redis_server.url}?timeout={bad}")


def test_a_client_passed_in_reports_its_socket_timeout(redis_server: RedisServer) -> None:
    client = redis.Redis(port=redis_server.port, socket_timeout=2.5)
    try:
        assert from_client(client, asynchronous=False)[0].timeout == 2.5
        assert from_client(client, asynchronous=False, timeout=1)[0].timeout == 1.0
    finally:
        client.close()


TIMEOUT = 1.0
#: generous over the bound (one timeout for a fresh connection's handshake, one for
#: the request), so that only a call stretched by retries or no bound at all fails
BOUND = 2 * TIMEOUT + 1.0


def test_a_silent_network_is_store_unavailable_within_the_bound(
    redis_server: RedisServer,
) -> None:
    with TcpProxy(redis_server.port) as proxy:
        s = open_sync(f"redis://127.0.0.1:{proxy.port}/0", timeout=TIMEOUT)
        store = s[0]
        try:
            ns = _ns()
            assert isinstance(store.claim(ns, "k", None, "aa", LONG), Granted)
            proxy.blackhole()
            for call in (
                lambda: store.claim(ns, "k2", None, "bb", LONG),
                lambda: store.complete(ns, "k", "aa", b"r", LONG),
                lambda: store.acquire(ns, "l", "me", LONG),
                lambda: store.subscribe(Channel("lock", ns, "l")),
            ):
                t0 = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    sub = call()
                    if hasattr(sub, "close"):  # subscribing returns; waiting on it is bounded
                        sub.close()
                        raise StoreUnavailable("subscribed")
                assert time.monotonic() - t0 < BOUND
            proxy.heal()
        finally:
            store.close()


async def test_a_silent_network_bounds_async_calls_and_the_listener(
    redis_server: RedisServer,
) -> None:
    with TcpProxy(redis_server.port) as proxy:
        store = open_async(f"redis://127.0.0.1:{proxy.port}/0", timeout=TIMEOUT)[0]
        try:
            ns = _ns()
            assert isinstance(await store.claim(ns, "k", None, "aa", LONG), Granted)
            proxy.blackhole()
            for make in (
                lambda: store.claim(ns, "k2", None, "bb", LONG),
                lambda: store.complete(ns, "k", "aa", b"r", LONG),
                lambda: store.acquire(ns, "l", "me", LONG),
            ):
                t0 = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    await make()
                assert time.monotonic() - t0 < BOUND
            t0 = time.monotonic()  # the listener's connection: bounded too
            try:
                sub = await asyncio.wait_for(store.subscribe(Channel("lock", ns, "l")), BOUND + 5)
            except StoreUnavailable:
                pass
            else:
                await sub.aclose()
            assert time.monotonic() - t0 < BOUND
            proxy.heal()
        finally:
            await store.aclose()


# ---- A6: fork ----------------------------------------------------------------------------


def _forked(child: Any, then: Any = None, timeout: float = 30.0) -> Any:
    """Run ``child()`` in a forked child (real os.fork, what Celery prefork and gunicorn
    --preload do) while the parent runs ``then(ready)``; the child's JSON-able return
    value, or its error text raised here."""
    ready_r, ready_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 0
        try:
            os.close(ready_r)
            os.close(out_r)
            value = child(lambda: os.write(ready_w, b"r"))
            payload = json.dumps({"ok": value})
        except BaseException as exc:  # reported to the parent
            payload = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
            code = 1
        with contextlib.suppress(BaseException):
            os.write(out_w, payload.encode())
        os._exit(code)
    os.close(ready_w)
    os.close(out_w)
    try:
        if then is not None:
            r, _, _ = select.select([ready_r], [], [], timeout)
            assert r, "the child did not get ready"
            os.read(ready_r, 1)
            then()
        deadline = time.monotonic() + timeout
        while True:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError("the forked child did not finish")
            time.sleep(0.01)
        data = b""
        while chunk := os.read(out_r, 65536):
            data += chunk
    finally:
        os.close(ready_r)
        os.close(out_r)
    result = json.loads(data or b'{"error": "no result"}')
    if "error" in result:
        raise AssertionError(f"in the forked child: {result['error']}")
    return result["ok"]


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_a_forked_child_is_woken_through_its_own_listener(
    where: str, request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue("redis_server" if where == "standalone" else "redis_cluster")
    coord = idemlock.connect(server.url, key_prefix=_ns())
    store: RedisStore = coord.store
    locks = coord.lock(LockSpec("l", ttl=timedelta(seconds=30)))
    try:
        # The parent is waiting on something: its listener thread and socket are live.
        warm = store.subscribe(Channel("lock", "warm", "k"))
        lease = locks.acquire("k")
        assert lease is not None

        def child(ready: Any) -> Any:
            sub = store.subscribe(Channel("lock", "child", "k"))
            ready()
            fired = sub.wait(20)  # the parent publishes on this channel
            sub.close()
            got = locks.acquire("k", owner="child", wait=20)  # a real waiting acquire
            ok = got is not None and locks.release(got)
            return {"fired": fired, "acquired": ok, "pid": os.getpid()}

        def parent() -> None:
            publish(server, Channel("lock", "child", "k"))
            time.sleep(0.2)
            locks.release(lease)

        result = _forked(child, parent)
        assert result["fired"] is True and result["acquired"] is True
        # The parent's listener still works: its old channel and a new one.
        publish(server, Channel("lock", "warm", "k"))
        assert warm.wait(10) is True
        warm.close()
        again = store.subscribe(Channel("lock", "again", "k"))
        publish(server, Channel("lock", "again", "k"))
        assert again.wait(10) is True
        again.close()
        assert isinstance(store.claim(_ns(), "k", None, "aa", LONG), Granted)
    finally:
        coord.close()


def publish(server: Any, channel: Channel) -> None:
    """A notification for everyone waiting on ``channel`` (what a release sends)."""
    name = C.channel_name(channel.kind, channel.ns, channel.key)
    if isinstance(server, RedisServer):
        with redis.Redis(port=server.port) as r:
            r.publish(name, b"*")
    else:
        with redis.cluster.RedisCluster(host="127.0.0.1", port=server.ports[0]) as rc:
            rc.publish(name, b"*")


def test_an_async_store_used_before_a_fork_works_in_the_child(redis_server: RedisServer) -> None:
    coord = idemlock.aio.connect(redis_server.url, key_prefix=_ns())
    port = coord.idempotency(IdempotencySpec("j"))
    store = coord.store

    async def warm() -> None:  # the parent used the store on its own loop
        assert isinstance(await port.claim("parent"), Claimed)
        sub = await store.subscribe(Channel("claim", "x", "y"))
        await sub.aclose()

    asyncio.run(warm())

    def child(ready: Any) -> Any:
        async def go() -> Any:
            sub = await store.subscribe(Channel("lock", "child-async", "k"))
            ready()
            fired = await sub.wait(20)
            await sub.aclose()
            claim = await port.claim("child")
            return {"fired": fired, "claimed": isinstance(claim, Claimed)}

        return asyncio.run(go())

    def parent() -> None:
        publish(redis_server, Channel("lock", "child-async", "k"))

    result = _forked(child, parent)
    assert result == {"fired": True, "claimed": True}

    async def after() -> None:
        assert isinstance(await port.claim("parent-again"), Claimed)
        await coord.close()

    asyncio.run(after())


# ---- connection failures name their cause; passwords never shown -------------------------


@pytest.fixture(scope="module")
def auth_redis() -> Iterator[RedisServer]:
    """A throwaway server that needs a password (``PASSWORD``)."""
    root = mkdtemp("ila-")
    server = _start_auth(RedisServer(root, free_port(), ("--requirepass", PASSWORD)))
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


PASSWORD = "s3cret-Pw-xyz"


def _start_auth(server: RedisServer) -> RedisServer:
    # RedisServer.start() waits for a PING without a password; answer it with one.
    server_bin, _ = find_redis()
    server.root.mkdir(parents=True, exist_ok=True)
    cmd = [
        server_bin, "--port", str(server.port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no", "--dir", str(server.root), "--logfile", str(server.log),
        *server.extra,
    ]  # fmt: skip
    server.proc = popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=False
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            with redis.Redis(port=server.port, password=PASSWORD, socket_timeout=1) as r:
                if r.ping():
                    return server
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _fail_fast(call: Any) -> str:
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        call()
    assert time.monotonic() - t0 < BOUND
    return str(info.value)


def test_connection_failures_name_their_cause_soon(auth_redis: RedisServer) -> None:
    ns = _ns()
    base = f"redis://127.0.0.1:{auth_redis.port}/0"
    for url, cause in (
        (f"redis://:wrong@127.0.0.1:{auth_redis.port}/0", "authentication failed"),
        (base, "authentication failed"),  # no password given
        (f"redis://127.0.0.1:{free_port()}/0", "connection refused"),  # nothing listens
    ):
        s = open_sync(url, timeout=TIMEOUT)[0]
        try:
            msg = _fail_fast(lambda s=s: s.claim(ns, "k", None, "aa", LONG))
            assert cause.lower() in msg.lower(), msg
            assert "wrong" not in msg
        finally:
            s.close()
    good = open_sync(f"{base}?password={PASSWORD}", timeout=TIMEOUT)[0]
    try:
        assert isinstance(good.claim(ns, "k", None, "aa", LONG), Granted)
    finally:
        good.close()


async def test_async_connection_failures_name_their_cause_soon(auth_redis: RedisServer) -> None:
    ns = _ns()
    for url, cause in (
        (f"redis://:wrong@127.0.0.1:{auth_redis.port}/0", "authentication failed"),
        (f"redis://127.0.0.1:{free_port()}/0", "connection refused"),
    ):
        s = open_async(url, timeout=TIMEOUT)[0]
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable) as info:
                await s.claim(ns, "k", None, "aa", LONG)
            assert time.monotonic() - t0 < BOUND
            assert cause in str(info.value).lower(), str(info.value)
        finally:
            await s.aclose()


def test_a_query_password_is_never_shown(auth_redis: RedisServer) -> None:
    url = f"redis://127.0.0.1:{auth_redis.port}/0?password={PASSWORD}"
    with pytest.raises(ConfigurationError) as bad:
        open_sync(url + "&no_such_option=1")
    assert PASSWORD not in str(bad.value) and "password=***" in str(bad.value)
    with pytest.raises(StoreUnavailable) as down:
        open_sync(f"redis+cluster://127.0.0.1:{free_port()}?password={PASSWORD}", timeout=TIMEOUT)
    assert PASSWORD not in str(down.value)


def test_a_query_password_is_not_in_the_coordinator_url(auth_redis: RedisServer) -> None:
    """coord.url is shown by idemlock._urls.redact (shared by every store)."""
    url = f"redis://127.0.0.1:{auth_redis.port}/0?password={PASSWORD}"
    coord = idemlock.connect(url)
    try:
        assert PASSWORD not in str(coord.url) and PASSWORD not in repr(coord)
        lease = coord.lock("l").acquire("k")  # and the password did reach Redis
        assert lease is not None
    finally:
        coord.close()


# ---- A4: tokens up to 2**63-1 ----------------------------------------------------------------


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_gate_tokens_up_to_2_63_minus_1(where: str, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue("redis_server" if where == "standalone" else "redis_cluster")
    s = open_sync(server.url)[0]
    top = 2**63 - 1
    try:
        ns = _ns()
        assert s.fence_advance(ns, "res", 2**53 + 1) == (True, 2**53 + 1)  # past a double
        assert s.fence_advance(ns, "res", 2**53) == (False, 2**53 + 1)
        assert s.fence_advance(ns, "res", top - 1) == (True, top - 1)
        assert s.fence_set(ns, "res", top, "res", b"v") == (True, top)
        assert s.fence_advance(ns, "res", top - 1) == (False, top)
        assert s.fence_set(ns, "res", top - 1, "res", b"late") == (False, top)
        assert s.fence_current(ns, "res") == top
        assert s.fence_advance(ns, "res", top) == (True, top)  # the same token again
    finally:
        s.close()


# ---- cancellation: undone, but only what the call took --------------------------------


async def _cancel_soon(coro: Any) -> None:
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)  # the script is on its way
    await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _settled(check: Any, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.02)
    return False


async def test_a_cancelled_acquire_is_undone_but_never_a_lease_held_before(
    redis_server: RedisServer,
) -> None:
    astore = open_async(redis_server.url)[0]
    try:
        ns = _ns()
        # A fresh acquire that is cancelled: the lease it took is given back.
        await _cancel_soon(astore.acquire(ns, "fresh", "me", LONG))

        async def free() -> bool:
            return await astore.lock(ns, "fresh") is None

        assert await _settled(free)
        # The owner already held this one: a cancelled re-acquire must leave it held.
        held = await astore.acquire(ns, "held", "me", LONG)
        assert isinstance(held, Acquired)
        await _cancel_soon(astore.acquire(ns, "held", "me", LONG))
        await asyncio.sleep(0.3)  # any undo has run by now
        row = await astore.lock(ns, "held")
        assert row is not None and row.owner == "me" and row.token == held.token
        # A cancelled claim is abandoned: the key is claimable again.
        await _cancel_soon(astore.claim(ns, "job", None, "aa", LONG))

        async def claimable() -> bool:
            return await astore.record(ns, "job") is None

        assert await _settled(claimable)
    finally:
        await astore.aclose()


async def test_a_cancelled_first_waiting_attempt_drops_its_registration(
    redis_server: RedisServer, raw: redis.Redis
) -> None:
    """A waiter cancelled while its first registering attempt is on the wire: its flow
    leaves the channel before the reply could mark the registration, so nobody would
    drop it; the attempt's undo does, once it lands. Kept, every release would hold the
    lock back for a process that no longer waits until the registration lapses."""
    ns = _ns()
    holder = open_async(redis_server.url)[0]
    with TcpProxy(redis_server.port) as proxy:
        store = open_async(f"redis://127.0.0.1:{proxy.port}/0")[0]
        try:
            held = await holder.acquire(ns, "l", "holder", LONG)
            assert isinstance(held, Acquired)
            sub = await store.subscribe(Channel("lock", ns, "l"))  # this process waits
            proxy.blackhole()
            attempt = asyncio.ensure_future(store.acquire(ns, "l", "waiter", LONG))
            await asyncio.sleep(0.3)  # its ACQUIRE waits in the silent proxy
            assert not attempt.done()
            attempt.cancel()
            with pytest.raises(asyncio.CancelledError):
                await attempt
            await sub.aclose()  # the caller's flow leaves as it unwinds
            proxy.heal()
            await asyncio.sleep(0.5)  # the attempt lands (registering), then its undo
            assert raw.hlen(C.names(ns, "l").waiters) == 0
        finally:
            await store.aclose()
            await holder.aclose()
