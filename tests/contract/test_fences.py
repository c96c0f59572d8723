"""The fence gate contract: monotonic acceptance of fencing tokens."""

from __future__ import annotations

from datetime import timedelta

import pytest

from idemlock import Claimed, ConfigurationError, FencedOut, IdempotencySpec, LockSpec

from .facade import Facade, each_face
from .harness import Harness


async def test_check_and_advance(api: Facade) -> None:
    gate = api.fence("accounts/42")
    assert await gate.current() is None
    assert await gate.check_and_advance(5) == 5
    assert await gate.check_and_advance(5) == 5  # equal tokens pass: one holder, many writes
    assert await gate.check_and_advance(9) == 9
    with pytest.raises(FencedOut) as info:
        await gate.check_and_advance(7)
    assert info.value.token == 7 and info.value.current == 9
    assert await gate.current() == 9  # a refused token changes nothing


async def test_gates_are_per_resource(api: Facade) -> None:
    a, b = api.fence("a"), api.fence("b")
    await a.check_and_advance(100)
    assert await b.check_and_advance(1) == 1
    assert await a.current() == 100


async def test_bad_tokens(api: Facade) -> None:
    gate = api.fence("r")
    for bad in (-1, 1.5, "3", None, True):
        with pytest.raises(ConfigurationError):
            await gate.check_and_advance(bad)


async def _lock_tokens_fence_a_late_holder(api: Facade) -> None:
    locks = api.lock(LockSpec("writer", ttl=timedelta(seconds=0.3)))
    gate = api.fence("ledger")
    old = await locks.acquire("ledger")
    assert old is not None and old.token is not None
    api.harness.advance(0.45)  # the old holder pauses past its lease
    new = await locks.acquire("ledger")
    assert new is not None and new.token is not None
    await gate.check_and_advance(new.token)
    with pytest.raises(FencedOut):
        await gate.check_and_advance(old.token)


async def test_lock_tokens_fence_a_late_holder(harness: Harness) -> None:
    await each_face(harness, _lock_tokens_fence_a_late_holder)


async def _claim_fences_fence_a_late_attempt(api: Facade) -> None:
    port = api.idem(IdempotencySpec("job", lease=timedelta(seconds=0.3)))
    gate = api.fence("job-output")
    first = await port.claim("j1")
    assert isinstance(first, Claimed)
    api.harness.advance(0.45)
    second = await port.claim("j1")
    assert isinstance(second, Claimed)
    await gate.check_and_advance(second.fence)
    with pytest.raises(FencedOut):
        await gate.check_and_advance(first.fence)


async def test_claim_fences_fence_a_late_attempt(harness: Harness) -> None:
    await each_face(harness, _claim_fences_fence_a_late_attempt)
