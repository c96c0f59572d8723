"""PostgreSQL behind PgBouncer in transaction mode (issue 26): a plain URL of the
pooler works (no ``options`` startup parameter, no prepared statements, a
per-statement ``statement_timeout``, found out by the store), waiting stays bounded
(the listener finds out that notifications do not reach it, says so once and pulses
its waiters), and ``listen_url`` takes notifications over a direct connection.

PgBouncer is the Debian package's, started by tests/servers/pgbouncer.py in front of
the session's PostgreSQL. The contract suites run through it too (store
``postgres-pgbouncer``). No timing asserts beyond generous bounds.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import quote

import psycopg
import pytest

import idemlock
import idemlock.aio
from idemlock import Claimed, Completed, ConfigurationError, StoreUnavailable
from idemlock._urls import redact
from idemlock.stores import postgres as pg

from .servers._proc import popen
from .servers.pgbouncer import PgBouncer, start_pgbouncer
from .servers.postgres import OS_USER, PgServer

LONG = idemlock.IdempotencySpec("pooled", ttl=timedelta(hours=1), lease=timedelta(minutes=5))
LOCK = idemlock.LockSpec("pooled", ttl=timedelta(seconds=30))
SECRET = "s3cr3t-listen-pw"


@pytest.fixture
def bouncer(pgbouncer_server: PgBouncer) -> PgBouncer:
    return pgbouncer_server


@pytest.fixture
def prefix() -> str:
    return "pb" + uuid.uuid4().hex[:10]


def _listen_url(bouncer: PgBouncer) -> str:
    """A direct URL with a password (the test server trusts loopback: it is ignored)."""
    server = bouncer.server
    return f"postgresql://{OS_USER}:{SECRET}@127.0.0.1:{server.port}/idemlock_test"


def _with_listen(bouncer: PgBouncer) -> str:
    return bouncer.dsn + "?listen_url=" + quote(_listen_url(bouncer), safe="")


def _lock_rows_waiting(direct: str, marker: str) -> int:
    with psycopg.connect(direct, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE %s",
            [f"%{marker}%"],
        ).fetchone()
    return int(row[0]) if row else 0


# ---- a plain URL of the pooler -------------------------------------------------------


def test_plain_pgbouncer_url_works_and_is_found_out(bouncer: PgBouncer, prefix: str) -> None:
    # Old code: every connection refused ("unsupported startup parameter: options").
    coord = idemlock.connect(bouncer.dsn, key_prefix=prefix)
    try:
        port = coord.idempotency(LONG)
        for i in range(12):  # more than psycopg's prepare threshold (5)
            claim = port.claim(f"k{i}")
            assert isinstance(claim, Claimed)
            port.complete(claim.token, {"i": i})
            replay = port.claim(f"k{i}")
            assert isinstance(replay, Completed) and replay.result == {"i": i}
        assert coord.store._pooled is True
    finally:
        coord.close()
    direct = idemlock.connect(bouncer.server.dsn, key_prefix=prefix)
    try:
        assert direct.idempotency(LONG).status("k0") is not None
        assert direct.store._pooled is False  # direct: prepared, as fast as before
        assert direct.store._prepare_now is True
    finally:
        direct.close()


async def test_plain_pgbouncer_url_works_async(bouncer: PgBouncer, prefix: str) -> None:
    coord = idemlock.aio.connect(bouncer.dsn, key_prefix=prefix)
    try:
        port = coord.idempotency(LONG)
        lock = coord.lock(LOCK)
        for i in range(8):
            claim = await port.claim(f"a{i}")
            assert isinstance(claim, Claimed)
            await port.complete(claim.token, i)
            lease = await lock.acquire(f"l{i % 2}")
            assert lease is not None
            assert await lock.release(lease)
        assert coord.store._pooled is True
    finally:
        await coord.close()


CHILD = """
import sys, idemlock
from datetime import timedelta
url, prefix = sys.argv[1], sys.argv[2]
coord = idemlock.connect(url, key_prefix=prefix)
port = coord.idempotency(idemlock.IdempotencySpec("p", lease=timedelta(seconds=30)))
ran = 0
for i in range(40):
    claim = port.claim(f"k{i}")
    if isinstance(claim, idemlock.Claimed):
        port.complete(claim.token, i)
        ran += 1
    elif isinstance(claim, idemlock.InFlight):
        pass
print(ran, flush=True)
coord.close()
"""


def test_many_processes_through_pgbouncer(bouncer: PgBouncer, prefix: str) -> None:
    # Old code with ignore_startup_parameters: DuplicatePreparedStatement "_pg3_0" in the
    # second process (prepared statements across pooled server connections).
    procs = [
        popen(
            [sys.executable, "-c", CHILD, bouncer.dsn, prefix],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    total = 0
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        total += int(out)
    assert total == 40  # each key ran exactly once across the processes


def test_a_refused_startup_parameter_says_what_to_do(bouncer: PgBouncer, prefix: str) -> None:
    # The user's own options in the URL: the pooler refuses them; the message says what
    # to do (old code: "PostgreSQL failed during checking the schema: ..." only).
    url = bouncer.dsn + "?options=" + quote("-c work_mem=8MB", safe="")
    coord = idemlock.connect(url, key_prefix=prefix, timeout=3)
    try:
        with pytest.raises(StoreUnavailable) as err:
            coord.idempotency(LONG).status("k")
        assert "ignore_startup_parameters" in str(err.value)
        assert "unsupported startup parameter" in str(err.value)
    finally:
        coord.close()


def test_statement_timeout_holds_behind_the_pooler(bouncer: PgBouncer, prefix: str) -> None:
    # Set per statement: a statement stuck on a row lock is ended by the server at the
    # store's timeout (old code: no connection at all; with the startup option ignored
    # by the pooler, the statement would wait for the lock for ever).
    coord = idemlock.connect(bouncer.dsn, key_prefix=prefix, timeout=1)
    direct = bouncer.server.dsn
    try:
        port = coord.idempotency(LONG)
        claim = port.claim("held")
        assert isinstance(claim, Claimed)
        with psycopg.connect(direct) as blocker:
            blocker.execute(
                "SELECT 1 FROM idemlock.claims WHERE key = %s FOR UPDATE", ["held"]
            ).fetchall()
            with pytest.raises(StoreUnavailable):
                port.complete(claim.token, "late")
            # The server ends the blocked statement itself, while the lock is still held.
            deadline = time.monotonic() + 20
            while _lock_rows_waiting(direct, "idemlock") > 0:
                assert time.monotonic() < deadline, "the blocked statement was never ended"
                time.sleep(0.05)
    finally:
        coord.close()


# ---- waiting through the pooler -------------------------------------------------------


def _handoff(url: str, prefix: str, **options: Any) -> tuple[float, Any]:
    """Seconds from a release to another process's (store's) waiter holding the lock,
    and the waiter's store."""
    holder = idemlock.connect(url, key_prefix=prefix, **options)
    waiter = idemlock.connect(url, key_prefix=prefix, **options)
    try:
        lease = holder.lock(LOCK).acquire("k")
        assert lease is not None
        got: list[float] = []

        def wait() -> None:
            took = waiter.lock(LOCK).acquire("k", wait=30)
            got.append(time.monotonic())
            assert took is not None
            waiter.lock(LOCK).release(took)

        thread = threading.Thread(target=wait)
        thread.start()
        deadline = time.monotonic() + 20
        # Waiting, and the listener's probe concluded (heard, or not within 1 s).
        while (
            not waiter.store.listener._core.has_waiters() or waiter.store.listener.notifies is None
        ):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        holder.lock(LOCK).release(lease)
        thread.join(30)
        assert got
        return got[0] - t0, waiter.store
    finally:
        holder.close()
        waiter.close()


def test_waiting_stays_bounded_and_warns_once(
    bouncer: PgBouncer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="idemlock")
    took, store = _handoff(bouncer.dsn, prefix)
    assert store.listener.notifies is False  # the probe never came back
    assert took < 3.0  # generous; measured ~0.05 s (pulses every 0.1 s); old: 1 s polls
    warned = [r for r in caplog.records if "listen_url" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]


def test_direct_connection_has_no_warning(
    bouncer: PgBouncer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="idemlock")
    _, store = _handoff(bouncer.server.dsn, prefix)
    assert store.listener.notifies is True
    assert not [r for r in caplog.records if "listen_url" in r.getMessage()]


async def _ahandoffs(url: str, prefix: str, keys: list[str]) -> Any:
    """The asyncio twin of ``_handoff``: for each key, a holder's release hands the lock
    to a waiter of another store, which must get it (``wait=``'s bound fails the test
    otherwise). Returns the waiter's store, after both stores are closed."""
    holder = idemlock.aio.connect(url, key_prefix=prefix)
    waiter = idemlock.aio.connect(url, key_prefix=prefix)
    try:
        for key in keys:
            lease = await holder.lock(LOCK).acquire(key)
            assert lease is not None
            waiting = asyncio.ensure_future(waiter.lock(LOCK).acquire(key, wait=20))
            deadline = time.monotonic() + 20
            # Waiting, and the listener's probe concluded (heard, or not within 1 s).
            while (
                not waiter.store.listener._core.has_waiters()
                or waiter.store.listener.notifies is None
            ):
                assert not waiting.done(), waiting.result()  # got it while still held?
                assert time.monotonic() < deadline, "the waiter never started waiting"
                await asyncio.sleep(0.01)
            await holder.lock(LOCK).release(lease)
            took = await asyncio.wait_for(waiting, 30)
            assert took is not None, f"no hand-off of {key!r} within the waiter's wait"
            assert took.token > lease.token
            assert await waiter.lock(LOCK).release(took)
        return waiter.store
    finally:
        await holder.close()
        await waiter.close()


async def test_waiting_stays_bounded_and_warns_once_async(
    bouncer: PgBouncer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The asyncio store shares the listener thread: behind the pooler its probe never
    # comes back, waiters are pulsed, and the warning naming listen_url comes once,
    # however many waits follow (two hand-offs on two keys here).
    caplog.set_level(logging.WARNING, logger="idemlock")
    store = await _ahandoffs(bouncer.dsn, prefix, ["k", "k2"])
    assert store._pooled is True
    assert store.listener.notifies is False  # the probe never came back: polled
    warned = [r for r in caplog.records if "listen_url" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]


async def test_direct_connection_has_no_warning_async(
    bouncer: PgBouncer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="idemlock")
    store = await _ahandoffs(bouncer.server.dsn, prefix, ["k"])
    assert store.listener.notifies is True and store.listener.received >= 1  # pushed
    assert not [r for r in caplog.records if "listen_url" in r.getMessage()]


@pytest.mark.parametrize("how", ["keyword", "url"])
def test_listen_url_pushes_handoffs_again(
    bouncer: PgBouncer, prefix: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Old code: listen_url unknown (a keyword refused; in the URL, libpq refuses it).
    caplog.set_level(logging.WARNING, logger="idemlock")
    if how == "keyword":
        took, store = _handoff(bouncer.dsn, prefix, listen_url=_listen_url(bouncer))
    else:
        took, store = _handoff(_with_listen(bouncer), prefix)
    assert store.listener.notifies is True
    assert store.listener.received >= 1  # the hand-off was pushed, not polled
    assert store._pooled is True  # statements still go through the pooler
    assert not [r for r in caplog.records if "listen_url" in r.getMessage()]
    assert took < 3.0


async def test_listen_url_async(bouncer: PgBouncer, prefix: str) -> None:
    coord = idemlock.aio.connect(_with_listen(bouncer), key_prefix=prefix)
    rival = idemlock.aio.connect(bouncer.dsn, key_prefix=prefix, listen_url=_listen_url(bouncer))
    try:
        lease = await coord.lock(LOCK).acquire("k")
        assert lease is not None
        waiting = asyncio.ensure_future(rival.lock(LOCK).acquire("k", wait=30))
        deadline = time.monotonic() + 20
        while not rival.store.listener._core.has_waiters() or not rival.store.listener.notifies:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await coord.lock(LOCK).release(lease)
        took = await asyncio.wait_for(waiting, 30)
        assert took is not None
        assert rival.store.listener.notifies is True and rival.store.listener.received >= 1
    finally:
        await coord.close()
        await rival.close()


def test_listen_url_secret_is_redacted(bouncer: PgBouncer, prefix: str) -> None:
    url = _with_listen(bouncer)
    coord = idemlock.connect(url, key_prefix=prefix)
    try:
        assert SECRET not in coord.url and SECRET not in redact(url)
        assert "listen_url=" in coord.url
        assert SECRET not in repr(coord)
    finally:
        coord.close()
    # A refused listen URL: no secret in the message.
    bad = "redis://u:" + SECRET + "@h/0"
    with pytest.raises(ConfigurationError) as err:
        idemlock.connect(bouncer.dsn + "?listen_url=" + quote(bad, safe=""))
    assert SECRET not in str(err.value) and "listen_url" in str(err.value)
    with pytest.raises(ConfigurationError, match="twice"):
        idemlock.connect(url, listen_url=_listen_url(bouncer))
    # An unreachable listen URL: the waiter's error names no secret either.
    dead = f"postgresql://{OS_USER}:{SECRET}@127.0.0.1:1/idemlock_test"
    coord = idemlock.connect(bouncer.dsn, key_prefix=prefix, listen_url=dead, timeout=2)
    try:
        lease = coord.lock(LOCK).acquire("k")
        assert lease is not None
        with pytest.raises(StoreUnavailable) as down:
            coord.lock(LOCK).acquire("k", wait=1, owner="other")
        assert SECRET not in str(down.value)
    finally:
        coord.close()


# ---- fenced helpers and migrate ---------------------------------------------------------


@pytest.fixture
def table(bouncer: PgBouncer) -> Iterator[str]:
    name = "acct_" + uuid.uuid4().hex[:10]
    with psycopg.connect(bouncer.server.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {name} (id text PRIMARY KEY, n int, fence_token bigint)")
    yield name


def test_fenced_helpers_through_pgbouncer(bouncer: PgBouncer, prefix: str, table: str) -> None:
    coord = idemlock.connect(bouncer.dsn, key_prefix=prefix)
    try:
        port = coord.idempotency(LONG)
        for i in range(8):  # past psycopg's prepare threshold on the user's connection
            claim = port.claim(f"f{i}")
            assert isinstance(claim, Claimed)
            conn = psycopg.connect(bouncer.dsn, prepare_threshold=None)
            with conn, conn.transaction():
                pg.fenced_upsert(conn, table, {"id": "a", "n": i}, ["id"], claim.fence)
                pg.complete_in_transaction(conn, port, claim.token, i)
            replay = port.claim(f"f{i}")
            assert isinstance(replay, Completed) and replay.result == i
    finally:
        coord.close()


async def test_fenced_helpers_through_pgbouncer_async(
    bouncer: PgBouncer, prefix: str, table: str
) -> None:
    coord = idemlock.aio.connect(bouncer.dsn, key_prefix=prefix)
    try:
        port = coord.idempotency(LONG)
        for i in range(8):
            claim = await port.claim(f"f{i}")
            assert isinstance(claim, Claimed)
            aconn = await psycopg.AsyncConnection.connect(bouncer.dsn, prepare_threshold=None)
            async with aconn, aconn.transaction():
                await pg.afenced_upsert(aconn, table, {"id": "a", "n": i}, ["id"], claim.fence)
                await pg.acomplete_in_transaction(aconn, port, claim.token, i)
            replay = await port.claim(f"f{i}")
            assert isinstance(replay, Completed) and replay.result == i
    finally:
        await coord.close()


def test_a_step_in_the_transaction_through_pgbouncer(
    bouncer: PgBouncer, prefix: str, table: str
) -> None:
    coord = idemlock.connect(bouncer.dsn, key_prefix=prefix)
    try:
        port = coord.idempotency(LONG)
        for i in range(8):  # past psycopg's prepare threshold on the user's connection
            with port.run(f"s{i}") as attempt:
                assert attempt.fence is not None
                conn = psycopg.connect(bouncer.dsn, prepare_threshold=None)
                with conn, conn.transaction():
                    pg.fenced_upsert(conn, table, {"id": "a", "n": i}, ["id"], attempt.fence)
                    pg.record_step_in_transaction(conn, attempt, "put", i)
                # Committed: the step replays instead of running.
                assert attempt.step("put", lambda: -1) == i
                attempt.result = i
    finally:
        coord.close()


def test_migrate_through_pgbouncer(bouncer: PgBouncer, prefix: str) -> None:
    # The advisory lock is transaction-level: migrating works through the pooler, from
    # the store's own URL (listen_url and timeout taken off), from several processes.
    schema = "mp_" + uuid.uuid4().hex[:10]
    url = _with_listen(bouncer) + "&timeout=10"
    procs = [
        popen(
            [sys.executable, "-m", "idemlock", "migrate", "--url", url, "--schema", schema],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert SECRET not in out + err
    assert asyncio.run(pg.amigrate(url, schema=schema)) == pg.SCHEMA_VERSION
    coord = idemlock.connect(url, key_prefix=prefix, schema=schema, auto_migrate=False)
    try:
        assert isinstance(coord.idempotency(LONG).claim("k"), Claimed)
    finally:
        coord.close()


@pytest.fixture(scope="module")
def lenient_bouncer(postgres_server: PgServer) -> Iterator[PgBouncer]:
    """A PgBouncer that ignores the ``options`` startup parameter (the issue's second
    setting): the store cannot tell by a refusal, only by the backend pid."""
    bouncer = start_pgbouncer(postgres_server, {"ignore_startup_parameters": "options"})
    try:
        yield bouncer
    finally:
        bouncer.destroy()


def test_a_pooler_that_accepts_options_is_found_out_too(
    lenient_bouncer: PgBouncer, prefix: str
) -> None:
    # Old code: DuplicatePreparedStatement "_pg3_0" (or "does not exist") once two
    # processes share the pooled server connections.
    test_many_processes_through_pgbouncer(lenient_bouncer, prefix)
    coord = idemlock.connect(lenient_bouncer.dsn, key_prefix=prefix)
    try:
        assert isinstance(coord.idempotency(LONG).claim("k0"), Claimed)
        assert coord.store._pooled is True and coord.store._prepare_now is False
    finally:
        coord.close()
