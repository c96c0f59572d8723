"""The PostgreSQL adapter; its baseline is raw psycopg, one comparable prepared
statement per round trip."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import psycopg_pool
from common import (
    BASE,
    CLAIM_OP,
    HAVE_ASYNCPG,
    IK,
    JOB,
    JOB_OP,
    LOCK_OP,
    OURS,
    OURS_AIO,
    OURS_PORT,
    OURS_TX,
    RESULT,
    SPEC,
    Make,
    Results,
    SyncFn,
    apeer,
    new_prefix,
    peer,
)

import idemlock
import idemlock.aio
from idemlock import Claimed, FencedOut
from idemlock.stores.postgres import fenced as PF
from subjects.base import (
    LEASE_MS,
    TTL_MS,
    TurnProxy,
    aio_claim,
    aio_lock,
    ik_claim,
    ik_job,
    new_loop,
    on_loop,
    ours_ajob,
    ours_claim_pairs,
    ours_lock_pairs,
    port_claim_pairs,
    port_lock_pairs,
)
from subjects.memory import (
    MemoryBench,
)
from subjects.redis import (
    RedisBench,
)
from subjects.sqlite import (
    SqliteBench,
)

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
            OURS_AIO: on_loop(
                loop,
                ours_ajob(
                    acoord,
                    lambda key, fence: PF.afenced_upsert(
                        aconn, "bench_effects", {"key": key, "value": "done"}, ["key"], fence
                    ),
                ),
            ),
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
