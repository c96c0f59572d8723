"""idemlock.compat.fencekit given an idemlock Coordinator: fencekit's classes on every
store (the sdist suites in test_fencekit_suite.py cover Redis through a redis-py client)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest

import idemlock
import idemlock.aio
from idemlock import ConfigurationError
from idemlock.compat.fencekit import (
    BeginOutcome,
    DistributedLock,
    FencedOutError,
    FenceGate,
    IdempotencyGuard,
    IdempotencyNotOwned,
    IdempotencyResultMissing,
    LockHandle,
    LockNotAcquired,
    LockNotOwned,
    idempotency_key,
)
from tests.contract.harness import Harness

TTL = timedelta(seconds=30)


@pytest.fixture
def coord(harness: Harness) -> Iterator[idemlock.Coordinator]:
    made = harness.sync()
    try:
        yield made
    finally:
        made.close()


def test_lock_contention_release_extend(coord: idemlock.Coordinator) -> None:
    lock = DistributedLock(coord, prefix="fk")
    first = lock.acquire("job", ttl=TTL)
    with pytest.raises(LockNotAcquired):
        lock.acquire("job", ttl=TTL)
    lock.extend(first, ttl=TTL)
    foreign = LockHandle(resource="job", owner_id="someone", token=first.token, ttl=first.ttl)
    with pytest.raises(LockNotOwned):
        lock.extend(foreign, ttl=TTL)
    with pytest.raises(LockNotOwned):
        lock.release(foreign)
    # A handle rebuilt by hand (no lease object) is acted on by owner and token.
    rebuilt = LockHandle(resource="job", owner_id=first.owner_id, token=first.token, ttl=TTL)
    lock.extend(rebuilt, ttl=TTL)
    lock.release(rebuilt)
    with pytest.raises(LockNotOwned):
        lock.release(first)
    second = lock.acquire("job", ttl=TTL)
    assert second.token.value > first.token.value
    with lock.hold("other", ttl=TTL) as held, pytest.raises(LockNotAcquired):
        lock.acquire("other", ttl=TTL)
    lock.release(second)
    assert lock.acquire("other", ttl=TTL).token.value > held.token.value


def test_expired_handle_is_refused(coord: idemlock.Coordinator, harness: Harness) -> None:
    lock = DistributedLock(coord, prefix="fk")
    stale = lock.acquire("exp", ttl=timedelta(milliseconds=300))
    harness.advance(0.5)
    fresh = lock.acquire("exp", ttl=TTL)
    assert fresh.token.value > stale.token.value
    with pytest.raises(LockNotOwned):
        lock.extend(stale, ttl=TTL)
    with pytest.raises(LockNotOwned):
        lock.release(stale)
    gate = FenceGate(coord, prefix="fk")
    gate.check_and_advance(fresh.token)
    with pytest.raises(FencedOutError):
        gate.check_and_advance(stale.token)
    with pytest.raises(FencedOutError):
        gate.check(stale.token)
    gate.check(fresh.token)
    assert gate.current_max("exp") == fresh.token.value
    lock.release(fresh)


def test_one_winner(coord: idemlock.Coordinator) -> None:
    lock = DistributedLock(coord, prefix="fk")
    won: list[int] = []
    start = threading.Barrier(8)

    def attempt() -> None:
        start.wait(timeout=60)
        with contextlib.suppress(LockNotAcquired):
            won.append(lock.acquire("race", ttl=TTL).token.value)

    threads = [threading.Thread(target=attempt) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "still running after 60 s"
    assert len(won) == 1


def test_guard_begin_done_result(coord: idemlock.Coordinator) -> None:
    guard = IdempotencyGuard(coord, prefix="fk", owner_id="a")
    other = IdempotencyGuard(coord, prefix="fk", owner_id="b")
    key = idempotency_key({"batch": 1}, namespace="jobs")
    assert guard.try_begin(key, ttl=TTL) is True
    assert other.try_begin(key, ttl=TTL) is False
    assert guard.status(key) == "pending"
    with pytest.raises(IdempotencyResultMissing, match="pending"):
        guard.get_result(key)
    with pytest.raises(IdempotencyNotOwned):
        other.mark_done(key, result="stolen")
    guard.mark_done(key, result={"n": 1})
    assert guard.status(key) == "done" and other.get_result(key) == {"n": 1}
    assert guard.try_begin(key, ttl=TTL) is False
    lock = DistributedLock(coord, prefix="fk")
    assert (
        other.try_begin_or_reclaim(key, lock=lock, lock_resource="r", ttl=TTL)
        == BeginOutcome.ALREADY_DONE
    )
    guard.clear(key)
    assert guard.status(key) is None
    assert other.try_begin_or_reclaim(key, lock=lock, lock_resource="r", ttl=TTL) == (
        BeginOutcome.BEGUN
    )
    assert guard.try_begin_or_reclaim(key, lock=lock, lock_resource="r", ttl=TTL) == (
        BeginOutcome.IN_PROGRESS
    )
    other.mark_done(key)  # no result: done, nothing to replay
    with pytest.raises(IdempotencyResultMissing, match="without a stored result"):
        guard.get_result(key)
    none_key = idempotency_key({"batch": 2}, namespace="jobs")
    assert guard.try_begin(none_key, ttl=TTL)
    guard.mark_done(none_key, result=None)
    assert guard.get_result(none_key) is None


def test_reclaim_after_the_lease(coord: idemlock.Coordinator, harness: Harness) -> None:
    dead = IdempotencyGuard(coord, prefix="fk", owner_id="dead")
    alive = IdempotencyGuard(coord, prefix="fk", owner_id="alive")
    lock = DistributedLock(coord, prefix="fk")
    key = idempotency_key({"batch": 3}, namespace="jobs")
    assert dead.try_begin(key, ttl=timedelta(seconds=1))
    assert alive.try_begin_or_reclaim(
        key, lock=lock, lock_resource="r", ttl=timedelta(seconds=1)
    ) == (BeginOutcome.IN_PROGRESS)
    harness.advance(1.3)
    # Both mean "run it"; RECLAIMED needs the store to still list the expired claim.
    assert alive.try_begin_or_reclaim(
        key, lock=lock, lock_resource="r", ttl=timedelta(seconds=1)
    ) in (BeginOutcome.RECLAIMED, BeginOutcome.BEGUN)
    with pytest.raises(IdempotencyNotOwned):
        dead.mark_done(key)
    alive.mark_done(key, result="recovered")
    assert dead.get_result(key) == "recovered"


def test_set_if_fresh(coord: idemlock.Coordinator, harness: Harness) -> None:
    lock = DistributedLock(coord, prefix="fk")
    gate = FenceGate(coord, prefix="fk")
    old = lock.acquire("w", ttl=timedelta(milliseconds=300))
    harness.advance(0.5)
    new = lock.acquire("w", ttl=TTL)
    if not harness.name.startswith("redis"):
        with pytest.raises(ConfigurationError):
            gate.set_if_fresh(new.token, f"{harness.prefix}:out", "fresh")
        return
    # On Redis Cluster the key shares the gate's hash tag: {<prefix>.<resource>}.
    out = "{fk.w}:" + harness.prefix
    gate.set_if_fresh(new.token, out, "fresh")
    with pytest.raises(FencedOutError):
        gate.set_if_fresh(old.token, out, "stale")
    assert gate.current_max("w") == new.token.value


def test_async_coordinator_is_refused() -> None:
    coord = idemlock.aio.connect("memory://")
    with pytest.raises(ConfigurationError, match="blocking"):
        DistributedLock(coord)


def test_late_mark_done_is_kept_when_nobody_took_over(
    coord: idemlock.Coordinator, harness: Harness
) -> None:
    guard = IdempotencyGuard(coord, prefix="fk")
    key = idempotency_key({"batch": 4}, namespace="jobs")
    assert guard.try_begin(key, ttl=timedelta(seconds=1))
    harness.advance(1.3)  # past the lease; nobody began the key meanwhile
    guard.mark_done(key, result="late")
    assert guard.get_result(key) == "late"


def test_hooks_are_called(coord: idemlock.Coordinator) -> None:
    seen: list[tuple[object, ...]] = []

    class Hooks:
        def lock_acquired(self, resource: str, token: int) -> None:
            seen.append(("acquired", resource))

        def lock_released(self, resource: str) -> None:
            raise RuntimeError("a failing hook changes nothing")

    lock = DistributedLock(coord, prefix="fk", hooks=Hooks())
    lock.release(lock.acquire("h", ttl=TTL))
    assert seen == [("acquired", "h")]
    assert lock.acquire("h", ttl=TTL).token.value > 0  # the release took effect
