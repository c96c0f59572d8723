"""Late completion (agreement A2): ``complete`` and ``abandon`` are accepted while the
record is still in flight with the caller's token, even after its lease ended, as
long as no other attempt took the key over. Refusing them would throw finished work
away and run it again. Lock renewal and claim extension after expiry stay refused."""

from __future__ import annotations

from datetime import timedelta

import pytest

from idemlock import Claimed, Completed, IdempotencySpec, InFlight, StaleClaim

from .facade import Facade, each_face
from .harness import Harness

LEASE = 0.3
SPEC = IdempotencySpec("late", ttl=timedelta(seconds=60), lease=timedelta(seconds=LEASE))


async def _complete_after_the_lease_ended_is_accepted(api: Facade) -> None:
    port = api.idem(SPEC)
    claim = await port.claim("k", payload={"n": 1})
    assert isinstance(claim, Claimed)
    api.harness.advance(LEASE + 0.2)
    await port.complete(claim.token, {"done": True})  # no StaleClaim: nobody took over
    replay = await port.claim("k", payload={"n": 1})
    assert isinstance(replay, Completed) and replay.result == {"done": True}
    status = await port.status("k")
    assert status is not None and status.state == "completed"
    assert status.fence == claim.token.fence
    # Completing it again is still refused: the record is completed now.
    with pytest.raises(StaleClaim):
        await port.complete(claim.token, {"done": False})


async def test_complete_after_the_lease_ended_is_accepted(harness: Harness) -> None:
    await each_face(harness, _complete_after_the_lease_ended_is_accepted)


async def _abandon_after_the_lease_ended_is_accepted(api: Facade) -> None:
    port = api.idem(SPEC)
    claim = await port.claim("k")
    assert isinstance(claim, Claimed)
    api.harness.advance(LEASE + 0.2)
    await port.abandon(claim.token)
    with pytest.raises(StaleClaim):
        await port.abandon(claim.token)
    again = await port.claim("k")
    assert isinstance(again, Claimed) and again.token.fence > claim.token.fence


async def test_abandon_after_the_lease_ended_is_accepted(harness: Harness) -> None:
    await each_face(harness, _abandon_after_the_lease_ended_is_accepted)


async def _late_complete_after_a_takeover_is_stale(api: Facade) -> None:
    port = api.idem(SPEC)
    first = await port.claim("k")
    assert isinstance(first, Claimed)
    api.harness.advance(LEASE + 0.2)
    second = await port.claim("k")
    assert isinstance(second, Claimed) and second.token.fence > first.token.fence
    with pytest.raises(StaleClaim):
        await port.complete(first.token, "late")
    with pytest.raises(StaleClaim):
        await port.abandon(first.token)
    assert isinstance(await port.claim("k"), InFlight)  # the new attempt is untouched
    await port.complete(second.token, "fresh")
    replay = await port.claim("k")
    assert isinstance(replay, Completed) and replay.result == "fresh"


async def test_late_complete_after_a_takeover_is_stale(harness: Harness) -> None:
    await each_face(harness, _late_complete_after_a_takeover_is_stale)


async def _extend_after_the_lease_ended_stays_refused(api: Facade) -> None:
    port = api.idem(SPEC)
    claim = await port.claim("k")
    assert isinstance(claim, Claimed)
    api.harness.advance(LEASE + 0.2)
    with pytest.raises(StaleClaim):
        await port.extend(claim.token)
    # ...but the finished work can still be recorded.
    await port.complete(claim.token, 7)
    replay = await port.claim("k")
    assert isinstance(replay, Completed) and replay.result == 7


async def test_extend_after_the_lease_ended_stays_refused(harness: Harness) -> None:
    await each_face(harness, _extend_after_the_lease_ended_stays_refused)


async def _decorated_call_that_outlives_its_lease_is_recorded(api: Facade) -> None:
    runs: list[int] = []

    def slow(n: int) -> int:
        runs.append(n)
        api.harness.advance(LEASE + 0.2)  # the work takes longer than the lease
        return n * 10

    wrapped = api.wrap(SPEC, slow, key=lambda n: f"job-{n}")
    assert await wrapped(4) == 40
    assert await wrapped(4) == 40  # replayed, not run again
    assert runs == [4]


async def test_decorated_call_that_outlives_its_lease_is_recorded(harness: Harness) -> None:
    await each_face(harness, _decorated_call_that_outlives_its_lease_is_recorded)
