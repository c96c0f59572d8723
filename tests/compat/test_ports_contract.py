"""idemlock.compat.ports passes the lock and idempotency checks of the contract suite
through the framework contract's own names, on every store, sync and async."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

import idemlock
from idemlock import ConfigurationError, LockLost, LockNotAcquired, PayloadMismatch, StaleClaim
from idemlock.compat import ports
from idemlock.compat.ports import (
    AcquiredLock,
    Claimed,
    Completed,
    DistributedLockSpec,
    IdempotencySpec,
    InFlight,
)
from idemlock.stores.memory import MemoryStore
from tests.compat.conftest import each_backend
from tests.contract.harness import Harness

LOCK = DistributedLockSpec("jobs", ttl=timedelta(seconds=30))
SHORT = DistributedLockSpec("short", ttl=timedelta(seconds=0.4))
IDEM = IdempotencySpec("orders", ttl=timedelta(hours=1), lease=timedelta(seconds=30))
BRIEF = IdempotencySpec("brief", ttl=timedelta(hours=1), lease=timedelta(seconds=0.4))


async def _(value: Any) -> Any:
    """Await what an async port returned; a sync port's value as is."""
    return await value if inspect.isawaitable(value) else value


def test_spec_defaults_are_the_contracts() -> None:
    assert IdempotencySpec("x").ttl == timedelta(hours=24)
    assert IdempotencySpec("x").encrypt_result is False
    assert DistributedLockSpec("x").ttl == timedelta(seconds=30)
    assert DistributedLockSpec("x").requires_fencing_token is False


async def test_begin_commit_replay(backend: Any) -> None:
    idem = backend.idempotency
    first = await _(idem.begin(IDEM, "o-1", {"amount": 5}))
    assert isinstance(first, Claimed)
    assert isinstance(await _(idem.begin(IDEM, "o-1", {"amount": 5})), InFlight)
    with pytest.raises(PayloadMismatch):
        await _(idem.begin(IDEM, "o-1", {"amount": 6}))
    await _(idem.commit(first, {"charged": 5}))
    again = await _(idem.begin(IDEM, "o-1", {"amount": 5}))
    assert isinstance(again, Completed) and again.result == {"charged": 5}
    with pytest.raises(StaleClaim):  # committing twice: the claim is finished
        await _(idem.commit(first, {"charged": 6}))


async def test_commit_keeps_the_specs_ttl(harness: Harness) -> None:
    await each_backend(harness, _commit_keeps_the_specs_ttl)


async def _commit_keeps_the_specs_ttl(backend: Any, harness: Harness) -> None:
    # A token carries only the spec's name: commit must still use the begun spec's ttl.
    spec = IdempotencySpec("kept", ttl=timedelta(seconds=0.5), lease=timedelta(seconds=30))
    idem = backend.idempotency
    claim = await _(idem.begin(spec, "k"))
    assert isinstance(claim, Claimed)
    await _(idem.commit(claim, "once"))
    assert isinstance(await _(idem.begin(spec, "k")), Completed)
    harness.advance(0.8)  # past the spec's ttl (the default would be 24 h)
    assert isinstance(await _(idem.begin(spec, "k")), Claimed)


async def test_fail_lets_a_retry_run(backend: Any) -> None:
    idem = backend.idempotency
    first = await _(idem.begin(IDEM, "o-2"))
    assert isinstance(first, Claimed)
    await _(idem.fail(first))
    retry = await _(idem.begin(IDEM, "o-2"))
    assert isinstance(retry, Claimed) and retry.fence > first.fence
    await _(idem.commit(retry.token, "done"))  # a bare ClaimToken works too


async def test_takeover_after_lease_and_late_commit(harness: Harness) -> None:
    await each_backend(harness, _takeover_after_lease_and_late_commit)


async def _takeover_after_lease_and_late_commit(backend: Any, harness: Harness) -> None:
    idem = backend.idempotency
    # Nobody took over: a commit after the lease ended is still recorded.
    late = await _(idem.begin(BRIEF, "late"))
    assert isinstance(late, Claimed)
    harness.advance(0.6)
    await _(idem.commit(late, 1))
    done = await _(idem.begin(BRIEF, "late"))
    assert isinstance(done, Completed) and done.result == 1
    # Taken over after the lease ended: the old attempt's commit is refused.
    old = await _(idem.begin(BRIEF, "taken"))
    assert isinstance(old, Claimed)
    assert isinstance(await _(idem.begin(BRIEF, "taken")), InFlight)  # not before
    harness.advance(0.6)
    new = await _(idem.begin(BRIEF, "taken"))
    assert isinstance(new, Claimed) and new.fence > old.fence
    with pytest.raises(StaleClaim):
        await _(idem.commit(old, "stale"))
    await _(idem.commit(new, "fresh"))


async def test_lock_commands_and_queries(backend: Any) -> None:
    cmd, query = backend.commands(LOCK), backend.queries(LOCK)
    got = await _(cmd.acquire("r", "alice"))
    assert isinstance(got, AcquiredLock) and got.owner == "alice"
    assert isinstance(got.token, int) and got.token > 0
    assert await _(cmd.acquire("r", "bob")) is None
    again = await _(cmd.acquire("r", "alice"))  # same owner: same lease
    assert again is not None and again.token == got.token
    assert await _(query.is_locked("r")) is True
    assert await _(query.get_owner("r")) == "alice"
    ttl = await _(query.get_ttl("r"))
    assert ttl is not None and timedelta(seconds=25) < ttl <= timedelta(seconds=30)
    assert await _(cmd.reset("r", "bob")) is False
    assert await _(cmd.release("r", "bob")) is False
    assert await _(query.get_owner("r")) == "alice"  # bob changed nothing
    assert await _(cmd.reset("r", "alice")) is True
    after = await _(cmd.acquire("r", "alice"))
    assert after is not None and after.token == got.token  # reset keeps the token
    assert await _(cmd.release("r", "alice")) is True
    assert await _(cmd.release("r", "alice")) is False
    assert await _(query.is_locked("r")) is False
    assert await _(query.get_owner("r")) is None
    assert await _(query.get_ttl("r")) is None
    nxt = await _(cmd.acquire("r", "bob"))
    assert nxt is not None and nxt.token is not None and nxt.token > got.token
    assert await _(cmd.release("r", "bob")) is True


async def test_reset_renews_and_expiry_is_not_revived(harness: Harness) -> None:
    await each_backend(harness, _reset_renews_and_expiry_is_not_revived)


async def _reset_renews_and_expiry_is_not_revived(backend: Any, harness: Harness) -> None:
    cmd, query = backend.commands(SHORT), backend.queries(SHORT)
    got = await _(cmd.acquire("k", "w1"))
    assert got is not None
    for _i in range(3):  # renewed before each expiry, it stays held
        harness.advance(0.25)
        assert await _(cmd.reset("k", "w1")) is True
    assert await _(query.get_owner("k")) == "w1"
    harness.advance(0.6)
    assert await _(query.is_locked("k")) is False
    assert await _(cmd.reset("k", "w1")) is False
    assert await _(cmd.release("k", "w1")) is False
    other = await _(cmd.acquire("k", "w2"))
    assert other is not None and other.token is not None and other.token > (got.token or 0)


async def test_scope_renews_a_long_section(harness: Harness) -> None:
    await each_backend(harness, _scope_renews_a_long_section)


async def _scope_renews_a_long_section(backend: Any, harness: Harness) -> None:
    # Renewed every 0.1 s: a ttl that a busy machine's stalls do not outlast.
    spec = DistributedLockSpec("scoped", ttl=timedelta(seconds=1.2))
    cmd, query = backend.commands(spec), backend.queries(spec)
    scope = backend.scope(spec, "s", "me", extend_interval=timedelta(seconds=0.1))
    if isinstance(backend, ports.AsyncBackend):
        async with scope as lease:
            await asyncio.sleep(2.5)  # twice the ttl
            assert await cmd.acquire("s", "rival") is None
            assert await query.get_owner("s") == "me" and not lease.lost
    else:
        with scope as lease:
            time.sleep(2.5)  # noqa: ASYNC251  (sync mode: a blocking body is the point)
            assert cmd.acquire("s", "rival") is None
            assert query.get_owner("s") == "me" and not lease.lost
    assert await _(query.is_locked("s")) is False


async def test_scope_raises_when_held(backend: Any) -> None:
    cmd = backend.commands(LOCK)
    assert await _(cmd.acquire("busy", "holder")) is not None
    scope = backend.scope(LOCK, "busy", "me", wait=timedelta(seconds=0.1))
    with pytest.raises(LockNotAcquired):
        if isinstance(backend, ports.AsyncBackend):
            async with scope:
                pass
        else:
            with scope:
                pass


async def test_scope_waits_for_the_release(harness: Harness) -> None:
    await each_backend(harness, _scope_waits_for_the_release)


async def _scope_waits_for_the_release(backend: Any, harness: Harness) -> None:
    cmd = backend.commands(LOCK)
    assert await _(cmd.acquire("handoff", "first")) is not None
    scope = backend.scope(LOCK, "handoff", "second", wait=timedelta(seconds=10))
    if isinstance(backend, ports.AsyncBackend):

        async def release_soon() -> None:
            await asyncio.sleep(0.3)
            assert await cmd.release("handoff", "first")

        task = asyncio.create_task(release_soon())
        async with scope as lease:
            assert lease.owner == "second"
        await task
    else:
        timer = threading.Timer(0.3, lambda: cmd.release("handoff", "first"))
        timer.start()
        try:
            with scope as lease:
                assert lease.owner == "second"
        finally:
            timer.join(timeout=60)
            assert not timer.is_alive(), "still running after 60 s"
    assert await _(cmd.acquire("handoff", "third")) is not None


async def test_scope_reports_a_lost_lease(harness: Harness) -> None:
    await each_backend(harness, _scope_reports_a_lost_lease)


async def _scope_reports_a_lost_lease(backend: Any, harness: Harness) -> None:
    spec = DistributedLockSpec("lost", ttl=timedelta(seconds=0.5))
    cmd = backend.commands(spec)
    scope = backend.scope(spec, "l", "me", extend_interval=timedelta(seconds=0.1))
    with pytest.raises((LockLost, asyncio.CancelledError)):
        if isinstance(backend, ports.AsyncBackend):
            async with scope as lease:
                await cmd.release("l", "me")  # taken away behind the scope's back
                for _ in range(10):
                    _let_time_pass(harness)
                    await asyncio.sleep(0.1)
        else:
            with scope as lease:
                cmd.release("l", "me")
                for _ in range(10):
                    _let_time_pass(harness)
                    time.sleep(0.1)  # noqa: ASYNC251  (sync mode: a blocking body)
    assert lease.lost


def _let_time_pass(harness: Harness) -> None:
    # A store on a manual clock sees time pass only when the test moves it: renewals
    # fall due and the lease's deadline comes on that clock.
    if harness.clock is not None:
        harness.clock.advance(0.1)


def test_requires_fencing_token_wires_on_every_store() -> None:
    # Every store idemlock ships issues fencing tokens: the requirement always holds.
    coord = idemlock.Coordinator(MemoryStore())
    spec = DistributedLockSpec("fenced", requires_fencing_token=True)
    cmd = ports.DistributedLockCommandPort(coord, spec)
    ports.DistributedLockQueryPort(coord, spec)
    with ports.DistributedLockScope(spec, "k2", "o", coordinator=coord) as lease:
        assert isinstance(lease.token, int)
    got = cmd.acquire("k", "o")
    assert got is not None and isinstance(got.token, int) and got.token > 0


def test_wrong_coordinator_kind_is_refused() -> None:
    coord = idemlock.connect("memory://")
    with pytest.raises(ConfigurationError, match="Async"):
        ports.AsyncIdempotencyPort(coord)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        ports.AsyncDistributedLockCommandPort(coord, LOCK)  # type: ignore[arg-type]
    coord.close()


def test_mock_backend() -> None:
    clock = idemlock.ManualClock()
    mock = ports.mock_backend(clock=clock)
    cmd = mock.commands(SHORT)
    assert cmd.acquire("m", "a") is not None
    clock.advance(1.0)  # the mock's time moves by hand
    assert cmd.acquire("m", "b") is not None
    claim = mock.idempotency.begin(IDEM, "m")
    assert isinstance(claim, Claimed)
    mock.idempotency.commit(claim, [1, 2])
    replay = mock.idempotency.begin(IDEM, "m")
    assert isinstance(replay, Completed) and replay.result == [1, 2]
    mock.close()


async def test_async_mock_backend() -> None:
    mock = ports.async_mock_backend()
    cmd = mock.commands(LOCK)
    assert await cmd.acquire("m", "a") is not None
    assert await cmd.acquire("m", "b") is None
    assert await cmd.release("m", "a") is True
    claim = await mock.idempotency.begin(IDEM, "m")
    assert isinstance(claim, Claimed)
    await mock.idempotency.fail(claim)
    assert isinstance(await mock.idempotency.begin(IDEM, "m"), Claimed)
    await mock.close()
