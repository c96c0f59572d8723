"""Leases on the failure paths: releasing twice, a lost lease in ``hold()``, leaving a
block while the store hangs, cancellation on the way out, an ``on_lost`` that raises."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import idemlock
import idemlock.aio
from idemlock import Lease, LockLost, LockSpec

from ..servers._proc import waitpid
from .facade import Facade, LockProxy
from .harness import Harness

LONG = LockSpec("long", ttl=timedelta(seconds=30))


async def test_second_release_returns_false(api: Facade) -> None:
    locks = api.lock(LONG)
    lease = await locks.acquire("k")
    assert lease is not None
    assert await locks.release(lease) is True
    # "release if owned; returns whether it was": a second release in a finally block
    # must never raise over the body's own error.
    assert await locks.release(lease) is False
    assert not await locks.is_locked("k")


async def test_second_release_leaves_a_new_holder_alone(api: Facade) -> None:
    locks = api.lock(LONG)
    first = await locks.acquire("k", owner="me")
    assert first is not None
    assert await locks.release(first) is True
    again = await locks.acquire("k", owner="me")
    assert again is not None
    assert await locks.release(first) is False
    assert await locks.owner("k") == "me"
    assert await locks.release(again) is True


# ---- a store that stops answering -------------------------------------------------
#
# A renewal that hangs (a silent network) must not decide anything: the lease is lost
# when its local deadline passes, and leaving the block waits at most the store's
# bound. The stalls here are real: the memory store's internal lock held by another
# thread (every call waits on it), or another SQLite connection holding BEGIN IMMEDIATE
# (every write waits the busy timeout). The fault contract covers the network stores.

STALL_LIMIT = 20.0  # a stall never outlives this, so a broken exit cannot hang the run


class Stall:
    """Makes the store's calls hang from ``start()`` until ``stop()``."""

    def __init__(self, begin: Any, end: Any) -> None:
        self._begin, self._end = begin, end
        self.active = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        started = threading.Event()

        def run() -> None:
            self._begin()
            self.active = True
            started.set()
            self._done.wait(STALL_LIMIT)
            self.active = False
            self._end()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert started.wait(60), "the thread did not start"

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            assert not self._thread.is_alive(), "still running after 60 s"


@dataclass
class Stalling:
    mode: str
    coord: Any
    stall: Stall

    def lock(self, spec: LockSpec) -> LockProxy:
        return LockProxy(self.coord.lock(spec), self.mode)

    async def close(self) -> None:
        self.stall.stop()
        result = self.coord.close()
        if inspect.isawaitable(result):
            await result


@pytest.fixture(params=["memory-sync", "sqlite-sync", "sqlite-async"])
async def stalling(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stalling]:
    store_name, mode = request.param.split("-")
    if store_name == "memory":
        coord: Any = idemlock.connect("memory://", timeout=BOUND)
        lock = coord.store._lock
        stall = Stall(lock.acquire, lock.release)
    else:
        path = tmp_path / "stall.db"
        url = f"sqlite:///{path}"
        # The coordinator's bound is the store's timeout; the file lock wait is longer,
        # so a call really hangs past the bound (as a driver without a deadline would).
        coord = (idemlock.connect if mode == "sync" else idemlock.aio.connect)(
            url, timeout=BOUND, busy_timeout=STALL_LIMIT
        )
        blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        stall = Stall(
            lambda: blocker.execute("BEGIN IMMEDIATE"), lambda: blocker.execute("ROLLBACK")
        )
    s = Stalling(mode, coord, stall)
    try:
        yield s
    finally:
        await s.close()


#: the store's bound on one call in these tests (memory ``timeout``, SQLite busy timeout)
BOUND = 1.0
SHORT = LockSpec("short", ttl=timedelta(seconds=0.6))


async def _pause(mode: str, seconds: float) -> None:
    # The body's own waiting: the event loop keeps running in async mode.
    if mode == "sync":
        time.sleep(seconds)  # noqa: ASYNC251 - a sync holder's body blocks its thread
    else:
        await asyncio.sleep(seconds)


async def test_lease_is_lost_at_its_deadline_while_a_renewal_hangs(stalling: Stalling) -> None:
    locks = stalling.lock(SHORT)
    told: list[float] = []
    body_finished = False
    lost_seen_while_stalled = False
    with pytest.raises(LockLost) as info:
        async with locks.hold(
            "k", renew_every=0.2, on_lost=lambda _: told.append(time.monotonic())
        ) as lease:
            deadline = lease._sent + 0.6
            stalling.stall.start()  # from now on the renewal at 0.2 s hangs
            waited = time.monotonic() + STALL_LIMIT / 2
            while not lease.lost and time.monotonic() < waited:
                await _pause(stalling.mode, 0.02)  # async: cancelled when lost
            lost_seen_while_stalled = lease.lost and stalling.stall.active
            body_finished = True
    # The renewal never answered: the local deadline decided, not a reply.
    assert lease.lost and stalling.stall.active
    assert told and told[0] >= deadline  # never early
    assert "lease ran out" in str(info.value)
    if stalling.mode == "async":
        assert not body_finished  # the body was cancelled
    else:
        assert lost_seen_while_stalled
    assert lease.remaining() == timedelta(0)


async def test_leaving_the_block_does_not_wait_for_a_hung_store(stalling: Stalling) -> None:
    locks = stalling.lock(LockSpec("long", ttl=timedelta(seconds=30)))
    async with locks.hold("k", renew_every=0.05) as lease:
        stalling.stall.start()
        await _pause(stalling.mode, 0.2)  # a renewal is now waiting on the store
    # Left while the store still hangs: the exit waited at most the store's bound.
    assert stalling.stall.active
    assert not lease.lost
    stalling.stall.stop()
    # The release was left to the renewer (it went out when the store answered, or
    # timed out and was logged); the lease object can still be released.
    await locks.release(lease)
    assert not await locks.is_locked("k")


async def test_async_cancellation_while_leaving_reaches_the_caller(tmp_path: Path) -> None:
    path = tmp_path / "cancel.db"
    coord = idemlock.aio.connect(f"sqlite:///{path}", busy_timeout=3.0)
    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    stall = Stall(lambda: blocker.execute("BEGIN IMMEDIATE"), lambda: blocker.execute("ROLLBACK"))
    locks = coord.lock(LockSpec("long", ttl=timedelta(seconds=30)))
    leaving = asyncio.Event()
    after: list[str] = []

    async def holder() -> None:
        async with locks.hold("k", renew_every=0.05):
            stall.start()
            await asyncio.sleep(0.2)  # a renewal is now waiting on the file lock
            leaving.set()
        after.append("the block was left normally")

    try:
        task = asyncio.ensure_future(holder())
        await leaving.wait()
        await asyncio.sleep(0.2)  # inside the exit: the release waits on the file lock
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert after == []
        assert task.cancelled()
    finally:
        stall.stop()
        await coord.close()


async def test_one_watchdog_thread_serves_every_hold_of_a_coordinator() -> None:
    coord = idemlock.connect("memory://")
    locks = coord.lock(LONG)
    before = {t for t in threading.enumerate() if t.name == "idemlock-watchdog"}
    try:
        with locks.hold("a"), locks.hold("b"), coord.for_tenant("t").lock(LONG).hold("c"):
            now = {t for t in threading.enumerate() if t.name == "idemlock-watchdog"}
            assert len(now - before) == 1
    finally:
        coord.close()


# ---- on_lost that raises ----------------------------------------------------------


async def test_on_lost_that_raises_is_logged_and_the_lease_still_lost(
    api: Facade, caplog: pytest.LogCaptureFixture
) -> None:
    locks = api.lock(LockSpec("cb", ttl=timedelta(seconds=0.4)))

    def broken(lease: Lease) -> None:
        raise RuntimeError("callback bug")

    def logged() -> bool:
        return any(
            "on_lost" in r.getMessage() and r.exc_info and "callback bug" in str(r.exc_info[1])
            for r in caplog.records
        )

    body_finished = False
    with caplog.at_level(logging.WARNING, logger="idemlock"):
        with pytest.raises(LockLost):
            async with locks.hold("k", renew_every=0.05, on_lost=broken) as lease:
                await locks.release(lease)  # lost from under the holder
                waited = time.monotonic() + 30  # a bound, not a timing: left once lost
                while not lease.lost and time.monotonic() < waited:
                    await _pause(api.mode, 0.02)  # async: cancelled when lost
                    if api.harness.clock is not None:
                        api.harness.clock.advance(0.02)
                if api.mode == "sync":
                    assert lease.lost
                body_finished = True
        # The sync face marks the lease lost, then runs on_lost on the renewer's thread:
        # its log may come just after the body saw ``lost``.
        waited = time.monotonic() + 30
        while not logged() and time.monotonic() < waited:
            await _pause(api.mode, 0.02)
        assert logged()
    assert lease.lost
    assert (api.mode == "sync") == body_finished  # an async body was still cancelled


def test_watchdog_works_in_a_forked_child() -> None:
    # The child inherits the coordinator but not the parent's timer thread.
    coord = idemlock.connect("memory://")
    locks = coord.lock(LockSpec("fork", ttl=timedelta(seconds=0.3)))
    with locks.hold("warm"):
        pass
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 3
        try:
            with locks.hold("k", max_hold=0.05) as lease:
                waited = time.monotonic() + 5
                while not lease.lost and time.monotonic() < waited:
                    time.sleep(0.01)
        except LockLost:
            code = 0 if lease.lost else 2
        os._exit(code)
    _, status = waitpid(pid)
    assert os.waitstatus_to_exitcode(status) == 0
    with locks.hold("after"):  # the parent's timer still works
        pass
    coord.close()


async def test_async_hold_without_cancel_on_lost_lets_the_body_finish(harness: Harness) -> None:
    coord = harness.aio()
    locks = coord.lock(LockSpec("nocancel", ttl=timedelta(seconds=0.4)))
    finished = False
    try:
        with pytest.raises(LockLost):
            async with locks.hold("k", renew_every=0.05, cancel_on_lost=False) as lease:
                await locks.release(lease)  # lost from under the holder
                waited = time.monotonic() + 5
                while not lease.lost and time.monotonic() < waited:
                    await asyncio.sleep(0.02)
                    if harness.clock is not None:
                        harness.clock.advance(0.02)
                await asyncio.sleep(0.05)  # not cancelled: the body runs on
                finished = True
        assert finished and lease.lost
        await asyncio.sleep(0)  # no cancellation left pending on this task
    finally:
        await coord.close()
