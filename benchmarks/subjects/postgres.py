"""The PostgreSQL adapter; its baseline is raw psycopg, one comparable prepared
statement per round trip."""

from __future__ import annotations

import contextlib
import hashlib
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, ClassVar

import common as c
import psycopg
import psycopg_pool
from psycopg.rows import tuple_row
from tests.servers.proxy import TcpProxy

import idemlock
from idemlock import Claimed, FencedOut
from idemlock.stores.postgres import fenced as PF
from idemlock.stores.postgres._replies import _i8
from idemlock.stores.postgres._shared import HANDOFF_MS
from subjects.base import Adapter, Ctx, Peers, Raw
from subjects.peers import ik_peer

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


NS, TABLE = "ns", "bench_effects"


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


class PgRaw(Raw):
    """One prepared statement per request, on one connection (``send``) or as ``asend``
    says; the job's write is a fenced upsert."""

    spread = 16  # the sync lock pairs rotate over 16 keys, as this baseline always has

    def __init__(self, conn: Any = None, asend: Any = None) -> None:
        self.conn, self.asend, self.owner = conn, asend, uuid.uuid4().hex

    def steps(self, op: str, key: str) -> tuple[Any, Callable[[Any], Any]]:
        """A pair's two statements: the first's, and the second's made from its row."""
        if op == c.LOCK_OP:
            now, token = pg_now_ms(), self.owner
            return (PG_ACQUIRE, (NS, key, token, now + 30_000, now)), lambda row: (
                PG_RELEASE, (NS, key, token, row[0]))  # fmt: skip
        token = uuid.uuid4().hex
        return (PG_CLAIM, (NS, key, token, "fp", pg_now_ms() + c.LEASE_MS)), lambda row: (
            PG_COMPLETE, (b"j1", pg_now_ms() + c.TTL_MS, NS, key, token))  # fmt: skip

    def send(self, request: tuple[bytes, Any]) -> Any:
        row = self.conn.execute(*request, prepare=True).fetchone()
        assert row is not None, request[0]  # every statement returns its row
        return row

    def write(self, key: str, reply: Any) -> None:
        if self.conn.execute(PG_FENCED, (key, "done", reply[0]), prepare=True).fetchone() is None:
            raise FencedOut(key, reply[0], None)


class PgOwnSql(PgRaw):
    """idemlock's own statements, with the arguments its store builds, sent as the store
    sends them (psycopg's RawCursor, prepared, binary) on one connection: what its SQL
    costs next to the baseline's, without the rest of the store."""

    def __init__(self, conn: Any, store: Any) -> None:
        super().__init__(conn)
        self.store, self.sql = store, store.statements

    def steps(self, op: str, key: str) -> tuple[Any, Callable[[Any], Any]]:
        store, sql, owner, token = self.store, self.sql, self.owner, uuid.uuid4().hex
        if op == c.LOCK_OP:
            chan = store._chan("lock", NS, key)
            release = {"ns": NS, "key": key, "owner": owner, "chan": chan}
            release["handoff"] = _i8(HANDOFF_MS)
            first = (sql.acquire_fast, store._acquire_params(NS, key, owner, 30_000, 1, None))
            return first, lambda row: (sql.release, {**release, "token": _i8(row[1])})
        claim = {"ns": NS, "key": key, "token": token, "fp": "fp", "lease": _i8(c.LEASE_MS)}
        done = store._complete_params(NS, key, token, c.RESULT_BYTES, c.TTL_MS)
        return (sql.claim_fast, claim), lambda _: (sql.complete, done)

    def send(self, request: tuple[Any, dict[str, Any]]) -> Any:
        stmt, params = request
        cur = psycopg.RawCursor(self.conn, row_factory=tuple_row)
        row = cur.execute(stmt.sql, stmt.args(params), prepare=True, binary=True).fetchone()
        assert row is not None and row[0] is not False, stmt.sql  # granted, or its reply
        return row


def pg_job_same_tx(coord: idemlock.Coordinator, conn: psycopg.Connection[Any]) -> c.SyncFn:
    port = coord.idempotency(c.SPEC)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:8]
        for i in range(count):
            claim = port.claim(key := f"{tag}-{i}")
            assert isinstance(claim, Claimed)
            with conn.transaction():
                PF.fenced_upsert(conn, TABLE, effect(key), ["key"], claim.fence)
                PF.complete_in_transaction(conn, port, claim.token, c.RESULT)

    return run


def effect(key: str) -> dict[str, Any]:
    return {"key": key, "value": "done"}


def connect(url: str, stack: contextlib.ExitStack) -> psycopg.Connection[Any]:
    conn = psycopg.connect(url, autocommit=True)
    stack.callback(conn.close)
    return conn


def aconnect(url: str, stack: contextlib.ExitStack, loop: Any) -> psycopg.AsyncConnection[Any]:
    aconn = loop.run_until_complete(psycopg.AsyncConnection.connect(url, autocommit=True))
    stack.callback(lambda: loop.run_until_complete(aconn.close()))
    return aconn


def ik_write(x: Ctx) -> Any:
    """The job's effect: a plain upsert, on a connection of its own."""
    upsert = partial(aconnect(x.t["dsn"], x.stack, x.loop).execute, PG_UPSERT, prepare=True)
    return lambda key: upsert((key, "done"))


class PgBench(Adapter):
    name = "postgres"
    peers: ClassVar[Peers] = {
        c.IK: ik_peer(lambda x, size: pg_idemkit(x.t["dsn"], max_size=size), ik_write)
    }

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

    def raw(self, x: Ctx) -> Raw:
        return PgRaw(connect(x.t["dsn"], x.stack))

    async def araw(self, x: Ctx, tasks: int) -> Raw:
        """1 task: one connection; 100: a pool of idemlock's pool size (10), one checkout
        per statement as the store does."""
        if tasks == 1:
            aconn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
            x.stack.push_async_callback(aconn.close)
            checkout: Any = partial(contextlib.nullcontext, aconn)
        else:
            pool: psycopg_pool.AsyncConnectionPool[Any] = psycopg_pool.AsyncConnectionPool(
                self.dsn, min_size=10, max_size=10, kwargs={"autocommit": True}, open=False
            )
            await pool.open(wait=True)
            x.stack.push_async_callback(pool.close)
            checkout = pool.connection

        async def send(request: tuple[bytes, Any]) -> Any:
            async with checkout() as conn:
                row = await (await conn.execute(*request, prepare=True)).fetchone()
            assert row is not None, request[0]
            return row

        return PgRaw(asend=send)

    def own_sql(self, x: Ctx) -> Raw:
        coord = self.coord(x.t["dsn"], x.stack)
        coord.store._ensure_ready()  # its schema, before the raw connection uses it
        return PgOwnSql(connect(x.t["dsn"], x.stack), coord.store)

    def effect(self, x: Ctx, url: str, aio: bool) -> Any:
        """idemlock's fenced upsert into a table of your own."""
        if aio:
            aconn = aconnect(url, x.stack, x.loop)
            return lambda key, fence: PF.afenced_upsert(aconn, TABLE, effect(key), ["key"], fence)
        conn = connect(url, x.stack)
        return lambda key, fence: PF.fenced_upsert(conn, TABLE, effect(key), ["key"], fence)

    def job_fns(self, t: Any, stack: Any, res: c.Results) -> dict[str, c.SyncFn]:
        fns = super().job_fns(t, stack, res)
        fns[c.OURS_TX] = pg_job_same_tx(self.coord(t["dsn"], stack), connect(t["dsn"], stack))
        return fns

    @staticmethod
    def contender(x: Ctx) -> tuple[Any, Any]:
        """pg_advisory_lock / pg_advisory_unlock: the server queues the waiters."""
        conn = connect(x.t["dsn"], x.stack)

        def lock_id(key: str) -> int:
            digest = hashlib.blake2b((x.t["prefix"] + key).encode(), digest_size=8).digest()
            return int.from_bytes(digest, "big", signed=True)

        def acquire(key: str) -> Any:
            conn.execute("SELECT pg_advisory_lock(%s)", (lock_id(key),))
            return key

        return acquire, lambda key: conn.execute("SELECT pg_advisory_unlock(%s)", (lock_id(key),))
