"""The semaphore contract (``coord.semaphore()``), on every store, sync and async: up
to ``limit`` fenced permits per key; a lock is the one-permit case of the same rows."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import pytest

from idemlock import (
    ConfigurationError,
    FencedOut,
    LockInfo,
    LockLost,
    LockNotAcquired,
    LockSpec,
    Permit,
    SemaphoreSpec,
)

from .facade import Facade

SEM = SemaphoreSpec("exports", limit=3, ttl=timedelta(seconds=30))


async def _until(api: Facade, check: Any, what: str, bound: float = 20.0) -> None:
    deadline = time.monotonic() + bound
    while not await check():
        assert time.monotonic() < deadline, what
        if api.harness.clock is not None:
            api.harness.clock.advance(0.05)  # a store on a manual clock: time moves here
        await asyncio.sleep(0.02)


async def test_up_to_limit_permits_each_fenced(api: Facade) -> None:
    sem = api.semaphore(SEM)
    assert await sem.available("tenant-42") == 3
    permits = [await sem.acquire("tenant-42") for _ in range(3)]
    assert all(isinstance(p, Permit) for p in permits)
    tokens = [p.token for p in permits]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    assert len({p.owner for p in permits}) == 3
    assert await sem.acquire("tenant-42") is None
    assert await sem.available("tenant-42") == 0
    held = await sem.holders("tenant-42")
    assert all(isinstance(h, LockInfo) for h in held)
    assert [(h.owner, h.token, h.spec) for h in held] == [
        (p.owner, p.token, "exports") for p in permits
    ]
    assert all(timedelta(seconds=25) < p.remaining() <= timedelta(seconds=30) for p in permits)
    # Another key has its own permits.
    assert await sem.acquire("tenant-7") is not None
    assert await sem.release(permits[0]) is True
    assert await sem.release(permits[0]) is False  # a second release
    assert await sem.available("tenant-42") == 1
    again = await sem.acquire("tenant-42")
    assert again is not None and again.token > max(tokens)


async def test_same_owner_gets_its_permit_again(api: Facade) -> None:
    sem = api.semaphore(SEM)
    first = await sem.acquire("k", owner="worker-1")
    again = await sem.acquire("k", owner="worker-1")
    assert first is not None and again is not None and again.token == first.token
    assert await sem.available("k") == 2


async def test_renew_and_break_one_permit(api: Facade) -> None:
    sem = api.semaphore(SEM)
    a, b = await sem.acquire("k"), await sem.acquire("k")
    assert a is not None and b is not None
    assert await sem.renew(a) is True
    assert await sem.break_permit("k", b.token) is True
    assert await sem.break_permit("k", b.token) is False
    assert [h.token for h in await sem.holders("k")] == [a.token]
    assert await sem.renew(b) is False and b.lost
    assert await sem.release(b) is False
    c = await sem.acquire("k")
    assert c is not None and c.token > b.token


async def test_permit_tokens_fence_a_resource(api: Facade) -> None:
    sem = api.semaphore(SEM)
    gate = api.fence("exports-table")
    old, new = await sem.acquire("k"), await sem.acquire("k")
    assert old is not None and new is not None
    assert await gate.check_and_advance(new.token) == new.token
    with pytest.raises(FencedOut):
        await gate.check_and_advance(old.token)


async def test_a_lock_is_the_one_permit_case_of_the_same_keys(api: Facade) -> None:
    locks = api.lock(LockSpec("exports", ttl=30))
    sem = api.semaphore(SemaphoreSpec("exports", limit=2, ttl=30))
    lease = await locks.acquire("k")
    assert lease is not None
    assert await sem.available("k") == 1
    permit = await sem.acquire("k")
    assert permit is not None and permit.token > lease.token
    assert await sem.acquire("k") is None
    assert await locks.acquire("k") is None
    assert await locks.release(lease) is True
    assert await locks.acquire("k") is None  # the permit still counts for a limit of 1


async def test_a_caller_with_a_lower_limit_counts_every_holder(api: Facade) -> None:
    wide = api.semaphore(SemaphoreSpec("exports", limit=3, ttl=30))
    narrow = api.semaphore(SemaphoreSpec("exports", limit=2, ttl=30))
    held = [await wide.acquire("k") for _ in range(3)]
    assert all(p is not None for p in held)
    assert await narrow.available("k") == 0
    assert await narrow.acquire("k") is None
    for p in held[:2]:
        assert p is not None and await wide.release(p)
    assert await narrow.acquire("k") is not None


async def test_hold_and_not_acquired(api: Facade) -> None:
    sem = api.semaphore(SemaphoreSpec("exports", limit=1, ttl=30))
    async with sem.hold("k", wait=5) as permit:
        assert isinstance(permit, Permit) and not permit.lost
        assert await sem.available("k") == 0
        with pytest.raises(LockNotAcquired, match="held"):
            async with sem.hold("k", wait=0):
                pass  # pragma: no cover
    assert await sem.available("k") == 1
    two = api.semaphore(SEM)
    async with two.hold("k") as p1, two.hold("k") as p2, two.hold("k") as p3:
        assert len({p1.token, p2.token, p3.token}) == 3
        with pytest.raises(LockNotAcquired, match="all 3 permits of semaphore exports:k"):
            async with two.hold("k", wait=0):
                pass  # pragma: no cover
    assert await two.available("k") == 3


async def _acquire_in_background(
    api: Facade, sem: Any, key: str, wait: float
) -> asyncio.Future[Any]:
    if api.mode == "async":
        return asyncio.ensure_future(sem.raw.acquire(key, wait=wait))
    return asyncio.ensure_future(asyncio.to_thread(sem.raw.acquire, key, wait=wait))


async def test_a_waiter_gets_the_permit_a_holder_releases(api: Facade) -> None:
    sem = api.semaphore(SemaphoreSpec("exports", limit=2, ttl=30))
    a, b = await sem.acquire("k"), await sem.acquire("k")
    assert a is not None and b is not None
    waiter = await _acquire_in_background(api, sem, "k", 20)
    await asyncio.sleep(0.05)
    assert not waiter.done()
    assert await sem.release(a) is True
    got = await asyncio.wait_for(waiter, 25)
    assert got is not None and got.token > b.token
    assert [h.token for h in await sem.holders("k")] == [b.token, got.token]


async def test_a_cancelled_waiter_leaves_no_permit_behind(api: Facade) -> None:
    if api.mode == "sync":
        return  # a blocked thread is not cancellable; the async face is the subject
    sem = api.semaphore(SemaphoreSpec("exports", limit=1, ttl=30))
    held = await sem.acquire("k")
    assert held is not None
    waiter = asyncio.ensure_future(sem.raw.acquire("k", wait=20))
    await asyncio.sleep(0.1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert await sem.release(held) is True
    got = await sem.acquire("k", wait=10)
    assert got is not None
    assert [h.owner for h in await sem.holders("k")] == [got.owner]


async def test_a_broken_permit_is_lost_in_its_hold(api: Facade) -> None:
    sem = api.semaphore(SemaphoreSpec("exports", limit=2, ttl=timedelta(seconds=2)))
    seen: list[Permit] = []
    with pytest.raises(LockLost, match="lost a permit of semaphore exports:k"):
        async with sem.hold("k", renew_every=0.2, on_lost=seen.append) as permit:
            assert await sem.break_permit("k", permit.token) is True

            async def lost() -> bool:
                return bool(permit.lost)

            await _until(api, lost, "the broken permit was not reported lost")
            if api.mode == "async":
                await asyncio.sleep(30)  # cancelled by the loss
    assert seen and seen[0].lost


def test_semaphore_spec_validation() -> None:
    for bad in (0, -1, True, 2.0, "3", 10_001):
        with pytest.raises(ConfigurationError, match="limit"):
            SemaphoreSpec("s", limit=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        SemaphoreSpec("s", limit=2, ttl=0)
    assert SemaphoreSpec("s", limit=10_000).limit == 10_000


async def test_semaphore_needs_a_spec_with_a_limit(api: Facade) -> None:
    with pytest.raises(ConfigurationError, match="SemaphoreSpec"):
        api.coord.semaphore("exports")
    with pytest.raises(ConfigurationError, match="SemaphoreSpec"):
        api.coord.semaphore(LockSpec("exports"))
