"""What only the PostgreSQL store promises, on real servers started by the tests.

Crashes are SIGKILLs, pauses are SIGSTOP/SIGCONT, store loss is a server restart;
other processes are real processes. The contract suite covers the port itself.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import psycopg_pool
import pytest
from psycopg.rows import dict_row

import idemlock
import idemlock.aio
from idemlock import (
    Claimed,
    Completed,
    ConfigurationError,
    FencedOut,
    IdempotencySpec,
    InFlight,
    LockSpec,
    StaleClaim,
    StoreCorrupt,
    StoreUnavailable,
)
from idemlock._core.keys import namespace
from idemlock._core.port import Acquired, Channel, Held
from idemlock.stores import postgres as pg
from idemlock.stores.postgres._sql import Statements

from .servers._proc import popen
from .servers.postgres import PgServer, start_postgres

LONG = IdempotencySpec("job", lease=timedelta(seconds=30))


def ms(n: int) -> timedelta:
    return timedelta(milliseconds=n)


@pytest.fixture
def prefix() -> str:
    return "p" + uuid.uuid4().hex[:12]


@pytest.fixture
def coord(postgres_dsn: str, prefix: str) -> Iterator[idemlock.Coordinator]:
    c = idemlock.connect(postgres_dsn, key_prefix=prefix)
    yield c
    c.close()


@pytest.fixture(scope="module")
def scratch() -> Iterator[PgServer]:
    """A server of this module's own, which tests may stop and restart. Commits are
    synchronous so that a crash (immediate stop) loses nothing acknowledged."""
    server = start_postgres({"synchronous_commit": "on"})
    try:
        yield server
    finally:
        server.destroy()


def _table(dsn: str, ddl: str) -> str:
    name = "t_" + uuid.uuid4().hex[:10]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ddl.format(name=name))
    return name


def _child(code: str, *args: str) -> subprocess.Popen[str]:
    return popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=False,
    )


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        assert proc.stderr is not None
        raise AssertionError(f"child exited: {proc.wait(timeout=30)} {proc.stderr.read()}")
    return line.strip()


# ---- crashes and pauses --------------------------------------------------------------

KILLED_CHILD = """
import sys, time, psycopg, idemlock
from datetime import timedelta
from idemlock.stores.postgres import complete_in_transaction
url, prefix, table = sys.argv[1:4]
coord = idemlock.connect(url, key_prefix=prefix)
port = coord.idempotency(idemlock.IdempotencySpec("job", lease=timedelta(seconds=1)))
claim = port.claim("k")
conn = psycopg.connect(url)
conn.execute(f"INSERT INTO {table} (id) VALUES ('effect')")
complete_in_transaction(conn, port, claim.token, "done")  # not committed yet
print(claim.fence, flush=True)
time.sleep(60)
"""


def test_killed_client_leaves_no_half_made_claim(postgres_dsn: str, prefix: str) -> None:
    table = _table(postgres_dsn, "CREATE TABLE {name} (id text PRIMARY KEY)")
    child = _child(KILLED_CHILD, postgres_dsn, prefix, table)
    old_fence = int(_line(child))
    child.send_signal(signal.SIGKILL)  # between claim and (committed) complete
    child.wait(timeout=30)
    coord = idemlock.connect(postgres_dsn, key_prefix=prefix)
    try:
        port = coord.idempotency(IdempotencySpec("job", lease=timedelta(seconds=1)))
        # The open transaction died with the client: no result, no effect.
        status = port.status("k")
        assert status is not None and status.state == "in_flight"
        assert status.fence == old_fence
        with psycopg.connect(postgres_dsn) as conn:
            assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)
        assert isinstance(port.claim("k"), InFlight)
        deadline = time.monotonic() + 5
        while True:
            claim = port.claim("k")
            if isinstance(claim, Claimed) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert isinstance(claim, Claimed), "the lease of the killed client never ended"
        assert claim.fence > old_fence
        port.complete(claim.token, "second try")
    finally:
        coord.close()


PAUSED_CHILD = """
import sys, psycopg, idemlock
from datetime import timedelta
from idemlock.stores.postgres import fenced_update
url, prefix, table = sys.argv[1:4]
coord = idemlock.connect(url, key_prefix=prefix)
lease = coord.lock(idemlock.LockSpec("acct", ttl=timedelta(seconds=0.3))).acquire("1")
print(lease.token, flush=True)
sys.stdin.readline()  # the parent stops us around here, past our lease
conn = psycopg.connect(url, autocommit=True)
try:
    n = fenced_update(conn, table, {"balance": 666}, {"id": 1}, lease.token)
    print("wrote", n, flush=True)
except idemlock.FencedOut as exc:
    print("fenced", exc.current, flush=True)
"""


def test_paused_holder_is_fenced_out(postgres_dsn: str, prefix: str) -> None:
    table = _table(
        postgres_dsn,
        "CREATE TABLE {name} (id int PRIMARY KEY, balance int, fence_token bigint)",
    )
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {table} (id, balance) VALUES (1, 0)")
    child = _child(PAUSED_CHILD, postgres_dsn, prefix, table)
    old_token = int(_line(child))
    child.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.45)  # the paused holder's lease runs out
        coord = idemlock.connect(postgres_dsn, key_prefix=prefix)
        locks = coord.lock(LockSpec("acct", ttl=timedelta(seconds=30)))
        lease = locks.acquire("1")
        assert lease is not None and lease.token is not None and lease.token > old_token
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            assert pg.fenced_update(conn, table, {"balance": 100}, {"id": 1}, lease.token) == 1
    finally:
        child.send_signal(signal.SIGCONT)
    out, err = child.communicate("go\n", timeout=30)
    assert out.split() == ["fenced", str(lease.token)], err
    with psycopg.connect(postgres_dsn) as conn:
        row = conn.execute(f"SELECT balance, fence_token FROM {table}").fetchone()
    assert row == (100, lease.token)
    locks.release(lease)
    coord.close()


MIGRATE_CHILD = """
import os, sys, time, idemlock
url, schema, go = sys.argv[1:4]
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
coord = idemlock.connect(url, key_prefix="mig", schema=schema)
claim = coord.idempotency("first-use").claim(f"k{os.getpid()}")
print(claim.fence, flush=True)
coord.close()
"""


def test_many_processes_migrate_at_once(postgres_dsn: str, tmp_path: Any) -> None:
    schema = "mig_" + uuid.uuid4().hex[:10]
    go = tmp_path / "go"
    children = [_child(MIGRATE_CHILD, postgres_dsn, schema, str(go)) for _ in range(6)]
    for child in children:
        assert _line(child) == "ready"
    go.touch()  # all at once: every one finds the schema missing
    fences = []
    for child in children:
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        fences.append(int(out))
    assert len(set(fences)) == len(fences)
    with psycopg.connect(postgres_dsn) as conn:
        rows = conn.execute(
            f"SELECT version FROM {schema}.schema_version ORDER BY version"
        ).fetchall()
    # every migration applied exactly once
    assert rows == [(v,) for v in range(1, pg.SCHEMA_VERSION + 1)]


# ---- durability and errors (on the scratch server) ----------------------------------


def test_tokens_survive_a_server_crash(scratch: PgServer, prefix: str) -> None:
    coord = idemlock.connect(scratch.dsn, key_prefix=prefix)
    port = coord.idempotency(LONG)
    locks = coord.lock(LockSpec("L", ttl=timedelta(seconds=30)))
    first = port.claim("a")
    lease = locks.acquire("x")
    assert isinstance(first, Claimed) and lease is not None and lease.token is not None
    assert coord.fence("res").check_and_advance(lease.token) == lease.token

    scratch.restart("immediate")  # a crash: no shutdown checkpoint

    # The same coordinator carries on: its pooled connections died with the server,
    # and a call that is safe to repeat is retried once on a fresh one.
    again = port.claim("a")
    assert isinstance(again, InFlight)
    assert port.forget("a") is True
    second = port.claim("a")
    assert isinstance(second, Claimed) and second.fence > first.fence
    assert locks.release(lease) is True
    lease2 = locks.acquire("x")
    assert lease2 is not None and lease2.token is not None and lease2.token > lease.token
    with pytest.raises(FencedOut):
        coord.fence("res").check_and_advance(lease.token - 1)
    coord.close()


def test_waiters_survive_a_server_restart(scratch: PgServer, prefix: str) -> None:
    from idemlock._core.port import Channel

    coord = idemlock.connect(scratch.dsn, key_prefix=prefix)
    store = coord.store
    ns = namespace(prefix, "w")
    channel = Channel("lock", ns, "k")
    sub = store.subscribe(channel)
    name = store.statements.channel(*channel)
    try:
        assert store.listener.is_listening(name)
        scratch.restart()
        # Losing the connection wakes every waiter (notifications may have been lost)...
        assert sub.wait(5) is True
        deadline = time.monotonic() + 10
        while not store.listener.is_listening(name):  # ...and it LISTENs again
            assert time.monotonic() < deadline, "the listener did not reconnect"
            time.sleep(0.05)
        before = store.listener.received
        other = idemlock.connect(scratch.dsn, key_prefix=prefix)
        lease = other.store.acquire(ns, "k", "o", 30_000)
        assert other.store.release(ns, "k", "o", lease.token)
        # A release after the restart reaches the old waiter as a real notification.
        assert sub.wait(5) is True
        while store.listener.received == before:
            assert time.monotonic() < deadline, "no notification after the restart"
            sub.wait(0.05)
        other.close()
    finally:
        sub.close()
        coord.close()


def test_errors_become_store_unavailable(scratch: PgServer, prefix: str) -> None:
    coord = idemlock.connect(scratch.dsn, key_prefix=prefix, timeout=0.5)
    port = coord.idempotency(LONG)
    claim = port.claim("k")
    assert isinstance(claim, Claimed)

    # An administrator ends our sessions: the next call that must not be repeated
    # blindly (complete) fails with the driver's error chained.
    with psycopg.connect(scratch.dsn, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    with pytest.raises(StoreUnavailable) as info:
        port.complete(claim.token, 1)
    assert isinstance(info.value.__cause__, psycopg.OperationalError)
    port.complete(claim.token, 1)  # the pool replaced the dead connection

    scratch.stop()
    try:
        with pytest.raises(StoreUnavailable) as info:
            port.claim("other")
        assert isinstance(info.value.__cause__, psycopg.Error)
        with pytest.raises(StoreUnavailable):
            coord.lock("L").acquire("x")
    finally:
        scratch.start()
    deadline = time.monotonic() + 10
    while True:  # the pool reconnects in the background
        try:
            assert isinstance(port.claim("other"), Claimed)
            break
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    coord.close()


def test_pool_timeout_is_store_unavailable(postgres_dsn: str, prefix: str) -> None:
    pool = psycopg_pool.ConnectionPool(postgres_dsn, min_size=1, max_size=1, timeout=0.2, open=True)
    pool.wait()
    coord = idemlock.connect(pool, key_prefix=prefix)
    try:
        assert coord.idempotency(LONG).status("k") is None
        # The only connection is busy.
        with pool.connection(), pytest.raises(StoreUnavailable) as info:
            coord.idempotency(LONG).status("k")
        assert isinstance(info.value.__cause__, psycopg_pool.PoolTimeout)
    finally:
        coord.close()
        pool.close()


def test_unknown_state_is_store_corrupt(coord: idemlock.Coordinator, postgres_dsn: str) -> None:
    ns = namespace(coord.key_prefix, "job")
    assert coord.idempotency(LONG).status("warmup") is None  # the tables exist
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO idemlock.claims (ns, key, state, token, fence, expires_ms) "
            "VALUES (%s, 'k', 'exploded', 't', 1, 9e15)",
            (ns,),
        )
    port = coord.idempotency(LONG)
    with pytest.raises(StoreCorrupt):
        port.claim("k")
    with pytest.raises(StoreCorrupt):
        port.status("k")
    # a listing shows the foreign row as corrupt instead of failing (A3)
    assert [(r.key, r.state) for r in coord.store.records(ns)] == [("k", "corrupt")]


# ---- schema ----------------------------------------------------------------------------


def test_migrate(postgres_dsn: str) -> None:
    schema = "m_" + uuid.uuid4().hex[:10]
    with pytest.raises(ConfigurationError):
        pg.migrate(postgres_dsn, schema="bad-name; DROP")
    # Without auto_migrate the store refuses an unmigrated schema and says what to do.
    coord = idemlock.connect(postgres_dsn, schema=schema, auto_migrate=False)
    with pytest.raises(ConfigurationError, match="idemlock migrate"):
        coord.idempotency(LONG).status("k")
    coord.close()
    assert pg.migrate(postgres_dsn, schema=schema) == pg.SCHEMA_VERSION
    assert pg.migrate(postgres_dsn, schema=schema) == pg.SCHEMA_VERSION  # a no-op
    coord = idemlock.connect(postgres_dsn, schema=schema, auto_migrate=False)
    assert isinstance(coord.idempotency(LONG).claim("k"), Claimed)
    coord.close()
    with psycopg.connect(postgres_dsn) as conn:
        indexes = {
            r[0]
            for r in conn.execute(
                "SELECT indexname FROM pg_indexes WHERE schemaname = %s", (schema,)
            )
        }
    assert {"claims_expires_idx", "locks_expires_idx"} <= indexes
    assert asyncio.run(pg.amigrate(postgres_dsn, schema=schema)) == pg.SCHEMA_VERSION


def test_migrate_takes_the_stores_own_url_and_schema(postgres_dsn: str) -> None:
    # The URL the store is opened with, idemlock's ?timeout= included, and its schema=.
    schema = "m_" + uuid.uuid4().hex[:10]
    url = postgres_dsn + "?timeout=3"
    coord = idemlock.connect(url, schema=schema, auto_migrate=False)
    # The command the store tells the user to run names the schema it needs.
    hint = f"run `idemlock migrate --url ... --schema {schema}`"
    with pytest.raises(ConfigurationError) as refused:
        coord.idempotency(LONG).status("k")
    assert hint in str(refused.value)
    assert pg.migrate(url, schema=schema) == pg.SCHEMA_VERSION
    assert asyncio.run(pg.amigrate(url, schema=schema)) == pg.SCHEMA_VERSION
    assert isinstance(coord.idempotency(LONG).claim("k"), Claimed)
    # Tables gone under a running store: the same command, with the same schema.
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")
    with pytest.raises(StoreUnavailable) as missing:
        coord.idempotency(LONG).status("k")
    assert hint in str(missing.value)
    coord.close()
    # The URL's timeout is checked as the store checks it.
    for bad in ("?timeout=0", "?timeout=1&timeout=2"):
        with pytest.raises(ConfigurationError, match="timeout"):
            pg.migrate(postgres_dsn + bad, schema=schema)
        with pytest.raises(ConfigurationError, match="timeout"):
            asyncio.run(pg.amigrate(postgres_dsn + bad, schema=schema))


def test_writes_into_the_store_name_the_postgres_tools(coord: idemlock.Coordinator) -> None:
    # PostgreSQL holds the user's data in the user's tables: the refusals name, by their
    # import path, the helpers that fence or record there atomically.
    with pytest.raises(ConfigurationError) as fenced:
        coord.fence("acct").set_if_fresh(1, "balance", "10")
    assert "check_and_advance followed by your own write is not atomic" in str(fenced.value)
    assert "idemlock.stores.postgres.fenced.fenced_update or fenced_upsert" in str(fenced.value)
    port = coord.idempotency(LONG)
    claim = port.claim("k")
    assert isinstance(claim, Claimed)
    with pytest.raises(ConfigurationError) as writes:
        port.complete(claim.token, {"ok": 1}, writes={"k2": "v"})
    assert "idemlock.stores.postgres.fenced.complete_in_transaction" in str(writes.value)


def test_channel_names_fit_postgres_limits() -> None:
    st = Statements.for_schema("idemlock")
    names = {st.channel("lock", "ns", "k" * 512), st.channel("claim", "ns", "k" * 512)}
    assert len(names) == 2
    assert all(len(n.encode()) <= 63 for n in names)


# ---- purge -----------------------------------------------------------------------------


def test_purge_removes_expired_rows_and_keeps_fences_rising(postgres_dsn: str) -> None:
    schema = "pu_" + uuid.uuid4().hex[:10]
    coord = idemlock.connect(postgres_dsn, schema=schema)
    short = coord.idempotency(IdempotencySpec("s", ttl=ms(100), lease=ms(100)))
    locks = coord.lock(LockSpec("l", ttl=ms(100)))
    fences: dict[str, int] = {}
    for i in range(5):
        claim = short.claim(f"done{i}")
        assert isinstance(claim, Claimed)
        short.complete(claim.token, i)
        fences[f"done{i}"] = claim.fence
    abandoned = short.claim("abandoned")
    assert isinstance(abandoned, Claimed)
    short.abandon(abandoned.token)
    assert isinstance(short.claim("lapsed"), Claimed)
    lease = locks.acquire("released")
    assert lease is not None
    locks.release(lease)
    assert locks.acquire("lapsed") is not None
    live = coord.idempotency(LONG).claim("live")
    assert isinstance(live, Claimed)
    time.sleep(0.25)
    # 5 completed + abandoned + lapsed claims; released + lapsed locks. The live one stays.
    assert coord.purge() == 9
    assert coord.purge() == 0
    with psycopg.connect(postgres_dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {schema}.claims").fetchone() == (1,)
        assert conn.execute(f"SELECT count(*) FROM {schema}.locks").fetchone() == (0,)
    again = short.claim("done0")
    assert isinstance(again, Claimed) and again.fence > max(fences.values())
    coord.close()


# ---- same-transaction completion --------------------------------------------------------


def test_complete_in_transaction_commits_or_rolls_back_with_the_write(
    coord: idemlock.Coordinator, postgres_dsn: str
) -> None:
    table = _table(postgres_dsn, "CREATE TABLE {name} (id text PRIMARY KEY)")
    port = coord.idempotency(LONG)

    def orders() -> set[str]:
        with psycopg.connect(postgres_dsn) as conn:
            return {r[0] for r in conn.execute(f"SELECT id FROM {table}")}

    ok = port.claim("ok")
    assert isinstance(ok, Claimed)
    with psycopg.connect(postgres_dsn) as conn, conn.transaction():
        conn.execute(f"INSERT INTO {table} VALUES ('ok')")
        pg.complete_in_transaction(conn, port, ok.token, {"order": "ok"})
    replay = port.claim("ok")
    assert isinstance(replay, Completed) and replay.result == {"order": "ok"}

    failed = port.claim("failed")
    assert isinstance(failed, Claimed)
    with pytest.raises(RuntimeError), psycopg.connect(postgres_dsn) as conn, conn.transaction():
        conn.execute(f"INSERT INTO {table} VALUES ('failed')")
        pg.complete_in_transaction(conn, port, failed.token, "never")
        raise RuntimeError("the rest of the transaction failed")
    status = port.status("failed")
    assert status is not None and status.state == "in_flight"  # still ours to retry
    port.abandon(failed.token)

    # A claim that lost its key: StaleClaim inside the block rolls the write back.
    short = coord.idempotency(IdempotencySpec("short", lease=ms(100)))
    stale = short.claim("k")
    assert isinstance(stale, Claimed)
    time.sleep(0.15)
    assert isinstance(short.claim("k"), Claimed)
    with pytest.raises(StaleClaim), psycopg.connect(postgres_dsn) as conn, conn.transaction():
        conn.execute(f"INSERT INTO {table} VALUES ('stale')")
        pg.complete_in_transaction(conn, short, stale.token, "late")
    assert orders() == {"ok"}

    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        claim = port.claim("outside")
        assert isinstance(claim, Claimed)
        with pytest.raises(ConfigurationError, match="inside your transaction"):
            pg.complete_in_transaction(conn, port, claim.token, 1)


async def test_complete_in_transaction_async(postgres_dsn: str, prefix: str) -> None:
    table = _table(postgres_dsn, "CREATE TABLE {name} (id text PRIMARY KEY)")
    coord = idemlock.aio.connect(postgres_dsn, key_prefix=prefix)
    port = coord.idempotency(LONG)
    try:
        claim = await port.claim("a")
        assert isinstance(claim, Claimed)
        waiter = asyncio.ensure_future(port.wait("a", timeout=10))
        await asyncio.sleep(0.1)
        conn = await psycopg.AsyncConnection.connect(postgres_dsn)
        async with conn, conn.transaction():
            await conn.execute(f"INSERT INTO {table} VALUES ('a')")
            await pg.acomplete_in_transaction(conn, port, claim.token, [1, 2])
            await asyncio.sleep(0.05)
            assert not waiter.done()  # not visible before commit
        # The commit woke the waiter, which replays the result.
        replay = await asyncio.wait_for(waiter, 5)
        assert isinstance(replay, Completed) and replay.result == [1, 2]
    finally:
        await coord.close()


# ---- fenced writes -----------------------------------------------------------------------


def test_fenced_update_and_upsert(postgres_dsn: str) -> None:
    table = _table(
        postgres_dsn,
        "CREATE TABLE {name} (id int PRIMARY KEY, v text, fence_token bigint)",
    )
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {table} (id, v) VALUES (1, 'new')")
        assert pg.fenced_update(conn, table, {"v": "five"}, {"id": 1}, 5) == 1
        assert pg.fenced_update(conn, table, {"v": "five again"}, {"id": 1}, 5) == 1
        with pytest.raises(FencedOut) as info:
            pg.fenced_update(conn, table, {"v": "stale"}, {"id": 1}, 4)
        assert (info.value.token, info.value.current) == (4, 5)
        assert pg.fenced_update(conn, table, {"v": "x"}, {"id": 99}, 9) == 0  # no such row
        pg.fenced_upsert(conn, table, {"id": 2, "v": "inserted"}, ["id"], 3)
        pg.fenced_upsert(conn, table, {"id": 2, "v": "updated"}, ["id"], 7)
        with pytest.raises(FencedOut):
            pg.fenced_upsert(conn, table, {"id": 2, "v": "stale"}, ["id"], 6)
        rows = conn.execute(f"SELECT id, v, fence_token FROM {table} ORDER BY id").fetchall()
    assert rows == [(1, "five again", 5), (2, "updated", 7)]

    async def run_async() -> None:
        async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as conn:
            assert await pg.afenced_update(conn, table, {"v": "ten"}, {"id": 1}, 10) == 1
            with pytest.raises(FencedOut):
                await pg.afenced_update(conn, table, {"v": "stale"}, {"id": 1}, 9)
            await pg.afenced_upsert(conn, table, {"id": 3, "v": "a"}, ["id"], 1)
            with pytest.raises(FencedOut):
                await pg.afenced_upsert(conn, table, {"id": 2, "v": "stale"}, ["id"], 1)

    asyncio.run(run_async())


def test_sqlalchemy_core_helpers(postgres_dsn: str) -> None:
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import create_async_engine

    url = postgres_dsn.replace("postgresql://", "postgresql+psycopg://")
    meta = sa.MetaData()
    accounts = sa.Table(
        "sa_" + uuid.uuid4().hex[:10],
        meta,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("balance", sa.Integer),
        sa.Column("fence_token", sa.BigInteger),
    )
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        meta.create_all(conn)
        conn.execute(accounts.insert().values(id=1, balance=0))
    stmt = pg.fenced_update_stmt(accounts, {"balance": 1}, accounts.c.id == 1, 5)
    assert "fence_token <=" in str(stmt.compile(dialect=engine.dialect))
    with engine.begin() as conn:
        assert pg.sa_fenced_update(conn, accounts, {"balance": 10}, accounts.c.id == 1, 5) == 1
        with pytest.raises(FencedOut) as info:
            pg.sa_fenced_update(conn, accounts, {"balance": -1}, accounts.c.id == 1, 4)
        assert info.value.current == 5
        pg.sa_fenced_upsert(conn, accounts, {"id": 2, "balance": 20}, ["id"], 6)
        pg.sa_fenced_upsert(conn, accounts, {"id": 2, "balance": 21}, ["id"], 7)
        with pytest.raises(FencedOut):
            pg.sa_fenced_upsert(conn, accounts, {"id": 2, "balance": -1}, ["id"], 6)
        rows = conn.execute(sa.select(accounts).order_by(accounts.c.id)).all()
    assert [tuple(r) for r in rows] == [(1, 10, 5), (2, 21, 7)]
    engine.dispose()

    async def run_async() -> None:
        aengine = create_async_engine(url)
        async with aengine.begin() as conn:
            where = accounts.c.id == 1
            assert await pg.sa_afenced_update(conn, accounts, {"balance": 30}, where, 8) == 1
            with pytest.raises(FencedOut):
                await pg.sa_afenced_update(conn, accounts, {"balance": -1}, where, 7)
            await pg.sa_afenced_upsert(conn, accounts, {"id": 3, "balance": 3}, ["id"], 1)
            with pytest.raises(FencedOut):
                await pg.sa_afenced_upsert(conn, accounts, {"id": 2, "balance": 0}, ["id"], 1)
        await aengine.dispose()

    asyncio.run(run_async())


# ---- existing pools ----------------------------------------------------------------------


def test_existing_pool(postgres_dsn: str, prefix: str) -> None:
    # A user's pool as users make them: no autocommit, and here rows as dicts.
    with psycopg_pool.ConnectionPool(
        postgres_dsn, min_size=1, max_size=2, kwargs={"row_factory": dict_row}
    ) as pool:
        coord = idemlock.connect(pool, key_prefix=prefix)
        port = coord.idempotency(LONG)
        claim = port.claim("k", payload={"a": 1})
        assert isinstance(claim, Claimed)
        port.complete(claim.token, "r")
        assert isinstance(port.claim("k", payload={"a": 1}), Completed)
        coord.close()  # the pool is the user's: still open
        with pool.connection() as conn:
            assert conn.autocommit is False  # lent back as it was lent
            row: Any = conn.execute("SELECT 1 AS one").fetchone()
            assert row == {"one": 1}
        with pytest.raises(ConfigurationError):
            idemlock.aio.connect(pool)


async def test_existing_async_pool(postgres_dsn: str, prefix: str) -> None:
    async with psycopg_pool.AsyncConnectionPool(postgres_dsn, min_size=1, max_size=2) as pool:
        coord = idemlock.aio.connect(pool, key_prefix=prefix)
        port = coord.idempotency(LONG)
        claim = await port.claim("k")
        assert isinstance(claim, Claimed)
        await port.complete(claim.token, "r")
        assert isinstance(await port.claim("k"), Completed)
        await coord.close()
        async with pool.connection() as conn:
            assert conn.autocommit is False
        with pytest.raises(ConfigurationError):
            idemlock.connect(pool)


# ---- hand-off across processes ---------------------------------------------------------

HOLDER_CHILD = """
import sys, time, idemlock
from datetime import timedelta
url, prefix = sys.argv[1:3]
coord = idemlock.connect(url, key_prefix=prefix)
locks = coord.lock(idemlock.LockSpec("h", ttl=timedelta(seconds=30)))
lease = locks.acquire("k")
print("held", flush=True)
sys.stdin.readline()
released_at = time.monotonic()
assert locks.release(lease)
print(released_at, flush=True)
coord.close()
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_handoff_across_processes(postgres_dsn: str, prefix: str, mode: str) -> None:
    child = _child(HOLDER_CHILD, postgres_dsn, prefix)
    assert _line(child) == "held"
    spec = LockSpec("h", ttl=timedelta(seconds=30))
    assert child.stdin is not None
    stdin = child.stdin

    def release_soon() -> None:
        time.sleep(0.3)
        stdin.write("go\n")
        stdin.flush()

    threading.Thread(target=release_soon, daemon=True).start()
    if mode == "sync":
        coord = idemlock.connect(postgres_dsn, key_prefix=prefix)
        lease = coord.lock(spec).acquire("k", wait=20)
        acquired_at = time.monotonic()
        received = coord.store.listener.received
        coord.close()
    else:

        async def wait_async() -> tuple[Any, float, int]:
            acoord = idemlock.aio.connect(postgres_dsn, key_prefix=prefix)
            try:
                lease = await acoord.lock(spec).acquire("k", wait=20)
                return lease, time.monotonic(), acoord.store.listener.received
            finally:
                await acoord.close()

        lease, acquired_at, received = asyncio.run(wait_async())
    released_at = float(_line(child))
    child.wait(timeout=10)
    assert lease is not None
    assert acquired_at >= released_at
    # Woken by the release's NOTIFY, not by a timer (the holder's ttl is 30 s).
    assert received >= 1


def test_subscription_catches_a_notification_before_wait(
    coord: idemlock.Coordinator,
) -> None:
    from idemlock._core.port import Channel

    store = coord.store
    ns = namespace(coord.key_prefix, "h")
    lease = store.acquire(ns, "k", "owner", 30_000)
    sub = store.subscribe(Channel("lock", ns, "k"))
    try:
        assert store.release(ns, "k", "owner", lease.token)
        time.sleep(0.2)  # the notification arrives before anyone waits
        assert sub.wait(0) is True
        assert sub.wait(0.05) is False
    finally:
        sub.close()


def test_idle_channels_linger_then_unlisten(
    coord: idemlock.Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    from idemlock._core.port import Channel
    from idemlock.stores.postgres import _listen

    monkeypatch.setattr(_listen, "LINGER", 0.3)
    store = coord.store
    channel = Channel("lock", namespace(coord.key_prefix, "h"), "k")
    name = store.statements.channel(*channel)
    store.subscribe(channel).close()
    assert store.listener.is_listening(name)
    # Waiting again on a busy key right away needs no LISTEN round trip (try_subscribe
    # only declines while the reader thread holds the connection for a moment)...
    for _ in range(100):
        again = store.listener.try_subscribe(name)
        if again is not None:
            break
        time.sleep(0.001)
    assert again is not None
    again.close()
    # ...and a channel nobody waits on is given up after a while.
    deadline = time.monotonic() + 5
    while store.listener.is_listening(name):
        assert time.monotonic() < deadline, "the idle channel was never UNLISTENed"
        time.sleep(0.05)


# ---- counted leases (permits) and the upgrade to layout 3 ---------------------------

#: layout 2's ACQUIRE_FAST, as the previous release runs it: what a process that has
#: not been upgraded yet does to a key
_V2_ACQUIRE = """
WITH up AS (
    INSERT INTO {s}.locks AS l (ns, key, owner, token, expires_ms)
    VALUES (%(ns)s::text, %(key)s::text, %(owner)s::text, nextval({seq}), {now} + %(ttl)s)
    ON CONFLICT (ns, key) DO UPDATE
        SET token = CASE WHEN l.expires_ms <= excluded.expires_ms - %(ttl)s
                         THEN nextval({seq}) ELSE l.token END,
            owner = excluded.owner, expires_ms = excluded.expires_ms, window_ms = 0
        WHERE CASE WHEN l.expires_ms > excluded.expires_ms - %(ttl)s
                   THEN l.owner = excluded.owner
                   ELSE l.chosen IS NULL OR l.window_ms <= excluded.expires_ms - %(ttl)s
                        OR l.chosen = %(gid)s::text END
    RETURNING l.token, l.expires_ms
)
SELECT true, up.token, up.expires_ms, up.expires_ms - %(ttl)s, NULL::text, 0::bigint, false
FROM up
UNION ALL
SELECT false, c.token, c.expires_ms, n.ms, c.owner, c.window_ms,
       coalesce(c.window_ms > n.ms AND c.chosen <> %(gid)s::text, false)
FROM {s}.locks c, (SELECT {now} AS ms) AS n
WHERE c.ns = %(ns)s::text AND c.key = %(key)s::text AND NOT EXISTS (SELECT FROM up)
"""

PERMIT_TTL = 60_000


def _schema_v2(dsn: str, schema: str) -> None:
    """A schema made by the previous release: layout 2's DDL, as it ran it."""
    from idemlock.stores.postgres._sql import (
        bootstrap_statements,
        migration_statements,
        record_version,
    )

    with psycopg.connect(dsn) as conn:
        for stmt in bootstrap_statements(schema):
            conn.execute(stmt)
        for version in (1, 2):
            for stmt in migration_statements(schema, version):
                conn.execute(stmt)
            conn.execute(record_version(schema), {"v": version})


def _v2_acquire(dsn: str, schema: str, ns: str, key: str, owner: str) -> int | None:
    """An acquire by a process of the previous release: its token, or None if refused."""
    from idemlock.stores.postgres._sql import _render

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            _render(_V2_ACQUIRE, schema),
            {"ns": ns, "key": key, "owner": owner, "ttl": PERMIT_TTL, "gid": ""},
        ).fetchone()
    assert row is not None
    return int(row[1]) if row[0] else None


def test_a_version_2_schema_upgrades_in_place_and_its_locks_stay_exclusive(
    postgres_dsn: str,
) -> None:
    schema = "v2_" + uuid.uuid4().hex[:10]
    _schema_v2(postgres_dsn, schema)
    ns = "old:lock"
    held = _v2_acquire(postgres_dsn, schema, ns, "held", "old-owner")
    freed = _v2_acquire(postgres_dsn, schema, ns, "freed", "old-owner")
    assert held is not None and freed is not None
    with psycopg.connect(postgres_dsn) as conn:  # the previous release's release
        conn.execute(f"UPDATE {schema}.locks SET expires_ms = 0 WHERE key = 'freed'")
    # Several processes start on the new release at once: one migrates, the others
    # find it done.
    results: list[Any] = []

    def upgrade() -> None:
        try:
            results.append(pg.migrate(postgres_dsn, schema=schema))
        except BaseException as exc:  # pragma: no cover - reported below
            results.append(exc)

    threads = [threading.Thread(target=upgrade) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [pg.SCHEMA_VERSION] * 6
    with psycopg.connect(postgres_dsn) as conn:
        versions = conn.execute(
            f"SELECT version FROM {schema}.schema_version ORDER BY version"
        ).fetchall()
    assert versions == [(v,) for v in range(1, pg.SCHEMA_VERSION + 1)]
    coord = idemlock.connect(postgres_dsn, key_prefix="up", schema=schema, auto_migrate=False)
    try:
        store = coord.store
        # The lock held at upgrade time: still held, by the same owner and token.
        assert isinstance(store.acquire(ns, "held", "new-owner", PERMIT_TTL), Held)
        (row,) = store.holders(ns, "held")
        assert (row.owner, row.token, row.value) == ("old-owner", held, None)
        # Its holder renews and releases it as before.
        assert store.renew(ns, "held", "old-owner", held, PERMIT_TTL) is not None
        assert store.release(ns, "held", "old-owner", held) is True
        got = store.acquire(ns, "held", "new-owner", PERMIT_TTL)
        assert isinstance(got, Acquired) and got.token > held
        # A released key of the old layout is free, and its tokens keep rising.
        again = store.acquire(ns, "freed", "new-owner", PERMIT_TTL, 2, b"v")
        assert isinstance(again, Acquired) and again.token > freed
    finally:
        coord.close()


def test_the_previous_release_cannot_grant_a_lock_this_one_holds(postgres_dsn: str) -> None:
    schema = "v2_" + uuid.uuid4().hex[:10]
    _schema_v2(postgres_dsn, schema)
    coord = idemlock.connect(postgres_dsn, key_prefix="up", schema=schema)
    ns = "mixed:lock"
    try:
        store = coord.store
        lock = store.acquire(ns, "lock", "new", PERMIT_TTL)
        assert isinstance(lock, Acquired)
        assert _v2_acquire(postgres_dsn, schema, ns, "lock", "intruder") is None
        # A key shared by permits is held too while its first permit lives.
        for owner in ("a", "b"):
            assert isinstance(store.acquire(ns, "sem", owner, PERMIT_TTL, 2), Acquired)
        assert _v2_acquire(postgres_dsn, schema, ns, "sem", "intruder") is None
        # Once released, the old release takes the key the way it always did, and this
        # release sees that holder.
        assert store.release(ns, "lock", "new", lock.token) is True
        old = _v2_acquire(postgres_dsn, schema, ns, "lock", "intruder")
        assert old is not None and old > lock.token
        assert isinstance(store.acquire(ns, "lock", "new", PERMIT_TTL), Held)
        assert [(r.owner, r.token) for r in store.holders(ns, "lock")] == [("intruder", old)]
    finally:
        coord.close()


def test_permits_never_exceed_the_limit_under_contention(postgres_dsn: str, prefix: str) -> None:
    coord = idemlock.connect(postgres_dsn, key_prefix=prefix)
    store = coord.store
    ns, limit = prefix + ":sem", 2
    guard = threading.Lock()
    inside: list[str] = []
    seen: dict[str, list[int]] = {}
    errors: list[BaseException] = []
    deadline = time.monotonic() + 60

    def worker(owner: str, mine: int) -> None:
        tokens = seen.setdefault(owner, [])
        try:
            while len(tokens) < 15 and time.monotonic() < deadline:
                got = store.acquire(ns, "k", owner, PERMIT_TTL, mine)
                if not isinstance(got, Acquired):
                    continue
                with guard:
                    inside.append(owner)
                    # Holders counted by this process never exceed what the store
                    # allows: the limit, or 1 for the lock's caller.
                    assert len(inside) <= limit, inside
                    assert mine == limit or inside == [owner], inside
                tokens.append(got.token)
                with guard:
                    inside.remove(owner)
                assert store.release(ns, "k", owner, got.token) is True
        except BaseException as exc:
            errors.append(exc)

    owners = [(f"o{i}", 1 if i == 0 else limit) for i in range(5)]
    threads = [threading.Thread(target=worker, args=o) for o in owners]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    finally:
        coord.close()
    assert not errors, errors[0]
    assert all(len(seen[o]) == 15 for o, _ in owners), {o: len(t) for o, t in seen.items()}
    every = [tok for toks in seen.values() for tok in toks]
    assert len(set(every)) == len(every)
    assert all(toks == sorted(toks) for toks in seen.values())


@pytest.fixture
def long_handoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand-off windows and waiter registrations last ten minutes here (50 ms and
    1.5 s in production), so a loaded machine cannot let one lapse under the test."""
    from psycopg.types.numeric import Int8

    from idemlock.stores.postgres import _async, _shared, _sync

    for module in (_sync, _async):
        monkeypatch.setattr(module, "_HANDOFF_MS8", Int8(600_000))
    monkeypatch.setattr(_shared, "_REGISTER_MS8", Int8(600_000))


def test_a_window_kept_for_a_waiter_counts_as_one_holder(
    postgres_dsn: str, prefix: str, long_handoff: None
) -> None:
    # Two coordinators: two processes as far as the store's waiters' queue goes.
    here = idemlock.connect(postgres_dsn, key_prefix=prefix)
    there = idemlock.connect(postgres_dsn, key_prefix=prefix)
    ns = prefix + ":sem"
    sub = there.store.subscribe(Channel("lock", ns, "k"))
    try:
        a = here.store.acquire(ns, "k", "a", PERMIT_TTL, 2)
        b = here.store.acquire(ns, "k", "b", PERMIT_TTL, 2)
        assert isinstance(a, Acquired) and isinstance(b, Acquired)
        # The other process waits: refused, it queues.
        assert isinstance(there.store.acquire(ns, "k", "w", PERMIT_TTL, 2), Held)
        assert here.store.release(ns, "k", "a", a.token) is True
        assert sub.wait(20.0) is True
        # One holder and the window kept for the waiter: the key is full at 2 ...
        assert isinstance(here.store.acquire(ns, "k", "c", PERMIT_TTL, 2), Held)
        # ... and has room at 3, where the window stays kept.
        c = here.store.acquire(ns, "k", "c", PERMIT_TTL, 3)
        assert isinstance(c, Acquired)
        assert isinstance(here.store.acquire(ns, "k", "d", PERMIT_TTL, 3), Held)
        # The chosen waiter takes its slot.
        w = there.store.acquire(ns, "k", "w", PERMIT_TTL, 3)
        assert isinstance(w, Acquired) and w.token > c.token
        assert [r.owner for r in here.store.holders(ns, "k")] == ["b", "c", "w"]
    finally:
        sub.close()
        here.close()
        there.close()


def test_purge_counts_and_removes_expired_permits(postgres_dsn: str) -> None:
    schema = "pp_" + uuid.uuid4().hex[:10]
    coord = idemlock.connect(postgres_dsn, key_prefix="pp", schema=schema)
    store = coord.store
    ns = "pp:sem"
    try:
        # k: its first permit (slot 0) and one more expire, one lives on.
        # j: every permit expires. r: a released lock (its row stays until purged).
        for owner in ("a", "b"):
            assert isinstance(store.acquire(ns, "k", owner, 150, 3), Acquired)
        live = store.acquire(ns, "k", "c", PERMIT_TTL, 3)
        assert isinstance(live, Acquired)
        for owner in ("a", "b", "c"):
            assert isinstance(store.acquire(ns, "j", owner, 150, 3), Acquired)
        r = store.acquire(ns, "r", "a", PERMIT_TTL)
        assert isinstance(r, Acquired) and store.release(ns, "r", "a", r.token)
        deadline = time.monotonic() + 20
        while len(store.holders(ns, "k")) > 1 or store.holders(ns, "j"):
            assert time.monotonic() < deadline, "the short permits did not expire"
            time.sleep(0.05)
        # 2 of k + 3 of j + the released lock
        assert coord.purge(dry_run=True) == 6
        assert coord.purge() == 6
        assert coord.purge(dry_run=True) == 0 and coord.purge() == 0
        (row,) = store.holders(ns, "k")
        assert (row.owner, row.token) == ("c", live.token)
        assert store.renew(ns, "k", "c", live.token, PERMIT_TTL) is not None
        with psycopg.connect(postgres_dsn) as conn:
            rows = conn.execute(
                f"SELECT key, owner, cardinality(others) FROM {schema}.locks ORDER BY key"
            ).fetchall()
        assert rows == [("k", "c", 0)]  # c took the first slot
        nxt = store.acquire(ns, "j", "a", PERMIT_TTL, 3)
        assert isinstance(nxt, Acquired) and nxt.token > live.token
    finally:
        coord.close()


def test_renew_many_renews_two_permits_of_one_key(coord: idemlock.Coordinator) -> None:
    store = coord.store
    ns = "rm:sem"
    a = store.acquire(ns, "k", "a", 5_000, 2)
    b = store.acquire(ns, "k", "b", 5_000, 2)
    assert isinstance(a, Acquired) and isinstance(b, Acquired)
    out = store.renew_many(
        [
            ("lock", ns, "k", "a", a.token, PERMIT_TTL),
            ("lock", ns, "k", "b", b.token, PERMIT_TTL + 1_000),
            ("lock", ns, "k", "c", b.token, PERMIT_TTL),
        ]
    )
    assert out[0] is not None and out[1] is not None and out[2] is None
    assert out[1] - out[0] == 1_000
    rows = {r.owner: r.expires_ms for r in store.holders(ns, "k")}
    assert rows == {"a": out[0], "b": out[1]}


# ---- election observers ----------------------------------------------------------------


def test_a_published_value_wakes_observers_and_not_waiters(postgres_dsn: str, prefix: str) -> None:
    # Two coordinators: two processes as far as the listeners go.
    here = idemlock.connect(postgres_dsn, key_prefix=prefix)
    there = idemlock.connect(postgres_dsn, key_prefix=prefix)
    ns = prefix + ":el"
    observer = there.store.subscribe(Channel("leader", ns, "k"))
    # An observer alone does not queue its process for a hand-off it would not take...
    assert there.store._acquire_params(ns, "k", "x", 1000, 1, None)["wait"] is False
    waiter = there.store.subscribe(Channel("lock", ns, "k"))
    # ...a waiter does.
    assert there.store._acquire_params(ns, "k", "x", 1000, 1, None)["wait"] is True
    try:
        # A term begins: a grant that publishes a value.
        lease = here.store.acquire(ns, "k", "a", PERMIT_TTL, 1, b"v1")
        assert isinstance(lease, Acquired)
        assert observer.wait(10.0) is True
        assert waiter.wait(0.5) is False
        # A renewal without a value publishes nothing: nobody is woken.
        assert here.store.renew(ns, "k", "a", lease.token, PERMIT_TTL) is not None
        assert observer.wait(0.5) is False
        # proclaim(): a renewal with a new value.
        assert here.store.renew(ns, "k", "a", lease.token, PERMIT_TTL, b"v2") is not None
        assert observer.wait(10.0) is True
        assert waiter.wait(0.5) is False
        assert [r.value for r in there.store.holders(ns, "k")] == [b"v2"]
        # The same owner re-acquiring with a value publishes it too.
        again = here.store.acquire(ns, "k", "a", PERMIT_TTL, 1, b"v3")
        assert isinstance(again, Acquired) and again.token == lease.token
        assert observer.wait(10.0) is True
        assert waiter.wait(0.5) is False
        # A release frees the key: both wake.
        assert here.store.release(ns, "k", "a", lease.token) is True
        assert waiter.wait(10.0) is True
        assert observer.wait(10.0) is True
        # A grant to a process that waits on the key (its statement also queues it when
        # refused) publishes as well.
        theirs = there.store.acquire(ns, "k", "c", PERMIT_TTL, 1, b"v4")
        assert isinstance(theirs, Acquired)
        assert observer.wait(10.0) is True
        assert waiter.wait(0.5) is False
        assert there.store.release(ns, "k", "c", theirs.token) is True
        assert waiter.wait(10.0) is True
        assert observer.wait(10.0) is True
        # A plain lock's grant (no value) wakes nobody.
        plain = here.store.acquire(ns, "k", "b", PERMIT_TTL)
        assert isinstance(plain, Acquired)
        assert observer.wait(0.5) is False
        assert waiter.wait(0.05) is False
    finally:
        observer.close()
        waiter.close()
        here.close()
        there.close()


async def test_a_published_value_wakes_observers_and_not_waiters_async(
    postgres_dsn: str, prefix: str
) -> None:
    here = idemlock.aio.connect(postgres_dsn, key_prefix=prefix)
    there = idemlock.aio.connect(postgres_dsn, key_prefix=prefix)
    ns = prefix + ":el"
    observer = await there.store.subscribe(Channel("leader", ns, "k"))
    waiter = await there.store.subscribe(Channel("lock", ns, "k"))
    try:
        lease = await here.store.acquire(ns, "k", "a", PERMIT_TTL, 1, b"v1")
        assert isinstance(lease, Acquired)
        assert await observer.wait(10.0) is True
        assert await waiter.wait(0.5) is False
        assert await here.store.renew(ns, "k", "a", lease.token, PERMIT_TTL, b"v2") is not None
        assert await observer.wait(10.0) is True
        assert await waiter.wait(0.5) is False
        assert await here.store.release(ns, "k", "a", lease.token) is True
        assert await waiter.wait(10.0) is True
        assert await observer.wait(10.0) is True
    finally:
        await observer.aclose()
        await waiter.aclose()
        await here.close()
        await there.close()
