"""The PostgreSQL adapter; its baseline is raw psycopg, one comparable prepared
statement per round trip."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Any

import common as c
import psycopg
import psycopg_pool
from tests.servers.proxy import TcpProxy

import idemlock
from idemlock import Claimed, FencedOut
from idemlock.stores.postgres import fenced as PF
from subjects.base import ABuilds, Adapter, Builds
from subjects.peers import ik_claim, ik_job

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


NS = "ns"


async def pg_idemkit(dsn: str, max_size: int = 4) -> Any:
    if not c.HAVE_ASYNCPG:
        raise ImportError("idemkit's PostgreSQL backend needs asyncpg (pip install asyncpg)")
    from idemkit.backends.postgres import PostgresBackend, init_pg

    await init_pg(dsn)
    return PostgresBackend.from_url(dsn, min_size=1, max_size=max_size)


PG_EFFECTS = (
    "CREATE TABLE IF NOT EXISTS bench_effects "
    '(key text COLLATE "C" PRIMARY KEY, value text NOT NULL, fence_token bigint)'
)
PG_FENCED = (
    b"INSERT INTO bench_effects AS t (key, value, fence_token) VALUES (%s, %s, %s) "
    b"ON CONFLICT (key) DO UPDATE SET value = excluded.value, "
    b"fence_token = excluded.fence_token "
    b"WHERE t.fence_token IS NULL OR t.fence_token <= excluded.fence_token RETURNING 1"
)
PG_UPSERT = (
    b"INSERT INTO bench_effects (key, value) VALUES (%s, %s) "
    b"ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)


def pg_now_ms() -> int:
    return int(time.time() * 1000)


def pg_steps(op: str, key: str, token: str) -> tuple[Any, Callable[[Any], Any]]:
    """A pair's two statements: the first's, and the second's made from its row."""
    if op == c.LOCK_OP:
        now = pg_now_ms()
        return (PG_ACQUIRE, (NS, key, token, now + 30_000, now)), lambda row: (
            PG_RELEASE, (NS, key, token, row[0]))  # fmt: skip
    return (PG_CLAIM, (NS, key, token, "fp", pg_now_ms() + c.LEASE_MS)), lambda row: (
        PG_COMPLETE, (b"j1", pg_now_ms() + c.TTL_MS, NS, key, token))  # fmt: skip


def pg_key(op: str, tag: str, t: int, i: int) -> str:
    return f"k{t}" if op == c.LOCK_OP else f"{tag}-{t}-{i}"


def pg_pairs(op: str, conn: psycopg.Connection[Any], job: bool = False) -> c.SyncFn:
    """The sync baseline; the job writes its effect with a fenced upsert between the two."""

    def run(count: int) -> None:
        tag, owner = uuid.uuid4().hex[:8], uuid.uuid4().hex
        for i in range(count):
            token = owner if op == c.LOCK_OP else uuid.uuid4().hex
            key = pg_key(op, tag, i % 16, i)
            first, then = pg_steps(op, key, token)
            row = conn.execute(*first, prepare=True).fetchone()
            assert row is not None
            if (
                job
                and conn.execute(PG_FENCED, (key, "done", row[0]), prepare=True).fetchone() is None
            ):
                raise FencedOut(key, row[0], None)
            conn.execute(*then(row), prepare=True).fetchall()

    return run


def pg_apairs(op: str, one: Callable[[bytes, Any], Awaitable[Any]]) -> c.Make:
    """The asyncio baseline: ``one(sql, args)`` on one connection, or through a pool of
    idemlock's pool size (10), one checkout per statement as the store does."""

    async def make(t: int, count: int) -> None:
        tag, owner = uuid.uuid4().hex[:8], uuid.uuid4().hex
        for i in range(count):
            token = owner if op == c.LOCK_OP else uuid.uuid4().hex
            first, then = pg_steps(op, pg_key(op, tag, t, i), token)
            row = await one(*first)
            assert row is not None
            await one(*then(row))

    return make


def pg_job_same_tx(coord: idemlock.Coordinator, conn: psycopg.Connection[Any]) -> c.SyncFn:
    port = coord.idempotency(c.SPEC)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:8]
        for i in range(count):
            claim = port.claim(key := f"{tag}-{i}")
            assert isinstance(claim, Claimed)
            with conn.transaction():
                PF.fenced_upsert(conn, "bench_effects", effect(key), ["key"], claim.fence)
                PF.complete_in_transaction(conn, port, claim.token, c.RESULT)

    return run


def effect(key: str) -> dict[str, Any]:
    return {"key": key, "value": "done"}


class PgBench(Adapter):
    name = "postgres"

    def __init__(self, dsn: str, port: int) -> None:
        self.dsn, self.port = dsn, port
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(PG_SCHEMA.encode())
            conn.execute(PG_EFFECTS.encode())

    def target(self) -> dict[str, Any]:
        return {"dsn": self.dsn, "url": self.dsn}

    @contextlib.contextmanager
    def counting(self) -> Iterator[tuple[Callable[[], int], dict[str, Any]]]:
        proxy = TcpProxy(self.port)  # counts request/response turns, whatever the driver
        try:
            dsn = self.dsn.replace(f":{self.port}/", f":{proxy.port}/")
            yield (lambda: proxy.turns), {"dsn": dsn, "url": dsn}
        finally:
            proxy.close()

    def _conn(self, url: str, stack: contextlib.ExitStack) -> psycopg.Connection[Any]:
        conn = psycopg.connect(url, autocommit=True)
        stack.callback(conn.close)
        return conn

    def _aconn(
        self, url: str, stack: contextlib.ExitStack, loop: Any
    ) -> psycopg.AsyncConnection[Any]:
        connect = psycopg.AsyncConnection.connect(url, autocommit=True)
        aconn = loop.run_until_complete(connect)
        stack.callback(lambda: loop.run_until_complete(aconn.close()))
        return aconn

    def raw_pairs(self, op: str, t: dict[str, Any], stack: contextlib.ExitStack) -> c.SyncFn:
        return pg_pairs(op, self._conn(t["dsn"], stack))

    async def araw_pairs(self, op: str, tasks: int, stack: contextlib.AsyncExitStack) -> c.Make:
        if tasks == 1:
            aconn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
            stack.push_async_callback(aconn.close)

            async def one(sql: bytes, args: Any) -> Any:
                return await (await aconn.execute(sql, args, prepare=True)).fetchone()

            return pg_apairs(op, one)
        pool: psycopg_pool.AsyncConnectionPool[Any] = psycopg_pool.AsyncConnectionPool(
            self.dsn, min_size=10, max_size=10, kwargs={"autocommit": True}, open=False
        )
        await pool.open(wait=True)
        stack.push_async_callback(pool.close)

        async def pooled(sql: bytes, args: Any) -> Any:
            async with pool.connection() as conn:
                return await (await conn.execute(sql, args, prepare=True)).fetchone()

        return pg_apairs(op, pooled)

    def raw_job(self, t: dict[str, Any], stack: contextlib.ExitStack) -> c.SyncFn:
        return pg_pairs("job", self._conn(t["dsn"], stack), job=True)

    def write(self, url: str, stack: contextlib.ExitStack) -> Callable[[str, int], Any]:
        conn = self._conn(url, stack)
        return lambda key, fence: PF.fenced_upsert(
            conn, "bench_effects", effect(key), ["key"], fence
        )

    def awrite(
        self, url: str, stack: contextlib.ExitStack, loop: Any
    ) -> Callable[[str, int], Awaitable[Any]]:
        aconn = self._aconn(url, stack, loop)
        return lambda key, fence: PF.afenced_upsert(
            aconn, "bench_effects", effect(key), ["key"], fence
        )

    def apeers(self, op: str, t: dict[str, Any], stack: contextlib.AsyncExitStack) -> ABuilds:
        if op == c.LOCK_OP:
            return {}

        async def build_ik() -> c.Make:
            backend = await pg_idemkit(self.dsn, max_size=10)
            stack.push_async_callback(backend.aclose)
            return ik_claim(backend)

        return {c.IK: build_ik}

    def job_peers(
        self, coord: idemlock.Coordinator, t: dict[str, Any], stack: contextlib.ExitStack,
        loop: Any,
    ) -> Builds:  # fmt: skip
        def build_ik() -> c.SyncFn:
            backend = loop.run_until_complete(pg_idemkit(t["dsn"], max_size=4))
            aconn = self._aconn(t["dsn"], stack, loop)
            upsert = partial(aconn.execute, PG_UPSERT, prepare=True)
            return ik_job(backend, lambda key: upsert((key, "done")), loop, stack)

        return {c.IK: build_ik}

    def job_fns(
        self, t: dict[str, Any], stack: contextlib.ExitStack, res: c.Results
    ) -> dict[str, c.SyncFn]:
        fns = super().job_fns(t, stack, res)
        fns[c.OURS_TX] = pg_job_same_tx(self.coord(t["dsn"], stack), self._conn(t["dsn"], stack))
        return fns
