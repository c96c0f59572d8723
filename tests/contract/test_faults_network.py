"""Fault contract: a silent network (or a stalled store), on every store, sync and async.

While the store is silent (``harness.stall()``: a blackholed proxy, SIGSTOPped
Cluster nodes, a foreign SQLite writer, the memory store's lock held), every call
must raise ``StoreUnavailable`` within the documented bound (the store option
``timeout``, agreement A1; asserted generously as ``BOUND``), and the same
coordinator must work again, correctly, once the store answers (no stale reply read
as the answer to a later request). ``hold()`` must mark its lease lost by the lease's
local deadline, whatever the renewal in progress is doing, and leaving the block must
return within the bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

import idemlock
import idemlock.aio
from idemlock import (
    Claimed,
    ClaimToken,
    Completed,
    IdempotencySpec,
    InFlight,
    Lease,
    LockLost,
    LockSpec,
    StaleClaim,
)

from ..servers.proxy import TcpProxy
from .facade import Facade, Proxy
from .fault_stores import (
    BOUND,
    HANG,
    TIMEOUT,
    SharedFault,
    assert_unavailable,
    each_face_in_one_fault,
    eventually,
    in_thread,
    timed,
)
from .harness import Harness

SPEC = IdempotencySpec("net", lease=timedelta(seconds=30))
LONG = LockSpec("net", ttl=timedelta(seconds=30))
#: the hold() lease: short, so that losing it takes seconds
HOLD_TTL = 1.0
HOLD = LockSpec("net-hold", ttl=timedelta(seconds=HOLD_TTL))
#: how late after its local deadline a lease may be reported lost
SLACK = 0.5
#: tries at entering a hold() before the store goes silent (its acquire may time out on
#: a loaded machine: the fault contract's store timeout is short)
STARTS = 5


# ---- the proxy itself --------------------------------------------------------------


class _Echo:
    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the proxy's cut resets it
            while data := conn.recv(65536):
                conn.sendall(data)

    def close(self) -> None:
        self.sock.close()


def test_proxy_blackholes_heals_and_cuts() -> None:
    echo = _Echo()
    threads_before = {t.ident for t in threading.enumerate()}
    try:
        with TcpProxy(echo.port) as proxy:
            c = socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
            c.sendall(b"ping")
            assert c.recv(16) == b"ping"
            proxy.blackhole()
            c.sendall(b"late")
            c.settimeout(0.3)
            with pytest.raises(socket.timeout):  # silent: no reply, no EOF, no reset
                c.recv(16)
            fresh = socket.create_connection(("127.0.0.1", proxy.port), timeout=0.3)
            fresh.sendall(b"new")
            with pytest.raises(socket.timeout):
                fresh.recv(16)
            proxy.heal()  # what was sent during the blackhole arrives now
            c.settimeout(2)
            fresh.settimeout(2)
            assert c.recv(16) == b"late"
            assert fresh.recv(16) == b"new"
            assert proxy.connections() == 2
            assert proxy.cut() == 2
            with pytest.raises(OSError):  # reset (or EOF turned into an error on send)
                if c.recv(16) == b"":
                    raise ConnectionResetError
            c.close()
            fresh.close()
    finally:
        echo.close()
    leaked = [
        t for t in threading.enumerate() if t.ident not in threads_before and "proxy" in t.name
    ]
    assert not leaked


# ---- one call while the store is silent -----------------------------------------------
#
# Each scenario below makes one call while the store is silent and then checks that the
# same coordinator recovers. Two or three scenarios run at once, both faces of each, in
# one stall (fault_stores.each_face_in_one_fault): the stall's real time (a store
# timeout, then the recovery) is spent once for them, and each still makes its call on
# a store silent from before the first call to after the last. Not more at once: every
# face reconnects when the store is back, and on a loaded machine eight PostgreSQL
# faces reconnecting together took longer than a recovery window of 8 s.


async def test_silent_claim_and_complete_are_bounded_and_the_coordinator_recovers(
    fault_harness: Harness,
) -> None:
    await each_face_in_one_fault(
        fault_harness,
        "stall",
        _silent_claim_is_bounded_and_the_coordinator_recovers,
        _silent_complete_is_bounded_and_the_result_is_not_lost,
    )


async def test_silent_abandon_step_and_a_first_call_are_bounded(
    fault_harness: Harness,
) -> None:
    await each_face_in_one_fault(
        fault_harness,
        "stall",
        _silent_abandon_is_bounded,
        _silent_step_is_bounded,
        _silent_store_on_the_first_call,
    )


async def test_silent_acquires_are_bounded(fault_harness: Harness) -> None:
    """acquire, a permit's acquire and a waited acquire."""
    await each_face_in_one_fault(
        fault_harness,
        "stall",
        _silent_acquire_is_bounded,
        _silent_permit_acquire_is_bounded,
        _silent_waited_acquire_is_bounded,
    )


async def test_silent_renew_and_release_are_bounded(fault_harness: Harness) -> None:
    await each_face_in_one_fault(
        fault_harness, "stall", _silent_renew_is_bounded, _silent_release_is_bounded
    )


async def _silent_claim_is_bounded_and_the_coordinator_recovers(
    fault_api: Facade, fault: SharedFault
) -> None:
    port = fault_api.idem(SPEC)
    assert isinstance(await port.claim("warm"), Claimed)  # connections exist now
    async with fault:
        out = await timed(fault_api, lambda: port.claim("k"))
    assert_unavailable(out, "claim")
    # The same coordinator works again, and each reply answers its own request: a
    # connection still carrying the late reply of the timed-out claim must not be used.
    # Waited for with a read, safe to retry: a claim retried after a slow reply (a
    # loaded machine) could meet its own first attempt and see InFlight.
    assert await eventually(fault_api, lambda: port.status("k2")) is None
    claim = await port.claim("k2", payload={"n": 2})
    assert isinstance(claim, Claimed)
    status = await port.status("k2")
    assert status is not None and status.state == "in_flight"
    await port.complete(claim.token, {"done": 2})
    again = await port.claim("k2", payload={"n": 2})
    assert isinstance(again, Completed) and again.result == {"done": 2}
    # The timed-out claim may or may not have been applied ("maybe applied"), but
    # the key is in a state the contract knows.
    assert isinstance(await port.claim("k"), Claimed | InFlight)


async def _silent_complete_is_bounded_and_the_result_is_not_lost(
    fault_api: Facade, fault: SharedFault
) -> None:
    port = fault_api.idem(SPEC)
    claim = await port.claim("k")
    assert isinstance(claim, Claimed)
    async with fault:
        out = await timed(fault_api, lambda: port.complete(claim.token, {"v": 1}))
    assert_unavailable(out, "complete")
    # Re-sending the completion is safe: it lands, or the first one had landed.
    await eventually(fault_api, lambda: port.complete(claim.token, {"v": 1}), accept=(StaleClaim,))
    replay = await port.claim("k")
    assert isinstance(replay, Completed) and replay.result == {"v": 1}, replay


async def _silent_abandon_is_bounded(fault_api: Facade, fault: SharedFault) -> None:
    port = fault_api.idem(SPEC)
    claim = await port.claim("k")
    assert isinstance(claim, Claimed)
    async with fault:
        out = await timed(fault_api, lambda: port.abandon(claim.token))
    assert_unavailable(out, "abandon")
    # StaleClaim: the first abandon had landed.
    await eventually(fault_api, lambda: port.abandon(claim.token), accept=(StaleClaim,))
    assert isinstance(await port.claim("k"), Claimed)


def attempt_of(api: Facade, spec: IdempotencySpec, key: str, token: ClaimToken) -> Proxy:
    """The attempt ``port.run(key)`` would give for ``token``, on the facade's face."""
    face = idemlock.Attempt if api.mode == "sync" else idemlock.aio.AsyncAttempt
    return Proxy(face(key, token, port=api.coord.idempotency(spec)), api.mode)


async def _silent_step_is_bounded(fault_api: Facade, fault: SharedFault) -> None:
    port = fault_api.idem(SPEC)
    claim = await port.claim("stepping")
    assert isinstance(claim, Claimed)
    attempt = attempt_of(fault_api, SPEC, "stepping", claim.token)
    async with fault:
        out = await timed(fault_api, lambda: attempt.step("s1", lambda: 1))
    assert_unavailable(out, "step")
    # Back: the same attempt records its next step (its claim is still its own).
    await eventually(fault_api, lambda: port.status("stepping"))
    assert await attempt.step("s2", lambda: 2) == 2
    status = await port.status("stepping")
    assert status is not None and "s2" in [s.name for s in status.steps]
    await port.complete(claim.token, "done")


async def _silent_acquire_is_bounded(fault_api: Facade, fault: SharedFault) -> None:
    locks = fault_api.lock(LONG)
    warm = await locks.acquire("warm")
    assert warm is not None
    async with fault:
        out = await timed(fault_api, lambda: locks.acquire("L", owner="me"))
    assert_unavailable(out, "acquire")
    # Maybe applied: the same owner gets the lock (or the same lease) again.
    lease = await eventually(fault_api, lambda: locks.acquire("L", owner="me"))
    assert isinstance(lease, Lease)
    assert await locks.release(lease) is True
    other = await locks.acquire("L", owner="other")
    assert isinstance(other, Lease)
    await locks.release(other)
    await locks.release(warm)


async def _silent_permit_acquire_is_bounded(fault_api: Facade, fault: SharedFault) -> None:
    sems = fault_api.semaphore(idemlock.SemaphoreSpec("net-sem", limit=2, ttl=30))
    other = await sems.acquire("S", owner="other")
    assert other is not None
    async with fault:
        out = await timed(fault_api, lambda: sems.acquire("S", owner="me"))
    assert_unavailable(out, "acquire")
    # Maybe applied: the same owner gets its permit (the same token) again, never a
    # second one, and the key still admits exactly two holders.
    permit = await eventually(fault_api, lambda: sems.acquire("S", owner="me"))
    assert isinstance(permit, Lease)
    assert await sems.acquire("S", owner="third") is None
    assert sorted(h.owner for h in await sems.holders("S")) == ["me", "other"]
    assert await sems.release(permit) is True
    assert await sems.release(other) is True


async def _silent_waited_acquire_is_bounded(fault_api: Facade, fault: SharedFault) -> None:
    locks = fault_api.lock(LONG)
    holder = await locks.acquire("L", owner="holder")
    assert holder is not None
    wait = 1.0
    async with fault:
        out = await timed(fault_api, lambda: locks.acquire("L", owner="waiter", wait=wait))
    # Nothing can be learned from a silent store: give up by the wait plus the bound.
    assert out.error is None or isinstance(out.error, idemlock.StoreUnavailable), out.describe()
    assert out.error is not None or out.value is None, out.describe()
    assert out.elapsed <= wait + BOUND, out.describe()
    assert await eventually(fault_api, lambda: locks.release(holder)) is True


async def _silent_renew_is_bounded(fault_api: Facade, fault: SharedFault) -> None:
    locks = fault_api.lock(LONG)
    lease = await locks.acquire("L")
    assert lease is not None
    async with fault:
        out = await timed(fault_api, lambda: locks.renew(lease))
    assert_unavailable(out, "renew")
    assert await eventually(fault_api, lambda: locks.renew(lease)) is True
    assert await locks.release(lease) is True


async def _silent_release_is_bounded(fault_api: Facade, fault: SharedFault) -> None:
    locks = fault_api.lock(LONG)
    lease = await locks.acquire("L")
    assert lease is not None
    async with fault:
        out = await timed(fault_api, lambda: locks.release(lease))
    assert_unavailable(out, "release")
    await eventually(fault_api, lambda: locks.release(lease))  # True, or False if it landed
    assert isinstance(await locks.acquire("L", owner="next"), Lease)


async def _silent_store_on_the_first_call(fault_api: Facade, fault: SharedFault) -> None:
    fresh = fault_api.other(timeout=TIMEOUT)
    try:
        port = fresh.idem(SPEC)
        async with fault:
            out = await timed(fresh, lambda: port.claim("first"))
        assert_unavailable(out, "the first claim of a new coordinator")
        # Waited for with a read (see the claim scenario), then a claim.
        assert await eventually(fresh, lambda: port.status("second")) is None
        assert isinstance(await port.claim("second"), Claimed)
    finally:
        await fresh.close()


# ---- hold() while the store goes silent ------------------------------------------------


async def test_silent_hold_loses_the_lease_by_its_deadline(fault_harness: Harness) -> None:
    """A sync and an async hold() at once (each on a key prefix of its own), in one
    stall that starts once both hold their lease (fault_stores.SharedFault): each lease
    is marked lost by its local deadline, and leaving each block meets the silent store
    and returns within the bound. The last renewal a holder can have had confirmed was
    sent before the stall began, so each local deadline is at most the stall's start
    plus the ttl."""
    stall = SharedFault(fault_harness, "stall")

    async def face(run: Any, mode: str) -> None:
        try:
            await run(dataclasses.replace(fault_harness, prefix=fault_harness.prefix + mode[0]))
        except BaseException as exc:
            stall.abort()
            exc.add_note(f"(on the {mode} face)")
            raise

    try:
        results = await asyncio.gather(
            in_thread(asyncio.run, face(lambda h: _silent_hold_sync(h, stall), "sync")),
            face(lambda h: _silent_hold_async(h, stall), "async"),
            return_exceptions=True,
        )
    finally:
        stall.abort()  # ends the stall if a face never left its block
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:  # the face that failed first, not the other's broken wait
        raise min(errors, key=lambda e: isinstance(e, threading.BrokenBarrierError))


async def _silent_hold_sync(harness: Harness, stall: SharedFault) -> None:
    # In a thread of its own: its blocking calls block no other face.
    coord = harness.sync(timeout=TIMEOUT)
    try:
        locks = coord.lock(HOLD)
        lost_at: list[float] = []
        for attempt in range(STARTS):
            cm = locks.hold("h", on_lost=lambda lease: lost_at.append(time.monotonic()))
            try:
                lease = cm.__enter__()
                break
            except idemlock.StoreUnavailable:
                # The store is not silent yet: a slow answer on a loaded machine (the
                # short timeout) is not the subject; the hold starts again.
                if attempt == STARTS - 1:
                    raise
                time.sleep(0.5)  # noqa: ASYNC251  (this face's own thread)
        exc: BaseException | None = None
        async with stall:
            t0 = stall.started_at
            seen_at = None
            while time.monotonic() < t0 + HOLD_TTL + SLACK + BOUND:
                if lease.lost:
                    seen_at = time.monotonic()
                    break
                time.sleep(0.01)  # noqa: ASYNC251
            left_at = time.monotonic()
            try:
                cm.__exit__(None, None, None)
            except BaseException as e:
                exc = e
            exited_at = time.monotonic()
        deadline = t0 + HOLD_TTL + SLACK
        assert seen_at is not None and seen_at <= deadline, (
            f"lease.lost turned True {_late(seen_at, t0)} after the stall began; "
            f"the lease ran out {HOLD_TTL}s after its last renewal"
        )
        assert lost_at and lost_at[0] <= deadline, f"on_lost ran {_late(lost_at, t0)}"
        assert isinstance(exc, LockLost), f"leaving the block raised {exc!r}, not LockLost"
        assert exited_at - left_at <= BOUND, (
            f"leaving the block took {exited_at - left_at:.2f}s on a silent store"
        )
    finally:
        coord.close()


async def _silent_hold_async(harness: Harness, stall: SharedFault) -> None:
    coord = harness.aio(timeout=TIMEOUT)
    times: dict[str, float] = {}
    entered: list[bool] = []

    async def holder() -> BaseException | None:
        locks = coord.lock(HOLD)
        # Silent from inside the block until after leaving it, so that the exit (the
        # renewer's stop, the release) meets the silent store too.
        try:
            async with locks.hold(
                "h", on_lost=lambda lease: times.setdefault("on_lost", time.monotonic())
            ):
                entered.append(True)
                try:
                    await stall.__aenter__()
                    await asyncio.sleep(HOLD_TTL + SLACK + BOUND)
                except asyncio.CancelledError:
                    times["cancelled"] = time.monotonic()
                    raise
                finally:
                    times["left"] = time.monotonic()
        except BaseException as exc:
            times["exited"] = time.monotonic()
            return exc
        finally:
            if entered:
                await stall.__aexit__()
        times["exited"] = time.monotonic()
        return None

    try:
        for attempt in range(STARTS):
            times.clear()
            exc = await asyncio.wait_for(holder(), HOLD_TTL + SLACK + BOUND * 3 + HANG * 2)
            if entered or not isinstance(exc, idemlock.StoreUnavailable) or attempt == STARTS - 1:
                break
            # The acquire failed before the store went silent: a slow answer on a loaded
            # machine (the short timeout) is not the subject; the hold starts again.
            await asyncio.sleep(0.5)
    finally:
        await coord.close()
    t0 = stall.started_at
    deadline = t0 + HOLD_TTL + SLACK
    assert "cancelled" in times, "the body was not cancelled when the lease was lost"
    assert times["cancelled"] <= deadline, (
        f"the body was cancelled {_late(times['cancelled'], t0)} after the stall began; "
        f"the lease ran out {HOLD_TTL}s after its last renewal"
    )
    assert times.get("on_lost", float("inf")) <= deadline, (
        f"on_lost ran {_late(times.get('on_lost'), t0)}"
    )
    assert isinstance(exc, LockLost), f"leaving the block raised {exc!r}, not LockLost"
    assert times["exited"] - times["left"] <= BOUND, (
        f"leaving the block took {times['exited'] - times['left']:.2f}s on a silent store"
    )


def _late(at: Any, t0: float) -> str:
    if isinstance(at, list):
        at = at[0] if at else None
    return "never" if at is None else f"{at - t0:.2f}s"
