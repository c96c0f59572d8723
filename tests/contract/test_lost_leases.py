"""Leases on the failure paths: releasing twice, a lost lease in ``hold()``, leaving a
block while the store hangs, cancellation on the way out, an ``on_lost`` that raises."""

from __future__ import annotations

from datetime import timedelta

from idemlock import LockSpec

from .facade import Facade

LONG = LockSpec("long", ttl=timedelta(seconds=30))


async def test_second_release_returns_false(api: Facade) -> None:
    locks = api.lock(LONG)
    lease = await locks.acquire("k")
    assert lease is not None
    assert await locks.release(lease) is True
    # "release if owned; returns whether it was": a second release in a finally block
    # must never raise over the body's own error.
    assert await locks.release(lease) is False
    assert not await locks.is_locked("k")


async def test_second_release_leaves_a_new_holder_alone(api: Facade) -> None:
    locks = api.lock(LONG)
    first = await locks.acquire("k", owner="me")
    assert first is not None
    assert await locks.release(first) is True
    again = await locks.acquire("k", owner="me")
    assert again is not None
    assert await locks.release(first) is False
    assert await locks.owner("k") == "me"
    assert await locks.release(again) is True
