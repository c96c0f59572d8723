"""Every waiting path of idemlock against one Redis URL, sync and asyncio.

Run as a script (``python tests/redis_wait_script.py URL``) by the install-line test,
in a fresh virtualenv that holds only ``idemlock[redis]``, and imported by the Redis
fault tests. It needs nothing but idemlock: acquire(wait=), hold(wait=), port.wait,
``on_in_flight="wait"``, each woken by another thread's release or completion.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import uuid
from datetime import timedelta

import idemlock
import idemlock.aio
from idemlock import Claimed, Completed, IdempotencySpec, LockSpec

WAIT = 20.0  # seconds: far longer than a wake-up takes; a failure is an error, not slow
LATER = 0.2  # seconds before the other side lets go


def _later(fn: object, *args: object) -> threading.Timer:
    t = threading.Timer(LATER, fn, args)  # type: ignore[arg-type]
    t.start()
    return t


def run_sync(url: str) -> None:
    coord = idemlock.connect(url, key_prefix="w" + uuid.uuid4().hex[:8])
    try:
        locks = coord.lock(LockSpec("l", ttl=timedelta(seconds=30)))
        first = locks.acquire("k")
        assert first is not None
        _later(locks.release, first)
        got = locks.acquire("k", wait=WAIT)
        assert got is not None and got.token is not None and first.token is not None
        assert got.token > first.token
        _later(locks.release, got)
        with locks.hold("k", wait=WAIT) as held:
            assert held.token is not None and held.token > got.token

        port = coord.idempotency(IdempotencySpec("j", lease=timedelta(seconds=30)))
        claim = port.claim("job")
        assert isinstance(claim, Claimed)
        _later(port.complete, claim.token, {"v": 1})
        done = port.wait("job", timeout=WAIT)
        assert isinstance(done, Completed) and done.result == {"v": 1}

        started, calls = threading.Event(), []

        @coord.idempotent("d", key=lambda n: f"n{n}", on_in_flight="wait", wait=WAIT)
        def job(n: int) -> int:
            calls.append(n)
            started.set()
            time.sleep(LATER)
            return n * 2

        first_call = threading.Thread(target=job, args=(7,))
        first_call.start()
        assert started.wait(WAIT)
        assert job(7) == 14  # waited for the running call and replays its result
        first_call.join(timeout=60)
        assert not first_call.is_alive(), "still running after 60 s"
        assert calls == [7]
    finally:
        coord.close()


async def run_async(url: str) -> None:
    coord = idemlock.aio.connect(url, key_prefix="a" + uuid.uuid4().hex[:8])
    try:
        locks = coord.lock(LockSpec("l", ttl=timedelta(seconds=30)))
        first = await locks.acquire("k")
        assert first is not None

        async def release_later(lease: idemlock.Lease) -> None:
            await asyncio.sleep(LATER)
            await locks.release(lease)

        bg = asyncio.ensure_future(release_later(first))
        got = await locks.acquire("k", wait=WAIT)
        await bg
        assert got is not None
        bg = asyncio.ensure_future(release_later(got))
        async with locks.hold("k", wait=WAIT) as held:
            assert held.token is not None and got.token is not None and held.token > got.token
        await bg

        port = coord.idempotency(IdempotencySpec("j", lease=timedelta(seconds=30)))
        claim = await port.claim("job")
        assert isinstance(claim, Claimed)

        async def complete_later() -> None:
            await asyncio.sleep(LATER)
            await port.complete(claim.token, {"v": 2})

        bg = asyncio.ensure_future(complete_later())
        done = await port.wait("job", timeout=WAIT)
        await bg
        assert isinstance(done, Completed) and done.result == {"v": 2}
    finally:
        await coord.close()


def main(url: str) -> None:
    run_sync(url)
    asyncio.run(run_async(url))


if __name__ == "__main__":
    import redis.utils

    main(sys.argv[1])
    print(
        f"waits ok on {sys.argv[1].split('://')[0]}; hiredis={redis.utils.HIREDIS_AVAILABLE}; "
        f"idemlock from {idemlock.__file__}"
    )
