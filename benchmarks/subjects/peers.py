"""The peers' subjects: redis-py's Lock, python-redis-lock, fencekit, idemkit and
Powertools, as the functions the scenarios time (optional imports)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from common import RESULT, Make, SyncFn


def keyed(step: Callable[[str], Any]) -> SyncFn:
    """``count`` calls of ``step`` on fresh keys."""

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            step(f"{tag}-{i}")

    return run


def lock_pairs(new_lock: Callable[[], Any]) -> SyncFn:
    """Acquire (without waiting) and release a lock object ``new_lock()`` makes."""

    def run(count: int) -> None:
        for _ in range(count):
            lock = new_lock()
            assert lock.acquire(blocking=False)
            lock.release()

    return run


def redispy_lock_pairs(r: Any, name: str = "peer:redis-py") -> SyncFn:
    return lock_pairs(lambda: r.lock(name, timeout=30))


def prl_lock_pairs(r: Any, name: str = "peer:prl", strict: bool = True) -> SyncFn:
    """``strict=False`` lets python-redis-lock take a RedisCluster client (then ``name``
    needs a hash tag, e.g. ``{peer:prl}``, for its lock and signal keys to share a slot)."""
    import redis_lock

    return lock_pairs(lambda: redis_lock.Lock(r, name, expire=30, strict=strict))


def fencekit_lock_pairs(r: Any, prefix: str = "fk") -> SyncFn:
    import fencekit

    dl, ttl = fencekit.DistributedLock(r, prefix=prefix), timedelta(seconds=30)

    def run(count: int) -> None:
        for _ in range(count):
            dl.release(dl.acquire("peer", ttl=ttl))

    return run


def fencekit_guard_pairs(r: Any, prefix: str = "fk") -> SyncFn:
    import fencekit

    guard, ttl = fencekit.IdempotencyGuard(r, prefix=prefix), timedelta(hours=1)

    def step(key: str) -> None:
        assert guard.try_begin(key, ttl=ttl)
        guard.mark_done(key, result=RESULT, ttl=ttl)

    return keyed(step)


def fencekit_job(r: Any, prefix: str = "fkj") -> SyncFn:
    """On a Cluster, give ``prefix`` a hash tag (``{fkj}``): the fenced write's key and
    fencekit's gate keys must share a slot."""
    import fencekit

    guard = fencekit.IdempotencyGuard(r, prefix=prefix)
    lock = fencekit.DistributedLock(r, prefix=prefix)
    gate = fencekit.FenceGate(r, prefix=prefix)
    ttl = timedelta(seconds=300)

    def step(key: str) -> None:
        assert guard.try_begin(key, ttl=ttl)
        handle = lock.acquire(key, ttl=ttl, owner_id=guard.owner_id)
        gate.set_if_fresh(handle.token, f"{prefix}out:{key}", "done")
        guard.mark_done(key, result=RESULT, ttl=timedelta(hours=1))
        lock.release(handle)

    return keyed(step)


def lock_job(r: Any, lock_of: Callable[[str], Any]) -> SyncFn:
    """A job from a lock alone: lock, check a done marker, write, mark done, release."""
    done = json.dumps(RESULT)

    def step(key: str) -> None:
        lock = lock_of(key)
        assert lock.acquire(blocking=False)
        if r.get(f"done:{key}") is None:
            r.set(f"eff:{key}", "done")
            r.set(f"done:{key}", done, ex=3600)
        lock.release()

    return keyed(step)


def powertools(r: Any, job: bool) -> SyncFn:
    """Powertools' idempotent_function (Redis cache layer); the job's body writes an effect."""
    from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
    from aws_lambda_powertools.utilities.idempotency.persistence.cache import CachePersistenceLayer

    layer = CachePersistenceLayer(client=r)
    config = IdempotencyConfig(expires_after_seconds=3600)

    @idempotent_function(data_keyword_argument="job", persistence_store=layer, config=config)
    def work(job: dict[str, str]) -> dict[str, Any]:
        if job["effect"]:
            r.set(f"ptout:{job['key']}", "done")
        return RESULT

    return keyed(lambda key: work(job={"key": key, "effect": job}))


async def _ik(backend: Any, key: str, write: Callable[[str], Awaitable[Any]] | None) -> None:
    res = await backend.claim(key, "f" * 64, 1, 300.0)
    if write is not None:
        await write(key)
    await backend.complete(key, res.our_claim_token, 200, {}, b"x" * 40, 3600.0)


def ik_claim(backend: Any) -> Make:
    """idemkit's backend claim + complete, the calls its middleware makes per request."""

    async def make(t: int, count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            await _ik(backend, f"{tag}-{t}-{i}", None)

    return make


def ik_job(backend: Any, write: Callable[[str], Awaitable[Any]], loop: Any, stack: Any) -> SyncFn:
    """The job through idemkit's backend, 1 task on ``loop``, measured among sync ones."""
    stack.callback(lambda: loop.run_until_complete(backend.aclose()))

    async def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            await _ik(backend, f"{tag}-{i}", write)

    return lambda n: loop.run_until_complete(run(n))
