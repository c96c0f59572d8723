"""Fault contract: event loops one after the other, every store (agreement A7).

Two ``asyncio.run()`` calls in one process (two ``TestClient(app)`` blocks, a CLI
that runs a coroutine per command, a test suite with a loop per test): one
AsyncCoordinator used in both, and a fresh coordinator per loop. Each loop does the
whole round: claim, complete, replay, a waited claim (``port.wait``) and a waited
acquire that the other side's release wakes (so pub/sub listeners and pools made in
the first loop must not be reused, closed, in the second), release, close. The same
for a semaphore and an election (``permit_round``), and permits and a term granted in
one loop are released in the next.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

from idemlock import (
    Claimed,
    Completed,
    ElectionSpec,
    IdempotencySpec,
    LockSpec,
    ManualClock,
    SemaphoreSpec,
)

from .harness import Harness

SPEC = IdempotencySpec("loops", lease=timedelta(seconds=30))
LOCK = LockSpec("loops", ttl=timedelta(seconds=30))
SEM = SemaphoreSpec("loops-sem", limit=2, ttl=timedelta(seconds=30))
#: a short ttl: a permit held with it lives on its renewals
SEM_RENEWED = SemaphoreSpec("loops-sem-renewed", limit=2, ttl=timedelta(seconds=2))
ELECTION = ElectionSpec("loops-el", ttl=timedelta(seconds=30))
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


async def permit_round(coord: Any, tag: str, clock: ManualClock | None = None) -> None:
    """The round of a semaphore and an election: permits up to the limit, a waited
    acquire and a waited campaign woken by the other side's release, a hold and a
    campaign block renewed by the loop's renewer, an observer on the key."""
    sems, el = coord.semaphore(SEM), coord.election(ELECTION)
    first = await sems.acquire(f"{tag}-S", owner="first")
    second = await sems.acquire(f"{tag}-S", owner="second")
    assert first is not None and second is not None
    assert await sems.acquire(f"{tag}-S", owner="third") is None, "past the limit"
    released: dict[str, float] = {}

    async def release_first() -> None:
        await asyncio.sleep(0.2)
        released["at"] = time.monotonic()
        assert await sems.release(first) is True

    releaser = asyncio.create_task(release_first())
    third = await sems.acquire(f"{tag}-S", owner="third", wait=10)
    woke = time.monotonic()
    await releaser
    assert third is not None, "the waited permit acquire gave up"
    assert third.token > second.token
    assert woke - released["at"] <= WAKE, (
        f"the permit waiter woke {woke - released['at']:.2f}s after the release"
    )
    for permit in (second, third):
        assert await sems.release(permit) is True
    assert await sems.holders(f"{tag}-S") == []

    # A hold renewed by this loop's renewer (a short ttl: it lives on renewals).
    renewed = coord.semaphore(SEM_RENEWED)
    async with renewed.hold(f"{tag}-H", renew_every=0.2) as held:
        seen = {held.expires_at}
        deadline = time.monotonic() + 15
        while len(seen) < 3:
            assert time.monotonic() < deadline, "the permit was not renewed in this loop"
            if clock is not None:  # memory: its time moves when told
                clock.advance(0.05)
            await asyncio.sleep(0.05)
            seen.add(held.expires_at)
        assert not held.lost
    assert await renewed.holders(f"{tag}-H") == []

    # A campaign waiting for the leader's term to end, while an observer watches.
    seen_terms: list[Any] = []

    async def watch() -> None:
        async for leader in el.observe(f"{tag}-R", timeout=20):
            seen_terms.append(None if leader is None else leader.value)
            if leader is not None and leader.value == "second":
                return

    async def saw(value: str) -> None:
        # observe() re-reads at least once a second: a term is seen while it lasts.
        deadline = time.monotonic() + 15
        while value not in seen_terms:
            assert time.monotonic() < deadline, f"observe missed {value!r}: {seen_terms}"
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    async with el.campaign(f"{tag}-R", value="first", renew_every=0.2) as term:
        await saw("first")
        leader = await el.leader(f"{tag}-R")
        assert leader is not None and leader.term == term.number
        ended: dict[str, float] = {}

        async def campaign_second() -> tuple[int, float]:
            async with el.campaign(f"{tag}-R", value="second", wait=10) as later:
                elected_at = time.monotonic()
                await saw("second")
                return later.number, elected_at

        candidate = asyncio.create_task(campaign_second())
        await asyncio.sleep(0.2)
        assert not candidate.done(), "elected while the first term was held"
        ended["at"] = time.monotonic()
    number, elected_at = await asyncio.wait_for(candidate, 15)
    assert number > term.number
    assert elected_at - ended["at"] <= WAKE, (
        f"the candidate was elected {elected_at - ended['at']:.2f}s after the term ended"
    )
    await asyncio.wait_for(watcher, 25)
    assert seen_terms[-1] == "second" and "first" in seen_terms, seen_terms


async def take_permits(coord: Any, tag: str) -> list[Any]:
    """Permits and a term granted in one loop, left for the next to release."""
    sems, el = coord.semaphore(SEM), coord.election(ELECTION)
    permits = [await sems.acquire(f"{tag}-K", owner=f"o{i}") for i in range(2)]
    assert all(p is not None for p in permits)
    term = await el.acquire(f"{tag}-E", value="left-held")
    assert term is not None
    return [*permits, term]


async def release_permits(coord: Any, tag: str, held: list[Any]) -> None:
    """In another loop: the permits and the term granted before are released, and
    their places are taken again, waiters woken."""
    sems, el = coord.semaphore(SEM), coord.election(ELECTION)
    *permits, term = held
    assert await sems.available(f"{tag}-K") == 0
    leader = await el.leader(f"{tag}-E")
    assert leader is not None and (leader.term, leader.value) == (term.token, "left-held")

    async def release_later() -> None:
        await asyncio.sleep(0.2)
        assert await sems.release(permits[0]) is True
        assert await el.release(term) is True

    releaser = asyncio.create_task(release_later())
    waiter = await sems.acquire(f"{tag}-K", owner="waiter", wait=10)
    async with el.campaign(f"{tag}-E", value="next", wait=10) as next_term:
        assert next_term.number > term.token
    await releaser
    assert waiter is not None and waiter.token > max(p.token for p in permits)
    assert await sems.release(permits[1]) is True
    assert await sems.release(permits[0]) is False  # released once, in this loop
    assert await sems.release(waiter) is True
    assert await sems.holders(f"{tag}-K") == []
    assert await el.leader(f"{tag}-E") is None


def test_permits_and_elections_on_one_coordinator_two_event_loops(harness: Harness) -> None:
    coord = harness.aio()
    try:
        asyncio.run(permit_round(coord, "first", harness.clock))
        held = asyncio.run(take_permits(coord, "across"))
        asyncio.run(permit_round(coord, "second", harness.clock))
        asyncio.run(release_permits(coord, "across", held))
    finally:
        asyncio.run(coord.close())


def test_permits_of_a_coordinator_made_in_one_loop_used_in_the_next(harness: Harness) -> None:
    async def make() -> tuple[Any, list[Any]]:
        coord = harness.aio()
        await permit_round(coord, "made-here", harness.clock)
        return coord, await take_permits(coord, "across")

    coord, held = asyncio.run(make())
    try:

        async def there() -> None:
            await permit_round(coord, "used-there", harness.clock)
            await release_permits(coord, "across", held)

        asyncio.run(there())
    finally:
        asyncio.run(coord.close())
