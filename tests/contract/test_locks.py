"""The fenced-lease contract: acquire, release, renew, queries, waiting, hold."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta

import pytest

from idemlock import (
    ConfigurationError,
    InvalidKey,
    Lease,
    LockLost,
    LockNotAcquired,
    LockNotHeld,
    LockSpec,
)

from .facade import Facade, each_face
from .harness import Harness

TTL = 0.4
SPEC = LockSpec("jobs", ttl=timedelta(seconds=TTL))
LONG = LockSpec("long", ttl=timedelta(seconds=30))
#: renew's test: calls between its checks must be answered within 0.4 of it
RENEW_TTL = 1.0
RENEW = LockSpec("renew", ttl=timedelta(seconds=RENEW_TTL))


async def test_acquire_release(api: Facade) -> None:
    locks = api.lock(LONG)
    lease = await locks.acquire("a")
    assert isinstance(lease, Lease)
    assert lease.key == "a" and isinstance(lease.token, int) and lease.token > 0
    assert timedelta(seconds=29) < lease.remaining() <= timedelta(seconds=30)
    assert await locks.is_locked("a")
    assert await locks.owner("a") == lease.owner
    ttl = await locks.ttl("a")
    assert ttl is not None and timedelta(seconds=25) < ttl <= timedelta(seconds=30)
    assert await locks.acquire("a") is None  # another owner
    assert await locks.release(lease) is True
    assert not await locks.is_locked("a")
    assert await locks.owner("a") is None
    assert await locks.ttl("a") is None


async def test_tokens_strictly_increase_per_key(api: Facade) -> None:
    locks = api.lock(LONG)
    tokens = []
    for _ in range(5):
        lease = await locks.acquire("k")
        assert lease is not None
        tokens.append(lease.token)
        other = await locks.acquire("other-key")
        assert other is not None
        await locks.release(other)
        await locks.release(lease)
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


async def test_same_owner_reacquire_returns_same_lease(api: Facade) -> None:
    locks = api.lock(LONG)
    first = await locks.acquire("k", owner="worker-1")
    assert first is not None and first.owner == "worker-1"
    again = await locks.acquire("k", owner="worker-1")
    assert again is not None and again.token == first.token
    assert await locks.acquire("k", owner="worker-2") is None
    assert await locks.release(again) is True
    # The first object names the same lease, which is gone now.
    assert await locks.release(first) is False


async def _expiry_frees_the_lock_and_fences_the_old_holder(api: Facade) -> None:
    locks = api.lock(SPEC)
    old = await locks.acquire("k")
    assert old is not None
    api.harness.advance(TTL + 0.15)
    new = await locks.acquire("k")
    assert new is not None and new.token is not None and old.token is not None
    assert new.token > old.token
    # The late holder can neither release nor renew the new holder's lease.
    assert await locks.release(old) is False
    assert await locks.owner("k") == new.owner
    with pytest.raises(LockNotHeld):
        await locks.renew(old)  # released objects are spent
    assert await locks.release(new) is True


async def test_expiry_frees_the_lock_and_fences_the_old_holder(harness: Harness) -> None:
    await each_face(harness, _expiry_frees_the_lock_and_fences_the_old_holder)


async def _renew_extends_and_keeps_token(api: Facade) -> None:
    locks = api.lock(RENEW)
    # On a store on real time each check is only certain if the calls around it were
    # answered within the lease: the times around them tell, and a try that stalled
    # longer (its outcome unknown, not wrong) is made again on a fresh key.
    real = api.harness.clock is None
    for attempt in range(5):
        key = f"k{attempt}"
        t0 = time.monotonic()  # the first lease cannot end before t0 + RENEW_TTL
        lease = await locks.acquire(key)
        assert lease is not None
        token = lease.token
        api.harness.advance(RENEW_TTL * 0.6)
        sent = time.monotonic()  # the renewed lease cannot end before sent + RENEW_TTL
        renewed = await locks.renew(lease)
        if real and time.monotonic() - t0 >= RENEW_TTL:
            await locks.release(lease)
            continue  # the renewal may have come after the first lease ended
        assert renewed is True
        api.harness.advance(RENEW_TTL * 0.6)
        # Past the original expiry, still held thanks to the renewal.
        owner = await locks.owner(key)
        if real and time.monotonic() - sent >= RENEW_TTL:
            await locks.release(lease)
            continue  # the renewed lease may have ended too
        assert owner == lease.owner
        break
    else:
        raise AssertionError("every try stalled longer than the lease")
    assert lease.token == token
    assert await locks.renew(lease, ttl=timedelta(seconds=30)) is True
    assert lease.remaining() > timedelta(seconds=20)
    assert await locks.release(lease) is True


async def test_renew_extends_and_keeps_token(harness: Harness) -> None:
    await each_face(harness, _renew_extends_and_keeps_token)


async def _renew_after_expiry_fails_and_marks_lost(api: Facade) -> None:
    locks = api.lock(SPEC)
    lease = await locks.acquire("k")
    assert lease is not None
    api.harness.advance(TTL + 0.15)
    assert await locks.renew(lease) is False
    assert lease.lost is True
    assert lease.remaining() == timedelta(0)


async def test_renew_after_expiry_fails_and_marks_lost(harness: Harness) -> None:
    await each_face(harness, _renew_after_expiry_fails_and_marks_lost)


async def test_renew_of_released_lease_is_an_error(api: Facade) -> None:
    locks = api.lock(LONG)
    lease = await locks.acquire("k")
    assert lease is not None
    await locks.release(lease)
    with pytest.raises(LockNotHeld) as info:
        await locks.renew(lease)
    assert "released" in str(info.value)


async def test_wait_times_out(api: Facade) -> None:
    locks = api.lock(LONG)
    holder = await locks.acquire("k")
    assert holder is not None
    assert await locks.acquire("k", wait=0.15) is None
    await locks.release(holder)


async def _waiter_acquires_after_release(api: Facade) -> None:
    locks = api.lock(LONG)
    other = api.other()
    try:
        holder = await other.lock(LONG).acquire("k")
        assert holder is not None
        if api.mode == "sync":
            release = other.coord.lock(LONG).release
            timer = threading.Timer(0.1, release, args=(holder,))
            timer.start()
            lease = await locks.acquire("k", wait=10)
            timer.join(timeout=60)
            assert not timer.is_alive(), "still running after 60 s"
        else:

            async def later() -> None:
                await asyncio.sleep(0.1)
                await other.lock(LONG).release(holder)

            task = asyncio.ensure_future(later())
            lease = await locks.acquire("k", wait=10)
            await task
        assert lease is not None and holder.token is not None
        assert lease.token is not None and lease.token > holder.token
    finally:
        await other.close()


async def test_waiter_acquires_after_release(harness: Harness) -> None:
    await each_face(harness, _waiter_acquires_after_release)


async def _waiter_acquires_after_expiry(api: Facade) -> None:
    locks = api.lock(SPEC)
    holder = await locks.acquire("k")
    assert holder is not None
    if api.harness.clock is not None:
        # A manual clock does not move while we wait in real time: move it first.
        api.harness.advance(TTL + 0.1)
    # Nobody releases: the waiter must notice the expiry by itself.
    lease = await locks.acquire("k", wait=5)
    assert lease is not None and lease.token is not None and holder.token is not None
    assert lease.token > holder.token


async def test_waiter_acquires_after_expiry(harness: Harness) -> None:
    await each_face(harness, _waiter_acquires_after_expiry)


async def test_queries_validate_keys(api: Facade) -> None:
    locks = api.lock(LONG)
    for bad in ("", "with space", "x" * 600):
        with pytest.raises(InvalidKey):
            await locks.acquire(bad)
        with pytest.raises(InvalidKey):
            await locks.is_locked(bad)
    with pytest.raises(InvalidKey):
        await locks.acquire("k", owner="bad owner")


#: a lease renewed every 50 ms: a ttl that a busy machine's stalls do not outlast
RENEWED_TTL = 1.5
RENEWED = LockSpec("renewed", ttl=timedelta(seconds=RENEWED_TTL))


async def _hold_renews_past_ttl_and_releases(api: Facade) -> None:
    locks = api.lock(RENEWED)
    async with locks.hold("k", renew_every=0.05) as lease:
        for _ in range(int(RENEWED_TTL / 0.05) + 4):
            await asyncio.sleep(0.05)
            if api.harness.clock is not None:
                api.harness.clock.advance(0.05)
        # Well past one ttl, still held by us.
        assert await locks.owner("k") == lease.owner
        assert not lease.lost
    assert not await locks.is_locked("k")


async def test_hold_renews_past_ttl_and_releases(harness: Harness) -> None:
    await each_face(harness, _hold_renews_past_ttl_and_releases)


async def test_hold_not_acquired(api: Facade) -> None:
    locks = api.lock(LONG)
    holder = await locks.acquire("k")
    assert holder is not None
    with pytest.raises(LockNotAcquired):
        async with locks.hold("k", wait=0.1):
            raise AssertionError("must not enter")
    await locks.release(holder)


async def _hold_loses_lease_after_max_hold(api: Facade) -> None:
    locks = api.lock(SPEC)
    lost: list[Lease] = []
    with pytest.raises(LockLost) as info:
        async with locks.hold("k", renew_every=0.05, max_hold=0.05, on_lost=lost.append) as lease:
            # Renewal stops after max_hold; the lease then runs out while we are inside.
            # (bounded: on a loaded machine the watchdog's thread may run late)
            deadline = time.monotonic() + 20
            while not lease.lost and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                if api.harness.clock is not None:
                    api.harness.advance(0.05)
    assert "lost the lock" in str(info.value)
    assert lease.lost and lost == [lease]


async def test_hold_loses_lease_after_max_hold(harness: Harness) -> None:
    await each_face(harness, _hold_loses_lease_after_max_hold)


async def test_async_hold_detects_a_lease_taken_over_and_cancels_the_body(
    harness: Harness,
) -> None:
    # Async only: blocking the event loop is how we pause the renewer here (a GC pause,
    # a stopped VM); a sync holder's renewer thread cannot be paused from its body.
    coord, other = harness.aio(), harness.sync()
    locks = coord.lock(SPEC)
    lost: list[Lease] = []
    reached_end = False
    thief = None
    try:
        with pytest.raises(LockLost):
            async with locks.hold("k", renew_every=TTL * 0.8, on_lost=lost.append) as lease:
                harness.advance(TTL + 0.15)  # blocks the loop: no renewal runs
                # Take over with a blocking call, so the renewer cannot run in between
                # (for a long ttl: the same key, still held when checked below).
                thief = other.lock(LockSpec(SPEC.name, ttl=LONG.ttl)).acquire("k")
                assert thief is not None
                await asyncio.sleep(10)  # cancelled when the renewer finds the lease gone
                reached_end = True
        assert not reached_end
        assert lease.lost and lost == [lease]
        # The loser's exit did not release the new holder's lease.
        assert thief is not None and await locks.owner("k") == thief.owner
    finally:
        await coord.close()
        other.close()


async def test_hold_body_exception_wins_over_lock_lost(api: Facade) -> None:
    locks = api.lock(LONG)
    with pytest.raises(ValueError):
        async with locks.hold("k"):
            raise ValueError("body failed")
    assert not await locks.is_locked("k")


def test_lock_spec_validation() -> None:
    with pytest.raises(ConfigurationError):
        LockSpec("x", ttl=timedelta(seconds=0))
    with pytest.raises(InvalidKey):
        LockSpec("")


async def test_renew_every_must_be_shorter_than_ttl(api: Facade) -> None:
    locks = api.lock(SPEC)
    with pytest.raises(ConfigurationError):
        async with locks.hold("k", renew_every=TTL * 2):
            pass


async def test_listing_locks(api: Facade) -> None:
    locks = api.lock(LONG)
    a = await locks.acquire("a", owner="me")
    b = await locks.acquire("b")
    assert a is not None and b is not None
    rows = {(r.spec, r.key): r for r in await api.locks()}
    assert set(rows) == {("long", "a"), ("long", "b")}
    assert rows[("long", "a")].owner == "me" and rows[("long", "a")].token == a.token
    await locks.release(b)
    assert {r.key for r in await api.locks()} == {"a"}
