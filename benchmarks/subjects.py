"""The subjects: each store's raw baseline, idemlock through its API (and its store
port alone), and each peer, as the functions the scenarios time.

Per store, a ``*Bench`` adapter builds a scenario's subjects on fresh clients:
``sync_fns(op, ...)`` and ``async_fns(op, tasks, ...)`` for the pairs, ``job_fns(...)``
for the crash-safe job, ``counting()`` for counting round trips, and ``lock_pair(...)``
gives one contender's acquire/release for the contention scenario. Baselines: the raw
driver doing the same work in the same round trips (``BASELINES`` in common.py says
which, for each store); peers are optional imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import selectors
import socket
import sqlite3
import threading
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import psycopg_pool
import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from common import (
    BASE,
    CLAIM_OP,
    CLIENT,
    FK,
    HAVE_ASYNCPG,
    IK,
    JOB,
    JOB_OP,
    KEEP,
    LOCK,
    LOCK_OP,
    OURS,
    OURS_AIO,
    OURS_PORT,
    OURS_TX,
    OURS_W,
    PRL,
    PT,
    RESULT,
    RPY,
    SCALE,
    SPEC,
    UNC,
    Make,
    Results,
    SyncFn,
    _fail,
    apeer,
    new_prefix,
    peer,
)

import idemlock
import idemlock.aio
from idemlock import Claimed, FencedOut
from idemlock.stores.postgres import fenced as PF
from idemlock.stores.redis import _common as C
from idemlock.stores.sqlite import _SCHEMA

# Powertools warns on every call outside Lambda that it cannot tell the time left (no
# Lambda context); its Redis layer's class is marked deprecated in favour of an alias.
warnings.filterwarnings("ignore", message="Couldn't determine the remaining time")
warnings.filterwarnings("ignore", message="RedisCachePersistenceLayer will be removed")

RESULT_BYTES = b"J" + b"x" * 40  # what the raw baselines store as a result
LEASE_MS, TTL_MS = 300_000, 3_600_000

# ---- the baseline: raw redis-py on idemlock's own scripts ------------------------------


class Raw:
    """EVALSHA of idemlock's scripts with the arguments the store would send."""

    def __init__(self, client: Any) -> None:
        self.r = client
        self.ns = "raw" + uuid.uuid4().hex[:6] + ":jobs"

    def lock_args(self, key: str) -> tuple[C.Names, tuple[Any, ...]]:
        n = C.names(self.ns, key)
        return n, ("owner-" + key, 30_000, KEEP, b"", b"", C.REGISTER_MS)

    def sync_lock_pairs(self, count: int, key: str = "k") -> None:
        n, args = self.lock_args(key)
        r = self.r
        for _ in range(count):
            reply = r.evalsha(C.ACQUIRE.sha, 2, n.lock, n.waiters, *args)
            r.evalsha(
                C.RELEASE.sha, 2, n.lock, n.waiters, args[0], reply[1], KEEP, 10,
                n.lock_channel, C.nonce(),
            )  # fmt: skip

    def sync_claim_pairs(self, count: int) -> None:
        r = self.r
        fp = C.pack_id("ab" * 32)
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            n = C.names(self.ns, f"{tag}-{i}")
            tok = C.pack_id(uuid.uuid4().hex)
            r.evalsha(C.CLAIM.sha, 1, n.claim, fp, tok, 300_000, KEEP)
            r.evalsha(C.COMPLETE.sha, 1, n.claim, tok, b"J" + b"x" * 40, 3_600_000,
                      n.claim_channel, C.nonce())  # fmt: skip

    async def async_lock_pairs(self, count: int, key: str = "k") -> None:
        n, args = self.lock_args(key)
        r = self.r
        for _ in range(count):
            reply = await r.evalsha(C.ACQUIRE.sha, 2, n.lock, n.waiters, *args)
            await r.evalsha(
                C.RELEASE.sha, 2, n.lock, n.waiters, args[0], reply[1], KEEP, 10,
                n.lock_channel, C.nonce(),
            )  # fmt: skip

    async def async_claim_pairs(self, count: int, tag: str = "") -> None:
        r = self.r
        fp = C.pack_id("ab" * 32)
        tag = tag or uuid.uuid4().hex[:6]
        for i in range(count):
            n = C.names(self.ns, f"{tag}-{i}")
            tok = C.pack_id(uuid.uuid4().hex)
            await r.evalsha(C.CLAIM.sha, 1, n.claim, fp, tok, 300_000, KEEP)
            await r.evalsha(C.COMPLETE.sha, 1, n.claim, tok, b"J" + b"x" * 40, 3_600_000,
                            n.claim_channel, C.nonce())  # fmt: skip


def load_scripts(r: redis.Redis) -> None:
    for s in (C.ACQUIRE, C.RELEASE, C.CLAIM, C.COMPLETE):
        assert r.script_load(s.text) == s.sha


# ---- idemlock through its public API ----------------------------------------------------


def ours_lock_pairs(coord: idemlock.Coordinator) -> Callable[[int], None]:
    locks = coord.lock(LOCK)

    def run(count: int) -> None:
        for _ in range(count):
            lease = locks.acquire("k")
            assert lease is not None
            locks.release(lease)

    return run


def ours_claim_pairs(coord: idemlock.Coordinator) -> Callable[[int], None]:
    port = coord.idempotency(SPEC)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            claim = port.claim(f"{tag}-{i}")
            assert isinstance(claim, Claimed)
            port.complete(claim.token, RESULT)

    return run


def ours_job(coord: idemlock.Coordinator) -> Callable[[int], None]:
    port = coord.idempotency(SPEC)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            claim = port.claim(key)
            assert isinstance(claim, Claimed)
            coord.fence(f"out:{key}").set_if_fresh(claim.fence, f"out:{key}", b"done")
            port.complete(claim.token, RESULT)

    return run


def ours_job_together(coord: idemlock.Coordinator) -> Callable[[int], None]:
    """The same job with its effect written by the completing script: the effect and
    the record commit together (2 round trips), and no late write can land after it."""
    port = coord.idempotency(SPEC)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            claim = port.claim(key)
            assert isinstance(claim, Claimed)
            port.complete(claim.token, RESULT, writes={f"out:{key}": b"done"})

    return run


# ---- peers ---------------------------------------------------------------------------


def redispy_lock_pairs(r: redis.Redis, name: str = "peer:redis-py") -> Callable[[int], None]:
    def run(count: int) -> None:
        for _ in range(count):
            lock = r.lock(name, timeout=30)
            assert lock.acquire(blocking=False)
            lock.release()

    return run


def prl_lock_pairs(
    r: redis.Redis, name: str = "peer:prl", strict: bool = True
) -> Callable[[int], None]:
    """``strict=False`` lets python-redis-lock take a RedisCluster client (then ``name``
    needs a hash tag, e.g. ``{peer:prl}``, for its lock and signal keys to share a slot)."""
    import redis_lock

    def run(count: int) -> None:
        for _ in range(count):
            lock = redis_lock.Lock(r, name, expire=30, strict=strict)
            assert lock.acquire(blocking=False)
            lock.release()

    return run


def fencekit_lock_pairs(r: redis.Redis, prefix: str = "fk") -> Callable[[int], None]:
    import fencekit

    dl = fencekit.DistributedLock(r, prefix=prefix)
    ttl = timedelta(seconds=30)

    def run(count: int) -> None:
        for _ in range(count):
            dl.release(dl.acquire("peer", ttl=ttl))

    return run


def fencekit_guard_pairs(r: redis.Redis, prefix: str = "fk") -> Callable[[int], None]:
    import fencekit

    guard = fencekit.IdempotencyGuard(r, prefix=prefix)
    ttl = timedelta(hours=1)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            assert guard.try_begin(key, ttl=ttl)
            guard.mark_done(key, result=RESULT, ttl=ttl)

    return run


def fencekit_job(r: redis.Redis, prefix: str = "fkj") -> Callable[[int], None]:
    """On a Cluster, give ``prefix`` a hash tag (``{fkj}``): the fenced write's key and
    fencekit's gate keys must share a slot."""
    import fencekit

    guard = fencekit.IdempotencyGuard(r, prefix=prefix)
    lock = fencekit.DistributedLock(r, prefix=prefix)
    gate = fencekit.FenceGate(r, prefix=prefix)
    ttl = timedelta(seconds=300)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            assert guard.try_begin(key, ttl=ttl)
            handle = lock.acquire(key, ttl=ttl, owner_id=guard.owner_id)
            gate.set_if_fresh(handle.token, f"{prefix}out:{key}", "done")
            guard.mark_done(key, result=RESULT, ttl=timedelta(hours=1))
            lock.release(handle)

    return run


def port_lock_pairs(coord: idemlock.Coordinator) -> SyncFn:
    """The store port alone: what the store adapter costs, without the API's own work
    per call (key checks, fingerprint, result encoding, typed outcomes)."""
    store, owner = coord.store, uuid.uuid4().hex

    def run(count: int) -> None:
        for _ in range(count):
            reply = store.acquire("bench", "k", owner, 30_000)
            store.release("bench", "k", owner, reply.token)

    return run


def port_claim_pairs(coord: idemlock.Coordinator) -> SyncFn:
    store = coord.store

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            token = uuid.uuid4().hex
            store.claim("bench", f"{tag}-{i}", "fp", token, LEASE_MS)
            store.complete("bench", f"{tag}-{i}", token, RESULT_BYTES, TTL_MS)

    return run


# ---- raw sqlite3 ------------------------------------------------------------------

SQ_NS = "bench:job"
SQ_RESULT = b'{"ok":true,"id":12345}'
SQ_TTL_MS = 86_400_000

_keys = itertools.count()


def sq_fresh_keys(n: int) -> list[str]:
    return [f"k{next(_keys)}" for _ in range(n)]


# ---- raw sqlite3 baseline ----------------------------------------------------------


def sq_open_raw(path: str) -> sqlite3.Cursor:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    for stmt in _SCHEMA:  # the store's own schema, indexes included
        conn.execute(stmt)
    return conn.cursor()


SQ_INSERT_CLAIM = (
    "INSERT INTO claims (ns, key, state, token, fence, fp, expires_ms, result) "
    "VALUES (?, ?, 'in_flight', ?, ?, NULL, ?, NULL)"
)
SQ_COMPLETE = (
    "UPDATE claims SET state = 'completed', result = ?, expires_ms = ? WHERE ns = ? AND key = ?"
)
SQ_INSERT_LOCK = "INSERT INTO locks (ns, key, owner, token, expires_ms) VALUES (?, ?, ?, ?, ?)"
SQ_DELETE_LOCK = "DELETE FROM locks WHERE ns = ? AND key = ?"


def sq_claim_complete(cur: sqlite3.Cursor, n: int) -> float:
    keys = sq_fresh_keys(n)
    start = time.perf_counter()
    for i, key in enumerate(keys):
        now = time.time_ns() // 1_000_000
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(SQ_INSERT_CLAIM, (SQ_NS, key, "token", i, now + LEASE_MS))
        cur.execute("COMMIT")
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(SQ_COMPLETE, (SQ_RESULT, now + SQ_TTL_MS, SQ_NS, key))
        cur.execute("COMMIT")
    return time.perf_counter() - start


def sq_acquire_release(cur: sqlite3.Cursor, n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        now = time.time_ns() // 1_000_000
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(SQ_INSERT_LOCK, (SQ_NS, "shared", "owner", i, now + 30_000))
        cur.execute("COMMIT")
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(SQ_DELETE_LOCK, (SQ_NS, "shared"))
        cur.execute("COMMIT")
    return time.perf_counter() - start


# ---- raw psycopg ---------------------------------------------------------------------

# ---- raw psycopg baseline ------------------------------------------------------------

PG_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS raw;
CREATE SEQUENCE IF NOT EXISTS raw.seq;
CREATE TABLE IF NOT EXISTS raw.claims (
    ns text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL, state text NOT NULL,
    token text NOT NULL, fence bigint NOT NULL, fp text, expires_ms bigint NOT NULL,
    result bytea, PRIMARY KEY (ns, key));
CREATE INDEX IF NOT EXISTS claims_expires_idx ON raw.claims (expires_ms);
CREATE TABLE IF NOT EXISTS raw.locks (
    ns text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL, owner text NOT NULL,
    token bigint NOT NULL, expires_ms bigint NOT NULL, PRIMARY KEY (ns, key));
CREATE INDEX IF NOT EXISTS locks_expires_idx ON raw.locks (expires_ms);
"""
PG_CLAIM = (
    b"INSERT INTO raw.claims (ns, key, state, token, fence, fp, expires_ms) "
    b"VALUES (%s, %s, 'in_flight', %s, nextval('raw.seq'), %s, %s) "
    b"ON CONFLICT (ns, key) DO NOTHING RETURNING fence, expires_ms"
)
PG_COMPLETE = (
    b"UPDATE raw.claims SET state = 'completed', result = %s, expires_ms = %s "
    b"WHERE ns = %s AND key = %s AND token = %s AND state = 'in_flight' RETURNING 1"
)
PG_ACQUIRE = (
    b"INSERT INTO raw.locks AS l (ns, key, owner, token, expires_ms) "
    b"VALUES (%s, %s, %s, nextval('raw.seq'), %s) ON CONFLICT (ns, key) DO UPDATE "
    b"SET owner = excluded.owner, token = excluded.token, expires_ms = excluded.expires_ms "
    b"WHERE l.expires_ms <= %s RETURNING token"
)
PG_RELEASE = (
    b"DELETE FROM raw.locks WHERE ns = %s AND key = %s AND owner = %s AND token = %s RETURNING 1"
)


def pg_now_ms() -> int:
    return int(time.time() * 1000)


def pg_sync_claims(conn: psycopg.Connection[Any], n: int) -> float:
    run = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    for i in range(n):
        key, token = f"{run}-{i}", uuid.uuid4().hex
        conn.execute(PG_CLAIM, ("ns", key, token, "fp", pg_now_ms() + 300_000), prepare=True)
        conn.execute(
            PG_COMPLETE, (b"j1", pg_now_ms() + 86_400_000, "ns", key, token), prepare=True
        ).fetchall()
    return n / (time.perf_counter() - t0)


def pg_sync_locks(conn: psycopg.Connection[Any], n: int) -> float:
    owner = uuid.uuid4().hex
    t0 = time.perf_counter()
    for i in range(n):
        key, now = f"k{i % 16}", pg_now_ms()
        row = conn.execute(
            PG_ACQUIRE, ("ns", key, owner, now + 30_000, now), prepare=True
        ).fetchone()
        assert row is not None
        conn.execute(PG_RELEASE, ("ns", key, owner, row[0]), prepare=True).fetchall()
    return n / (time.perf_counter() - t0)


async def pg_async_claims(conn: psycopg.AsyncConnection[Any], n: int) -> float:
    run = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    for i in range(n):
        key, token = f"{run}-{i}", uuid.uuid4().hex
        await conn.execute(PG_CLAIM, ("ns", key, token, "fp", pg_now_ms() + 300_000), prepare=True)
        cur = await conn.execute(
            PG_COMPLETE, (b"j1", pg_now_ms() + 86_400_000, "ns", key, token), prepare=True
        )
        await cur.fetchall()
    return n / (time.perf_counter() - t0)


async def pg_async_locks(conn: psycopg.AsyncConnection[Any], n: int) -> float:
    owner = uuid.uuid4().hex
    t0 = time.perf_counter()
    for i in range(n):
        key, now = f"k{i % 16}", pg_now_ms()
        cur = await conn.execute(PG_ACQUIRE, ("ns", key, owner, now + 30_000, now), prepare=True)
        row = await cur.fetchone()
        assert row is not None
        cur = await conn.execute(PG_RELEASE, ("ns", key, owner, row[0]), prepare=True)
        await cur.fetchall()
    return n / (time.perf_counter() - t0)


async def pg_idemkit(dsn: str, max_size: int = 4) -> Any:
    try:
        from idemkit.backends.postgres import PostgresBackend, init_pg
    except ImportError:
        return None
    try:
        await init_pg(dsn)
    except ImportError:  # idemkit without asyncpg
        return None
    return PostgresBackend.from_url(dsn, min_size=1, max_size=max_size)


@contextlib.contextmanager
def count_redis_requests() -> Iterator[Callable[[], int]]:
    """Requests redis-py writes to its sockets (sync and asyncio): one per command, one
    per pipeline. Counted on the client because the server's INFO commandstats also
    counts every command a Lua script calls, which is no round trip."""
    import redis.asyncio.connection as aconn
    import redis.connection as sconn

    box = [0]
    s_orig = sconn.AbstractConnection.send_packed_command
    a_orig = aconn.AbstractConnection.send_packed_command

    def s_send(self: Any, command: Any, check_health: bool = True) -> Any:
        box[0] += 1
        return s_orig(self, command, check_health)

    async def a_send(self: Any, command: Any, check_health: bool = True) -> Any:
        box[0] += 1
        return await a_orig(self, command, check_health)

    sconn.AbstractConnection.send_packed_command = s_send  # type: ignore[method-assign]
    aconn.AbstractConnection.send_packed_command = a_send  # type: ignore[method-assign]
    try:
        yield lambda: box[0]
    finally:
        sconn.AbstractConnection.send_packed_command = s_orig  # type: ignore[method-assign]
        aconn.AbstractConnection.send_packed_command = a_orig  # type: ignore[method-assign]


@contextlib.contextmanager
def count_sqlite_transactions() -> Iterator[Callable[[], int]]:
    """Transactions run on SQLite connections opened meanwhile (every BEGIN, and every
    statement run outside one, which SQLite runs as a transaction of its own)."""
    real = sqlite3.connect
    box = [0]

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = real(*args, **kwargs)
        inside = [False]

        def trace(sql: str) -> None:
            head = sql.lstrip()[:8].upper()
            if head.startswith("BEGIN"):
                box[0] += 1
                inside[0] = True
            elif head.startswith(("COMMIT", "END", "ROLLBACK")):
                inside[0] = False
            elif not inside[0]:
                box[0] += 1

        conn.set_trace_callback(trace)
        return conn

    sqlite3.connect = connect  # type: ignore[assignment]
    try:
        yield lambda: box[0]
    finally:
        sqlite3.connect = real  # type: ignore[assignment]


class TurnProxy:
    """A loopback TCP relay that counts round trips whatever the driver (psycopg,
    asyncpg): one each time a client sends after the server has answered."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.turns = 0
        self._listen = socket.socket()
        self._listen.bind(("127.0.0.1", 0))
        self._listen.listen(128)
        self.port: int = self._listen.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listen, selectors.EVENT_READ, None)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="turn-proxy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select(0.05):
                if key.data is None:
                    self._accept()
                    continue
                sock, (other, side, state) = key.fileobj, key.data
                try:
                    data = sock.recv(65536)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                if not data:
                    self._drop(sock, other)
                    continue
                if side == "c" and state[0] != "c":
                    self.turns += 1
                state[0] = side
                try:
                    other.sendall(data)
                except OSError:
                    self._drop(sock, other)

    def _accept(self) -> None:
        client, _ = self._listen.accept()
        server = socket.create_connection(("127.0.0.1", self.upstream))
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        state = [""]
        self._sel.register(client, selectors.EVENT_READ, (server, "c", state))
        self._sel.register(server, selectors.EVENT_READ, (client, "s", state))

    def _drop(self, *socks: Any) -> None:
        for s in socks:
            with contextlib.suppress(Exception):
                self._sel.unregister(s)
            with contextlib.suppress(Exception):
                s.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)
        for key in list(self._sel.get_map().values()):
            self._drop(key.fileobj)
        self._sel.close()


# ---- generic measured functions ------------------------------------------------------------


def aio_lock(coord: idemlock.aio.AsyncCoordinator) -> Make:
    locks = coord.lock(LOCK)

    async def make(t: int, count: int) -> None:
        for _ in range(count):
            lease = await locks.acquire(f"k{t}")
            assert lease is not None
            await locks.release(lease)

    return make


def aio_claim(coord: idemlock.aio.AsyncCoordinator) -> Make:
    port = coord.idempotency(SPEC)

    async def make(t: int, count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            claim = await port.claim(f"{tag}-{t}-{i}")
            assert isinstance(claim, Claimed)
            await port.complete(claim.token, RESULT)

    return make


def ik_claim(backend: Any) -> Make:
    """idemkit's backend claim + complete, the calls its middleware makes per request."""

    async def make(t: int, count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{t}-{i}"
            res = await backend.claim(key, "f" * 64, 1, 300.0)
            await backend.complete(key, res.our_claim_token, 200, {}, b"x" * 40, 3600.0)

    return make


def ik_job(
    backend: Any, write: Callable[[str], Awaitable[Any]]
) -> Callable[[int], Awaitable[None]]:
    async def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            res = await backend.claim(key, "f" * 64, 1, 300.0)
            await write(key)
            await backend.complete(key, res.our_claim_token, 200, {}, b"x" * 40, 3600.0)

    return run


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[int], Awaitable[None]]) -> SyncFn:
    """An asyncio subject measured among sync ones (1 task, its loop kept between calls)."""
    return lambda n: loop.run_until_complete(fn(n))


def new_loop(stack: contextlib.ExitStack) -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    stack.callback(loop.close)
    return loop


# ---- memory --------------------------------------------------------------------------------


class MemoryRaw:
    """The floor of an in-process store: a dict under a lock, the same critical sections."""

    def __init__(self) -> None:
        self.mu = threading.Lock()
        self.claims: dict[str, list[Any]] = {}
        self.locks: dict[str, tuple[str, int, float]] = {}
        self.effects: dict[str, tuple[int, str]] = {}
        self.counter = 0

    def claim(self, key: str, token: str) -> int | None:
        now = time.monotonic()
        with self.mu:
            rec = self.claims.get(key)
            if rec is not None and rec[3] > now:
                return None
            self.counter += 1
            self.claims[key] = ["in_flight", token, self.counter, now + 300.0, None]
            return self.counter

    def complete(self, key: str, token: str, result: bytes) -> bool:
        now = time.monotonic()
        with self.mu:
            rec = self.claims.get(key)
            if rec is None or rec[1] != token or rec[0] != "in_flight":
                return False
            rec[0], rec[3], rec[4] = "completed", now + 3600.0, result
            return True

    def acquire(self, key: str, owner: str) -> int | None:
        now = time.monotonic()
        with self.mu:
            cur = self.locks.get(key)
            if cur is not None and cur[2] > now:
                return None
            self.counter += 1
            self.locks[key] = (owner, self.counter, now + 30.0)
            return self.counter

    def release(self, key: str, owner: str, token: int) -> bool:
        with self.mu:
            cur = self.locks.get(key)
            if cur is None or cur[0] != owner or cur[1] != token:
                return False
            del self.locks[key]
            return True

    def fenced_write(self, key: str, fence: int, value: str) -> None:
        with self.mu:
            cur = self.effects.get(key)
            if cur is not None and cur[0] > fence:
                raise FencedOut(key, fence, cur[0])
            self.effects[key] = (fence, value)

    def claim_pairs(self, count: int, t: int = 0) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key, token = f"{tag}-{t}-{i}", uuid.uuid4().hex
            assert self.claim(key, token) is not None
            assert self.complete(key, token, RESULT_BYTES)

    def lock_pairs(self, count: int, t: int = 0) -> None:
        key = f"k{t}"
        for _ in range(count):
            token = self.acquire(key, "owner")
            assert token is not None
            assert self.release(key, "owner", token)

    def jobs(self, count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key, token = f"{tag}-{i}", uuid.uuid4().hex
            fence = self.claim(key, token)
            assert fence is not None
            self.fenced_write(key, fence, "done")
            assert self.complete(key, token, RESULT_BYTES)

    async def aclaim(self, t: int, count: int) -> None:
        self.claim_pairs(count, t)

    async def alock(self, t: int, count: int) -> None:
        self.lock_pairs(count, t)


def memory_job(coord: idemlock.Coordinator, effects: MemoryRaw) -> SyncFn:
    port = coord.idempotency(SPEC)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            claim = port.claim(key)
            assert isinstance(claim, Claimed)
            effects.fenced_write(key, claim.fence, "done")
            port.complete(claim.token, RESULT)

    return run


def memory_ajob(coord: idemlock.aio.AsyncCoordinator, effects: MemoryRaw) -> Any:
    port = coord.idempotency(SPEC)

    async def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            claim = await port.claim(key)
            assert isinstance(claim, Claimed)
            effects.fenced_write(key, claim.fence, "done")
            await port.complete(claim.token, RESULT)

    return run


class MemoryBench:
    name = "memory"
    scale = SCALE["memory"]
    trips_unit = "in-process"
    kinds = (BASE, OURS)

    def target(self) -> dict[str, Any]:
        return {}

    counting = None

    def sync_fns(
        self, op: str, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        raw = MemoryRaw()
        coord = idemlock.connect("memory://", key_prefix=new_prefix())
        stack.callback(coord.close)
        if op == LOCK_OP:
            return {
                BASE: raw.lock_pairs,
                OURS: ours_lock_pairs(coord),
                OURS_PORT: port_lock_pairs(coord),
            }
        return {
            BASE: raw.claim_pairs,
            OURS: ours_claim_pairs(coord),
            OURS_PORT: port_claim_pairs(coord),
        }

    async def async_fns(
        self, op: str, tasks: int, stack: contextlib.AsyncExitStack, res: Results, where: Any
    ) -> dict[str, Make]:
        raw = MemoryRaw()
        coord = idemlock.aio.connect("memory://", key_prefix=new_prefix())
        stack.push_async_callback(coord.close)
        if op == LOCK_OP:
            return {BASE: raw.alock, OURS: aio_lock(coord)}
        return {BASE: raw.aclaim, OURS: aio_claim(coord)}

    def job_fns(
        self, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        raw = MemoryRaw()
        coord = idemlock.connect("memory://", key_prefix=new_prefix())
        stack.callback(coord.close)
        loop = new_loop(stack)
        acoord = idemlock.aio.connect("memory://", key_prefix=new_prefix())
        stack.callback(lambda: loop.run_until_complete(acoord.close()))
        effects = MemoryRaw()
        return {
            BASE: raw.jobs,
            OURS: memory_job(coord, effects),
            OURS_AIO: on_loop(loop, memory_ajob(acoord, effects)),
        }


# ---- SQLite --------------------------------------------------------------------------------

SQLITE_EFFECTS = (
    "CREATE TABLE IF NOT EXISTS effects "
    "(key TEXT PRIMARY KEY, value TEXT NOT NULL, fence_token INTEGER NOT NULL)"
)
SQLITE_FENCED_UPSERT = (
    "INSERT INTO effects (key, value, fence_token) VALUES (?, ?, ?) ON CONFLICT (key) DO "
    "UPDATE SET value = excluded.value, fence_token = excluded.fence_token "
    "WHERE effects.fence_token <= excluded.fence_token"
)


def sqlite_effects(path: str) -> sqlite3.Cursor:
    """Your own table in the same file, written with a fenced upsert."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(SQLITE_EFFECTS)
    return conn.cursor()


def sqlite_fenced_write(cur: sqlite3.Cursor, key: str, fence: int) -> None:
    if cur.execute(SQLITE_FENCED_UPSERT, (key, "done", fence)).rowcount != 1:
        raise FencedOut(key, fence, None)


def sqlite_raw_job(cur: sqlite3.Cursor, effects: sqlite3.Cursor) -> SyncFn:
    def run(count: int) -> None:
        for i, key in enumerate(sq_fresh_keys(count)):
            now = time.time_ns() // 1_000_000
            cur.execute("BEGIN IMMEDIATE")
            cur.execute(SQ_INSERT_CLAIM, (SQ_NS, key, "token", i, now + LEASE_MS))
            cur.execute("COMMIT")
            sqlite_fenced_write(effects, key, i)
            cur.execute("BEGIN IMMEDIATE")
            cur.execute(SQ_COMPLETE, (SQ_RESULT, now + SQ_TTL_MS, SQ_NS, key))
            cur.execute("COMMIT")

    return run


def sqlite_job(coord: idemlock.Coordinator, effects: sqlite3.Cursor) -> SyncFn:
    port = coord.idempotency(SPEC)

    def run(count: int) -> None:
        for key in sq_fresh_keys(count):
            claim = port.claim(key)
            assert isinstance(claim, Claimed)
            sqlite_fenced_write(effects, key, claim.fence)
            port.complete(claim.token, RESULT)

    return run


def sqlite_ajob(coord: idemlock.aio.AsyncCoordinator, effects: sqlite3.Cursor) -> Any:
    port = coord.idempotency(SPEC)

    async def run(count: int) -> None:
        for key in sq_fresh_keys(count):
            claim = await port.claim(key)
            assert isinstance(claim, Claimed)
            await asyncio.to_thread(sqlite_fenced_write, effects, key, claim.fence)
            await port.complete(claim.token, RESULT)

    return run


class SqliteThreadedRaw:
    """The asyncio baseline: raw sqlite3 transactions, each in asyncio.to_thread (the
    store's async face does the same), one connection per worker thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.local = threading.local()

    def _cur(self) -> sqlite3.Cursor:
        cur = getattr(self.local, "cur", None)
        if cur is None:
            cur = self.local.cur = sq_open_raw(self.path)
        return cur

    def _txn(self, sql: str, args: tuple[Any, ...]) -> None:
        cur = self._cur()
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(sql, args)
        cur.execute("COMMIT")

    async def aclaim(self, t: int, count: int) -> None:
        for i, key in enumerate(sq_fresh_keys(count)):
            now = time.time_ns() // 1_000_000
            args = (SQ_NS, key, "token", i, now + LEASE_MS)
            await asyncio.to_thread(self._txn, SQ_INSERT_CLAIM, args)
            args = (SQ_RESULT, now + SQ_TTL_MS, SQ_NS, key)
            await asyncio.to_thread(self._txn, SQ_COMPLETE, args)

    async def alock(self, t: int, count: int) -> None:
        key = f"k{t}"
        for i in range(count):
            now = time.time_ns() // 1_000_000
            args = (SQ_NS, key, "owner", i, now + 30_000)
            await asyncio.to_thread(self._txn, SQ_INSERT_LOCK, args)
            await asyncio.to_thread(self._txn, SQ_DELETE_LOCK, (SQ_NS, key))


class SqliteBench:
    name = "sqlite"
    scale = SCALE["sqlite"]
    trips_unit = "transactions"
    kinds = (BASE, OURS)

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp

    def _file(self) -> str:
        return os.path.join(self.tmp, f"{uuid.uuid4().hex[:10]}.db")

    def target(self) -> dict[str, Any]:
        path = self._file()
        return {"path": path, "url": f"sqlite:///{path}"}

    @contextlib.contextmanager
    def counting(self) -> Iterator[tuple[Callable[[], int], dict[str, Any]]]:
        with count_sqlite_transactions() as count:
            yield count, self.target()

    def contention_target(self) -> dict[str, Any]:
        """A file made ready here (schemas, WAL), before 4 processes open it at once."""
        t = self.target()
        sq_open_raw(t["path"]).connection.close()
        coord = idemlock.connect(t["url"])
        coord.lock(LOCK).release(coord.lock(LOCK).acquire("warm") or _fail())
        coord.close()
        return t

    def _coord(self, stack: contextlib.ExitStack) -> idemlock.Coordinator:
        coord = idemlock.connect(f"sqlite:///{self._file()}", key_prefix=new_prefix())
        stack.callback(coord.close)
        return coord

    def _raw(self, stack: contextlib.ExitStack) -> sqlite3.Cursor:
        cur = sq_open_raw(self._file())
        stack.callback(cur.connection.close)
        return cur

    def sync_fns(
        self, op: str, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        raw, coord = self._raw(stack), self._coord(stack)
        if op == LOCK_OP:
            return {
                BASE: lambda k: sq_acquire_release(raw, k),
                OURS: ours_lock_pairs(coord),
                OURS_PORT: port_lock_pairs(coord),
            }
        return {
            BASE: lambda k: sq_claim_complete(raw, k),
            OURS: ours_claim_pairs(coord),
            OURS_PORT: port_claim_pairs(coord),
        }

    async def async_fns(
        self, op: str, tasks: int, stack: contextlib.AsyncExitStack, res: Results, where: Any
    ) -> dict[str, Make]:
        raw = SqliteThreadedRaw(self._file())
        coord = idemlock.aio.connect(f"sqlite:///{self._file()}", key_prefix=new_prefix())
        stack.push_async_callback(coord.close)
        if op == LOCK_OP:
            return {BASE: raw.alock, OURS: aio_lock(coord)}
        return {BASE: raw.aclaim, OURS: aio_claim(coord)}

    def job_fns(
        self, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        fns: dict[str, SyncFn] = {}
        path = self._file()
        raw = sq_open_raw(path)
        stack.callback(raw.connection.close)
        effects = sqlite_effects(path)
        stack.callback(effects.connection.close)
        fns[BASE] = sqlite_raw_job(raw, effects)
        path = self._file()
        coord = idemlock.connect(f"sqlite:///{path}", key_prefix=new_prefix())
        stack.callback(coord.close)
        effects = sqlite_effects(path)
        stack.callback(effects.connection.close)
        fns[OURS] = sqlite_job(coord, effects)
        path = self._file()
        loop = new_loop(stack)
        acoord = idemlock.aio.connect(f"sqlite:///{path}", key_prefix=new_prefix())
        stack.callback(lambda: loop.run_until_complete(acoord.close()))
        effects = sqlite_effects(path)
        stack.callback(effects.connection.close)
        fns[OURS_AIO] = on_loop(loop, sqlite_ajob(acoord, effects))
        return fns


# ---- Redis and Redis Cluster -----------------------------------------------------------

UNLOCK_LUA = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) "
    "else return 0 end"
)


def redis_client(t: dict[str, Any]) -> Any:
    if t["cluster"]:
        return redis.cluster.RedisCluster(host="127.0.0.1", port=t["ports"][0], **CLIENT)
    return redis.Redis(port=t["ports"][0], **CLIENT)


def redis_aclient(t: dict[str, Any]) -> Any:
    if t["cluster"]:
        return redis.asyncio.cluster.RedisCluster(host="127.0.0.1", port=t["ports"][0], **CLIENT)
    return redis.asyncio.Redis(port=t["ports"][0], **CLIENT)


def redis_raw_job(raw: Raw) -> SyncFn:
    """idemlock's job issued raw: EVALSHA of its claim, fence_set and complete scripts."""
    r, fp = raw.r, C.pack_id("ab" * 32)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            n, tok = C.names(raw.ns, key), C.pack_id(uuid.uuid4().hex)
            reply = r.evalsha(C.CLAIM.sha, 1, n.claim, fp, tok, LEASE_MS, KEEP)
            fence = int(reply[1])
            out = f"out:{key}"
            gate = C.gate_name(raw.ns, out)
            r.evalsha(C.FENCE_SET.sha, 2, gate, out.encode(), str(fence), b"done")
            r.evalsha(C.COMPLETE.sha, 1, n.claim, tok, RESULT_BYTES, TTL_MS,
                      n.claim_channel, C.nonce())  # fmt: skip

    return run


def redis_ajob(coord: idemlock.aio.AsyncCoordinator) -> Any:
    port = coord.idempotency(SPEC)

    async def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            claim = await port.claim(key)
            assert isinstance(claim, Claimed)
            await coord.fence(f"out:{key}").set_if_fresh(claim.fence, f"out:{key}", b"done")
            await port.complete(claim.token, RESULT)

    return run


def lock_job(r: Any, lock_of: Callable[[str], Any]) -> SyncFn:
    """A job from a lock alone: lock, check a done marker, write, mark done, release."""
    done = json.dumps(RESULT)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            lock = lock_of(key)
            assert lock.acquire(blocking=False)
            if r.get(f"done:{key}") is None:
                r.set(f"eff:{key}", "done")
                r.set(f"done:{key}", done, ex=3600)
            lock.release()

    return run


def powertools_fn(r: Any, body: Callable[[str], None]) -> Callable[[str], Any]:
    from aws_lambda_powertools.utilities.idempotency import (
        IdempotencyConfig,
        idempotent_function,
    )
    from aws_lambda_powertools.utilities.idempotency.persistence.cache import (
        CachePersistenceLayer,
    )

    layer = CachePersistenceLayer(client=r)
    config = IdempotencyConfig(expires_after_seconds=3600)

    @idempotent_function(data_keyword_argument="job", persistence_store=layer, config=config)
    def work(job: dict[str, str]) -> dict[str, Any]:
        body(job["key"])
        return RESULT

    return lambda key: work(job={"key": key})


def powertools_pairs(r: Any) -> SyncFn:
    work = powertools_fn(r, lambda key: None)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            work(f"{tag}-{i}")

    return run


def powertools_job(r: Any) -> SyncFn:
    work = powertools_fn(r, lambda key: r.set(f"ptout:{key}", "done"))

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            work(f"{tag}-{i}")

    return run


class RedisBench:
    scale = 1
    trips_unit = "requests"
    kinds = (BASE, OURS, RPY, PRL, FK)

    def __init__(self, url: str, ports: list[int], cluster: bool) -> None:
        self.name = "redis-cluster" if cluster else "redis"
        self.url, self.ports, self.cluster = url, ports, cluster
        r = redis_client(self.target())
        load_scripts(r)
        assert r.script_load(C.FENCE_SET.text) == C.FENCE_SET.sha
        r.close()

    def target(self) -> dict[str, Any]:
        return {"url": self.url, "ports": self.ports, "cluster": self.cluster}

    @contextlib.contextmanager
    def counting(self) -> Iterator[tuple[Callable[[], int], dict[str, Any]]]:
        with count_redis_requests() as count:
            yield count, self.target()

    def _tag(self, name: str) -> str:
        """A name whose keys share one Cluster slot (a hash tag) on a Cluster."""
        return "{" + name + "}" if self.cluster else name

    def _sync(self, t: dict[str, Any], stack: contextlib.ExitStack) -> tuple[Any, Any]:
        r = redis_client(t)
        stack.callback(r.close)
        coord = idemlock.connect(t["url"], key_prefix=new_prefix())
        stack.callback(coord.close)
        return r, coord

    def sync_fns(
        self, op: str, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        where = (UNC, op, self.name)
        r, coord = self._sync(t, stack)
        raw = Raw(r)
        fns: dict[str, SyncFn]
        builds: dict[str, Callable[[], SyncFn]]
        if op == LOCK_OP:
            fns = {
                BASE: raw.sync_lock_pairs,
                OURS: ours_lock_pairs(coord),
                OURS_PORT: port_lock_pairs(coord),
            }
            builds = {
                RPY: lambda: redispy_lock_pairs(r, name=new_prefix("rp")),
                PRL: lambda: prl_lock_pairs(
                    r, name=self._tag(new_prefix("prl")), strict=not self.cluster
                ),
                FK: lambda: fencekit_lock_pairs(r, prefix=self._tag(new_prefix("fk"))),
            }
        else:
            fns = {
                BASE: raw.sync_claim_pairs,
                OURS: ours_claim_pairs(coord),
                OURS_PORT: port_claim_pairs(coord),
            }
            builds = {
                FK: lambda: fencekit_guard_pairs(r, prefix=self._tag(new_prefix("fk"))),
                PT: lambda: powertools_pairs(r),
            }
        for name, build in builds.items():
            if (fn := peer(res, where, name, build)) is not None:
                fns[name] = fn
        return fns

    async def async_fns(
        self, op: str, tasks: int, stack: contextlib.AsyncExitStack, res: Results, where: Any
    ) -> dict[str, Make]:
        t = self.target()
        ar = redis_aclient(t)
        stack.push_async_callback(ar.aclose)
        if self.cluster:
            await ar.initialize()
        coord = idemlock.aio.connect(t["url"], key_prefix=new_prefix())
        stack.push_async_callback(coord.close)
        raw = Raw(ar)
        fns: dict[str, Make]
        if op == LOCK_OP:

            async def raw_lock(t: int, count: int) -> None:
                await raw.async_lock_pairs(count, key=f"k{t}")

            fns = {BASE: raw_lock, OURS: aio_lock(coord)}
            prefix = new_prefix("arp")

            async def build_rpy() -> Make:
                async def make(t: int, count: int) -> None:
                    for _ in range(count):
                        lock = ar.lock(f"{prefix}:{t}", timeout=30)
                        assert await lock.acquire(blocking=False)
                        await lock.release()

                return make

            if (fn := await apeer(res, where, RPY, build_rpy)) is not None:
                fns[RPY] = fn
            return fns

        async def raw_claim(t: int, count: int) -> None:
            await raw.async_claim_pairs(count, tag=f"{uuid.uuid4().hex[:6]}-{t}")

        fns = {BASE: raw_claim, OURS: aio_claim(coord)}

        async def build_ik() -> Make:
            from idemkit.backends.redis import RedisBackend

            client = redis_aclient(t)
            if self.cluster:
                await client.initialize()
            backend = RedisBackend(client, namespace=new_prefix("ik"))
            stack.push_async_callback(backend.aclose)
            return ik_claim(backend)

        if (fn := await apeer(res, where, IK, build_ik)) is not None:
            fns[IK] = fn
        return fns

    def job_fns(
        self, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        where = (JOB, JOB_OP, self.name)
        r, coord = self._sync(t, stack)
        loop = new_loop(stack)
        acoord = idemlock.aio.connect(t["url"], key_prefix=new_prefix())
        stack.callback(lambda: loop.run_until_complete(acoord.close()))
        fns: dict[str, SyncFn] = {
            BASE: redis_raw_job(Raw(r)),
            OURS: ours_job(coord),
            OURS_AIO: on_loop(loop, redis_ajob(acoord)),
        }

        def build_ik() -> SyncFn:
            from idemkit.backends.redis import RedisBackend

            ar = redis_aclient(t)
            backend = RedisBackend(ar, namespace=new_prefix("ik"))
            stack.callback(lambda: loop.run_until_complete(backend.aclose()))

            async def write(key: str) -> None:
                await ar.set(f"ikout:{key}", "done")

            return on_loop(loop, ik_job(backend, write))

        builds: dict[str, Callable[[], SyncFn]] = {
            OURS_W: lambda: ours_job_together(coord),
            FK: lambda: fencekit_job(r, prefix=self._tag(new_prefix("fkj"))),
            RPY: lambda: lock_job(r, lambda key: r.lock(f"rpj:{key}", timeout=300)),
            PRL: lambda: lock_job(r, self._prl(r)),
            PT: lambda: powertools_job(r),
            IK: build_ik,
        }
        for name, build in builds.items():
            if (fn := peer(res, where, name, build)) is not None:
                fns[name] = fn
        return fns

    def _prl(self, r: Any) -> Callable[[str], Any]:
        import redis_lock

        return lambda key: redis_lock.Lock(
            r, self._tag(f"prlj:{key}"), expire=300, strict=not self.cluster
        )


# ---- PostgreSQL ------------------------------------------------------------------------------

PG_EFFECTS = (
    "CREATE TABLE IF NOT EXISTS bench_effects "
    '(key text COLLATE "C" PRIMARY KEY, value text NOT NULL, fence_token bigint)'
)
PG_RAW_FENCED_UPSERT = (
    b"INSERT INTO bench_effects AS t (key, value, fence_token) VALUES (%s, %s, %s) "
    b"ON CONFLICT (key) DO UPDATE SET value = excluded.value, "
    b"fence_token = excluded.fence_token "
    b"WHERE t.fence_token IS NULL OR t.fence_token <= excluded.fence_token RETURNING 1"
)
PG_UPSERT = (
    b"INSERT INTO bench_effects (key, value) VALUES (%s, %s) "
    b"ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)


def pg_raw_job(conn: psycopg.Connection[Any]) -> SyncFn:
    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:8]
        for i in range(count):
            key, token = f"{tag}-{i}", uuid.uuid4().hex
            row = conn.execute(
                PG_CLAIM, ("ns", key, token, "fp", pg_now_ms() + LEASE_MS), prepare=True
            ).fetchone()
            assert row is not None
            got = conn.execute(PG_RAW_FENCED_UPSERT, (key, "done", row[0]), prepare=True)
            if got.fetchone() is None:
                raise FencedOut(key, row[0], None)
            conn.execute(
                PG_COMPLETE, (b"j1", pg_now_ms() + TTL_MS, "ns", key, token), prepare=True
            ).fetchall()

    return run


def pg_job(coord: idemlock.Coordinator, conn: psycopg.Connection[Any], same_tx: bool) -> SyncFn:
    port = coord.idempotency(SPEC)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:8]
        for i in range(count):
            key = f"{tag}-{i}"
            claim = port.claim(key)
            assert isinstance(claim, Claimed)
            values = {"key": key, "value": "done"}
            if same_tx:
                with conn.transaction():
                    PF.fenced_upsert(conn, "bench_effects", values, ["key"], claim.fence)
                    PF.complete_in_transaction(conn, port, claim.token, RESULT)
            else:
                PF.fenced_upsert(conn, "bench_effects", values, ["key"], claim.fence)
                port.complete(claim.token, RESULT)

    return run


def pg_ajob(coord: idemlock.aio.AsyncCoordinator, conn: psycopg.AsyncConnection[Any]) -> Any:
    port = coord.idempotency(SPEC)

    async def run(count: int) -> None:
        tag = uuid.uuid4().hex[:8]
        for i in range(count):
            key = f"{tag}-{i}"
            claim = await port.claim(key)
            assert isinstance(claim, Claimed)
            values = {"key": key, "value": "done"}
            await PF.afenced_upsert(conn, "bench_effects", values, ["key"], claim.fence)
            await port.complete(claim.token, RESULT)

    return run


class PgPoolRaw:
    """The asyncio baseline for many tasks: raw statements through a pool of the size
    idemlock's own pool has (10), one checkout per statement as the store does."""

    def __init__(self, pool: psycopg_pool.AsyncConnectionPool[Any]) -> None:
        self.pool = pool

    async def _one(self, sql: bytes, args: tuple[Any, ...]) -> Any:
        async with self.pool.connection() as conn:
            cur = await conn.execute(sql, args, prepare=True)
            return await cur.fetchone()

    async def aclaim(self, t: int, count: int) -> None:
        tag = uuid.uuid4().hex[:8]
        for i in range(count):
            key, token = f"{tag}-{t}-{i}", uuid.uuid4().hex
            await self._one(PG_CLAIM, ("ns", key, token, "fp", pg_now_ms() + LEASE_MS))
            args = (b"j1", pg_now_ms() + TTL_MS, "ns", key, token)
            await self._one(PG_COMPLETE, args)

    async def alock(self, t: int, count: int) -> None:
        owner, key = uuid.uuid4().hex, f"k{t}"
        for _ in range(count):
            now = pg_now_ms()
            row = await self._one(PG_ACQUIRE, ("ns", key, owner, now + 30_000, now))
            assert row is not None
            await self._one(PG_RELEASE, ("ns", key, owner, row[0]))


class PgBench:
    name = "postgres"
    scale = 1
    trips_unit = "requests"
    kinds = (BASE, OURS)

    def __init__(self, dsn: str, port: int) -> None:
        self.dsn, self.port = dsn, port
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(PG_SCHEMA.encode())
            conn.execute(PG_EFFECTS.encode())

    def target(self) -> dict[str, Any]:
        return {"dsn": self.dsn, "url": self.dsn}

    @contextlib.contextmanager
    def counting(self) -> Iterator[tuple[Callable[[], int], dict[str, Any]]]:
        proxy = TurnProxy(self.port)
        try:
            dsn = self.dsn.replace(f":{self.port}/", f":{proxy.port}/")
            yield (lambda: proxy.turns), {"dsn": dsn, "url": dsn}
        finally:
            proxy.close()

    def _conn(self, t: dict[str, Any], stack: contextlib.ExitStack) -> psycopg.Connection[Any]:
        conn = psycopg.connect(t["dsn"], autocommit=True)
        stack.callback(conn.close)
        return conn

    def _coord(self, t: dict[str, Any], stack: contextlib.ExitStack) -> idemlock.Coordinator:
        coord = idemlock.connect(t["dsn"], key_prefix=new_prefix())
        stack.callback(coord.close)
        return coord

    def sync_fns(
        self, op: str, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        raw, coord = self._conn(t, stack), self._coord(t, stack)
        if op == LOCK_OP:
            return {
                BASE: lambda k: pg_sync_locks(raw, k),
                OURS: ours_lock_pairs(coord),
                OURS_PORT: port_lock_pairs(coord),
            }
        return {
            BASE: lambda k: pg_sync_claims(raw, k),
            OURS: ours_claim_pairs(coord),
            OURS_PORT: port_claim_pairs(coord),
        }

    async def async_fns(
        self, op: str, tasks: int, stack: contextlib.AsyncExitStack, res: Results, where: Any
    ) -> dict[str, Make]:
        coord = idemlock.aio.connect(self.dsn, key_prefix=new_prefix())
        stack.push_async_callback(coord.close)
        if tasks == 1:
            aconn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
            stack.push_async_callback(aconn.close)

            async def raw_claim(t: int, count: int) -> None:
                await pg_async_claims(aconn, count)

            async def raw_lock(t: int, count: int) -> None:
                await pg_async_locks(aconn, count)

            base = {LOCK_OP: raw_lock, CLAIM_OP: raw_claim}[op]
        else:
            pool: psycopg_pool.AsyncConnectionPool[Any] = psycopg_pool.AsyncConnectionPool(
                self.dsn, min_size=10, max_size=10, kwargs={"autocommit": True}, open=False
            )
            await pool.open(wait=True)
            stack.push_async_callback(pool.close)
            pr = PgPoolRaw(pool)
            base = {LOCK_OP: pr.alock, CLAIM_OP: pr.aclaim}[op]
        if op == LOCK_OP:
            return {BASE: base, OURS: aio_lock(coord)}
        fns = {BASE: base, OURS: aio_claim(coord)}

        async def build_ik() -> Make:
            if not HAVE_ASYNCPG:
                raise ImportError(
                    "idemkit's PostgreSQL backend needs asyncpg (pip install asyncpg)"
                )
            backend = await pg_idemkit(self.dsn, max_size=10)
            stack.push_async_callback(backend.aclose)
            return ik_claim(backend)

        if (fn := await apeer(res, where, IK, build_ik)) is not None:
            fns[IK] = fn
        return fns

    def job_fns(
        self, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        where = (JOB, JOB_OP, self.name)
        coord = self._coord(t, stack)
        loop = new_loop(stack)
        acoord = idemlock.aio.connect(t["dsn"], key_prefix=new_prefix())
        stack.callback(lambda: loop.run_until_complete(acoord.close()))
        aconn = loop.run_until_complete(psycopg.AsyncConnection.connect(t["dsn"], autocommit=True))
        stack.callback(lambda: loop.run_until_complete(aconn.close()))
        fns: dict[str, SyncFn] = {
            BASE: pg_raw_job(self._conn(t, stack)),
            OURS: pg_job(coord, self._conn(t, stack), same_tx=False),
            OURS_TX: pg_job(coord, self._conn(t, stack), same_tx=True),
            OURS_AIO: on_loop(loop, pg_ajob(acoord, aconn)),
        }

        def build_ik() -> SyncFn:
            if not HAVE_ASYNCPG:
                raise ImportError(
                    "idemkit's PostgreSQL backend needs asyncpg (pip install asyncpg)"
                )
            backend = loop.run_until_complete(pg_idemkit(t["dsn"], max_size=4))
            stack.callback(lambda: loop.run_until_complete(backend.aclose()))

            async def write(key: str) -> None:
                await aconn.execute(PG_UPSERT, (key, "done"), prepare=True)

            return on_loop(loop, ik_job(backend, write))

        if (fn := peer(res, where, IK, build_ik)) is not None:
            fns[IK] = fn
        return fns


Bench = MemoryBench | SqliteBench | RedisBench | PgBench


# ---- contention ------------------------------------------------------------------------------


def _lock_id(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big", signed=True)


def lock_pair(
    store: str, kind: str, t: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[Any], Any], Callable[[], Any]]:
    """(acquire(key) -> handle, release(handle), close) of one contender."""
    prefix = t["prefix"]
    if kind == OURS:
        coord = idemlock.connect(t["url"], key_prefix=prefix)
        locks = coord.lock(LOCK)

        def acquire(key: str) -> Any:
            lease = locks.acquire(key, wait=30)
            if lease is None:
                raise RuntimeError("idemlock: no lease within 30 s")
            return lease

        return acquire, locks.release, coord.close
    if store == "sqlite":
        cur = sq_open_raw(t["path"])
        owner = uuid.uuid4().hex

        def acquire_row(key: str) -> Any:
            while True:
                try:
                    now = time.time_ns() // 1_000_000
                    cur.execute(SQ_INSERT_LOCK, (SQ_NS, key, owner, 0, now + 30_000))
                    return key
                except sqlite3.IntegrityError:
                    time.sleep(0.001)

        def release_row(key: str) -> None:
            cur.execute(SQ_DELETE_LOCK, (SQ_NS, key))

        return acquire_row, release_row, cur.connection.close
    if store == "postgres":
        conn = psycopg.connect(t["dsn"], autocommit=True)

        def acquire_adv(key: str) -> Any:
            conn.execute("SELECT pg_advisory_lock(%s)", (_lock_id(prefix + key),))
            return key

        def release_adv(key: str) -> None:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_lock_id(prefix + key),))

        return acquire_adv, release_adv, conn.close
    r = redis_client(t)
    cluster = t["cluster"]
    if kind == BASE:
        unlock = r.register_script(UNLOCK_LUA)

        def acquire_nx(key: str) -> Any:
            name, token = f"{prefix}:raw:{key}", uuid.uuid4().hex
            while not r.set(name, token, nx=True, px=30_000):
                time.sleep(0.001)
            return name, token

        def release_nx(h: Any) -> None:
            unlock(keys=[h[0]], args=[h[1]])

        return acquire_nx, release_nx, r.close
    if kind == RPY:

        def acquire_rpy(key: str) -> Any:
            lock = r.lock(f"{prefix}:{key}", timeout=30)
            assert lock.acquire(blocking=True, blocking_timeout=30)
            return lock

        return acquire_rpy, lambda lock: lock.release(), r.close
    if kind == PRL:
        import redis_lock

        def acquire_prl(key: str) -> Any:
            name = "{" + f"{prefix}:{key}" + "}" if cluster else f"{prefix}:{key}"
            lock = redis_lock.Lock(r, name, expire=30, strict=not cluster)
            assert lock.acquire(blocking=True, timeout=30)
            return lock

        return acquire_prl, lambda lock: lock.release(), r.close
    import fencekit

    dl = fencekit.DistributedLock(r, prefix="{" + prefix + "}" if cluster else prefix)

    def acquire_fk(key: str) -> Any:
        return dl.acquire(key, ttl=timedelta(seconds=30), blocking=True,
                          wait=timedelta(seconds=30))  # fmt: skip

    return acquire_fk, dl.release, r.close
