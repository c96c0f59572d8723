"""The peers, each one adapter: its subjects per scenario (``Peers``: slot -> build) on
the Redis clients it is given (optional imports). idemkit's, which differ per store,
are completed by the Redis and PostgreSQL adapters."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from functools import partial
from typing import Any

import common as c
import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from common import RESULT, Make, SyncFn, new_prefix

from subjects.base import ASYNC, Ctx


def redis_client(t: dict[str, Any]) -> Any:
    if t["cluster"]:
        return redis.cluster.RedisCluster(host="127.0.0.1", port=t["ports"][0], **c.CLIENT)
    return redis.Redis(port=t["ports"][0], **c.CLIENT)


def redis_aclient(t: dict[str, Any]) -> Any:
    if t["cluster"]:
        return redis.asyncio.cluster.RedisCluster(host="127.0.0.1", port=t["ports"][0], **c.CLIENT)
    return redis.asyncio.Redis(port=t["ports"][0], **c.CLIENT)


def client(x: Ctx) -> Any:
    r = redis_client(x.t)
    x.stack.callback(r.close)
    return r


async def aclient(x: Ctx) -> Any:
    ar = redis_aclient(x.t)
    x.stack.push_async_callback(ar.aclose)
    if x.t["cluster"]:
        await ar.initialize()
    return ar


def tag(x: Ctx, name: str) -> str:
    """A name whose keys share one Cluster slot (a hash tag) on a Cluster."""
    return "{" + name + "}" if x.t["cluster"] else name


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


def lock_peer(new: Callable[[Ctx, Any, str, int], Any], name: str, wait: str) -> dict[str, Any]:
    """A peer that is a lock object, ``new(x, client, name, ttl)``: its pairs, its job and
    its contender (blocking; ``wait`` names its acquire's timeout argument)."""

    def contender(x: Ctx) -> tuple[Any, Any]:
        r = client(x)

        def acquire(key: str) -> Any:
            lock = new(x, r, f"{x.t['prefix']}:{key}", 30)
            assert lock.acquire(blocking=True, **{wait: 30})
            return lock

        return acquire, lambda lock: lock.release()

    def pairs(x: Ctx) -> SyncFn:
        r = client(x)
        return lock_pairs(partial(new, x, r, new_prefix(name), 30))

    def job(x: Ctx) -> SyncFn:
        r = client(x)
        return lock_job(r, lambda key: new(x, r, f"{name}j:{key}", 300))

    return {c.LOCK_OP: pairs, c.JOB_OP: job, c.HAND_OP: contender}


def prl_lock(x: Ctx, r: Any, name: str, ttl: int) -> Any:
    """``strict=False`` lets python-redis-lock take a RedisCluster client (then ``name``
    needs a hash tag for its lock and signal keys to share a slot)."""
    import redis_lock

    return redis_lock.Lock(r, tag(x, name), expire=ttl, strict=not x.t["cluster"])


async def arpy_pairs(x: Ctx) -> Make:
    ar, prefix = await aclient(x), new_prefix("arp")

    async def make(t: int, count: int) -> None:
        for _ in range(count):
            lock = ar.lock(f"{prefix}:{t}", timeout=30)
            assert await lock.acquire(blocking=False)
            await lock.release()

    return make


def fencekit_lock_pairs(x: Ctx) -> SyncFn:
    import fencekit

    dl = fencekit.DistributedLock(client(x), prefix=tag(x, new_prefix("fk")))
    ttl = timedelta(seconds=30)

    def run(count: int) -> None:
        for _ in range(count):
            dl.release(dl.acquire("peer", ttl=ttl))

    return run


def fencekit_guard_pairs(x: Ctx) -> SyncFn:
    import fencekit

    guard = fencekit.IdempotencyGuard(client(x), prefix=tag(x, new_prefix("fk")))
    ttl = timedelta(hours=1)

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


def fencekit_contender(x: Ctx) -> tuple[Any, Any]:
    import fencekit

    dl = fencekit.DistributedLock(client(x), prefix=tag(x, x.t["prefix"]))
    ttl = timedelta(seconds=30)
    return partial(dl.acquire, ttl=ttl, blocking=True, wait=ttl), dl.release


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


def ik_job(backend: Any, write: Callable[[str], Awaitable[Any]], x: Ctx) -> SyncFn:
    """The job through idemkit's backend, 1 task on ``x.loop``, measured among sync ones."""
    loop = x.loop
    assert loop is not None
    x.stack.callback(lambda: loop.run_until_complete(backend.aclose()))

    async def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            await _ik(backend, f"{tag}-{i}", write)

    return lambda n: loop.run_until_complete(run(n))


REDIS_PEERS: dict[str, dict[str, Any]] = {
    c.RPY: {
        **lock_peer(lambda x, r, name, ttl: r.lock(name, timeout=ttl), "rp", "blocking_timeout"),
        ASYNC + c.LOCK_OP: arpy_pairs,
    },
    c.PRL: lock_peer(prl_lock, "prl", "timeout"),
    c.FK: {
        c.LOCK_OP: fencekit_lock_pairs,
        c.CLAIM_OP: fencekit_guard_pairs,
        c.JOB_OP: lambda x: fencekit_job(client(x), prefix=tag(x, new_prefix("fkj"))),
        c.HAND_OP: fencekit_contender,
    },
    c.PT: {
        c.CLAIM_OP: lambda x: powertools(client(x), job=False),
        c.JOB_OP: lambda x: powertools(client(x), job=True),
    },
}
