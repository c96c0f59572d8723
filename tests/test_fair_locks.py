"""Fair lock hand-off: waiters are served in arrival order, nobody barges in on a
reserved lock, and a waiter that left does not hold the queue up beyond its window.

Behaviour only (who gets the lock, in which order), on the store port (memory with a
ManualClock where a window must pass; SQLite on a real file, whose queue is a table
shared by processes) and through the public API with threads queued in a known order.
No timing asserts.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import idemlock
from idemlock import ManualClock
from idemlock._core.port import Acquired, Channel, Held
from idemlock.stores import memory
from idemlock.stores import sqlite as sqlite_store
from idemlock.stores.memory import MemoryStore
from idemlock.stores.sqlite import SQLiteStore

NS, KEY = "fair", "k"
CHANNEL = Channel("lock", NS, KEY)
TTL = 10_000


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def mem(clock: ManualClock) -> Iterator[MemoryStore]:
    s = MemoryStore(clock=clock)
    yield s
    s.close()


#: ms a hand-off window or a registration lasts in the tests on real time
LONG_MS = 600_000


@pytest.fixture
def long_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand-off windows and waiter registrations last ``LONG_MS`` on the stores that run
    on real time here (SQLite; memory without a manual clock): in production they are
    100-200 ms and a registration lasts a poll plus 250 ms, which a loaded machine may
    spend between two calls of a test, ending a reservation under it. Where a window
    must pass, the test ends it in the store's own row."""
    for module in (sqlite_store._store, memory):
        monkeypatch.setattr(module, "HANDOFF_MS", LONG_MS)
        monkeypatch.setattr(module, "REGISTER_SLACK_MS", LONG_MS)


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, clock: ManualClock, tmp_path: Path) -> Iterator[Any]:
    if request.param == "sqlite":
        request.getfixturevalue("long_windows")  # memory's run on the manual clock
    s: Any = MemoryStore(clock=clock) if request.param == "memory" else _sqlite(tmp_path)
    yield s
    s.close()


def _sqlite(tmp_path: Path) -> SQLiteStore:
    return SQLiteStore(str(tmp_path / "fair.db"))


def queue(store: Any, owner: str) -> None:
    """What a waiting caller does: fail, subscribe (done by the test), fail again."""
    for _ in range(2):
        assert isinstance(store.acquire(NS, KEY, owner, TTL), Held)


def test_waiters_acquire_in_arrival_order(store: Any) -> None:
    a = store.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = store.subscribe(CHANNEL)
    for owner in ("b", "c", "d"):
        queue(store, owner)
    token = a.token
    order = []
    holder = "a"
    for _ in range(3):
        assert store.release(NS, KEY, holder, token)
        # everyone tries, newest first: only the oldest waiter gets it
        got = [o for o in ("d", "c", "b") if o not in order]
        winners = []
        for owner in got:
            reply = store.acquire(NS, KEY, owner, TTL)
            if isinstance(reply, Acquired):
                winners.append(owner)
                token = reply.token
        assert len(winners) == 1
        holder = winners[0]
        order.append(holder)
    assert order == ["b", "c", "d"]
    sub.close()


def test_releasing_owner_and_newcomer_cannot_barge(store: Any) -> None:
    a = store.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = store.subscribe(CHANNEL)
    queue(store, "b")
    assert store.release(NS, KEY, "a", a.token)
    assert store.lock(NS, KEY) is None  # reserved is not held
    assert isinstance(store.acquire(NS, KEY, "a", TTL), Held)
    assert isinstance(store.acquire(NS, KEY, "newcomer", TTL), Held)
    b = store.acquire(NS, KEY, "b", TTL)
    assert isinstance(b, Acquired)
    assert b.token > a.token
    sub.close()


def test_release_wakes_the_chosen_waiter(store: Any) -> None:
    a = store.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = store.subscribe(CHANNEL)
    queue(store, "b")
    assert not sub.wait(0)
    assert store.release(NS, KEY, "a", a.token)
    assert sub.wait(0)
    sub.close()


def test_chosen_waiter_that_left_loses_its_turn_after_the_window(
    mem: MemoryStore, clock: ManualClock
) -> None:
    a = mem.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = mem.subscribe(CHANNEL)  # the others still wait on the key
    queue(mem, "gone")
    queue(mem, "c")
    assert mem.release(NS, KEY, "a", a.token)
    assert isinstance(mem.acquire(NS, KEY, "c", TTL), Held)  # kept for "gone"
    clock.advance(memory.HANDOFF_MS / 1000)
    assert isinstance(mem.acquire(NS, KEY, "c", TTL), Acquired)
    sub.close()


def test_waiter_that_stopped_retrying_lapses(mem: MemoryStore, clock: ManualClock) -> None:
    a = mem.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = mem.subscribe(CHANNEL)
    queue(mem, "gone")
    clock.advance(2.0)  # far past its registration; the lease is still held
    queue(mem, "c")
    assert mem.release(NS, KEY, "a", a.token)
    assert isinstance(mem.acquire(NS, KEY, "c", TTL), Acquired)
    sub.close()


def test_waiter_that_gave_up_does_not_block(store: Any) -> None:
    a = store.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = store.subscribe(CHANNEL)
    queue(store, "b")
    sub.close()  # b stopped waiting: nobody is subscribed to the key any more
    assert store.release(NS, KEY, "a", a.token)
    assert isinstance(store.acquire(NS, KEY, "newcomer", TTL), Acquired)


def test_one_shot_tries_are_not_queued(store: Any) -> None:
    a = store.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = store.subscribe(CHANNEL)
    assert isinstance(store.acquire(NS, KEY, "try-once", TTL), Held)
    assert store.release(NS, KEY, "a", a.token)
    assert isinstance(store.acquire(NS, KEY, "newcomer", TTL), Acquired)
    sub.close()


def test_break_ends_a_reservation(store: Any) -> None:
    a = store.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = store.subscribe(CHANNEL)
    queue(store, "b")
    assert store.release(NS, KEY, "a", a.token)
    assert store.break_lock(NS, KEY) is False  # lock.break.free: nothing held
    # the queue stays: b is chosen again at once, and takes it
    assert isinstance(store.acquire(NS, KEY, "c", TTL), Held)
    assert isinstance(store.acquire(NS, KEY, "b", TTL), Acquired)
    sub.close()


def test_purge_drops_lapsed_queues(mem: MemoryStore, clock: ManualClock) -> None:
    a = mem.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = mem.subscribe(CHANNEL)
    queue(mem, "b")
    sub.close()
    clock.advance(2.0)
    mem.purge()
    assert mem._queues == {}


# ---- SQLite: the queue is shared by processes ---------------------------------------


@pytest.mark.usefixtures("long_windows")
def test_sqlite_chosen_waiter_that_left_loses_its_turn(tmp_path: Path) -> None:
    store = _sqlite(tmp_path)
    a = store.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = store.subscribe(CHANNEL)  # the others still wait on the key
    queue(store, "gone")
    queue(store, "c")
    assert store.release(NS, KEY, "a", a.token)
    assert isinstance(store.acquire(NS, KEY, "c", TTL), Held)  # kept for "gone"
    import sqlite3

    with sqlite3.connect(store.path) as raw:  # the window kept for "gone" passes untaken
        ended = raw.execute("UPDATE lock_waiters SET window_ms = 1 WHERE owner = 'gone'")
        assert ended.rowcount == 1
    assert isinstance(store.acquire(NS, KEY, "c", TTL), Acquired)
    sub.close()
    store.close()


@pytest.mark.usefixtures("long_windows")
def test_sqlite_chosen_waiter_that_stopped_asking_loses_its_window(tmp_path: Path) -> None:
    """A window is not kept for a waiter whose registration lapsed (it stopped asking,
    in a process that still runs) while the window is still open."""
    store = _sqlite(tmp_path)
    a = store.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = store.subscribe(CHANNEL)
    queue(store, "quiet")
    queue(store, "c")
    assert store.release(NS, KEY, "a", a.token)
    assert isinstance(store.acquire(NS, KEY, "c", TTL), Held)  # kept for "quiet"
    import sqlite3

    with sqlite3.connect(store.path) as raw:  # "quiet" stopped asking; its window is open
        lapsed = raw.execute(
            "UPDATE lock_waiters SET until_ms = 1 WHERE owner = 'quiet' AND window_ms > ?",
            (int(time.time() * 1000),),
        )
        assert lapsed.rowcount == 1
    assert isinstance(store.acquire(NS, KEY, "c", TTL), Acquired)
    sub.close()
    store.close()


def _queue_and_exit(path: str) -> None:
    # A waiter in another process: queued (it asked twice), then its process ends
    # without leaving the queue (as a crash does; a waiter that leaves unqueues).
    store = SQLiteStore(path)
    store.subscribe(CHANNEL)
    queue(store, "dead")
    os._exit(0)


@pytest.mark.usefixtures("long_windows")
def test_sqlite_ticket_of_an_exited_process_does_not_block(tmp_path: Path) -> None:
    store = _sqlite(tmp_path)
    a = store.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    proc = mp.get_context("spawn").Process(target=_queue_and_exit, args=(store.path,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    sub = store.subscribe(CHANNEL)
    queue(store, "c")
    assert store.release(NS, KEY, "a", a.token)
    assert isinstance(store.acquire(NS, KEY, "newcomer", TTL), Held)  # kept for "c"
    assert isinstance(store.acquire(NS, KEY, "c", TTL), Acquired)
    sub.close()
    store.close()


def test_sqlite_purge_drops_lapsed_tickets(tmp_path: Path) -> None:
    import sqlite3

    store = _sqlite(tmp_path)
    a = store.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = store.subscribe(CHANNEL)
    queue(store, "b")
    with sqlite3.connect(store.path) as raw:
        raw.execute("UPDATE lock_waiters SET until_ms = 1")
    store.purge()  # "b" still subscribed: only the purge can have dropped its ticket
    with sqlite3.connect(store.path) as raw:
        assert raw.execute("SELECT count(*) FROM lock_waiters").fetchone() == (0,)
    sub.close()
    store.close()


# ---- through the public API -------------------------------------------------------


def _queued(store: Any) -> int:
    if isinstance(store, MemoryStore):
        return sum(n > 1 for q in store._queues.values() for _, n in q.waiters.values())
    import sqlite3

    with sqlite3.connect(store.path) as raw:
        row = raw.execute("SELECT count(*) FROM lock_waiters WHERE tries > 1").fetchone()
    return int(row[0])


@pytest.mark.usefixtures("long_windows")
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_threads_get_the_lock_in_the_order_they_queued(kind: str, tmp_path: Path) -> None:
    url = "memory://" if kind == "memory" else f"sqlite:///{tmp_path / 'fair.db'}"
    coord = idemlock.connect(url)
    locks = coord.lock(idemlock.LockSpec("fair", ttl=30))
    store = coord._store
    first = locks.acquire(KEY)
    assert first is not None
    order: list[int] = []

    def waiter(i: int) -> None:
        lease = locks.acquire(KEY, wait=30)
        assert lease is not None
        order.append(i)
        locks.release(lease)

    threads = []
    for i in range(4):
        th = threading.Thread(target=waiter, args=(i,))
        th.start()
        threads.append(th)
        deadline = time.monotonic() + 60
        while _queued(store) < i + 1:
            assert time.monotonic() < deadline, "waiters did not queue"
            time.sleep(0.001)
    locks.release(first)
    for th in threads:
        th.join(30)
    coord.close()
    assert order == [0, 1, 2, 3]


# ---- SQLite: waiters that keep giving up ---------------------------------------------


def _churn(url: str, churning: Any, stop: Any, stopped: Any, got: Any, leave: Any) -> None:
    # A caller that keeps trying with a short wait and a short pause, as a queue job
    # with a small concurrency_wait does: each try queues a new owner, which gives up.
    coord = idemlock.connect(url)
    locks = coord.lock(idemlock.LockSpec("churn", ttl=60))
    tries = 0
    while not stop.is_set():
        lease = locks.acquire(KEY, wait=0.05)
        tries += 1
        if tries == 3:
            churning.put(os.getpid())  # it has waited (and given up) a few times
        if lease is not None:
            got.put(os.getpid())
            locks.release(lease)
        time.sleep(0.1)
    stopped.put(os.getpid())
    leave.wait(60)  # alive: its registrations cannot lapse as an exited process's
    coord.close()


def _waiters(path: Path) -> list[tuple[str, int]]:
    import sqlite3

    with sqlite3.connect(path) as raw:
        return raw.execute("SELECT owner, window_ms FROM lock_waiters").fetchall()


def test_sqlite_waiters_that_gave_up_keep_no_permit_from_others(tmp_path: Path) -> None:
    """Processes that keep trying with a short wait get a freed lock, and once they
    stop, none of their waiters stays queued: a waiter that gives up leaves the queue
    at once, so no window is kept for it (it used to stay queued a poll plus 250 ms,
    and a window kept for each such waiter in turn held the lock from everyone for
    seconds, or for good while the churn went on)."""
    path = tmp_path / "churn.db"
    url = f"sqlite:///{path}"
    coord = idemlock.connect(url)
    locks = coord.lock(idemlock.LockSpec("churn", ttl=600))
    ctx: Any = mp.get_context("spawn")
    churning, got, stopped = ctx.Queue(), ctx.Queue(), ctx.Queue()
    stop, leave = ctx.Event(), ctx.Event()
    lease = locks.acquire(KEY)
    assert lease is not None
    procs = [
        ctx.Process(target=_churn, args=(url, churning, stop, stopped, got, leave))
        for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        assert {churning.get(timeout=60), churning.get(timeout=60)} == {p.pid for p in procs}
        # The churn goes on while the lock is freed: some churner gets it (before the
        # fix, windows kept for churners that had left held it for 6 s to for good).
        assert locks.release(lease)
        assert got.get(timeout=30) in {p.pid for p in procs}
        lease = locks.acquire(KEY, wait=30)  # held again: the churners only give up now
        assert lease is not None
        stop.set()
        assert {stopped.get(timeout=60), stopped.get(timeout=60)} == {p.pid for p in procs}
        # Both still run, but no longer wait: none of their waiters is queued, so a
        # freed lock is free for anyone at once.
        assert _waiters(path) == []
        assert locks.release(lease)
        again = locks.acquire(KEY, wait=0)
        assert again is not None
        assert locks.release(again)
    finally:
        stop.set()
        leave.set()
        for proc in procs:
            proc.join(60)
        coord.close()
    assert [p.exitcode for p in procs] == [0, 0]


@pytest.mark.parametrize("face", ["sync", "async"])
def test_sqlite_waiter_that_times_out_leaves_the_queue(face: str, tmp_path: Path) -> None:
    """A waiter that gives up is unqueued when it leaves, on either face (the async
    face's from a worker thread: never a blocking write on the event loop), while the
    lock stays held and no other caller could drop its ticket."""
    path = tmp_path / "left.db"
    url = f"sqlite:///{path}"
    coord = idemlock.connect(url)
    locks = coord.lock(idemlock.LockSpec("left", ttl=600))
    lease = locks.acquire(KEY)
    assert lease is not None
    waiter = "waiter-that-left"
    if face == "sync":
        assert locks.acquire(KEY, owner=waiter, wait=0.2) is None
    else:
        import asyncio

        from idemlock import aio

        async def give_up() -> None:
            acoord = aio.connect(url)
            alocks = acoord.lock(idemlock.LockSpec("left", ttl=600))
            assert await alocks.acquire(KEY, owner=waiter, wait=0.2) is None
            deadline = time.monotonic() + 60  # the unqueueing thread's write
            while [o for o, _ in _waiters(path) if o.endswith(waiter)]:
                assert time.monotonic() < deadline, "the waiter stayed queued"
                await asyncio.sleep(0.01)
            await acoord.close()

        asyncio.run(give_up())
    assert _waiters(path) == []
    assert locks.release(lease)
    coord.close()
