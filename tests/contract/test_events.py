"""Every outcome raises an event through the hook interface, on every store."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest

from idemlock import Claimed, Event, IdempotencySpec, LockLost, LockSpec, PayloadMismatch

from .facade import Facade

SPEC = IdempotencySpec("ev", lease=timedelta(seconds=30))


def recorder(api: Facade) -> list[Event]:
    events: list[Event] = []
    api.coord.add_hook(events.append)
    return events


def seen(events: list[Event]) -> list[tuple[str, str]]:
    return [(e.name, e.outcome) for e in events]


async def test_idempotency_events(api: Facade) -> None:
    events = recorder(api)
    port = api.idem(SPEC)
    claim = await port.claim("secret-order-key", payload={"a": 1})
    assert isinstance(claim, Claimed)
    await port.claim("secret-order-key", payload={"a": 1})
    with pytest.raises(PayloadMismatch):
        await port.claim("secret-order-key", payload={"a": 2})
    await port.complete(claim.token, "r")
    await port.claim("secret-order-key", payload={"a": 1})
    other = await port.claim("k2")
    assert isinstance(other, Claimed)
    await port.abandon(other.token)
    with pytest.raises(Exception):  # noqa: B017 - StaleClaim, checked by its event
        await port.abandon(other.token)
    assert seen(events) == [
        ("claim", "claimed"),
        ("claim", "in_flight"),
        ("claim", "mismatch"),
        ("complete", "ok"),
        ("claim", "replayed"),
        ("claim", "claimed"),
        ("abandon", "ok"),
        ("abandon", "stale"),
    ]
    for e in events:
        assert e.kind == "idempotency" and e.spec == "ev" and e.duration >= 0
        assert e.store == api.coord.store.kind
        assert "secret-order-key" not in repr(e)  # never the key


async def test_wrap_events(api: Facade) -> None:
    events = recorder(api)
    wrapped = api.wrap(SPEC, lambda x: x * 2)
    await wrapped(1)
    await wrapped(1)
    assert seen(events) == [("claim", "claimed"), ("complete", "ok"), ("claim", "replayed")]


async def test_lock_events(api: Facade) -> None:
    events = recorder(api)
    locks = api.lock(LockSpec("lk", ttl=timedelta(seconds=30)))
    lease = await locks.acquire("a")
    assert lease is not None
    assert await locks.acquire("a", wait=0.05) is None
    assert await locks.renew(lease)
    assert await locks.release(lease)
    again = await locks.acquire("a")
    assert again is not None
    await locks.release(again)
    assert seen(events) == [
        ("acquire", "acquired"),
        ("acquire", "timeout"),
        ("renew", "ok"),
        ("release", "ok"),
        ("acquire", "acquired"),
        ("release", "ok"),
    ]
    assert {e.kind for e in events} == {"lock"} and {e.spec for e in events} == {"lk"}


async def test_lost_lease_event(api: Facade) -> None:
    events = recorder(api)
    locks = api.lock(LockSpec("lost", ttl=timedelta(seconds=0.3)))
    with pytest.raises(LockLost):
        async with locks.hold("k", renew_every=0.05, max_hold=0.05) as lease:
            # Renewals stop after max_hold; the lease is lost by its deadline (on a
            # loaded machine the watchdog's thread may run late: wait for it, bounded).
            deadline = time.monotonic() + 20
            while not lease.lost and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                if api.harness.clock is not None:
                    api.harness.clock.advance(0.05)
    # The watchdog's thread sets lease.lost, then delivers the event: wait for it.
    waited = time.monotonic() + 10
    while ("lost", "lost") not in seen(events):
        assert time.monotonic() < waited, seen(events)
        await asyncio.sleep(0.02)


def test_broken_hook_does_not_break_operations() -> None:
    import idemlock

    def broken(event: Event) -> None:
        raise RuntimeError("metrics backend down")

    coord = idemlock.connect("memory://", hooks=[broken])
    port = coord.idempotency(SPEC)
    claim = port.claim("k")
    assert isinstance(claim, Claimed)
    port.complete(claim.token, 1)
