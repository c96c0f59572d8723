"""Fault contract: event loops one after the other, every store (agreement A7).

Two ``asyncio.run()`` calls in one process (two ``TestClient(app)`` blocks, a CLI
that runs a coroutine per command, a test suite with a loop per test): one
AsyncCoordinator used in both, and a fresh coordinator per loop. Each loop does the
whole round: claim, complete, replay, a waited claim (``port.wait``) and a waited
acquire that the other side's release wakes (so pub/sub listeners and pools made in
the first loop must not be reused, closed, in the second), release, close.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

from idemlock import Claimed, Completed, IdempotencySpec, LockSpec

from .harness import Harness

SPEC = IdempotencySpec("loops", lease=timedelta(seconds=30))
LOCK = LockSpec("loops", ttl=timedelta(seconds=30))
#: a waiter must wake this soon after the release
WAKE = 1.0


async def one_round(coord: Any, tag: str) -> None:
    port, locks = coord.idempotency(SPEC), coord.lock(LOCK)
    claim = await port.claim(f"{tag}-k")
    assert isinstance(claim, Claimed), claim
    await port.complete(claim.token, {"tag": tag})
    replay = await port.claim(f"{tag}-k")
    assert isinstance(replay, Completed) and replay.result == {"tag": tag}

    # A waited claim, woken by the completion of the attempt that holds the key.
    holder = await port.claim(f"{tag}-w")
    assert isinstance(holder, Claimed)

    async def finish() -> None:
        await asyncio.sleep(0.2)
        await port.complete(holder.token, "done")

    finisher = asyncio.create_task(finish())
    waited = await port.wait(f"{tag}-w", timeout=10)
    await finisher
    assert isinstance(waited, Completed) and waited.result == "done", waited

    # A waited acquire, woken by the holder's release.
    lease = await locks.acquire(f"{tag}-L", owner="holder")
    assert lease is not None
    released: dict[str, float] = {}

    async def release() -> None:
        await asyncio.sleep(0.2)
        released["at"] = time.monotonic()
        assert await locks.release(lease) is True

    releaser = asyncio.create_task(release())
    got = await locks.acquire(f"{tag}-L", owner="waiter", wait=10)
    woke = time.monotonic()
    await releaser
    assert got is not None, "the waited acquire gave up"
    assert woke - released["at"] <= WAKE, (
        f"the waiter woke {woke - released['at']:.2f}s after the release"
    )
    async with locks.hold(f"{tag}-H") as held:
        assert held.token is not None
    assert await locks.release(got) is True


def test_one_coordinator_two_event_loops(harness: Harness) -> None:
    coord = harness.aio()
    try:
        asyncio.run(one_round(coord, "first"))
        asyncio.run(one_round(coord, "second"))
    finally:
        asyncio.run(coord.close())


def test_coordinator_made_in_one_loop_used_in_the_next(harness: Harness) -> None:
    async def make() -> Any:
        coord = harness.aio()
        await one_round(coord, "made-here")
        return coord

    coord = asyncio.run(make())
    try:
        asyncio.run(one_round(coord, "used-there"))
    finally:
        asyncio.run(coord.close())


def test_a_fresh_coordinator_per_loop(harness: Harness) -> None:
    for i in range(2):

        async def main(i: int = i) -> None:
            coord = harness.aio()
            try:
                await one_round(coord, f"fresh-{i}")
            finally:
                await coord.close()

        asyncio.run(main())
