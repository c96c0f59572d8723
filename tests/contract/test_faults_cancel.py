"""Fault contract: cancellation at each await point of each async method, every store.

Each scenario starts one call in a task, lets the event loop run 0, 1, 2, ...
iterations (then a few real-time delays), cancels the task, and checks:

* the cancellation propagated: a task cancelled before it finished ends cancelled
  (``CancelledError``), it does not return a value nor raise something else;
* nothing is left behind that the caller does not know of: a cancelled ``claim``
  leaves the key claimable by the next caller, a cancelled ``acquire`` leaves the
  lock free, a cancelled ``complete``/``abandon``/``release`` leaves the record or
  lock in a state the caller's token can still settle (a store may undo a cancelled
  call in the background: the checks wait up to ``BOUND`` for it).

The points go on until the call finishes before the cancel a few times in a row (then
every later point would too). A last test cancels while a store call is in progress
on a silent store.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

import idemlock
import idemlock.aio
from idemlock import (
    Claimed,
    Completed,
    IdempotencySpec,
    Lease,
    LockSpec,
    SemaphoreSpec,
    StaleClaim,
    _renewer,
)

from ..servers.faults import STALL_SAFETY
from .fault_stores import BOUND, TIMEOUT
from .harness import Harness

SPEC = IdempotencySpec("cancel", lease=timedelta(seconds=30))
LOCK = LockSpec("cancel", ttl=timedelta(seconds=30))
#: loop iterations tried before the real-time delays
ITERATIONS = 40
DELAYS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.03, 0.1)
#: the call finished before the cancel this many points in a row: later points would too
DONE_IN_A_ROW = 3


def points() -> Iterator[tuple[int, float]]:
    for n in range(ITERATIONS):
        yield n, 0.0
    for d in DELAYS:
        yield 0, d


async def settle(check: Callable[[], Awaitable[bool]], what: str, within: float = BOUND) -> None:
    """Wait until ``check()`` holds (a store may undo a cancelled call in the background)."""
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} (still not so {within:.1f}s after the cancel)")
        await asyncio.sleep(0.02)


async def run_points(
    label: str,
    setup: Callable[[str], Awaitable[Any]],
    call: Callable[[Any], Awaitable[Any]],
    check: Callable[[Any, bool, Any], Awaitable[None]],
    *,
    max_points: int | None = None,
    start: Callable[[Any], Awaitable[None]] | None = None,
) -> int:
    """For each point: ``state = await setup(key)``, run ``call(state)`` in a task,
    cancel it at the point, then ``await check(state, cancelled, result)``. Returns how
    many points cancelled the call before it finished."""
    in_a_row = 0
    cancelled_points = 0
    for i, (n, delay) in enumerate(points()):
        if max_points is not None and i >= max_points:
            break
        state = await setup(f"{label}-{i}")
        task = asyncio.ensure_future(call(state))
        if start is not None:
            # Count the points from a moment inside the call (e.g. its body's end).
            await asyncio.wait(
                {task, asyncio.ensure_future(start(state))},
                timeout=BOUND,
                return_when=asyncio.FIRST_COMPLETED,
            )
        for _ in range(n):
            await asyncio.sleep(0)
        if delay:
            await asyncio.sleep(delay)
        finished_first = task.done()
        task.cancel()
        try:
            result: Any = await asyncio.wait_for(asyncio.shield(task), BOUND)
        except asyncio.CancelledError:
            result = None
        except asyncio.TimeoutError:
            raise AssertionError(
                f"{label}: cancelled at point {i} (n={n}, delay={delay}), the call did not end "
                f"within {BOUND:.1f}s"
            ) from None
        except Exception as exc:
            result = exc
        if not finished_first:
            assert task.cancelled(), (
                f"{label}: cancelled at point {i} (n={n}, delay={delay}) before it finished, "
                f"the call ended with {result!r} instead of CancelledError"
            )
            cancelled_points += 1
            in_a_row = 0
        else:
            in_a_row += 1
        await check(state, not finished_first, result)
        if in_a_row >= DONE_IN_A_ROW:
            break
    return cancelled_points


async def quietly(call: Awaitable[Any]) -> None:
    """A background call whose outcome the check settles (StaleClaim included)."""
    with contextlib.suppress(StaleClaim):
        await call


async def claimable(port: Any, key: str) -> bool:
    reply = await port.claim(key)
    if isinstance(reply, Claimed):
        await port.abandon(reply.token)
        return True
    return False


async def lock_free(locks: Any, key: str) -> bool:
    lease = await locks.acquire(key, owner="checker")
    if lease is None:
        return False
    await locks.release(lease)
    return True


# ---- claims -----------------------------------------------------------------------


async def test_cancel_claim(harness: Harness) -> None:
    coord, checker = harness.aio(), harness.aio()
    try:
        port, other = coord.idempotency(SPEC), checker.idempotency(SPEC)

        async def setup(key: str) -> str:
            return key

        async def check(key: str, cancelled: bool, result: Any) -> None:
            if not cancelled:
                assert isinstance(result, Claimed), result
                await port.abandon(result.token)
            await settle(
                lambda: claimable(other, key),
                f"a cancelled claim of {key!r} left the key claimed by nobody the caller knows",
            )

        assert await run_points("claim", setup, lambda key: port.claim(key), check) > 0
    finally:
        await coord.close()
        await checker.close()


async def test_cancel_complete(harness: Harness) -> None:
    coord = harness.aio()
    try:
        port = coord.idempotency(SPEC)

        async def setup(key: str) -> Any:
            claim = await port.claim(key)
            assert isinstance(claim, Claimed)
            return claim

        async def check(claim: Any, cancelled: bool, result: Any) -> None:
            assert result is None or not isinstance(result, BaseException), result
            # The caller still holds its token: re-sending settles it (or it had landed).
            with contextlib.suppress(StaleClaim):
                await port.complete(claim.token, {"key": claim.token.key})
            replay = await port.claim(claim.token.key)
            assert isinstance(replay, Completed) and replay.result == {"key": claim.token.key}, (
                f"after a cancelled complete of {claim.token.key!r}: {replay!r}"
            )

        await run_points(
            "complete",
            setup,
            lambda claim: port.complete(claim.token, {"key": claim.token.key}),
            check,
        )
    finally:
        await coord.close()


async def test_cancel_abandon(harness: Harness) -> None:
    coord, checker = harness.aio(), harness.aio()
    try:
        port, other = coord.idempotency(SPEC), checker.idempotency(SPEC)

        async def setup(key: str) -> Any:
            claim = await port.claim(key)
            assert isinstance(claim, Claimed)
            return claim

        async def check(claim: Any, cancelled: bool, result: Any) -> None:
            await quietly(port.abandon(claim.token))  # StaleClaim: the cancelled one landed
            await settle(
                lambda: claimable(other, claim.token.key),
                f"after a cancelled abandon, {claim.token.key!r} is not claimable",
            )

        await run_points("abandon", setup, lambda claim: port.abandon(claim.token), check)
    finally:
        await coord.close()


async def test_cancel_wait(harness: Harness) -> None:
    """port.wait: cancelled while another attempt holds the key, and while that attempt
    lets go (the waiter may be claiming it right then)."""
    coord, holder_coord, checker = harness.aio(), harness.aio(), harness.aio()
    try:
        port = coord.idempotency(SPEC)
        holder, other = holder_coord.idempotency(SPEC), checker.idempotency(SPEC)
        for let_go in (False, True):

            async def setup(key: str) -> Any:
                claim = await holder.claim(key)
                assert isinstance(claim, Claimed)
                return claim

            async def call(claim: Any, let_go: bool = let_go) -> Any:
                if let_go:
                    # Free the key as the wait starts: the waiter claims it mid-flight.
                    asyncio.get_running_loop().create_task(quietly(holder.abandon(claim.token)))
                return await port.wait(claim.token.key, timeout=5)

            async def check(claim: Any, cancelled: bool, result: Any) -> None:
                key = claim.token.key
                if not cancelled and isinstance(result, Claimed):
                    await port.abandon(result.token)
                status = await holder.status(key)
                if status is not None and status.state == "in_flight":
                    # StaleClaim: let go already, and someone claimed it (settled below)
                    await quietly(holder.abandon(claim.token))
                await settle(
                    lambda: claimable(other, key),
                    f"a cancelled port.wait on {key!r} left a claim behind",
                )

            await run_points(f"wait-{let_go}", setup, call, check, max_points=ITERATIONS // 2)
    finally:
        for c in (coord, holder_coord, checker):
            await c.close()


async def test_cancel_decorator(harness: Harness) -> None:
    coord, checker = harness.aio(), harness.aio()
    try:
        other = checker.idempotency(SPEC)
        runs: dict[str, int] = {}

        body_done: dict[str, asyncio.Event] = {}

        @coord.idempotent(SPEC, key=lambda key: key)
        async def job(key: str) -> dict[str, str]:
            runs[key] = runs.get(key, 0) + 1
            await asyncio.sleep(0)
            body_done.setdefault(key, asyncio.Event()).set()
            return {"key": key}

        async def body_returned(key: str) -> None:
            await body_done.setdefault(key, asyncio.Event()).wait()

        async def setup(key: str) -> str:
            return key

        async def check(key: str, cancelled: bool, result: Any) -> None:
            if not cancelled:
                assert result == {"key": key}, result

            async def settled() -> bool:
                status = await other.status(key)
                # Free, or completed: the job ran to its end and its result was recorded.
                return status is None or status.state == "completed"

            await settle(settled, f"a cancelled idempotent call left {key!r} claimed")

        # Points counted from the call's start (claim, body), then from the body's
        # return (the result being recorded: the claim must not stay behind either).
        await run_points("decorator", setup, lambda key: job(key), check)
        await run_points(
            "decorator-recording", setup, lambda key: job(key), check, start=body_returned
        )
    finally:
        await coord.close()
        await checker.close()


# ---- locks ------------------------------------------------------------------------


async def test_cancel_acquire(harness: Harness) -> None:
    coord, checker = harness.aio(), harness.aio()
    try:
        locks, other = coord.lock(LOCK), checker.lock(LOCK)

        async def setup(key: str) -> str:
            return key

        async def check(key: str, cancelled: bool, result: Any) -> None:
            if not cancelled:
                assert isinstance(result, Lease), result
                await locks.release(result)
            await settle(
                lambda: lock_free(other, key),
                f"a cancelled acquire of {key!r} left the lock held by a lease nobody got",
            )

        assert await run_points("acquire", setup, lambda key: locks.acquire(key), check) > 0
    finally:
        await coord.close()
        await checker.close()


async def test_cancel_waited_acquire(harness: Harness) -> None:
    """acquire(wait=...): cancelled while the lock is held, and while the holder
    releases it (the waiter may be taking it right then)."""
    coord, holder_coord, checker = harness.aio(), harness.aio(), harness.aio()
    try:
        locks, holder, other = coord.lock(LOCK), holder_coord.lock(LOCK), checker.lock(LOCK)
        for let_go in (False, True):

            async def setup(key: str) -> Any:
                lease = await holder.acquire(key, owner="holder")
                assert lease is not None
                return lease

            async def call(lease: Any, let_go: bool = let_go) -> Any:
                if let_go:
                    asyncio.get_running_loop().create_task(quietly(holder.release(lease)))
                return await locks.acquire(lease.key, owner="waiter", wait=5)

            async def check(lease: Any, cancelled: bool, result: Any) -> None:
                if not cancelled and isinstance(result, Lease):
                    await locks.release(result)
                await holder.release(lease)  # False if it was let go already
                await settle(
                    lambda: lock_free(other, lease.key),
                    f"a cancelled waited acquire of {lease.key!r} left the lock held",
                )

            await run_points(
                f"acquire-wait-{let_go}", setup, call, check, max_points=ITERATIONS // 2
            )
    finally:
        for c in (coord, holder_coord, checker):
            await c.close()


async def test_cancel_permit_acquires(harness: Harness) -> None:
    """A semaphore's acquire, at once and waited with every permit held: a cancelled
    one never leaves a permit or a queue place behind."""
    coord, holder_coord, checker = harness.aio(), harness.aio(), harness.aio()
    spec = SemaphoreSpec("cancel-sem", limit=2, ttl=30)
    try:
        sems = coord.semaphore(spec)
        holder, other = holder_coord.semaphore(spec), checker.semaphore(spec)

        async def all_free(key: str) -> bool:
            return await other.available(key) == 2

        async def setup(key: str) -> str:
            return key

        async def check(key: str, cancelled: bool, result: Any) -> None:
            if not cancelled:
                assert isinstance(result, Lease), result
                await sems.release(result)
            await settle(lambda: all_free(key), f"a cancelled acquire of {key!r} left a permit")

        assert await run_points("permit", setup, lambda key: sems.acquire(key), check) > 0

        async def fill(key: str) -> Any:
            held = [await holder.acquire(key, owner=f"h{i}") for i in range(2)]
            assert all(isinstance(h, Lease) for h in held)
            asyncio.get_running_loop().create_task(quietly(holder.release(held[0])))
            return held

        async def waited(held: Any) -> Any:
            return await sems.acquire(held[0].key, owner="waiter", wait=5)

        async def check_waited(held: Any, cancelled: bool, result: Any) -> None:
            if not cancelled and isinstance(result, Lease):
                await sems.release(result)
            for h in held:
                await holder.release(h)
            await settle(
                lambda: all_free(held[0].key), "a cancelled waited acquire left a permit held"
            )

        await run_points("permit-wait", fill, waited, check_waited, max_points=ITERATIONS // 2)
    finally:
        for c in (coord, holder_coord, checker):
            await c.close()


async def test_cancel_release(harness: Harness) -> None:
    coord, checker = harness.aio(), harness.aio()
    try:
        locks, other = coord.lock(LOCK), checker.lock(LOCK)

        async def setup(key: str) -> Any:
            lease = await locks.acquire(key)
            assert lease is not None
            return lease

        async def check(lease: Any, cancelled: bool, result: Any) -> None:
            await locks.release(lease)  # True if the cancelled one had not landed
            await settle(
                lambda: lock_free(other, lease.key),
                f"after a cancelled release, {lease.key!r} is still held",
            )

        await run_points("release", setup, lambda lease: locks.release(lease), check)
    finally:
        await coord.close()
        await checker.close()


async def test_cancel_renew(harness: Harness) -> None:
    coord, checker = harness.aio(), harness.aio()
    try:
        locks, other = coord.lock(LOCK), checker.lock(LOCK)

        async def setup(key: str) -> Any:
            lease = await locks.acquire(key)
            assert lease is not None
            return lease

        async def check(lease: Any, cancelled: bool, result: Any) -> None:
            # Renewed or not, the caller's lease still holds the lock and frees it.
            assert await locks.owner(lease.key) == lease.owner
            assert await locks.release(lease) is True
            await settle(lambda: lock_free(other, lease.key), "the lock stayed held")

        await run_points("renew", setup, lambda lease: locks.renew(lease), check)
    finally:
        await coord.close()
        await checker.close()


async def test_cancel_hold(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """hold(): cancelled while entering (acquiring), in the body, and while leaving
    (stopping the renewer, releasing). The CancelledError reaches the caller, the lock
    ends up free (or held by the lease the caller got, which it can still free), and
    no renewal task is left running."""
    # The coordinator's renewal task ends once it has nothing live to renew, after
    # lingering LINGER (1 s) in case more comes: each point's check waited that out.
    # The condition it ends on is unchanged (no live renewal); it is only checked at once.
    monkeypatch.setattr(_renewer, "LINGER", 0.0)
    coord, checker = harness.aio(), harness.aio()
    try:
        locks, other = coord.lock(LOCK), checker.lock(LOCK)
        got: dict[str, Lease] = {}

        async def setup(key: str) -> str:
            return key

        async def call(key: str) -> str:
            async with locks.hold(key, renew_every=0.05) as lease:
                got[key] = lease
                await asyncio.sleep(0)
            return "left"

        async def check(key: str, cancelled: bool, result: Any) -> None:
            if not cancelled:
                assert result == "left", result

            async def free_or_ours() -> bool:
                owner = await other.owner(key)
                if owner is None:
                    return True
                lease = got.get(key)
                if lease is not None and owner == lease.owner:
                    # The caller got this lease: it can take it back (same owner, same
                    # token; or a new token if it was freed meanwhile) and free it.
                    again = await locks.acquire(key, owner=lease.owner)
                    if again is not None:
                        await locks.release(again)
                return False

            await settle(free_or_ours, f"a cancelled hold() left {key!r} held")
            await settle(
                lambda: _no_renewers(),
                "a cancelled hold() left its renewal task running",
            )

        await run_points("hold", setup, call, check)
    finally:
        await coord.close()
        await checker.close()


async def _no_renewers() -> bool:
    current = asyncio.current_task()
    return not [
        t
        for t in asyncio.all_tasks()
        if t is not current and not t.done() and "renew" in t.get_name()
    ]


# ---- a store call in progress on a silent store -------------------------------------


async def test_cancel_while_the_store_call_is_in_progress(fault_harness: Harness) -> None:
    """claim and acquire cancelled while their store call waits on a silent store. The
    request never reaches the store (the proxy drops it: its connections are cut before
    the store answers again), except where the stall only pauses the store: SQLite's
    call waits on the file lock in a worker thread and goes on when it is released,
    and a SIGSTOPped Cluster node reads the request when it resumes. Either way nothing
    may be left that the caller does not know of."""
    coord = fault_harness.aio(timeout=TIMEOUT)
    checker = fault_harness.aio(timeout=TIMEOUT)
    try:
        port, other = coord.idempotency(SPEC), checker.idempotency(SPEC)
        locks, other_locks = coord.lock(LOCK), checker.lock(LOCK)
        assert isinstance(await port.claim("warm"), Claimed)
        assert await other.status("warm") is not None
        for what, call, free in (
            ("claim", lambda: port.claim("in-progress"), lambda: claimable(other, "in-progress")),
            (
                "acquire",
                lambda: locks.acquire("in-progress"),
                lambda: lock_free(other_locks, "in-progress"),
            ),
        ):
            with fault_harness.stall():
                task = asyncio.ensure_future(call())
                await asyncio.sleep(0.3)  # the call is on the wire (or in its thread) now
                finished_first = task.done()
                task.cancel()
                t0 = time.monotonic()
                try:
                    result: Any = await asyncio.wait_for(asyncio.shield(task), BOUND + 1)
                except asyncio.CancelledError:
                    result = None
                except asyncio.TimeoutError:
                    raise AssertionError(
                        f"a {what} cancelled on a silent store did not end within {BOUND + 1:.0f}s"
                    ) from None
                except Exception as exc:
                    result = exc
                ended = time.monotonic() - t0
                proxy = getattr(fault_harness.faults, "proxy", None)
                if proxy is not None:
                    proxy.cut()
            if finished_first:
                # The call blocked the event loop (an inline store) and ended before the
                # cancel: on a silent store it can only have failed, within the bound.
                assert isinstance(result, idemlock.StoreUnavailable), (
                    f"a {what} on a silent store blocked the event loop and then ended with "
                    f"{result!r} (the stall ended by itself after {STALL_SAFETY:.0f}s), "
                    "instead of raising StoreUnavailable within the bound"
                )
            else:
                assert task.cancelled(), (
                    f"a {what} cancelled on a silent store ended with {result!r}, "
                    "not CancelledError"
                )
                assert ended <= BOUND, f"the cancelled {what} took {ended:.2f}s to end"
            await settle(
                free,
                f"a {what} cancelled while its store call was in progress left a claim or "
                "lease behind that nobody holds",
                within=BOUND * 2,
            )
    finally:
        await coord.close()
        await checker.close()


async def test_a_cancel_as_a_wait_ends_is_never_swallowed(harness: Harness) -> None:
    """A waiter cancelled as its wait for a wake-up ends (its timeout, or a wake-up
    arriving) ends cancelled: on Python 3.11 ``asyncio.wait_for`` can turn such a
    cancellation into its own timeout, and a waiter that took that for "no wake-up yet"
    waited on to its deadline. The cancel lands at the moment the wait's timeout fires,
    many times over, on each store's subscription."""
    coord = harness.aio()
    try:
        ns = coord.lock(LockSpec("cancel-wait"))._ns
        sub = await coord.store.subscribe(idemlock._core.port.Channel("lock", ns, "k"))
        loop = asyncio.get_running_loop()
        try:
            for i in range(300):
                delay = 0.001 * (i % 5)
                task = asyncio.ensure_future(sub.wait(delay))
                sent = loop.create_future()
                loop.call_later(delay, lambda t=task, f=sent: f.set_result(t.cancel()))
                try:
                    await task
                except asyncio.CancelledError:
                    continue
                # The task ended first (its timeout): the cancel, sent later, found it done.
                assert await sent is False, f"try {i}: the cancellation was swallowed"
        finally:
            await sub.aclose()
    finally:
        await coord.close()
