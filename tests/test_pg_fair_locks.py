"""Fair lock hand-off on PostgreSQL: waiting processes are served in the order they
queued (table ``lock_waiters``), a released lock is reserved for the chosen process
so neither the releasing process nor a newcomer barges in, and a waiter that gave up,
timed out, was cancelled or crashed holds the queue up by at most one hand-off window.

Each store object stands for a process (its listener has its own waiter id per key);
the cross-process tests run real child processes. Behaviour only, no timing asserts:
where the test waits for something (a registration to go), it polls for it. A test that
checks who may take a reserved lock keeps the window and the registrations open for
minutes (``long_windows``), so a busy machine cannot end them between two statements;
where a window must pass, the test ends it in the store's own row (a window is over
when ``window_ms`` is behind the database clock, whenever that happens).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg.types.numeric import Int8

import idemlock
import idemlock.aio
from idemlock import ConfigurationError
from idemlock._core.port import Acquired, Channel, Held
from idemlock.stores import postgres as pg
from idemlock.stores.postgres import _async, _shared, _sync
from idemlock.stores.postgres._sql import migration_statements, record_version

from .servers._proc import popen

NS = "fair"
TTL = 30_000
SPEC = idemlock.LockSpec("fair", ttl=timedelta(seconds=30))


@pytest.fixture
def key() -> str:
    return "k" + uuid.uuid4().hex[:10]


@pytest.fixture
def stores(postgres_dsn: str) -> Iterator[Callable[[], Any]]:
    """Store objects, each standing for a process of its own."""
    made: list[idemlock.Coordinator] = []

    def make() -> Any:
        coord = idemlock.connect(postgres_dsn, key_prefix="fair")
        made.append(coord)
        return coord.store

    yield make
    for coord in made:
        coord.close()


#: ms a hand-off window or a registration lasts in the tests that need one to last
LONG_MS = 600_000


@pytest.fixture
def long_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand-off windows and waiter registrations of this process last ``LONG_MS``
    (50 ms and 1.5 s in production: a loaded machine may stall that long between the
    release and the next statement, and the reservation would lapse under the test)."""
    for module in (_sync, _async):
        monkeypatch.setattr(module, "_HANDOFF_MS8", Int8(LONG_MS))
    monkeypatch.setattr(_shared, "_REGISTER_MS8", Int8(LONG_MS))


def end_window(dsn: str, chosen: str) -> None:
    """The hand-off window kept for ``chosen`` passes (untaken)."""
    with psycopg.connect(dsn) as conn:
        done = conn.execute(
            "UPDATE idemlock.locks SET window_ms = 1 WHERE chosen = %s", (chosen,)
        ).rowcount
    assert done == 1


def queue(store: Any, key: str, owner: str) -> Any:
    """What a waiting caller does: subscribe, then fail (which registers its process)."""
    sub = store.subscribe(Channel("lock", NS, key))
    assert isinstance(store.acquire(NS, key, owner, TTL), Held)
    return sub


def registrations(dsn: str, chan: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM idemlock.lock_waiters WHERE chan = %s", (chan,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def until(check: Callable[[], bool], what: str) -> None:
    """Poll until ``check()`` holds (a bound against hanging, not a timing assert)."""
    deadline = time.monotonic() + 20
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.usefixtures("long_windows")
def test_processes_acquire_in_arrival_order(stores: Callable[[], Any], key: str) -> None:
    holder = stores()
    a = holder.acquire(NS, key, "h", TTL)
    assert isinstance(a, Acquired)
    waiters = {name: stores() for name in ("a", "b", "c")}
    subs = [queue(store, key, name) for name, store in waiters.items()]
    token, owner, who = a.token, "h", holder
    order: list[str] = []
    for _ in range(3):
        assert who.release(NS, key, owner, token)
        # everyone tries at once, the releaser and the newest first: only the oldest
        # queued process gets it
        tries = [("h", holder), *reversed([(n, s) for n, s in waiters.items() if n not in order])]
        winners = []
        for name, store in tries:
            reply = store.acquire(NS, key, name, TTL)
            if isinstance(reply, Acquired):
                winners.append(name)
                token, owner, who = reply.token, name, store
        assert len(winners) == 1
        order.append(winners[0])
    assert order == ["a", "b", "c"]
    for sub in subs:
        sub.close()


@pytest.mark.usefixtures("long_windows")
def test_releasing_process_and_newcomer_cannot_barge(stores: Callable[[], Any], key: str) -> None:
    holder, waiter, newcomer = stores(), stores(), stores()
    a = holder.acquire(NS, key, "a", TTL)
    assert isinstance(a, Acquired)
    sub = queue(waiter, key, "w")
    assert holder.release(NS, key, "a", a.token)
    assert holder.lock(NS, key) is None  # reserved is not held
    assert isinstance(holder.acquire(NS, key, "a", TTL), Held)
    assert isinstance(newcomer.acquire(NS, key, "n", TTL), Held)
    got = waiter.acquire(NS, key, "w", TTL)
    assert isinstance(got, Acquired)
    assert got.token > a.token
    sub.close()


def test_release_wakes_the_chosen_process(stores: Callable[[], Any], key: str) -> None:
    holder, waiter = stores(), stores()
    a = holder.acquire(NS, key, "a", TTL)
    assert isinstance(a, Acquired)
    sub = queue(waiter, key, "w")
    assert not sub.wait(0)
    assert holder.release(NS, key, "a", a.token)
    assert sub.wait(20)
    sub.close()


@pytest.mark.usefixtures("long_windows")
def test_handoff_under_contention(stores: Callable[[], Any], key: str) -> None:
    # Four processes contend; after each release all of them try again at once, the
    # releaser first. Every time the lock goes to the process queued longest, and the
    # releaser, refused, queues behind the others: a strict round robin.
    names = ["p0", "p1", "p2", "p3"]
    procs = {n: stores() for n in names}
    first = procs["p0"].acquire(NS, key, "p0", TTL)
    assert isinstance(first, Acquired)
    subs = [queue(procs[n], key, n) for n in names[1:]]
    subs.append(procs["p0"].subscribe(Channel("lock", NS, key)))
    holder, token, order = "p0", first.token, []
    for _ in range(12):
        assert procs[holder].release(NS, key, holder, token)
        winners = []
        for name in [holder, *reversed([n for n in names if n != holder])]:
            reply = procs[name].acquire(NS, key, name, TTL)
            if isinstance(reply, Acquired):
                winners.append(name)
                token = reply.token
        assert len(winners) == 1
        holder = winners[0]
        order.append(holder)
    assert order == ["p1", "p2", "p3", "p0"] * 3
    for sub in subs:
        sub.close()


# ---- a waiter that left ------------------------------------------------------------


def test_waiter_that_gave_up_is_unregistered(
    stores: Callable[[], Any], key: str, postgres_dsn: str
) -> None:
    holder, waiter, newcomer = stores(), stores(), stores()
    chan = holder._chan("lock", NS, key)
    a = holder.acquire(NS, key, "a", TTL)
    assert isinstance(a, Acquired)
    sub = queue(waiter, key, "w")
    assert registrations(postgres_dsn, chan) == 1
    sub.close()  # its last waiter left: the listener drops the registration
    until(lambda: registrations(postgres_dsn, chan) == 0, "registration not dropped")
    assert holder.release(NS, key, "a", a.token)
    assert isinstance(newcomer.acquire(NS, key, "n", TTL), Acquired)


def test_waiter_that_timed_out_does_not_block(postgres_dsn: str, key: str) -> None:
    holder = idemlock.connect(postgres_dsn, key_prefix="fair")
    other = idemlock.connect(postgres_dsn, key_prefix="fair")
    newcomer = idemlock.connect(postgres_dsn, key_prefix="fair")
    try:
        locks = holder.lock(SPEC)
        chan = holder.store._chan("lock", locks._ns, key)
        lease = locks.acquire(key)
        assert lease is not None
        assert other.lock(SPEC).acquire(key, wait=0.3) is None  # queued, then gave up
        until(lambda: registrations(postgres_dsn, chan) == 0, "registration not dropped")
        locks.release(lease)
        assert newcomer.lock(SPEC).acquire(key) is not None  # no window kept for it
    finally:
        for c in (holder, other, newcomer):
            c.close()


def test_cancelled_waiter_does_not_block(postgres_dsn: str, key: str) -> None:
    async def main() -> None:
        holder = idemlock.aio.connect(postgres_dsn, key_prefix="fair")
        other = idemlock.aio.connect(postgres_dsn, key_prefix="fair")
        newcomer = idemlock.aio.connect(postgres_dsn, key_prefix="fair")
        try:
            locks = holder.lock(SPEC)
            lease = await locks.acquire(key)
            assert lease is not None
            chan = holder.store._chan("lock", locks._ns, key)
            task = asyncio.ensure_future(other.lock(SPEC).acquire(key, wait=30))
            while registrations(postgres_dsn, chan) == 0:
                assert not task.done()
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gone = lambda: registrations(postgres_dsn, chan) == 0  # noqa: E731
            await asyncio.to_thread(until, gone, "registration not dropped")
            await locks.release(lease)
            assert await newcomer.lock(SPEC).acquire(key) is not None
        finally:
            for c in (holder, other, newcomer):
                await c.close()

    asyncio.run(main())


CRASH_CHILD = """
import os, sys, idemlock
from idemlock._core.port import Channel, Held
from idemlock.stores.postgres import _shared
from psycopg.types.numeric import Int8
url, ns, key, register_ms = sys.argv[1:5]
_shared._REGISTER_MS8 = Int8(int(register_ms))  # as long_windows does in the test
coord = idemlock.connect(url, key_prefix="fair")
store = coord.store
store.subscribe(Channel("lock", ns, key))
assert isinstance(store.acquire(ns, key, "dead", 30_000), Held)
print(store.listener.waiting(store._chan("lock", ns, key)).gid.decode(), flush=True)
os._exit(0)  # crashed: nothing is closed, the registration stays until it lapses
"""


@pytest.mark.usefixtures("long_windows")
def test_crashed_waiter_costs_one_window(
    stores: Callable[[], Any], key: str, postgres_dsn: str
) -> None:
    holder, waiter = stores(), stores()
    chan = holder._chan("lock", NS, key)
    a = holder.acquire(NS, key, "a", TTL)
    assert isinstance(a, Acquired)
    child = subprocess.run(
        [sys.executable, "-c", CRASH_CHILD, postgres_dsn, NS, key, str(LONG_MS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr
    dead_gid = child.stdout.strip()
    sub = queue(waiter, key, "w")  # queued behind the dead process
    assert registrations(postgres_dsn, chan) == 2
    assert holder.release(NS, key, "a", a.token)
    assert isinstance(waiter.acquire(NS, key, "w", TTL), Held)  # reserved for the dead one
    end_window(postgres_dsn, dead_gid)  # its window passes untaken
    got = waiter.acquire(NS, key, "w", TTL)
    assert isinstance(got, Acquired)
    # Taking the lock ended the dead process's turn: it is never chosen again.
    with psycopg.connect(postgres_dsn) as conn:
        rows = conn.execute(
            "SELECT gid FROM idemlock.lock_waiters WHERE chan = %s", (chan,)
        ).fetchall()
    assert (dead_gid,) not in rows
    sub.close()


def test_one_shot_tries_are_not_queued(
    stores: Callable[[], Any], key: str, postgres_dsn: str
) -> None:
    holder, other, newcomer = stores(), stores(), stores()
    chan = holder._chan("lock", NS, key)
    a = holder.acquire(NS, key, "a", TTL)
    assert isinstance(a, Acquired)
    assert isinstance(other.acquire(NS, key, "try-once", TTL), Held)  # not subscribed
    assert registrations(postgres_dsn, chan) == 0
    assert holder.release(NS, key, "a", a.token)
    assert isinstance(newcomer.acquire(NS, key, "n", TTL), Acquired)


def test_purge_drops_lapsed_registrations(
    stores: Callable[[], Any], key: str, postgres_dsn: str
) -> None:
    holder, waiter = stores(), stores()
    chan = holder._chan("lock", NS, key)
    a = holder.acquire(NS, key, "a", TTL)
    assert isinstance(a, Acquired)
    sub = queue(waiter, key, "w")
    with psycopg.connect(postgres_dsn) as conn:
        conn.execute("UPDATE idemlock.lock_waiters SET until_ms = 1 WHERE chan = %s", (chan,))
    holder.purge()
    assert registrations(postgres_dsn, chan) == 0
    sub.close()


# ---- across processes, through the public API ------------------------------------

WAITER_CHILD = """
import sys, time, idemlock
from datetime import timedelta
from idemlock.stores.postgres import _shared, _sync
from psycopg.types.numeric import Int8
url, key, long_ms = sys.argv[1:4]
# as long_windows does in the test: a slow child keeps its turn and its place
_sync._HANDOFF_MS8 = _shared._REGISTER_MS8 = Int8(int(long_ms))
coord = idemlock.connect(url, key_prefix="fair")
locks = coord.lock(idemlock.LockSpec("fair", ttl=timedelta(seconds=30)))
print("ready", flush=True)
lease = locks.acquire(key, wait=60)
assert lease is not None
time.sleep(0.05)  # the next ones stay queued meanwhile
print(lease.token, flush=True)
locks.release(lease)
coord.close()
"""


@pytest.mark.usefixtures("long_windows")
def test_processes_get_the_lock_in_the_order_they_queued(postgres_dsn: str, key: str) -> None:
    coord = idemlock.connect(postgres_dsn, key_prefix="fair")
    locks = coord.lock(SPEC)
    chan = coord.store._chan("lock", locks._ns, key)
    lease = locks.acquire(key)
    assert lease is not None
    children = []
    try:
        for i in range(3):
            child = popen(
                [sys.executable, "-c", WAITER_CHILD, postgres_dsn, key, str(LONG_MS)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=False,
            )
            children.append(child)
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            until(lambda n=i + 1: registrations(postgres_dsn, chan) == n, "not queued")
        locks.release(lease)
        tokens = []
        for child in children:
            out, err = child.communicate(timeout=60)
            assert child.returncode == 0, err
            tokens.append(int(out))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
        coord.close()
    assert tokens == sorted(tokens)  # served in the order they queued
    assert lease.token < tokens[0]


# ---- upgrading a database of schema version 1 --------------------------------------


@pytest.fixture
def fresh_db(postgres_dsn: str) -> Iterator[str]:
    """A database of its own: ``idemlock migrate`` works on the default schema."""
    name = "fair_" + uuid.uuid4().hex[:10]
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = urlsplit(postgres_dsn)
    yield urlunsplit(url._replace(path="/" + name))
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


def _schema_v1(dsn: str, schema: str = "idemlock") -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(
            f"CREATE TABLE {schema}.schema_version (version integer PRIMARY KEY, "
            "applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for stmt in migration_statements(schema, 1):
            conn.execute(stmt)
        conn.execute(record_version(schema), {"v": 1})


def test_idemlock_migrate_upgrades_a_version_1_database(fresh_db: str) -> None:
    _schema_v1(fresh_db)
    coord = idemlock.connect(fresh_db, key_prefix="up", auto_migrate=False)
    with pytest.raises(ConfigurationError, match="idemlock migrate"):
        coord.lock(SPEC).acquire("k")  # the store refuses an old schema
    coord.close()
    # Rows written by the old layout survive the upgrade.
    with psycopg.connect(fresh_db) as conn:
        row = conn.execute(
            "INSERT INTO idemlock.locks (ns, key, owner, token, expires_ms) "
            "VALUES ('old', 'k', 'o', nextval('idemlock.fence_seq'), 0) RETURNING token"
        ).fetchone()
    assert row is not None
    old_token = row[0]
    done = subprocess.run(
        [sys.executable, "-m", "idemlock", "--url", fresh_db, "migrate"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    assert "migrated" in done.stdout
    with psycopg.connect(fresh_db) as conn:
        versions = conn.execute(
            "SELECT version FROM idemlock.schema_version ORDER BY version"
        ).fetchall()
        old = conn.execute(
            "SELECT owner, token, chosen, window_ms FROM idemlock.locks WHERE ns = 'old'"
        ).fetchall()
    assert versions == [(v,) for v in range(1, pg.SCHEMA_VERSION + 1)]
    assert old == [("o", old_token, None, 0)]
    coord = idemlock.connect(fresh_db, key_prefix="up", auto_migrate=False)
    try:
        store = coord.store
        got = store.acquire("old", "k", "n", TTL)  # the old row, under the new layout
        assert isinstance(got, Acquired)
        assert got.token > old_token
    finally:
        coord.close()


def test_store_upgrades_a_version_1_schema_on_first_use(fresh_db: str) -> None:
    _schema_v1(fresh_db, "legacy")
    coord = idemlock.connect(fresh_db, key_prefix="up", schema="legacy")
    try:
        assert coord.lock(SPEC).acquire("k") is not None
    finally:
        coord.close()
    with psycopg.connect(fresh_db) as conn:
        versions = conn.execute("SELECT max(version) FROM legacy.schema_version").fetchone()
    assert versions == (pg.SCHEMA_VERSION,)


def test_a_cancelled_subscribe_does_not_leave_the_process_waiting(
    fault_postgres_server: Any,
) -> None:
    """A caller cancelled while its LISTEN runs in a worker thread (here: held up by a
    silent network): the subscription the thread still makes is closed as it arrives.
    Kept, it would count its process as waiting on the lock for good, and every one-shot
    try of that process would register it in the queue (each holding up a hand-off)."""
    from .servers.faults import postgres_faults

    dsn, faults = postgres_faults(fault_postgres_server)
    key = "k" + uuid.uuid4().hex[:10]

    async def main() -> int:
        holder = idemlock.aio.connect(fault_postgres_server.dsn, key_prefix="fair")
        waiter = idemlock.aio.connect(dsn, key_prefix="fair")
        try:
            a = await holder.store.acquire(NS, key, "a", TTL)
            assert isinstance(a, Acquired)
            assert isinstance(await waiter.store.acquire(NS, key, "warm", TTL), Held)
            chan = holder.store._chan("lock", NS, key)
            with faults.stall():
                task = asyncio.ensure_future(waiter.store.subscribe(Channel("lock", NS, key)))
                await asyncio.sleep(0.3)  # the LISTEN waits in the silent proxy
                assert not task.done()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            # Healed: the thread's LISTEN completes and the subscription it made is closed
            # as it arrives (the channel is listened on, nobody of this process waits on
            # it); then a one-shot try, not a waiter's.
            listener = waiter.store.listener
            deadline = time.monotonic() + 20  # a bound against hanging, not a timing assert
            while not (listener.is_listening(chan) and listener.waiting(chan) is None):
                assert time.monotonic() < deadline, (
                    "the cancelled subscribe's LISTEN never completed and closed"
                )
                await asyncio.sleep(0.01)
            assert isinstance(await waiter.store.acquire(NS, key, "try-once", TTL), Held)
            return registrations(fault_postgres_server.dsn, chan)
        finally:
            await waiter.close()
            await holder.close()
            faults.close()

    assert asyncio.run(main()) == 0
