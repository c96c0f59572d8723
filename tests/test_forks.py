"""Fork safety, one mechanism (``idemlock._forks``): a pid check where a process-bound
resource is used, plus one at-fork hook for what must be reset before any use.

On every store, sync and async: a forked child that uses the coordinator works on
resources of its own, a child whose first call is ``close()`` leaves the parent's
alone, and the parent keeps working (pooled connections and its listener: a waited
acquire is still woken by a release). The contract's fault part
(``tests/contract/test_faults_fork.py``) races parent and child on the same keys."""

from __future__ import annotations

import ast
import asyncio
import os
import select
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import idemlock
import idemlock.aio
from idemlock import Claimed, Completed, IdempotencySpec, LockSpec, _forks
from idemlock._tokens import new_token

from .servers._proc import waitpid

SRC = Path(__file__).resolve().parent.parent / "src" / "idemlock"
SPEC = IdempotencySpec("fork", lease=timedelta(seconds=30))
LOCK = LockSpec("fork", ttl=timedelta(seconds=30))
#: a child that has not exited by then is hung
CHILD_LIMIT = 15.0


def test_register_at_fork_is_called_at_most_once_in_src() -> None:
    calls = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "register_at_fork"
            ):
                calls.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert len(calls) <= 1, f"os.register_at_fork called in {calls}: use idemlock._forks"
    text = "\n".join(p.read_text(encoding="utf-8") for p in SRC.rglob("*.py"))
    assert "ForkRegistry" not in text  # per-store fork registries are gone


def _read_until_eof(fd: int, timeout: float) -> str:
    """What a child writes to ``fd`` until it exits; "" if it hangs past ``timeout``."""
    deadline = time.monotonic() + timeout
    data = b""
    with os.fdopen(fd, "rb", buffering=0) as f:
        while (left := deadline - time.monotonic()) > 0 and select.select([f], [], [], left)[0]:
            chunk = f.read(4096)
            if not chunk:
                break
            data += chunk
    return data.decode()


def _in_child(body: Callable[[], str], meanwhile: Callable[[], object] = str) -> str:
    """Fork; the child runs ``body`` and reports its answer (or its error) through a
    pipe, then leaves without pytest's cleanup; the parent runs ``meanwhile``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(r)
        try:
            out = "ok " + body()
        except BaseException as exc:
            out = f"error {exc!r}"
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    try:
        meanwhile()
    finally:
        got = _read_until_eof(r, CHILD_LIMIT)
        assert waitpid(pid, CHILD_LIMIT)[1] == 0, "the forked child hung or failed"
    assert got.startswith("ok "), f"the forked child failed: {got}"
    return got[3:]


def test_the_hook_resets_what_must_be_right_before_any_use() -> None:
    # The swap lock, held by another thread of the parent at the fork, is free in the
    # child; and the child draws tokens of its own.
    held, stop = threading.Event(), threading.Event()

    def hold() -> None:
        with _forks.LOCK:
            held.set()
            stop.wait(30)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(10)
    try:
        parent_token = new_token()

        def body() -> str:
            assert _forks.LOCK.acquire(timeout=5), "the child inherited a held lock"
            return new_token()

        child_token = _in_child(body)
    finally:
        stop.set()
        thread.join(10)
    assert child_token[:16] != parent_token[:16]  # another random prefix


# ---- every store ------------------------------------------------------------------------


@pytest.fixture(params=["memory", "sqlite", "redis", "postgres", "etcd"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name = request.param
    if name == "memory":
        return "memory://"
    if name == "sqlite":
        return f"sqlite:///{tmp_path / 'f.db'}"
    if name == "postgres":
        return str(request.getfixturevalue("postgres_dsn"))
    server = request.getfixturevalue(f"{name}_server")
    return str(server.url)


def _prefix() -> str:
    return "f" + str(time.monotonic_ns())


def _warm(coord: Any, other: Any) -> None:
    """Make ``coord`` hold what a fork copies: pooled connections and, where the store
    has one, a listener (a waited acquire that really waited)."""
    port = coord.idempotency(SPEC)
    claim = port.claim("warm")
    assert isinstance(claim, Claimed)
    port.complete(claim.token, 1)
    held = other.lock(LOCK).acquire("warm", owner="other")
    assert held is not None
    assert coord.lock(LOCK).acquire("warm", owner="me", wait=0.2) is None
    assert other.lock(LOCK).release(held)


def _dropped_what_it_inherited(url: str) -> None:
    # Every store but memory holds something bound to the parent's process (pooled
    # connections, a listener, channels): the child's first call set it aside.
    assert _forks.INHERITED or url == "memory://", "the child kept the parent's resources"


def _claims(coord: Any, who: str, n: int = 100) -> None:
    """Many calls in a row: were parent and child on one socket, replies would cross."""
    port = coord.idempotency(SPEC)
    for i in range(n):
        claim = port.claim(f"{who}-{i}")
        assert isinstance(claim, Claimed), claim
        port.complete(claim.token, i)


def _parent_still_works(coord: Any, other: Any, key: str) -> None:
    port, locks = coord.idempotency(SPEC), coord.lock(LOCK)
    claim = port.claim(key)
    assert isinstance(claim, Claimed)
    port.complete(claim.token, "parent")
    assert isinstance(port.claim(key), Completed)
    # The listener still wakes a waiter: another coordinator releases while it waits.
    held = other.lock(LOCK).acquire(key, owner="other")
    assert held is not None
    timer = threading.Timer(0.3, lambda: other.lock(LOCK).release(held))
    timer.start()
    try:
        lease = locks.acquire(key, owner="parent", wait=10)
    finally:
        timer.join()
    assert lease is not None and locks.release(lease)


@pytest.mark.parametrize("first", ["use", "close"])
def test_a_forked_child_works_and_the_parent_goes_on(url: str, first: str) -> None:
    prefix = _prefix()
    coord = idemlock.connect(url, key_prefix=prefix)
    other = idemlock.connect(url, key_prefix=prefix) if url != "memory://" else None
    other = other or idemlock.Coordinator(coord.store, key_prefix=prefix)
    try:
        _warm(coord, other)

        def body() -> str:
            if first == "close":
                coord.close()  # its first call: the parent's resources stay untouched
                _dropped_what_it_inherited(url)
                return "closed"
            _claims(coord, "child")
            _dropped_what_it_inherited(url)
            port, locks = coord.idempotency(SPEC), coord.lock(LOCK)
            claim = port.claim("child")
            assert isinstance(claim, Claimed), claim
            port.complete(claim.token, "child")
            replay = port.claim("child")
            assert isinstance(replay, Completed) and replay.result == "child", replay
            lease = locks.acquire("child", owner="child", wait=1)
            assert lease is not None and locks.release(lease)
            coord.close()
            return "used"

        def meanwhile() -> None:
            _claims(coord, "parent")

        assert _in_child(body, meanwhile) == ("closed" if first == "close" else "used")
        _parent_still_works(coord, other, "after-" + first)
        if url != "memory://" and first == "use":  # the child's writes are the store's
            replay = coord.idempotency(SPEC).claim("child")
            assert isinstance(replay, Completed) and replay.result == "child"
    finally:
        if other.store is not coord.store:
            other.close()
        coord.close()


@pytest.mark.parametrize("first", ["use", "close"])
def test_a_forked_child_of_an_async_coordinator(url: str, first: str) -> None:
    prefix = _prefix()
    coord = idemlock.aio.connect(url, key_prefix=prefix)

    async def warm() -> None:
        port = coord.idempotency(SPEC)
        claim = await port.claim("warm")
        assert isinstance(claim, Claimed)
        await port.complete(claim.token, 1)
        locks = coord.lock(LOCK)
        held = await locks.acquire("warm", owner="other")
        assert held is not None
        assert await locks.acquire("warm", owner="me", wait=0.2) is None
        assert await locks.release(held)

    asyncio.run(warm())

    def body() -> str:
        async def main() -> str:
            if first == "close":
                await coord.close()
                _dropped_what_it_inherited(url)
                return "closed"
            port, locks = coord.idempotency(SPEC), coord.lock(LOCK)
            for i in range(100):
                claim = await port.claim(f"child-{i}")
                assert isinstance(claim, Claimed), claim
                await port.complete(claim.token, i)
            _dropped_what_it_inherited(url)
            claim = await port.claim("child")
            assert isinstance(claim, Claimed), claim
            await port.complete(claim.token, "child")
            lease = await locks.acquire("child", owner="child", wait=1)
            assert lease is not None and await locks.release(lease)
            await coord.close()
            return "used"

        return asyncio.run(main())

    try:
        assert _in_child(body) == ("closed" if first == "close" else "used")

        async def after() -> None:
            port, locks = coord.idempotency(SPEC), coord.lock(LOCK)
            claim = await port.claim("after")
            assert isinstance(claim, Claimed)
            await port.complete(claim.token, "parent")
            assert isinstance(await port.claim("after"), Completed)
            held = await locks.acquire("after", owner="a")
            assert held is not None

            async def release() -> None:
                await asyncio.sleep(0.3)
                assert await locks.release(held)

            task = asyncio.create_task(release())
            lease = await locks.acquire("after", owner="b", wait=10)
            await task
            assert lease is not None and await locks.release(lease)

        asyncio.run(after())
    finally:
        asyncio.run(coord.close())
