"""Fair lock hand-off: waiters are served in arrival order, nobody barges in on a
reserved lock, and a waiter that left does not hold the queue up beyond its window.

Behaviour only (who gets the lock, in which order), on the store port with a
ManualClock where a window must pass, and through the public API with threads queued
in a known order. No timing asserts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

import idemlock
from idemlock import ManualClock
from idemlock._core.port import Acquired, Channel, Held
from idemlock.stores import memory
from idemlock.stores.memory import MemoryStore

NS, KEY = "fair", "k"
CHANNEL = Channel("lock", NS, KEY)
TTL = 10_000


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store(clock: ManualClock) -> Iterator[MemoryStore]:
    s = MemoryStore(clock=clock)
    yield s
    s.close()


def queue(store: MemoryStore, owner: str) -> None:
    """What a waiting caller does: fail, subscribe (done by the test), fail again."""
    for _ in range(2):
        assert isinstance(store.acquire(NS, KEY, owner, TTL), Held)


def test_waiters_acquire_in_arrival_order(store: MemoryStore) -> None:
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


def test_releasing_owner_and_newcomer_cannot_barge(store: MemoryStore) -> None:
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


def test_release_wakes_the_chosen_waiter(store: MemoryStore) -> None:
    a = store.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = store.subscribe(CHANNEL)
    queue(store, "b")
    assert not sub.wait(0)
    assert store.release(NS, KEY, "a", a.token)
    assert sub.wait(0)
    sub.close()


def test_chosen_waiter_that_left_loses_its_turn_after_the_window(
    store: MemoryStore, clock: ManualClock
) -> None:
    a = store.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = store.subscribe(CHANNEL)  # the others still wait on the key
    queue(store, "gone")
    queue(store, "c")
    assert store.release(NS, KEY, "a", a.token)
    assert isinstance(store.acquire(NS, KEY, "c", TTL), Held)  # kept for "gone"
    clock.advance(memory.HANDOFF_MS / 1000)
    assert isinstance(store.acquire(NS, KEY, "c", TTL), Acquired)
    sub.close()


def test_waiter_that_stopped_retrying_lapses(store: MemoryStore, clock: ManualClock) -> None:
    a = store.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = store.subscribe(CHANNEL)
    queue(store, "gone")
    clock.advance(2.0)  # far past its registration; the lease is still held
    queue(store, "c")
    assert store.release(NS, KEY, "a", a.token)
    assert isinstance(store.acquire(NS, KEY, "c", TTL), Acquired)
    sub.close()


def test_waiter_that_gave_up_does_not_block(store: MemoryStore) -> None:
    a = store.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = store.subscribe(CHANNEL)
    queue(store, "b")
    sub.close()  # b stopped waiting: nobody is subscribed to the key any more
    assert store.release(NS, KEY, "a", a.token)
    assert isinstance(store.acquire(NS, KEY, "newcomer", TTL), Acquired)


def test_one_shot_tries_are_not_queued(store: MemoryStore) -> None:
    a = store.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = store.subscribe(CHANNEL)
    assert isinstance(store.acquire(NS, KEY, "try-once", TTL), Held)
    assert store.release(NS, KEY, "a", a.token)
    assert isinstance(store.acquire(NS, KEY, "newcomer", TTL), Acquired)
    sub.close()


def test_break_ends_a_reservation(store: MemoryStore) -> None:
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


def test_purge_drops_lapsed_queues(store: MemoryStore, clock: ManualClock) -> None:
    a = store.acquire(NS, KEY, "a", TTL)
    assert isinstance(a, Acquired)
    sub = store.subscribe(CHANNEL)
    queue(store, "b")
    sub.close()
    clock.advance(2.0)
    store.purge()
    assert store._queues == {}


def _wait_queued(store: MemoryStore, n: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        queued = [tries > 1 for q in store._queues.values() for _, tries in q.waiters.values()]
        if sum(queued) >= n:
            return
        assert time.monotonic() < deadline, "waiters did not queue"
        time.sleep(0.001)


def test_threads_get_the_lock_in_the_order_they_queued() -> None:
    coord = idemlock.connect("memory://")
    locks = coord.lock(idemlock.LockSpec("fair", ttl=30))
    store = coord._store
    assert isinstance(store, MemoryStore)
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
        _wait_queued(store, i + 1)
    locks.release(first)
    for th in threads:
        th.join(30)
    coord.close()
    assert order == [0, 1, 2, 3]
