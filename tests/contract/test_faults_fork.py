"""Fault contract: ``os.fork()`` with the parent and the child both using the coordinator.

What Celery prefork, gunicorn ``--preload`` and multiprocessing do: a process that
already holds connections, pools and listener threads forks. Afterwards the child and
the parent must both work, each on connections of its own (agreement A6): claims
answer correctly (one winner per key across both), a waited acquire is woken by the
other process's release within about a second (not after seconds of polling), and
the parent goes on working after the child is gone.

Permits and terms held across a fork stay the parent's: the child takes only what
the limit leaves, never the parent's permit or term (its owners are its own), and
the parent's renewals go on while the child works.

Memory: the child sees its own copy of the store (what the parent held at the fork),
and neither deadlocks, even when another thread was inside the store at the fork.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from idemlock import (
    Claimed,
    Completed,
    ElectionSpec,
    IdempotencySpec,
    InFlight,
    LockNotAcquired,
    LockSpec,
    SemaphoreSpec,
)

from .harness import Harness
from .stores import STORES

SPEC = IdempotencySpec("fork", lease=timedelta(seconds=30))
LOCK = LockSpec("fork", ttl=timedelta(seconds=30))
SEM = SemaphoreSpec("fork-sem", limit=2, ttl=timedelta(seconds=30))
#: a short ttl, so that the parent's permit lives on its renewals during the test
SEM_RENEWED = SemaphoreSpec("fork-sem-renewed", limit=2, ttl=timedelta(seconds=3))
ELECTION = ElectionSpec("fork-el", ttl=timedelta(seconds=30))
#: a waiter must wake this soon after the release in the other process
WAKE = 1.0
#: a child that has not reported by then is hung
CHILD_LIMIT = 15.0


class Pipe:
    """One direction of JSON lines between parent and child."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        self._buf = b""

    def send(self, msg: Any) -> None:
        data = (json.dumps(msg) + "\n").encode()
        while data:
            data = data[os.write(self.w, data) :]

    def recv(self, timeout: float = CHILD_LIMIT) -> Any:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.r], [], [], left)[0]:
                raise TimeoutError(f"no message within {timeout:.0f}s (the other side hung)")
            chunk = os.read(self.r, 65536)
            if not chunk:
                raise EOFError("the other side exited")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)


def fork(child: Callable[[Pipe, Pipe], None]) -> tuple[int, Pipe, Pipe]:
    """Fork; the child runs ``child(to_parent, from_parent)`` and exits (never returns
    into pytest). Returns (pid, from_child, to_child)."""
    up, down = Pipe(), Pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        status = 0
        try:
            child(up, down)
        except BaseException:
            status = 1
            with contextlib.suppress(BaseException):
                up.send({"error": traceback.format_exc()})
        finally:
            os._exit(status)
    return pid, up, down


def reap(pid: int, timeout: float = CHILD_LIMIT) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked child did not exit within {timeout:.0f}s (hung)")


def expect(pipe: Pipe, kind: str) -> Any:
    msg = pipe.recv()
    if isinstance(msg, dict) and "error" in msg:
        raise AssertionError(f"the forked child failed:\n{msg['error']}")
    assert msg[0] == kind, msg
    return msg[1] if len(msg) > 1 else None


def _warm_sync(harness: Harness, coord: Any) -> None:
    """Make the coordinator hold what a fork would copy: pooled connections and, where
    the store has one, a listener (a waited acquire that really waited)."""
    port, locks = coord.idempotency(SPEC), coord.lock(LOCK)
    claim = port.claim("warm")
    assert isinstance(claim, Claimed)
    port.complete(claim.token, 1)
    other = harness.sync()
    try:
        held = other.lock(LOCK).acquire("warm-lock", owner="other")
        assert held is not None
        assert locks.acquire("warm-lock", owner="me", wait=0.2) is None  # subscribed, waited
        other.lock(LOCK).release(held)
    finally:
        other.close()


def test_fork_parent_and_child_both_work(process_harness: Harness) -> None:
    harness = process_harness
    coord = harness.sync()
    try:
        _warm_sync(harness, coord)
        port, locks = coord.idempotency(SPEC), coord.lock(LOCK)
        parent_lease = locks.acquire("L1", owner="parent")
        assert parent_lease is not None
        shared = [f"shared-{i}" for i in range(20)]

        def child(up: Pipe, down: Pipe) -> None:
            won = []
            for key in shared:
                reply = port.claim(key)
                if isinstance(reply, Claimed):
                    won.append(key)
            for i in range(5):
                reply = port.claim(f"child-{i}")
                assert isinstance(reply, Claimed), reply
                port.complete(reply.token, {"by": "child"})
            up.send(["claims", won])
            # A waited acquire of the parent's lock, woken by the parent's release.
            up.send(["waiting"])
            lease = locks.acquire("L1", owner="child", wait=10)
            up.send(["acquired", lease is not None, time.monotonic()])
            assert lease is not None
            assert locks.release(lease)
            # Now the child holds, the parent waits.
            held = locks.acquire("L2", owner="child")
            assert held is not None
            up.send(["holding"])
            time.sleep(0.3)
            released_at = time.monotonic()
            assert locks.release(held)
            up.send(["released", released_at])
            coord.close()

        pid, up, _down = fork(child)
        try:
            parent_won = []
            for key in shared:
                if isinstance(port.claim(key), Claimed):
                    parent_won.append(key)
            child_won = expect(up, "claims")
            both = sorted(parent_won + child_won)
            assert both == sorted(shared), (
                f"one winner per key across parent and child: parent {parent_won}, "
                f"child {child_won}"
            )
            expect(up, "waiting")
            time.sleep(0.3)  # the child is waiting now
            released_at = time.monotonic()
            assert locks.release(parent_lease) is True
            ok, acquired_at = up.recv()[1:]
            assert ok, "the child's waited acquire gave up"
            assert acquired_at - released_at <= WAKE, (
                f"the child woke {acquired_at - released_at:.2f}s after the parent's release"
            )
            expect(up, "holding")
            lease = locks.acquire("L2", owner="parent", wait=10)
            acquired_at = time.monotonic()
            child_released_at = expect(up, "released")
            assert lease is not None, "the parent's waited acquire gave up"
            assert acquired_at - child_released_at <= WAKE, (
                f"the parent woke {acquired_at - child_released_at:.2f}s after the child's release"
            )
            assert locks.release(lease)
            replay = port.claim("child-0")
            assert isinstance(replay, Completed) and replay.result == {"by": "child"}
        finally:
            code = reap(pid)
        assert code == 0, f"the child exited with {code}"
        # The parent keeps working after its child is gone.
        claim = port.claim("after")
        assert isinstance(claim, Claimed)
        port.complete(claim.token, "ok")
        assert isinstance(port.claim("after"), Completed)
        lease = locks.acquire("L3")
        assert lease is not None and locks.release(lease)
    finally:
        coord.close()


def test_fork_async_coordinator(process_harness: Harness) -> None:
    """The same with an AsyncCoordinator: used in the parent's event loop before the
    fork, then in a new loop in the child and in the parent."""
    harness = process_harness
    coord = harness.aio()

    async def warm() -> None:
        port = coord.idempotency(SPEC)
        claim = await port.claim("warm")
        assert isinstance(claim, Claimed)
        await port.complete(claim.token, 1)
        locks = coord.lock(LOCK)
        held = await locks.acquire("warm-lock", owner="other")
        assert held is not None
        assert await locks.acquire("warm-lock", owner="me", wait=0.2) is None
        await locks.release(held)

    asyncio.run(warm())
    parent_lease = asyncio.run(coord.lock(LOCK).acquire("L1", owner="parent"))
    assert parent_lease is not None

    def child(up: Pipe, down: Pipe) -> None:
        async def main() -> None:
            port, locks = coord.idempotency(SPEC), coord.lock(LOCK)
            reply = await port.claim("child-key")
            assert isinstance(reply, Claimed), reply
            await port.complete(reply.token, {"by": "child"})
            up.send(["waiting"])
            lease = await locks.acquire("L1", owner="child", wait=10)
            up.send(["acquired", lease is not None, time.monotonic()])
            assert lease is not None
            assert await locks.release(lease)
            await coord.close()

        asyncio.run(main())

    pid, up, _down = fork(child)
    try:
        expect(up, "waiting")
        time.sleep(0.3)

        async def release() -> float:
            released_at = time.monotonic()
            assert await coord.lock(LOCK).release(parent_lease) is True
            return released_at

        released_at = asyncio.run(release())
        msg = up.recv()
        if isinstance(msg, dict):
            raise AssertionError(f"the forked child failed:\n{msg['error']}")
        _, ok, acquired_at = msg
        assert ok, "the child's waited acquire gave up"
        assert acquired_at - released_at <= WAKE, (
            f"the child woke {acquired_at - released_at:.2f}s after the parent's release"
        )
    finally:
        code = reap(pid)
    assert code == 0, f"the child exited with {code}"

    async def after() -> None:
        port = coord.idempotency(SPEC)
        replay = await port.claim("child-key")
        assert isinstance(replay, Completed) and replay.result == {"by": "child"}
        claim = await port.claim("after")
        assert isinstance(claim, Claimed)
        await port.complete(claim.token, "ok")
        await coord.close()

    asyncio.run(after())


def test_fork_while_another_thread_is_inside_the_store(harness: Harness) -> None:
    """Fork again and again while a thread of the parent keeps calling the store: a
    lock or a pooled connection that thread held at the fork must not hang or confuse
    the child (memory included: its child works on its own copy)."""
    coord = harness.sync()
    stop = threading.Event()
    errors: list[BaseException] = []
    try:
        port, locks = coord.idempotency(SPEC), coord.lock(LOCK)
        _warm_sync(harness, coord)

        def busy() -> None:
            i = 0
            try:
                while not stop.is_set():
                    reply = port.claim(f"busy-{i}")
                    assert isinstance(reply, Claimed)
                    port.abandon(reply.token)
                    lease = locks.acquire(f"busy-{i}")
                    assert lease is not None
                    locks.release(lease)
                    i += 1
                    # A short pause: busy, but leaving other writers (the child) a turn.
                    time.sleep(0.001)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=busy, daemon=True)
        thread.start()
        time.sleep(0.05)
        for round_ in range(8):

            def child(up: Pipe, down: Pipe, round_: int = round_) -> None:
                reply = port.claim(f"child-{round_}")
                assert isinstance(reply, Claimed), reply
                port.complete(reply.token, round_)
                again = port.claim(f"child-{round_}")
                assert isinstance(again, Completed) and again.result == round_, again
                lease = locks.acquire(f"child-lock-{round_}")
                assert lease is not None
                assert locks.release(lease)
                up.send(["done"])

            pid, up, _ = fork(child)
            try:
                expect(up, "done")
            finally:
                code = reap(pid)
            assert code == 0, f"round {round_}: the child exited with {code}"
            time.sleep(0.02)
        stop.set()
        thread.join(10)
        assert not errors, f"the parent's thread failed while it forked: {errors[0]!r}"
        assert not thread.is_alive(), "the parent's thread hung"
        # In the parent: stores that outlive a process see the children's records;
        # memory does not (each child had its own copy).
        seen = port.claim("child-0")
        if harness.url is None:
            assert isinstance(seen, Claimed), seen
        else:
            assert isinstance(seen, Completed) and seen.result == 0, seen
    finally:
        stop.set()
        coord.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fork_memory_child_sees_its_own_copy(
    mode: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    harness = STORES["memory"](request, tmp_path)
    if mode == "sync":
        coord: Any = harness.sync()

        def run(coro_fn: Callable[[], Any]) -> Any:
            return coro_fn()
    else:
        coord = harness.aio()

        def run(coro_fn: Callable[[], Any]) -> Any:
            return asyncio.run(coro_fn())

    port = coord.idempotency(SPEC)

    async def aclaim(key: str) -> Any:
        return await port.claim(key)

    def claim(key: str) -> Any:
        return run(lambda: aclaim(key)) if mode == "async" else port.claim(key)

    held = claim("before-fork")
    assert isinstance(held, Claimed)

    def child(up: Pipe, down: Pipe) -> None:
        copy = claim("before-fork")
        assert isinstance(copy, InFlight), copy  # the parent's claim, copied
        mine = claim("child-only")
        assert isinstance(mine, Claimed), mine
        up.send(["done"])

    pid, up, _ = fork(child)
    try:
        expect(up, "done")
    finally:
        code = reap(pid)
    assert code == 0
    # The child's claim lived in the child's copy only.
    assert isinstance(claim("child-only"), Claimed)


def receive(pipe: Pipe, kind: str) -> list[Any]:
    """The next message, which must be ``kind``: all of its fields (``expect`` gives
    only the first)."""
    msg = pipe.recv()
    if isinstance(msg, dict) and "error" in msg:
        raise AssertionError(f"the forked child failed:\n{msg['error']}")
    assert msg[0] == kind, msg
    return list(msg[1:])


def until(check: Callable[[], bool], what: str, bound: float = CHILD_LIMIT) -> None:
    """Wait for ``check()`` (store state, a renewal seen), failing after ``bound``."""
    deadline = time.monotonic() + bound
    while not check():
        assert time.monotonic() < deadline, f"{what} (not within {bound:.0f}s)"
        time.sleep(0.02)


def test_fork_permit_held_across_a_fork(process_harness: Harness) -> None:
    """A permit of a limit-2 semaphore held (and renewed) by the parent across a fork:
    the child takes the one permit left and no more, the parent's permit is neither
    taken nor disturbed, its renewals go on, and each side's release wakes the other's
    waiter."""
    harness = process_harness
    coord = harness.sync()
    try:
        _warm_sync(harness, coord)
        sems = coord.semaphore(SEM_RENEWED)
        with sems.hold("S", owner="parent", renew_every=0.3) as permit:

            def child(up: Pipe, down: Pipe) -> None:
                mine = sems.acquire("S", owner="child", wait=10)
                assert mine is not None, "the child could not take the permit left"
                assert mine.token > permit.token, (mine.token, permit.token)
                assert sems.acquire("S", owner="third") is None, "past the limit"
                # A waited acquire that really waits (a listener made in the child).
                assert sems.acquire("S", owner="third", wait=0.3) is None, "past the limit"
                assert sems.available("S") == 0
                holders = {h.owner: h.token for h in sems.holders("S")}
                assert holders == {"parent": permit.token, "child": mine.token}, holders
                up.send(["holding", mine.token])
                expect(down, "release")
                released_at = time.monotonic()
                assert sems.release(mine) is True
                assert sems.release(mine) is False
                up.send(["released", released_at])
                coord.close()

            pid, up, down = fork(child)
            try:
                child_token = expect(up, "holding")
                # The parent's permit is renewed on while the child holds its own.
                seen = {permit.expires_at}

                def renewed_twice() -> bool:
                    seen.add(permit.expires_at)
                    return len(seen) >= 3

                until(renewed_twice, "the parent's permit was not renewed after the fork")
                assert not permit.lost
                holders = {h.owner: h.token for h in sems.holders("S")}
                assert holders == {"parent": permit.token, "child": child_token}, holders
                assert sems.acquire("S", owner="third") is None, "past the limit"
                down.send(["release"])
                # The child's release wakes the parent's waiter.
                got = sems.acquire("S", owner="after", wait=10)
                acquired_at = time.monotonic()
                (released_at,) = receive(up, "released")
                assert got is not None, "the parent's waited acquire gave up"
                assert got.token > child_token
                assert acquired_at - released_at <= WAKE, (
                    f"the parent woke {acquired_at - released_at:.2f}s after the child's release"
                )
                assert sems.release(got) is True
            finally:
                code = reap(pid)
            assert code == 0, f"the child exited with {code}"
            # The parent's permit outlived its child, still renewed.
            assert not permit.lost
            assert sems.renew(permit) is True
            assert [h.owner for h in sems.holders("S")] == ["parent"]
        assert sems.holders("S") == []
    finally:
        coord.close()


def test_fork_async_permit_held_across_a_fork(process_harness: Harness) -> None:
    """The same with an AsyncCoordinator: a permit acquired in the parent's event loop
    before the fork; the child (a new loop) takes the permit left, no more, and its
    waiter is woken by the parent's release; the parent's permit renews throughout."""
    harness = process_harness
    coord = harness.aio()
    sems = coord.semaphore(SEM)

    async def warm() -> Any:
        other = await sems.acquire("S", owner="other")
        assert other is not None
        assert await sems.acquire("S", owner="parent") is not None
        # Full: a waited acquire that really waited (a listener made before the fork).
        assert await sems.acquire("S", owner="me", wait=0.2) is None
        assert await sems.release(other) is True
        return await sems.acquire("S", owner="parent")  # the same permit again

    permit = asyncio.run(warm())
    assert permit is not None

    def child(up: Pipe, down: Pipe) -> None:
        async def main() -> None:
            # Waited: the parent's waiter that gave up before the fork may keep its
            # queue place for a moment (SQLite: it lapses within a poll).
            mine = await sems.acquire("S", owner="child", wait=10)
            assert mine is not None, "the child could not take the permit left"
            assert mine.token > permit.token
            assert await sems.acquire("S", owner="third") is None, "past the limit"
            up.send(["waiting"])
            got = await sems.acquire("S", owner="waiter", wait=10)
            up.send(["acquired", got is not None, time.monotonic()])
            assert got is not None
            assert got.token > mine.token
            assert await sems.release(got) is True
            assert await sems.release(mine) is True
            await coord.close()

        asyncio.run(main())

    pid, up, _down = fork(child)
    try:
        expect(up, "waiting")
        time.sleep(0.3)  # the child is waiting now

        async def check_and_release() -> float:
            assert await sems.renew(permit) is True, "the parent's permit was disturbed"
            assert not permit.lost
            owners = sorted(h.owner for h in await sems.holders("S"))
            assert owners == ["child", "parent"], owners
            released_at = time.monotonic()
            assert await sems.release(permit) is True
            return released_at

        released_at = asyncio.run(check_and_release())
        ok, acquired_at = receive(up, "acquired")
        assert ok, "the child's waited acquire gave up"
        assert acquired_at - released_at <= WAKE, (
            f"the child woke {acquired_at - released_at:.2f}s after the parent's release"
        )
    finally:
        code = reap(pid)
    assert code == 0, f"the child exited with {code}"

    async def after() -> None:
        assert await sems.holders("S") == []
        again = await sems.acquire("S", owner="parent")
        assert again is not None and again.token > permit.token
        assert await sems.release(again) is True
        await coord.close()

    asyncio.run(after())


def test_fork_election_term_held_across_a_fork(process_harness: Harness) -> None:
    """A term held by the parent across a fork is not the child's: the child sees the
    parent lead, cannot enter a term of its own while it does, and is elected (in a
    later term) when the parent's term ends, woken by it."""
    harness = process_harness
    coord = harness.sync()
    try:
        _warm_sync(harness, coord)
        el = coord.election(ELECTION)
        with el.campaign("R", value="parent") as term:

            def child(up: Pipe, down: Pipe) -> None:
                leader = el.leader("R")
                assert leader is not None
                assert (leader.term, leader.value) == (term.number, "parent"), leader
                with pytest.raises(LockNotAcquired), el.campaign("R", value="child", wait=0):
                    raise AssertionError("the child entered the parent's term")
                assert el.acquire("R", value="child") is None
                up.send(["waiting"])
                with el.campaign("R", value="child", wait=10) as mine:
                    elected_at = time.monotonic()
                    leader = el.leader("R")
                    assert leader is not None and leader.value == "child", leader
                    assert leader.term == mine.number
                    up.send(["elected", mine.number, elected_at])
                coord.close()

            pid, up, _down = fork(child)
            try:
                expect(up, "waiting")
                time.sleep(0.3)  # the child is campaigning now
                assert not term.lost
                leader = el.leader("R")
                assert leader is not None and (leader.term, leader.value) == (
                    term.number,
                    "parent",
                ), leader
                term.proclaim("parent-2")  # the term is still the parent's to change
                ended_at = time.monotonic()
            except BaseException:
                reap(pid)
                raise
        # Leaving the block ended the parent's term: the child is elected.
        try:
            number, elected_at = receive(up, "elected")
            assert number > term.number, (number, term.number)
            assert elected_at - ended_at <= WAKE + 1.0, (
                f"the child was elected {elected_at - ended_at:.2f}s after the parent's term ended"
            )
        finally:
            code = reap(pid)
        assert code == 0, f"the child exited with {code}"
        until(lambda: el.leader("R") is None, "the child's term did not end")
        with el.campaign("R", value="parent-again", wait=10) as again:
            assert again.number > number
    finally:
        coord.close()


def test_fork_while_another_thread_is_inside_a_permit_acquire(harness: Harness) -> None:
    """Fork again and again while a thread of the parent is inside ``acquire`` of a
    semaphore (permits taken, a waited acquire on a full key): the child neither hangs
    nor shares the parent's state; it takes permits up to the limit, waits for one, and
    campaigns, on connections (and a renewer) of its own. Memory included."""
    coord = harness.sync()
    stop = threading.Event()
    errors: list[BaseException] = []
    try:
        _warm_sync(harness, coord)
        sems, el = coord.semaphore(SEM), coord.election(ELECTION)

        def busy() -> None:
            i = 0
            try:
                while not stop.is_set():
                    a = sems.acquire("busy", owner=f"a{i}", wait=10)
                    b = sems.acquire("busy", owner=f"b{i}", wait=10)
                    assert a is not None and b is not None
                    # Full: a waited acquire, inside acquire (subscribed) at the fork.
                    assert sems.acquire("busy", owner=f"c{i}", wait=0.02) is None
                    assert sems.release(a) and sems.release(b)
                    i += 1
                    time.sleep(0.001)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=busy, daemon=True)
        thread.start()
        time.sleep(0.05)
        for round_ in range(8):

            def child(up: Pipe, down: Pipe, round_: int = round_) -> None:
                key = f"child-{round_}"
                first = sems.acquire(key, owner="c1")
                second = sems.acquire(key, owner="c2")
                assert first is not None and second is not None
                assert sems.acquire(key, owner="c3") is None, "past the limit"
                assert sems.release(first) is True
                third = sems.acquire(key, owner="c3", wait=10)
                assert third is not None and third.token > second.token
                assert sems.release(second) and sems.release(third)
                with el.campaign(key, value="child", wait=10) as term:
                    leader = el.leader(key)
                    assert leader is not None and leader.term == term.number
                up.send(["done"])

            pid, up, _ = fork(child)
            try:
                expect(up, "done")
            finally:
                code = reap(pid)
            assert code == 0, f"round {round_}: the child exited with {code}"
            time.sleep(0.02)
        stop.set()
        thread.join(10)
        assert not errors, f"the parent's thread failed while it forked: {errors[0]!r}"
        assert not thread.is_alive(), "the parent's thread hung"
        # Nothing is left behind: the children released everything they took (memory:
        # they took it in copies of their own).
        assert sems.holders("busy") == []
        for round_ in range(8):
            assert sems.holders(f"child-{round_}") == []
            assert el.leader(f"child-{round_}") is None
    finally:
        stop.set()
        coord.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fork_memory_child_sees_its_own_permits(
    mode: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Memory: the child's copy holds the parent's permit (so the child gets only the
    one left of two), and what the child takes stays in its copy."""
    harness = STORES["memory"](request, tmp_path)
    coord: Any = harness.sync() if mode == "sync" else harness.aio()
    sems = coord.semaphore(SEM)

    def call(make: Callable[[], Any]) -> Any:
        if mode == "sync":
            return make()

        async def run() -> Any:
            return await make()

        return asyncio.run(run())

    permit = call(lambda: sems.acquire("S", owner="parent"))
    assert permit is not None

    def child(up: Pipe, down: Pipe) -> None:
        owners = [h.owner for h in call(lambda: sems.holders("S"))]
        assert owners == ["parent"], owners  # the parent's permit, copied
        mine = call(lambda: sems.acquire("S", owner="child"))
        assert mine is not None and mine.token > permit.token
        assert call(lambda: sems.acquire("S", owner="third")) is None, "past the limit"
        up.send(["done"])

    pid, up, _ = fork(child)
    try:
        expect(up, "done")
    finally:
        code = reap(pid)
    assert code == 0
    # The child's permit lived in the child's copy only.
    assert [h.owner for h in call(lambda: sems.holders("S"))] == ["parent"]
    assert call(lambda: sems.renew(permit)) is True
    assert call(lambda: sems.release(permit)) is True
