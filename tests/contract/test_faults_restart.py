"""Fault contract: the store stopped and started again, between calls and during
calls, every store, sync and async.

* While the store is down (``harness.outage()``: the server stopped; SQLite and
  memory: locked), every call raises ``StoreUnavailable`` within the bound.
* After it is back, the *same* coordinator works again without being reopened (its
  first calls may still fail with StoreUnavailable for a moment, never hang).
* A call in flight when the store goes down raises ``StoreUnavailable`` or succeeds,
  within the bound; it never hangs.

Redis comes back empty (no persistence: records and locks are gone, so a complete or
renew of what it held answers "stale"/False); PostgreSQL keeps its data.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from datetime import timedelta
from typing import Any

from idemlock import (
    Claimed,
    Completed,
    IdempotencySpec,
    Lease,
    LockLost,
    LockSpec,
    StaleClaim,
    StoreUnavailable,
)

from .facade import Facade
from .fault_stores import (
    BOUND,
    Outcome,
    SharedFault,
    SharedRestart,
    assert_unavailable,
    each_face_in_one_fault,
    eventually,
    timed,
)
from .harness import Harness

SPEC = IdempotencySpec("restart", lease=timedelta(seconds=30))
LOCK = LockSpec("restart", ttl=timedelta(seconds=30))


async def test_calls_while_the_store_is_down_fail_within_the_bound(
    fault_harness: Harness,
) -> None:
    # Both faces at once, in one outage (fault_stores.each_face_in_one_fault).
    await each_face_in_one_fault(fault_harness, "outage", _calls_while_the_store_is_down)


async def _calls_while_the_store_is_down(fault_api: Facade, outage: SharedFault) -> None:
    port, locks = fault_api.idem(SPEC), fault_api.lock(LOCK)
    claim = await port.claim("held")
    assert isinstance(claim, Claimed)
    lease = await locks.acquire("held")
    assert lease is not None
    async with outage:
        calls = {
            "claim": lambda: port.claim("during"),
            "complete": lambda: port.complete(claim.token, "v"),
            "acquire": lambda: locks.acquire("during"),
            "renew": lambda: locks.renew(lease),
        }
        # All at once (each sync call in a thread of its own): one bound, not four.
        outs = await asyncio.gather(*(timed(fault_api, call) for call in calls.values()))
        for what, out in zip(calls, outs, strict=True):
            assert_unavailable(out, what)
    # Back: the same coordinator works again, without being reopened.
    fresh = await eventually(fault_api, lambda: port.claim("after"))
    assert isinstance(fresh, Claimed)
    await port.complete(fresh.token, {"after": True})
    replay = await port.claim("after")
    assert isinstance(replay, Completed) and replay.result == {"after": True}
    # What the store held before: kept (PostgreSQL, SQLite, memory) or lost (Redis).
    out = await timed(fault_api, lambda: port.complete(claim.token, "v"))
    assert out.error is None or isinstance(out.error, StaleClaim), out.describe()
    renewed = await eventually(fault_api, lambda: locks.renew(lease))
    assert renewed in (True, False)
    new_lease = await locks.acquire("after")
    assert isinstance(new_lease, Lease)
    assert await locks.release(new_lease) is True


async def test_calls_in_flight_when_the_store_restarts(fault_harness: Harness) -> None:
    """A steady stream of calls while the store is restarted under it: each call ends
    within the bound, with an answer or StoreUnavailable (or a stale answer, for what a
    store that lost its data no longer has), and the stream goes on afterwards. Both
    faces at once, across one restart."""
    await each_face_in_one_fault(fault_harness, "restart", _calls_in_flight_across_a_restart)


async def _calls_in_flight_across_a_restart(fault_api: Facade, restart_once: SharedRestart) -> None:
    port, locks = fault_api.idem(SPEC), fault_api.lock(LOCK)
    assert isinstance(await port.claim("warm"), Claimed)
    outcomes: list[tuple[str, Outcome, float]] = []
    stop = asyncio.Event()
    restarted: dict[str, float] = {}

    async def stream() -> None:
        for i in itertools.count():
            if stop.is_set():
                return
            started = time.monotonic()
            out = await timed(fault_api, lambda i=i: port.claim(f"s-{i}"))
            outcomes.append(("claim", out, started))
            if isinstance(out.value, Claimed):
                token = out.value.token
                out = await timed(fault_api, lambda token=token, i=i: port.complete(token, i))
                outcomes.append(("complete", out, time.monotonic()))
            started = time.monotonic()
            out = await timed(fault_api, lambda i=i: locks.acquire(f"s-{i}"))
            outcomes.append(("acquire", out, started))
            if isinstance(out.value, Lease):
                got = out.value
                out = await timed(fault_api, lambda got=got: locks.release(got))
                outcomes.append(("release", out, time.monotonic()))
            if out.error is not None:
                await asyncio.sleep(0.02)

    async def restart() -> None:
        await asyncio.sleep(0.3)
        await restart_once()
        restarted["at"] = time.monotonic()
        await asyncio.sleep(1.0)
        stop.set()

    await asyncio.gather(stream(), restart())
    bad = [
        (what, out.describe())
        for what, out, _ in outcomes
        if out.elapsed > BOUND
        or (
            out.error is not None
            and not isinstance(out.error, StaleClaim)
            and not isinstance(out.error, StoreUnavailable)
        )
    ]
    assert not bad, f"calls across a restart that hung or failed otherwise: {bad[:5]}"
    # The stream went on after the restart without reopening anything.
    after = await eventually(fault_api, lambda: port.claim("after-restart"))
    assert isinstance(after, Claimed)
    assert any(o.error is None for _, o, _ in outcomes), "no call succeeded at all"


async def test_hold_across_a_restart_is_bounded(fault_harness: Harness) -> None:
    """hold() while the store restarts: the block is left within the bound, with the
    lease kept (a store that keeps its data and came back in time) or LockLost. Both
    faces at once, across one restart."""
    await each_face_in_one_fault(fault_harness, "restart", _hold_across_a_restart)


async def _hold_across_a_restart(fault_api: Facade, restart_once: SharedRestart) -> None:
    locks = fault_api.lock(LockSpec("restart-hold", ttl=timedelta(seconds=2)))
    outcome: Any = None
    t_left = t_exit = 0.0
    try:
        async with locks.hold("h") as lease:
            await restart_once()
            await asyncio.sleep(0.5)
            t_left = time.monotonic()
    except Exception as exc:
        outcome = exc
    t_exit = time.monotonic()
    assert outcome is None or isinstance(outcome, LockLost | StoreUnavailable), outcome
    if t_left:
        assert t_exit - t_left <= BOUND, f"leaving the block took {t_exit - t_left:.2f}s"
    assert lease.token is not None
