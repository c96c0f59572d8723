"""The peers' subjects: redis-py's Lock, python-redis-lock, fencekit, idemkit and
Powertools, as the functions the scenarios time (optional imports)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from common import RESULT, SyncFn


def redispy_lock_pairs(r: redis.Redis, name: str = "peer:redis-py") -> Callable[[int], None]:
    def run(count: int) -> None:
        for _ in range(count):
            lock = r.lock(name, timeout=30)
            assert lock.acquire(blocking=False)
            lock.release()

    return run


def prl_lock_pairs(
    r: redis.Redis, name: str = "peer:prl", strict: bool = True
) -> Callable[[int], None]:
    """``strict=False`` lets python-redis-lock take a RedisCluster client (then ``name``
    needs a hash tag, e.g. ``{peer:prl}``, for its lock and signal keys to share a slot)."""
    import redis_lock

    def run(count: int) -> None:
        for _ in range(count):
            lock = redis_lock.Lock(r, name, expire=30, strict=strict)
            assert lock.acquire(blocking=False)
            lock.release()

    return run


def fencekit_lock_pairs(r: redis.Redis, prefix: str = "fk") -> Callable[[int], None]:
    import fencekit

    dl = fencekit.DistributedLock(r, prefix=prefix)
    ttl = timedelta(seconds=30)

    def run(count: int) -> None:
        for _ in range(count):
            dl.release(dl.acquire("peer", ttl=ttl))

    return run


def fencekit_guard_pairs(r: redis.Redis, prefix: str = "fk") -> Callable[[int], None]:
    import fencekit

    guard = fencekit.IdempotencyGuard(r, prefix=prefix)
    ttl = timedelta(hours=1)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            assert guard.try_begin(key, ttl=ttl)
            guard.mark_done(key, result=RESULT, ttl=ttl)

    return run


def fencekit_job(r: redis.Redis, prefix: str = "fkj") -> Callable[[int], None]:
    """On a Cluster, give ``prefix`` a hash tag (``{fkj}``): the fenced write's key and
    fencekit's gate keys must share a slot."""
    import fencekit

    guard = fencekit.IdempotencyGuard(r, prefix=prefix)
    lock = fencekit.DistributedLock(r, prefix=prefix)
    gate = fencekit.FenceGate(r, prefix=prefix)
    ttl = timedelta(seconds=300)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            assert guard.try_begin(key, ttl=ttl)
            handle = lock.acquire(key, ttl=ttl, owner_id=guard.owner_id)
            gate.set_if_fresh(handle.token, f"{prefix}out:{key}", "done")
            guard.mark_done(key, result=RESULT, ttl=timedelta(hours=1))
            lock.release(handle)

    return run


def lock_job(r: Any, lock_of: Callable[[str], Any]) -> SyncFn:
    """A job from a lock alone: lock, check a done marker, write, mark done, release."""
    done = json.dumps(RESULT)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            lock = lock_of(key)
            assert lock.acquire(blocking=False)
            if r.get(f"done:{key}") is None:
                r.set(f"eff:{key}", "done")
                r.set(f"done:{key}", done, ex=3600)
            lock.release()

    return run


def powertools_fn(r: Any, body: Callable[[str], None]) -> Callable[[str], Any]:
    from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
    from aws_lambda_powertools.utilities.idempotency.persistence.cache import CachePersistenceLayer

    layer = CachePersistenceLayer(client=r)
    config = IdempotencyConfig(expires_after_seconds=3600)

    @idempotent_function(data_keyword_argument="job", persistence_store=layer, config=config)
    def work(job: dict[str, str]) -> dict[str, Any]:
        body(job["key"])
        return RESULT

    return lambda key: work(job={"key": key})


def powertools_pairs(r: Any) -> SyncFn:
    work = powertools_fn(r, lambda key: None)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            work(f"{tag}-{i}")

    return run


def powertools_job(r: Any) -> SyncFn:
    work = powertools_fn(r, lambda key: r.set(f"ptout:{key}", "done"))

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            work(f"{tag}-{i}")

    return run
