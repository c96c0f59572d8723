"""Breaking a lock (``locks.break_lock(key)``, ``idemlock unlock KEY --force``): an
operator frees a lock another owner holds. State table row ``lock.break``: the lock is
free at once, the token counter stays (the next acquire gets a higher token, so the
old holder is fenced out wherever the new holder writes), and the old holder's renew
and release fail, so it learns it lost the lock."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest

from idemlock import Event, FencedOut, LockLost, LockSpec

from .facade import Facade, each_face
from .harness import Harness

LONG = LockSpec("brk", ttl=timedelta(seconds=30))
SHORT = LockSpec("brk-short", ttl=timedelta(seconds=0.4))


async def _break_frees_the_lock_and_fences_the_old_holder(api: Facade) -> None:
    locks = api.lock(LONG)
    old = await locks.acquire("k", owner="stuck-worker")
    assert old is not None and old.token is not None
    # The operator is another client: it holds nothing and names only the key.
    operator = api.other()
    try:
        assert await operator.lock(LONG).break_lock("k") is True
        assert not await locks.is_locked("k")
        assert await locks.owner("k") is None
        new = await operator.lock(LONG).acquire("k", owner="next-worker")
    finally:
        await operator.close()
    assert new is not None and new.token is not None
    assert new.token > old.token
    gate = api.fence("brk-resource")
    await gate.check_and_advance(new.token)
    with pytest.raises(FencedOut):
        await gate.check_and_advance(old.token)  # the old holder's late write
    # The old holder is told: its renew fails (the lease is marked lost) and its
    # release frees nothing, leaving the new holder alone.
    assert await locks.renew(old) is False
    assert old.lost is True
    assert await locks.release(old) is False
    assert await locks.owner("k") == "next-worker"
    assert await locks.release(new) is True


async def test_break_frees_the_lock_and_fences_the_old_holder(harness: Harness) -> None:
    await each_face(harness, _break_frees_the_lock_and_fences_the_old_holder)


async def test_break_of_a_free_lock_returns_false(api: Facade) -> None:
    locks = api.lock(LONG)
    assert await locks.break_lock("never-taken") is False
    lease = await locks.acquire("k")
    assert lease is not None
    assert await locks.release(lease) is True
    assert await locks.break_lock("k") is False
    # Breaking twice: the second finds it free.
    again = await locks.acquire("k")
    assert again is not None
    assert await locks.break_lock("k") is True
    assert await locks.break_lock("k") is False


async def _break_of_an_expired_lock_returns_false(api: Facade) -> None:
    locks = api.lock(SHORT)
    lease = await locks.acquire("k")
    assert lease is not None
    api.harness.advance(0.4 + 0.15)
    assert await locks.break_lock("k") is False


async def test_break_of_an_expired_lock_returns_false(harness: Harness) -> None:
    await each_face(harness, _break_of_an_expired_lock_returns_false)


async def test_break_leaves_other_keys_and_specs_alone(api: Facade) -> None:
    locks = api.lock(LONG)
    a = await locks.acquire("a")
    b = await locks.acquire("b")
    other_spec = await api.lock(LockSpec("brk-other", ttl=timedelta(seconds=30))).acquire("a")
    assert a is not None and b is not None and other_spec is not None
    assert await locks.break_lock("a") is True
    assert not await locks.is_locked("a")
    assert await locks.owner("b") == b.owner
    assert await api.lock(LockSpec("brk-other", ttl=timedelta(seconds=30))).owner("a") == (
        other_spec.owner
    )
    assert await locks.release(b) is True


async def _a_hold_block_of_the_old_holder_reports_the_loss(api: Facade) -> None:
    locks = api.lock(SHORT)
    body_finished = False
    with pytest.raises(LockLost):
        async with locks.hold("k", renew_every=0.05) as lease:
            assert await locks.break_lock("k") is True
            waited = time.monotonic() + 5
            while not lease.lost and time.monotonic() < waited:
                # The next renewal finds the lease gone; async bodies are cancelled.
                if api.mode == "sync":
                    time.sleep(0.02)  # noqa: ASYNC251 - a sync holder blocks its thread
                else:
                    await asyncio.sleep(0.02)
                if api.harness.clock is not None:
                    api.harness.clock.advance(0.02)
            body_finished = True
    assert lease.lost
    assert (api.mode == "sync") == body_finished


async def test_a_hold_block_of_the_old_holder_reports_the_loss(harness: Harness) -> None:
    await each_face(harness, _a_hold_block_of_the_old_holder_reports_the_loss)


async def test_break_emits_an_event(api: Facade) -> None:
    events: list[Event] = []
    api.coord.add_hook(events.append)
    locks = api.lock(LONG)
    lease = await locks.acquire("k")
    assert lease is not None
    assert await locks.break_lock("k") is True
    assert await locks.break_lock("k") is False
    breaks = [(e.name, e.outcome, e.kind, e.spec) for e in events if e.name == "break"]
    assert breaks == [("break", "broken", "lock", "brk"), ("break", "not_held", "lock", "brk")]


async def test_break_guarded_by_a_token_spares_a_new_holder(api: Facade) -> None:
    locks = api.lock(LONG)
    lease = await locks.acquire("k", owner="holder")
    assert lease is not None and lease.token is not None
    # A token the holder does not have: nothing is freed.
    assert await locks.break_lock("k", token=lease.token + 1) is False
    assert await locks.owner("k") == "holder"
    assert await locks.break_lock("k", token=lease.token) is True
    assert not await locks.is_locked("k")
    new = await locks.acquire("k", owner="newcomer")
    assert new is not None and new.token is not None and new.token > lease.token
    # The operator's guard named the old token: the newcomer is left alone.
    assert await locks.break_lock("k", token=lease.token) is False
    assert await locks.owner("k") == "newcomer"
    assert await locks.release(new) is True
