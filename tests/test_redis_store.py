"""The Redis store on real servers: what the contract suite cannot see.

Script cache loss, data loss, connections cut in the middle of a transition, a holder
frozen with SIGSTOP, hand-off to another process by notification, foreign data, URLs
and clients, Cluster listings and awkward keys. Servers are throwaway ones started by
``tests/servers/redis.py``; processes are real subprocesses.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

import idemlock
import idemlock.aio
from idemlock import (
    Claimed,
    Completed,
    ConfigurationError,
    FencedOut,
    IdempotencySpec,
    LockSpec,
    StoreCorrupt,
    StoreUnavailable,
)
from idemlock._core.port import Acquired, Busy, Channel, Done, Granted, Held, Mismatch
from idemlock.stores.redis import AsyncRedisStore, RedisStore, from_client, open_async, open_sync
from idemlock.stores.redis import _common as C
from idemlock.stores.redis._compat import aclose_client

from .servers._proc import popen
from .servers.redis import RedisCluster, RedisServer, free_port, start_redis

LONG = 60_000  # ms: outlives every test


def _ns() -> str:
    return "t" + uuid.uuid4().hex[:10] + ":job"


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


# ---- scripts --------------------------------------------------------------------------


def test_noscript_after_script_flush_reloads_transparently(
    store: RedisStore, raw: redis.Redis
) -> None:
    ns = _ns()
    first = store.claim(ns, "k", None, "aa", LONG)
    assert isinstance(first, Granted)
    raw.script_flush()
    again = store.claim(ns, "k", None, "aa", LONG)  # NOSCRIPT -> SCRIPT LOAD -> EVALSHA
    assert isinstance(again, Granted)
    assert (again.fence, again.expires_ms) == (first.fence, first.expires_ms)
    raw.script_flush()
    assert store.complete(ns, "k", "aa", b"r", LONG)
    raw.script_flush()
    reply = store.claim(ns, "k", None, "bb", LONG)
    assert isinstance(reply, Done) and reply.result == b"r"


async def test_noscript_async_and_on_every_cluster_master(
    redis_server: RedisServer, redis_cluster: RedisCluster
) -> None:
    astore = open_async(redis_server.url)[0]
    cstore = open_sync(redis_cluster.url)[0]
    try:
        redis.Redis(port=redis_server.port).script_flush()
        assert isinstance(await astore.acquire(_ns(), "k", "me", LONG), Acquired)
        ns = _ns()
        keys = [f"k{i}" for i in range(12)]  # spread over the three masters
        for k in keys:
            assert isinstance(cstore.acquire(ns, k, "me", LONG), Acquired)
        for port in redis_cluster.ports:
            redis.Redis(port=port).script_flush()
        for k in keys:
            assert isinstance(cstore.acquire(ns, k, "me", LONG), Acquired)  # same owner
    finally:
        await astore.aclose()
        cstore.close()


# ---- fencing tokens survive data loss ----------------------------------------------------


def test_tokens_keep_rising_across_a_data_losing_restart(tmp_path: Path) -> None:
    server = start_redis(tmp_path / "lossy")
    try:
        coord = idemlock.connect(server.url, key_prefix="loss")
        locks = coord.lock(LockSpec("l", ttl=timedelta(seconds=60)))
        port = coord.idempotency(IdempotencySpec("j"))
        gate = coord.fence("res")
        issued: list[int] = []
        for _ in range(3):
            lease = locks.acquire("k")
            assert lease is not None and lease.token is not None
            issued.append(lease.token)
            locks.release(lease)
            claim = port.claim("job")
            assert isinstance(claim, Claimed)
            issued.append(claim.token.fence)
            port.abandon(claim.token)
        gate.check_and_advance(issued[-1])
        held = locks.acquire("k")  # still held when the data goes
        assert held is not None and held.token is not None
        issued.append(held.token)

        server.restart()  # no persistence: every key and every script is gone
        assert redis.Redis(port=server.port).dbsize() == 0

        after = locks.acquire("k")  # a lost lock is free again...
        assert after is not None and after.token is not None
        claim = port.claim("job")
        assert isinstance(claim, Claimed)
        # ...but its token, and the claim's fence, are above everything issued before.
        assert after.token > max(issued)
        assert claim.token.fence > max(issued)
        assert gate.current() is None  # the gate was lost with the data
        coord.close()
    finally:
        server.stop()


def test_readonly_replica_and_a_frozen_server_are_store_unavailable(tmp_path: Path) -> None:
    primary = start_redis(tmp_path / "primary")
    replica = RedisServer(
        tmp_path / "replica", free_port(), ("--replicaof", "127.0.0.1", str(primary.port))
    )
    replica.start()
    try:
        store = open_sync(replica.url)[0]
        with pytest.raises(StoreUnavailable) as info:
            store.claim(_ns(), "k", None, "t", LONG)  # a failover not seen yet: READONLY
        assert isinstance(info.value.__cause__, redis.ReadOnlyError)
        assert not isinstance(info.value, StoreCorrupt)
        store.close()

        store = open_sync(primary.url, socket_timeout=0.3)[0]
        assert isinstance(store.acquire(_ns(), "k", "me", LONG), Acquired)
        assert primary.proc is not None
        os.kill(primary.proc.pid, signal.SIGSTOP)  # hung, not dead: only a timeout tells
        try:
            with pytest.raises(StoreUnavailable) as info:
                store.acquire(_ns(), "k", "me", LONG)
            assert isinstance(info.value.__cause__, redis.TimeoutError)
        finally:
            os.kill(primary.proc.pid, signal.SIGCONT)
        store.close()
    finally:
        replica.stop()
        primary.stop()


# ---- a connection cut in the middle of a transition ------------------------------------


class CutProxy:
    """A loopback TCP proxy in front of Redis that can cut the connection once, either
    before an EVALSHA reaches the server or after the server ran it (the reply lost)."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.mode: str | None = None
        self.cuts = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, mode: str) -> None:
        with self._lock:
            self.mode = mode

    def _take(self, mode: str) -> bool:
        with self._lock:
            if self.mode == mode:
                self.mode = None
                self.cuts += 1
                return True
            return False

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream))
            state = {"drop_reply": False}
            self._socks += [client, up]
            threading.Thread(target=self._up, args=(client, up, state), daemon=True).start()
            threading.Thread(target=self._down, args=(client, up, state), daemon=True).start()

    @staticmethod
    def _close(*socks: socket.socket) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _up(self, client: socket.socket, up: socket.socket, state: dict[str, bool]) -> None:
        try:
            while data := client.recv(65536):
                if b"EVALSHA" in data:
                    if self._take("drop_request"):
                        self._close(client, up)
                        return
                    if self._take("drop_reply"):
                        state["drop_reply"] = True
                up.sendall(data)
        except OSError:
            pass
        self._close(client, up)

    def _down(self, client: socket.socket, up: socket.socket, state: dict[str, bool]) -> None:
        try:
            while data := up.recv(65536):
                if state["drop_reply"]:
                    self._close(client, up)  # the script ran; its reply is lost
                    return
                client.sendall(data)
        except OSError:
            pass
        self._close(client, up)

    def close(self) -> None:
        self.listener.close()
        self._close(*self._socks)


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[CutProxy]:
    p = CutProxy(redis_server.port)
    yield p
    p.close()


def test_cut_without_retries_leaves_no_half_made_claim(proxy: CutProxy) -> None:
    store = open_sync(f"redis://127.0.0.1:{proxy.port}/0", retry=Retry(NoBackoff(), 0))[0]
    try:
        ns = _ns()
        proxy.arm("drop_request")  # never reaches Redis
        with pytest.raises(StoreUnavailable) as info:
            store.claim(ns, "a", "fp", "tok-a", LONG)
        assert isinstance(info.value.__cause__, redis.ConnectionError)
        assert store.record(ns, "a") is None
        assert isinstance(store.claim(ns, "a", "fp", "tok-other", LONG), Granted)

        proxy.arm("drop_reply")  # Redis ran the script; the caller never hears of it
        with pytest.raises(StoreUnavailable):
            store.claim(ns, "b", "fp", "tok-b", LONG)
        row = store.record(ns, "b")
        assert row is not None and row.state == "in_flight"  # whole, not half-made
        again = store.claim(ns, "b", "fp", "tok-b", LONG)  # the caller's retry
        assert isinstance(again, Granted) and again.fence == row.fence
        assert isinstance(store.claim(ns, "b", "fp", "tok-c", LONG), Busy)
        assert proxy.cuts == 2
    finally:
        store.close()


def test_cut_with_client_retries_is_recognised_not_reported_stale(proxy: CutProxy) -> None:
    # Our clients retry a failed command once or twice; every script must be safe to
    # run twice with the same arguments.
    store = open_sync(f"redis://127.0.0.1:{proxy.port}/0")[0]
    try:
        ns = _ns()
        proxy.arm("drop_reply")
        first = store.claim(ns, "k", "fp", "tok", LONG)
        assert isinstance(first, Granted)
        proxy.arm("drop_reply")
        assert store.complete(ns, "k", "tok", b"result", LONG) is True  # ran twice
        done = store.claim(ns, "k", "fp", "tok2", LONG)
        assert isinstance(done, Done) and done.result == b"result"
        assert store.complete(ns, "k", "tok", b"other", LONG) is False  # a real 2nd call

        proxy.arm("drop_reply")
        lock = store.acquire(ns, "l", "me", LONG)
        assert isinstance(lock, Acquired)
        proxy.arm("drop_reply")
        assert store.release(ns, "l", "me", lock.token) is True
        assert store.release(ns, "l", "me", lock.token) is False
        claim = store.claim(ns, "a", None, "t3", LONG)
        proxy.arm("drop_reply")
        assert isinstance(claim, Granted) and store.abandon(ns, "a", "t3") is True
        assert proxy.cuts == 5
    finally:
        store.close()


# ---- a frozen holder is fenced out ------------------------------------------------------

HOLDER = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    import idemlock
    from idemlock import FencedOut, LockLost, LockSpec

    url, prefix = sys.argv[1], sys.argv[2]
    coord = idemlock.connect(url, key_prefix=prefix)
    locks = coord.lock(LockSpec("writer", ttl=timedelta(seconds=0.5)))
    gate = coord.fence("ledger")
    try:
        with locks.hold("ledger") as lease:
            print(lease.token, flush=True)
            sys.stdin.readline()  # frozen by SIGSTOP somewhere around here
            try:
                gate.set_if_fresh(lease.token, "ledger", b"stale write")
                print("written", flush=True)
            except FencedOut:
                print("fenced", flush=True)
    except LockLost:
        pass
    coord.close()
    """
)


def test_holder_paused_past_its_ttl_is_fenced_out(redis_server: RedisServer) -> None:
    prefix = "p" + uuid.uuid4().hex[:8]
    child = popen(
        [sys.executable, "-c", HOLDER, redis_server.url, prefix],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=False,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        old = int(child.stdout.readline())
        os.kill(child.pid, signal.SIGSTOP)  # a GC pause, a frozen VM: no renewals
        coord = idemlock.connect(redis_server.url, key_prefix=prefix)
        locks = coord.lock(LockSpec("writer", ttl=timedelta(seconds=30)))
        new = locks.acquire("ledger", wait=5)  # free once the frozen lease ran out
        assert new is not None and new.token is not None and new.token > old
        coord.fence("ledger").set_if_fresh(new.token, "ledger", b"fresh write")
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "fenced"
        assert child.wait(timeout=10) == 0
        assert redis.Redis(port=redis_server.port).get("ledger") == b"fresh write"
        with pytest.raises(FencedOut):
            coord.fence("ledger").set_if_fresh(old, "ledger", b"late")
        locks.release(new)
        coord.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait(timeout=30)


# ---- hand-off to a waiting process by notification -------------------------------------

WAITER = textwrap.dedent(
    """
    import sys
    import idemlock
    from idemlock._core.port import Channel
    from idemlock.stores.redis import open_sync

    url, ns, key = sys.argv[1], sys.argv[2], sys.argv[3]
    store = open_sync(url)[0]
    sub = store.subscribe(Channel("lock", ns, key))
    print("subscribed", flush=True)
    woken = sub.wait(30)  # a long wait: only a notification ends it early
    reply = store.acquire(ns, key, "waiter", 60000)
    print(woken, type(reply).__name__, getattr(reply, "token", 0), flush=True)
    sub.close()
    store.close()
    """
)


def test_waiter_in_another_process_is_woken_by_the_release(
    store: RedisStore, redis_server: RedisServer
) -> None:
    ns = _ns()
    held = store.acquire(ns, "k", "holder", LONG)
    assert isinstance(held, Acquired)
    child = popen(
        [sys.executable, "-c", WAITER, redis_server.url, ns, "k"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=False,
    )
    assert child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "subscribed"
        assert store.release(ns, "k", "holder", held.token)
        woken, kind, token = child.stdout.readline().split()
        assert woken == "True"  # the release woke it, not its 30 s timeout
        assert kind == "Acquired" and int(token) > held.token
        assert child.wait(timeout=10) == 0
    finally:
        child.kill()
        child.wait(timeout=30)


def test_a_release_hands_the_lock_to_the_waiter_not_back_to_the_releaser(
    redis_server: RedisServer,
) -> None:
    # The releaser tries again at once; the waiter, registered while it waited, wins.
    holder = idemlock.connect(redis_server.url, key_prefix="h", handoff_ms=2000)
    waiter = idemlock.connect(redis_server.url, key_prefix="h", handoff_ms=2000)
    spec = LockSpec("l" + uuid.uuid4().hex[:8], ttl=timedelta(seconds=30))
    mine = holder.lock(spec).acquire("k")
    assert mine is not None
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(waiter.lock(spec).acquire("k", wait=10)))
    t.start()
    waiters_key = C.names(holder._ns(spec.name), "k").waiters
    raw = redis.Redis(port=redis_server.port)
    deadline = time.monotonic() + 5
    while not raw.exists(waiters_key) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert raw.exists(waiters_key), "the waiter never registered"
    holder.lock(spec).release(mine)
    assert holder.lock(spec).acquire("k") is None  # no barging back in
    t.join(timeout=10)
    assert got and got[0] is not None and got[0].token > mine.token
    assert not raw.exists(waiters_key)  # it got the lock: no longer registered
    holder.close()
    waiter.close()


def test_a_waiter_that_gave_up_does_not_hold_the_lock_back(store: RedisStore) -> None:
    ns = _ns()
    held = store.acquire(ns, "k", "a", LONG)
    assert isinstance(held, Acquired)
    sub = store.subscribe(Channel("lock", ns, "k"))
    assert isinstance(store.acquire(ns, "k", "b", LONG), Held)  # registers "b"'s process
    sub.close()  # gives up: unregisters
    assert store.release(ns, "k", "a", held.token)
    assert isinstance(store.acquire(ns, "k", "c", LONG), Acquired)


async def test_async_subscription_keeps_an_early_notification(redis_server: RedisServer) -> None:
    astore = open_async(redis_server.url)[0]
    try:
        ns = _ns()
        held = await astore.acquire(ns, "k", "a", LONG)
        assert isinstance(held, Acquired)
        sub = await astore.subscribe(Channel("lock", ns, "k"))
        assert await astore.release(ns, "k", "a", held.token)
        await asyncio.sleep(0.05)  # the notification lands before anyone waits
        assert await sub.wait(5) is True
        assert await sub.wait(0.01) is False
        await sub.aclose()
    finally:
        await astore.aclose()


def _url(where: str, request: pytest.FixtureRequest) -> str:
    fixture = "redis_server" if where == "standalone" else "redis_cluster"
    return str(request.getfixturevalue(fixture).url)


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_a_published_value_wakes_observers_and_not_waiters(
    where: str, request: pytest.FixtureRequest
) -> None:
    # Two stores: two listeners, as two processes would have. The second one's
    # waiter and observer share one channel (one SUBSCRIBE).
    url = _url(where, request)
    first, second = open_sync(url)[0], open_sync(url)[0]
    ns = _ns()
    assert second.holders(ns, "k") == []  # a Cluster client learns the slots
    waiter = second.subscribe(Channel("lock", ns, "k"))
    observer = second.subscribe(Channel("leader", ns, "k"))
    try:
        got = first.acquire(ns, "k", "a", LONG, value=b"v1")  # a term begins
        assert isinstance(got, Acquired)
        assert observer.wait(10) is True
        assert waiter.wait(0.5) is False
        assert first.renew(ns, "k", "a", got.token, LONG, value=b"v2") is not None
        assert observer.wait(10) is True
        assert waiter.wait(0.5) is False
        again = first.acquire(ns, "k", "a", LONG, value=b"v3")  # re-acquired, new value
        assert isinstance(again, Acquired) and again.token == got.token
        assert observer.wait(10) is True
        assert waiter.wait(0.5) is False
        # Without a value nothing is published: a renewal, a plain lock's grant.
        assert first.renew(ns, "k", "a", got.token, LONG) is not None
        assert isinstance(first.acquire(ns, "plain", "a", LONG), Acquired)
        assert observer.wait(0.5) is False
        assert first.release(ns, "k", "a", got.token)  # a freed permit wakes both
        assert waiter.wait(10) is True
        assert observer.wait(10) is True
        assert [r.value for r in first.holders(ns, "k")] == []
    finally:
        waiter.close()
        observer.close()
        first.close()
        second.close()


def test_an_observer_alone_registers_no_waiter(redis_server: RedisServer, raw: redis.Redis) -> None:
    # A failed acquire in a process where only an observer listens is no waiter's: a
    # release must not reserve the lock for that process.
    first, second = open_sync(redis_server.url)[0], open_sync(redis_server.url)[0]
    ns = _ns()
    held = first.acquire(ns, "k", "a", LONG)
    assert isinstance(held, Acquired)
    observer = second.subscribe(Channel("leader", ns, "k"))
    try:
        assert isinstance(second.acquire(ns, "k", "b", LONG), Held)
        assert not raw.exists(C.names(ns, "k").waiters)
        waiter = second.subscribe(Channel("lock", ns, "k"))
        assert isinstance(second.acquire(ns, "k", "b", LONG), Held)  # now it waits
        assert raw.exists(C.names(ns, "k").waiters)
        waiter.close()  # the observer stays, and nobody waits here any more
        assert not raw.exists(C.names(ns, "k").waiters)
    finally:
        observer.close()
        first.close()
        second.close()


@pytest.mark.parametrize("where", ["standalone", "cluster"])
async def test_async_observers_and_a_deferred_waiter(
    where: str, request: pytest.FixtureRequest
) -> None:
    # On asyncio: a value wakes the observer alone; a release handed to a third
    # process's waiter wakes the observer at once and this process's waiter one
    # hand-off window later (the chosen one may not take it).
    url = _url(where, request)
    first = open_async(url, handoff_ms=200)[0]
    second = open_async(url, handoff_ms=200)[0]
    third = open_async(url, handoff_ms=200)[0]
    ns = _ns()
    try:
        # A Cluster client learns the slots with its first call: until then a channel
        # goes to any node's listener, and the waiter and the observer could part.
        assert await second.holders(ns, "k") == []
        waiter = await second.subscribe(Channel("lock", ns, "k"))
        observer = await second.subscribe(Channel("leader", ns, "k"))
        got = await first.acquire(ns, "k", "a", LONG, value=b"v")
        assert isinstance(got, Acquired)
        assert await observer.wait(10) is True
        assert await waiter.wait(0.5) is False
        chosen = await third.subscribe(Channel("lock", ns, "k"))
        assert isinstance(await third.acquire(ns, "k", "c", LONG), Held)  # registers
        assert await first.release(ns, "k", "a", got.token)
        assert await chosen.wait(10) is True
        assert await observer.wait(10) is True
        assert await waiter.wait(10) is True  # the deferred wake
        for sub in (waiter, observer, chosen):
            await sub.aclose()
    finally:
        for s in (first, second, third):
            await s.aclose()


# ---- foreign and corrupt data ---------------------------------------------------------


def test_foreign_data_raises_store_corrupt(store: RedisStore, raw: redis.Redis) -> None:
    ns = _ns()
    n = C.names(ns, "k")
    raw.set(n.claim, b"not a record")
    with pytest.raises(StoreCorrupt):
        store.claim(ns, "k", None, "t", LONG)
    with pytest.raises(StoreCorrupt):
        store.record(ns, "k")
    # A listing shows it as a corrupt row instead of failing (tests/test_redis_faults.py).
    assert [r.state for r in store.records(ns)] == ["corrupt"]
    raw.delete(n.claim)
    raw.rpush(n.claim, b"x")  # wrong type
    with pytest.raises(StoreCorrupt):
        store.complete(ns, "k", "t", b"r", LONG)
    raw.hset(n.lock, mapping={"owner": "someone"})  # a hash, but not ours
    with pytest.raises(StoreCorrupt):
        store.acquire(ns, "k", "me", LONG)
    raw.delete(n.lock)
    raw.hset(n.lock, mapping={"o": "x", "t": "abc", "x": "1"})  # ours, damaged
    with pytest.raises(StoreCorrupt):
        store.lock(ns, "k")
    raw.set(C.gate_name(ns, "res"), b"12abc")
    with pytest.raises(StoreCorrupt):
        store.fence_advance(ns, "res", 5)
    with pytest.raises(StoreCorrupt):
        store.fence_current(ns, "res")
    # A corrupt record is never replayed as a result.
    assert issubclass(StoreCorrupt, StoreUnavailable)


# ---- counted leases: the record's shape -------------------------------------------------
#
# A lock is the limit=1 case of the permit rows, and its record keeps the shape the
# previous release wrote and read: the newest permit in the fields o (owner), t (token,
# the key's counter) and x (expiry ms), hand-off in y/g/n. Other permits of a key with a
# larger limit live in fields "h" + owner. So a lock taken by a process of either release
# is seen held by the other during a rolling upgrade.

#: How the previous release's ACQUIRE decided that a lock is held by someone else (its
#: own script read the fields o and x of the same hash): for the test's reading only.
PREVIOUS_HELD = """
local tm = redis.call('TIME')
local now = math.floor((tonumber(tm[1]) * 1000000 + tonumber(tm[2])) / 1000)
local r = redis.call('HMGET', KEYS[1], 'o', 'x')
if r[2] and tonumber(r[2]) > now and r[1] ~= ARGV[1] then return r[1] end
return false
"""


def _previous_release_record(raw: Any, name: bytes, owner: str, token: int, ttl_ms: int) -> None:
    """A lock as the previous release's ACQUIRE left it (hash o/t/x, PEXPIREAT)."""
    now = _server_ms(raw)
    raw.hset(name, mapping={"o": owner, "t": str(token), "x": str(now + ttl_ms)})
    raw.pexpireat(name, now + ttl_ms + 60_000)


def _server_ms(raw: Any) -> int:
    sec, usec = raw.time()
    return int(sec) * 1000 + int(usec) // 1000


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_a_lock_of_the_previous_release_stays_exclusive(
    where: str, request: pytest.FixtureRequest
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
        name = C.names(ns, "k").lock
        token = _server_ms(rawc) * 1000  # seeded from TIME us, as that release did
        _previous_release_record(rawc, name, "old", token, LONG)
        # Held for a lock and for a caller allowing one permit; shared only by a caller
        # allowing two.
        assert isinstance(s.acquire(ns, "k", "new", LONG), Held)
        assert isinstance(s.acquire(ns, "k", "new", LONG, 1, b"v"), Held)
        row = s.lock(ns, "k")
        assert row is not None and (row.owner, row.token, row.value) == ("old", token, None)
        assert [r.owner for r in s.locks(ns)] == ["old"]
        # The old holder's renew and release (same fields, same meaning) still work.
        assert s.renew(ns, "k", "old", token, LONG) is not None
        assert s.release(ns, "k", "old", token) is True
        got = s.acquire(ns, "k", "new", LONG)
        assert isinstance(got, Acquired) and got.token > token
        # And the other way: a lock taken now reads as held to the previous release.
        assert rawc.eval(PREVIOUS_HELD, 1, name, "old") == b"new"
        assert rawc.hmget(name, *C.LOCK_FIELDS) == [b"new", b"%d" % got.token, ANY_INT]
    finally:
        s.close()
        rawc.close()


class _AnyInt:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, bytes) and other.isdigit()


ANY_INT: Any = _AnyInt()


def test_permits_beside_the_newest_and_what_the_previous_release_sees(
    store: RedisStore, raw: redis.Redis
) -> None:
    ns = _ns()
    name = C.names(ns, "k").lock
    a = store.acquire(ns, "k", "a", LONG, 3, b"pa")
    b = store.acquire(ns, "k", "b", LONG, 3)
    assert isinstance(a, Acquired) and isinstance(b, Acquired)
    fields = raw.hgetall(name)
    # The newest permit in o/t/x (a previous release's process sees the key held), the
    # one before in a field of its own with its value.
    assert (fields[b"o"], int(fields[b"t"])) == (b"b", b.token)
    assert fields[b"ha"] == b"%d:%d:pa" % (a.token, a.expires_ms)
    assert raw.eval(PREVIOUS_HELD, 1, name, "c") == b"b"
    # The newest released: the older permit is still held, the counter kept.
    assert store.release(ns, "k", "b", b.token) is True
    assert raw.eval(PREVIOUS_HELD, 1, name, "c") is None
    assert [(r.owner, r.value) for r in store.holders(ns, "k")] == [("a", b"pa")]
    assert isinstance(store.acquire(ns, "k", "c", LONG, 1), Held)  # a lock counts it
    c = store.acquire(ns, "k", "c", LONG, 2)
    assert isinstance(c, Acquired) and c.token > b.token
    assert [r.owner for r in store.holders(ns, "k")] == ["a", "c"]


def test_expired_permits_are_dropped_and_the_key_outlives_the_longest(
    store: RedisStore, raw: redis.Redis
) -> None:
    ns = _ns()
    name = C.names(ns, "k").lock
    short = store.acquire(ns, "k", "short", 200, 3)
    long = store.acquire(ns, "k", "long", LONG, 3)
    newest = store.acquire(ns, "k", "newest", 1_000, 3)
    assert isinstance(short, Acquired) and isinstance(long, Acquired)
    assert isinstance(newest, Acquired)
    # The key's own expiry covers its longest holder, not its newest.
    assert raw.pttl(name) > LONG - 5_000
    deadline = time.monotonic() + 10
    while _server_ms(raw) <= short.expires_ms:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert raw.hexists(name, "hshort")  # lingers until a script touches the key
    assert store.renew(ns, "k", "long", long.token, LONG) is not None
    assert not raw.hexists(name, "hshort")
    assert [r.owner for r in store.holders(ns, "k")] == ["long", "newest"]


def test_a_freed_permit_is_kept_for_the_oldest_waiter(redis_server: RedisServer) -> None:
    # Two processes' stores; the window (handoff_ms) long enough to look at.
    store = open_sync(redis_server.url, handoff_ms=5000)[0]
    other = open_sync(redis_server.url, handoff_ms=5000)[0]
    ns = _ns()
    a = store.acquire(ns, "k", "a", LONG, 2)
    b = store.acquire(ns, "k", "b", LONG, 2)
    assert isinstance(a, Acquired) and isinstance(b, Acquired)
    sub = store.subscribe(Channel("lock", ns, "k"))
    try:
        assert isinstance(store.acquire(ns, "k", "w", LONG, 2), Held)  # registers
        assert store.release(ns, "k", "a", a.token) is True
        # One holder plus the window kept for the waiter: no room under 2 for another
        # process's newcomer, until the window ends ...
        refused = other.acquire(ns, "k", "x", LONG, 2)
        assert isinstance(refused, Held) and 0 < refused.ttl_ms <= 5_000
        # ... but a caller allowing three finds room beside both.
        y = other.acquire(ns, "k", "y", LONG, 3)
        assert isinstance(y, Acquired)
        # The waiter's process takes the kept slot.
        got = store.acquire(ns, "k", "w", LONG, 3)
        assert isinstance(got, Acquired) and got.token > y.token
        assert [r.owner for r in store.holders(ns, "k")] == ["b", "y", "w"]
    finally:
        sub.close()
        store.close()
        other.close()


def test_a_lock_key_keeps_its_names_in_one_slot() -> None:
    # Every script of a key touches the lock hash and its waiters: one Cluster slot.
    for ns, key in [("a", "b"), ("x:{y}", "{z}"), ("ü", "}{")]:
        n = C.names(ns, key)
        assert key_slot(n.lock) == key_slot(n.waiters) == key_slot(n.claim)


async def test_async_permits_on_cluster(redis_cluster: RedisCluster) -> None:
    s = open_async(redis_cluster.url)[0]
    try:
        ns = _ns()
        got = [await s.acquire(ns, f"k{i % 5}", f"o{i}", LONG, 2) for i in range(15)]
        assert sum(isinstance(g, Acquired) for g in got) == 10
        rows = await s.locks(ns)
        assert sorted((r.key, r.owner) for r in rows) == sorted(
            (f"k{i % 5}", f"o{i}") for i in range(10)
        )
        first = got[0]
        assert isinstance(first, Acquired)
        assert await s.break_lock(ns, "k0", first.token) is True
        assert [r.owner for r in await s.holders(ns, "k0")] == ["o5"]
    finally:
        await s.aclose()


# ---- URLs and clients -------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis://localhost:notaport/0",
        "redis://localhost/notadb",
        "redis://localhost/0?bogus_option=1",
        "redis://localhost/0?socket_timeout=soon",
        "redis:///0",
        "unix://",
        "redis+cluster://",
        "redis+cluster://h1:1,h2:x",
        "redis+cluster://h1:1/3",
        "redis+cluster://h1:1?nonsense=2",
        "redis://localhost/0?counter_ttl=0",
        "redis://localhost/0?handoff_ms=-1",
    ],
)
def test_bad_urls_raise_configuration_error(url: str) -> None:
    with pytest.raises(ConfigurationError):
        idemlock.connect(url)
    with pytest.raises(ConfigurationError):
        idemlock.aio.connect(url)


def test_unreachable_server_is_store_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # nothing listens once the socket closes
    coord = idemlock.connect(f"redis://127.0.0.1:{dead}/0")
    with pytest.raises(StoreUnavailable) as info:
        coord.lock("l").acquire("k")
    assert isinstance(info.value.__cause__, redis.ConnectionError)
    coord.close()


def test_url_options_reach_the_store_and_the_client(redis_server: RedisServer) -> None:
    store = open_sync(f"{redis_server.url}?counter_ttl=5&handoff_ms=0&socket_timeout=2")[0]
    assert store._keep == 5000 and store._handoff == 0
    assert store.client.connection_pool.connection_kwargs["socket_timeout"] == 2.0
    store.close()


async def test_existing_clients_of_every_kind(
    redis_server: RedisServer, redis_cluster: RedisCluster
) -> None:
    port = redis_server.port
    nodes = [redis.cluster.ClusterNode("127.0.0.1", p) for p in redis_cluster.ports]
    anodes = [redis.asyncio.cluster.ClusterNode("127.0.0.1", p) for p in redis_cluster.ports]
    sync_clients = [
        redis.Redis(port=port),
        redis.Redis(port=port, decode_responses=True),  # results stay bytes anyway
        redis.cluster.RedisCluster(startup_nodes=nodes),
    ]
    for client in sync_clients:
        coord = idemlock.connect(client, key_prefix="c" + uuid.uuid4().hex[:8])
        port_ = coord.idempotency("ops")
        claim = port_.claim("k", payload={"n": 1})
        assert isinstance(claim, Claimed)
        port_.complete(claim.token, {"bytes": "é\u00ff"})
        again = port_.claim("k", payload={"n": 1})
        assert isinstance(again, Completed) and again.result == {"bytes": "é\u00ff"}
        rows = coord.keys()
        assert [r.key for r in rows] == ["k"]
        coord.close()
        assert client.ping()  # idemlock does not close a client it was given
        client.close()
    async_clients = [
        redis.asyncio.Redis(port=port),
        redis.asyncio.cluster.RedisCluster(startup_nodes=anodes),
    ]
    for aclient in async_clients:
        acoord = idemlock.aio.connect(aclient, key_prefix="a" + uuid.uuid4().hex[:8])
        lease = await acoord.lock("l").acquire("k")
        assert lease is not None
        assert [(i.key, i.token) for i in await acoord.locks()] == [("k", lease.token)]
        assert await acoord.lock("l").release(lease)
        await acoord.close()
        assert await aclient.ping()
        await aclose_client(aclient)


def test_clients_of_the_wrong_kind_are_refused(redis_server: RedisServer) -> None:
    with pytest.raises(ConfigurationError):
        idemlock.connect(redis.asyncio.Redis(port=redis_server.port))
    with pytest.raises(ConfigurationError):
        idemlock.aio.connect(redis.Redis(port=redis_server.port))
    with pytest.raises(ConfigurationError):
        from_client(redis.Redis(port=redis_server.port), asynchronous=False, max_keys=3)
    assert isinstance(from_client(redis.Redis(), asynchronous=False)[0], RedisStore)
    assert isinstance(from_client(redis.asyncio.Redis(), asynchronous=True)[0], AsyncRedisStore)


# ---- Cluster --------------------------------------------------------------------------


def test_cluster_listings_cover_every_master(redis_cluster: RedisCluster) -> None:
    coord = idemlock.connect(redis_cluster.url, key_prefix="ls" + uuid.uuid4().hex[:6])
    port = coord.idempotency("orders")
    locks = coord.lock(LockSpec("jobs", ttl=timedelta(seconds=60)))
    keys = [f"key-{i}" for i in range(30)]
    for k in keys:
        claim = port.claim(k)
        assert isinstance(claim, Claimed)
        if k.endswith("0"):
            port.complete(claim.token, k)
        assert locks.acquire(k) is not None
    # The records really live on all three masters.
    masters = set()
    client = coord.store.client
    for k in keys:
        node = client.get_node_from_key(C.names(port._ns, k).claim)
        masters.add(node.name)
    assert len(masters) == 3
    rows = coord.keys()
    assert sorted(r.key for r in rows) == sorted(keys)
    assert {r.state for r in rows} == {"in_flight", "completed"}
    assert sorted(i.key for i in coord.locks()) == sorted(keys)
    coord.close()


async def test_cluster_async_listing_and_waiting(redis_cluster: RedisCluster) -> None:
    prefix = "al" + uuid.uuid4().hex[:6]
    a = idemlock.aio.connect(redis_cluster.url, key_prefix=prefix)
    b = idemlock.aio.connect(redis_cluster.url, key_prefix=prefix)
    spec = LockSpec("jobs", ttl=timedelta(seconds=60))
    leases = [await a.lock(spec).acquire(f"k{i}") for i in range(10)]
    assert sorted(i.key for i in await b.locks()) == sorted(f"k{i}" for i in range(10))
    waiting = asyncio.create_task(b.lock(spec).acquire("k3", wait=10))
    await asyncio.sleep(0.1)
    lease = leases[3]
    assert lease is not None
    await a.lock(spec).release(lease)
    got = await waiting
    assert got is not None and got.token is not None and lease.token is not None
    assert got.token > lease.token
    await a.close()
    await b.close()


AWKWARD = ["a:b", "a}b", "{a}b", "a{b}", "{}", "}{", "a|b", "a%7Cb", "a%25", "{a", "ü:{x}|y"]


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_awkward_keys_never_collide(
    where: str, redis_server: RedisServer, redis_cluster: RedisCluster
) -> None:
    url = redis_server.url if where == "standalone" else redis_cluster.url
    store = open_sync(url)[0]
    try:
        base = "t" + uuid.uuid4().hex[:6]
        pairs = [(base + ns, key) for ns in ("", ":a", ":a|b", ":a%7Cb", ":{x}") for key in AWKWARD]
        for i, (ns, key) in enumerate(pairs):
            assert isinstance(store.claim(ns, key, None, f"t{i}", LONG), Granted)
            assert isinstance(store.acquire(ns, key, f"o{i}", LONG), Acquired)
        # Every pair got a record of its own: a second claim of each sees only its own.
        for i, (ns, key) in enumerate(pairs):
            again = store.claim(ns, key, None, f"t{i}", LONG)
            assert isinstance(again, Granted), (ns, key)
            row = store.lock(ns, key)
            assert row is not None and row.owner == f"o{i}" and (row.ns, row.key) == (ns, key)
        listed = {(r.ns, r.key) for r in store.records(base)}
        assert listed == set(pairs)
        assert {(r.ns, r.key) for r in store.locks(base + ":a|")} == {
            p for p in pairs if p[0].startswith(base + ":a|")
        }
        assert {(r.ns, r.key) for r in store.records(base + ":a%")} == {
            p for p in pairs if p[0].startswith(base + ":a%")
        }
    finally:
        store.close()


def test_mismatch_and_keys_with_braces_on_cluster(redis_cluster: RedisCluster) -> None:
    store = open_sync(redis_cluster.url)[0]
    try:
        ns = _ns()
        assert isinstance(store.claim(ns, "{tag}k", "fp1", "t1", LONG), Granted)
        assert store.claim(ns, "{tag}k", "fp2", "t2", LONG) == Mismatch("in_flight")
        assert isinstance(store.claim(ns, "{tag}k2", "fp2", "t2", LONG), Granted)
    finally:
        store.close()


def test_set_if_fresh_on_cluster_needs_the_resource_slot(redis_cluster: RedisCluster) -> None:
    coord = idemlock.connect(redis_cluster.url, key_prefix="f" + uuid.uuid4().hex[:6])
    raw = redis.cluster.RedisCluster(
        startup_nodes=[redis.cluster.ClusterNode("127.0.0.1", p) for p in redis_cluster.ports]
    )
    try:
        gate = coord.fence("balance:42")
        assert gate.set_if_fresh(5, "balance:42", b"100") == 5  # the resource itself
        tagged = coord.fence("{acct:42}")
        assert tagged.set_if_fresh(7, "{acct:42}:balance", "70") == 7  # a shared tag
        assert raw.get("{acct:42}:balance") == b"70"
        with pytest.raises(FencedOut):
            tagged.set_if_fresh(6, "{acct:42}:balance", b"60")
        assert raw.get("{acct:42}:balance") == b"70"
        odd = coord.fence("a}b")  # no hash tag, and a brace: placed by slot number
        assert odd.set_if_fresh(1, "a}b", b"x") == 1
        assert key_slot(C.gate_name(odd._ns, "a}b")) == key_slot(b"a}b")
        with pytest.raises(ConfigurationError):
            gate.set_if_fresh(9, "elsewhere", b"x")
    finally:
        raw.close()
        coord.close()


# ---- effects written with the completion ------------------------------------------------


def test_complete_with_writes_commits_effects_and_record_together(
    redis_server: RedisServer, raw: redis.Redis
) -> None:
    coord = idemlock.connect(redis_server.url, key_prefix=_ns().replace(":", "-"))
    port = coord.idempotency(IdempotencySpec("pay", lease=timedelta(seconds=0.3)))
    effect = f"balance:{uuid.uuid4().hex}"
    try:
        claim = port.claim("job-1")
        assert isinstance(claim, Claimed)
        port.complete(claim.token, {"ok": 1}, writes={effect: b"100"})
        assert raw.get(effect) == b"100"
        replay = port.claim("job-1")
        assert isinstance(replay, Completed) and replay.result == {"ok": 1}

        # A stale attempt writes nothing: its lease ran out and another took over.
        late = port.claim("job-2")
        assert isinstance(late, Claimed)
        time.sleep(0.4)
        fresh = port.claim("job-2")
        assert isinstance(fresh, Claimed) and fresh.fence > late.fence
        with pytest.raises(idemlock.StaleClaim):
            port.complete(late.token, "late", writes={effect: b"-1"})
        assert raw.get(effect) == b"100"
        port.complete(fresh.token, "fresh", writes={effect: b"90"})
        assert raw.get(effect) == b"90"
    finally:
        coord.close()


def test_complete_with_writes_on_cluster_needs_the_claim_slot(
    redis_cluster: RedisCluster,
) -> None:
    coord = idemlock.connect(redis_cluster.url, key_prefix="cw" + uuid.uuid4().hex[:8])
    port = coord.idempotency("pay")
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0])
    try:
        claim = port.claim("job")
        assert isinstance(claim, Claimed)
        with pytest.raises(ConfigurationError) as info:
            port.complete(claim.token, 1, writes={"elsewhere": b"x"})
        assert "port.write_key(key, 'elsewhere')" in str(info.value)
        status = port.status("job")
        assert status is not None and status.state == "in_flight"  # nothing happened
        # write_key names keys in the claim's slot, whatever the slot of the name alone.
        effects = [port.write_key("job", f"effect:{i}") for i in range(20)]
        slots = {redis.crc.key_slot(e.encode()) for e in effects}
        assert len(slots) == 1 and effects[0].endswith("}:effect:0")
        port.complete(claim.token, 1, writes=dict.fromkeys(effects, b"x"))
        assert [client.get(e) for e in effects] == [b"x"] * 20
        assert port.write_key("other-job", "effect:0") != effects[0]
    finally:
        client.close()
        coord.close()


@pytest.mark.parametrize("keyring", [False, True])
def test_write_key_on_standalone_redis_sync_and_async(
    redis_server: RedisServer, raw: redis.Redis, keyring: bool
) -> None:
    """The names write_key gives work on standalone Redis too (one program runs on both),
    from either face, with a keyring (the store then sees the key's HMAC) or without."""
    import asyncio

    options: dict[str, Any] = {"key_prefix": _ns().replace(":", "-")}
    if keyring:
        options["keyring"] = idemlock.Keyring({"k1": b"s" * 32}, "k1", b"L" * 32)
    coord = idemlock.connect(redis_server.url, **options)
    port = coord.idempotency("pay")
    try:
        claim = port.claim("job")
        assert isinstance(claim, Claimed)
        name = port.write_key("job", "balance")
        port.complete(claim.token, "done", writes={name: b"7"})
        assert raw.get(name) == b"7"

        async def from_asyncio() -> str:
            aco = idemlock.aio.connect(redis_server.url, **options)
            try:
                return aco.idempotency("pay").write_key("job", "balance")
            finally:
                await aco.close()

        assert asyncio.run(from_asyncio()) == name
        with pytest.raises(idemlock.InvalidKey):
            port.write_key("job", "")
    finally:
        coord.close()


def test_complete_with_writes_elsewhere_is_refused() -> None:
    coord = idemlock.connect("memory://")
    port = coord.idempotency("pay")
    claim = port.claim("job")
    assert isinstance(claim, Claimed)
    with pytest.raises(ConfigurationError):
        port.complete(claim.token, 1, writes={"k": b"v"})
    status = port.status("job")
    assert status is not None and status.state == "in_flight"  # nothing was recorded
    with pytest.raises(ConfigurationError, match="complete_in_transaction"):
        port.write_key("job", "k")  # no store-side writes here: no name to give


# ---- steps inside a claim: the hash beside the record -----------------------------------


def test_a_claim_key_keeps_its_steps_in_its_slot() -> None:
    # Every step transition touches the record and its steps: one Cluster slot.
    for ns, key in [("a", "b"), ("x:{y}", "{z}"), ("ü", "}{")]:
        n = C.names(ns, key)
        assert key_slot(n.steps) == key_slot(n.claim)
        assert n.steps != n.claim and C.parse_name(n.steps, "c") is None


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_steps_hash_follows_the_claim(where: str, request: pytest.FixtureRequest) -> None:
    """The steps hash (fence + marker or '=' result per field) sits beside the record
    on its node, its end (PEXPIREAT) is max(end, now + ttl) at each step, the record's
    end at complete; abandon keeps it, forget deletes it, an expired one is not revived."""
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
        n = C.names(ns, "k")
        first = s.claim(ns, "k", None, "aa", LONG)
        assert isinstance(first, Granted) and first.steps == ()
        assert rawc.exists(n.steps) == 0  # no steps, no hash
        assert s.step(ns, "k", "aa", "charge", b"ch_1", LONG, LONG) is not None
        assert s.step(ns, "k", "aa", "email", None, LONG, 2 * LONG) is not None
        if where == "cluster":  # on the record's node, read there
            node = rawc.get_node_from_key(n.claim)
            assert rawc.get_node_from_key(n.steps) == node
            assert rawc.keyslot(n.steps) == rawc.keyslot(n.claim)
        fence = first.fence.to_bytes(7, "big")
        assert rawc.hgetall(n.steps) == {b"charge": fence + b"=ch_1", b"email": fence}
        end = rawc.pexpiretime(n.steps)
        # max(end, now + ttl): a shorter ttl keeps the end, a longer one moves it
        assert s.step(ns, "k", "aa", "charge", b"ch_2", LONG, 1_000) is not None
        assert rawc.pexpiretime(n.steps) == end
        assert s.drop_step(ns, "k", "aa", "email", LONG) is not None
        assert s.step(ns, "k", "aa", "email", None, LONG, 3 * LONG) is not None
        assert rawc.pexpiretime(n.steps) > end
        # abandon leaves the steps, with their end; the next grant carries them
        assert s.abandon(ns, "k", "aa")
        assert rawc.pexpiretime(n.steps) > end
        again = s.claim(ns, "k", None, "bb", LONG)
        assert isinstance(again, Granted)
        assert sorted((r.name, r.fence, r.result) for r in again.steps) == [
            ("charge", first.fence, b"ch_2"),
            ("email", first.fence, None),
        ]
        # complete: the steps end with the completed record, exactly
        assert s.complete(ns, "k", "bb", b"done", 5_000)
        row = s.record(ns, "k")
        assert row is not None and rawc.pexpiretime(n.steps) == row.expires_ms
        # forget drops them with the record
        assert s.forget(ns, "k")
        assert rawc.exists(n.steps) == 0 and s.steps(ns, "k") == []

        # an expired hash is gone (Redis expires it): the next step starts a new one
        third = s.claim(ns, "k", None, "cc", LONG)
        assert isinstance(third, Granted)
        assert s.step(ns, "k", "cc", "old", b"1", LONG, 1) is not None
        deadline = time.monotonic() + 30
        while rawc.exists(n.steps) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.steps(ns, "k") == []
        assert s.step(ns, "k", "cc", "new", b"2", LONG, LONG) is not None
        assert [r.name for r in s.steps(ns, "k")] == ["new"]
    finally:
        s.close()
        rawc.close()


def test_foreign_steps_are_store_corrupt_and_change_nothing(
    store: RedisStore, raw: redis.Redis
) -> None:
    ns = _ns()
    n = C.names(ns, "k")
    raw.hset(n.steps, mapping={"s": b"not a step"})  # a hash, but not ours
    with pytest.raises(StoreCorrupt):
        store.claim(ns, "k", None, "aa", LONG)
    assert store.record(ns, "k") is None  # the claim was refused before any write
    with pytest.raises(StoreCorrupt):
        store.steps(ns, "k")
    raw.delete(n.steps)
    granted = store.claim(ns, "k", None, "aa", LONG)
    assert isinstance(granted, Granted)
    raw.hset(n.steps, mapping={"s": b"\x00" * 7 + b"?x"})  # a fence, then no '='
    with pytest.raises(StoreCorrupt):
        store.claim(ns, "k", None, "aa", LONG)  # claim.resend reads them too
    raw.delete(n.steps)
    raw.rpush(n.steps, b"x")  # wrong type
    with pytest.raises(StoreCorrupt):
        store.step(ns, "k", "aa", "s", b"1", 1_000, LONG)
    with pytest.raises(StoreCorrupt):
        store.drop_step(ns, "k", "aa", "s", 1_000)
    row = store.record(ns, "k")  # neither renewed the lease
    assert row is not None and row.expires_ms == granted.expires_ms
    with pytest.raises(StoreCorrupt):
        store.steps(ns, "k")
    raw.delete(n.steps)


async def test_async_steps_on_cluster(redis_cluster: RedisCluster) -> None:
    s = open_async(redis_cluster.url)[0]
    try:
        ns = _ns()
        keys = [f"k{i}" for i in range(9)]  # spread over the three masters
        for k in keys:
            g = await s.claim(ns, k, None, "aa", LONG)
            assert isinstance(g, Granted)
            assert await s.step(ns, k, "aa", "s", k.encode(), LONG, LONG) is not None
        for k in keys:
            assert [(r.name, r.result) for r in await s.steps(ns, k)] == [("s", k.encode())]
            assert await s.abandon(ns, k, "aa")
            g = await s.claim(ns, k, None, "bb", LONG)
            assert isinstance(g, Granted) and [r.result for r in g.steps] == [k.encode()]
    finally:
        await s.aclose()
