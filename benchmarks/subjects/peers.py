"""The peers, each one adapter: peer -> slot -> build (``REDIS_PEERS``; idemkit's are
the Redis and PostgreSQL adapters', its backend differing per store). Optional imports."""

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


def redis_client(t: dict[str, Any], aio: bool = False) -> Any:
    """redis-py's client (``aio``: its asyncio one), a RedisCluster on a Cluster."""
    lib = redis.asyncio if aio else redis
    if t["cluster"]:
        return lib.cluster.RedisCluster(host="127.0.0.1", port=t["ports"][0], **c.CLIENT)
    return lib.Redis(port=t["ports"][0], **c.CLIENT)


def client(x: Ctx) -> Any:
    r = redis_client(x.t)
    x.stack.callback(r.close)
    return r


async def aclient(x: Ctx) -> Any:
    ar = redis_client(x.t, aio=True)
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


def lock_job(r: Any, acquire: Callable[[str], Any], release: Callable[[Any], Any]) -> SyncFn:
    """A job from a lock alone: lock, check a done marker, write, mark done, release."""
    done = json.dumps(RESULT)

    def step(key: str) -> None:
        held = acquire(key)
        if r.get(f"done:{key}") is None:
            r.set(f"eff:{key}", "done")
            r.set(f"done:{key}", done, ex=3600)
        release(held)

    return keyed(step)


def lock_object(new: Callable[[Ctx, Any, str, int], Any], wait_arg: str) -> Any:
    """A peer's lock as an object, ``new(x, client, name, ttl)``, whose acquire's
    timeout argument is ``wait_arg``."""

    def lock(x: Ctx, r: Any, prefix: str, ttl: int, wait: int | None) -> tuple[Any, Any]:
        def acquire(key: str) -> Any:
            held = new(x, r, f"{prefix}:{key}", ttl)
            assert held.acquire(blocking=wait is not None, **{wait_arg: wait})
            return held

        return acquire, lambda held: held.release()

    return lock


def lock_peer(lock: Any, name: str, job: bool = True) -> dict[str, Any]:
    """A lock peer's pairs (acquire without waiting, release), its contender (waiting up
    to 30 s) and, with ``job``, its job from the lock alone; ``lock(x, client, prefix,
    ttl, wait)`` gives (acquire(key) -> held, release(held)), ttl and wait in seconds
    (wait None: acquire does not wait)."""

    def pairs(x: Ctx) -> SyncFn:
        acquire, release = lock(x, client(x), new_prefix(name), 30, None)

        def run(count: int) -> None:
            for _ in range(count):
                release(acquire("peer"))

        return run

    def job_of(x: Ctx) -> SyncFn:
        r = client(x)
        return lock_job(r, *lock(x, r, f"{name}j", 300, None))

    slots = {c.LOCK_OP: pairs, c.HAND_OP: lambda x: lock(x, client(x), x.t["prefix"], 30, 30)}
    return {**slots, c.JOB_OP: job_of} if job else slots


def prl_lock(x: Ctx, r: Any, name: str, ttl: int) -> Any:
    """``strict=False`` lets python-redis-lock take a RedisCluster client (then ``name``
    needs a hash tag for its lock and signal keys to share a slot)."""
    import redis_lock

    return redis_lock.Lock(r, tag(x, name), expire=ttl, strict=not x.t["cluster"])


def fencekit_lock(x: Ctx, r: Any, prefix: str, ttl: int, wait: int | None) -> tuple[Any, Any]:
    import fencekit

    dl, kw = fencekit.DistributedLock(r, prefix=tag(x, prefix)), {"ttl": timedelta(seconds=ttl)}
    if wait is not None:
        kw |= {"blocking": True, "wait": timedelta(seconds=wait)}
    return partial(dl.acquire, **kw), dl.release


async def arpy_pairs(x: Ctx) -> Make:
    ar, prefix = await aclient(x), new_prefix("arp")

    async def make(t: int, count: int) -> None:
        for _ in range(count):
            lock = ar.lock(f"{prefix}:{t}", timeout=30)
            assert await lock.acquire(blocking=False)
            await lock.release()

    return make


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


def ik_pairs(backend: Any, write: Callable[[str], Awaitable[Any]] | None = None) -> Make:
    """idemkit's backend claim + complete, the calls its middleware makes per request
    (the job: ``write(key)`` between them)."""

    async def make(t: int, count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{t}-{i}"
            res = await backend.claim(key, "f" * 64, 1, 300.0)
            if write is not None:
                await write(key)
            await backend.complete(key, res.our_claim_token, 200, {}, b"x" * 40, 3600.0)

    return make


def ik_peer(backend: Callable[[Ctx, int], Awaitable[Any]], write: Callable[[Ctx], Any]) -> Any:
    """idemkit on a store: ``backend(x, max_size)`` opens its backend, ``write(x)`` makes
    the job's write; the job runs 1 task on ``x.loop``, measured among sync subjects."""

    async def pairs(x: Ctx) -> Make:
        opened = await backend(x, 10)
        x.stack.push_async_callback(opened.aclose)
        return ik_pairs(opened)

    def job(x: Ctx) -> SyncFn:
        loop = x.loop
        assert loop is not None
        opened = loop.run_until_complete(backend(x, 4))
        x.stack.callback(lambda: loop.run_until_complete(opened.aclose()))
        make = ik_pairs(opened, write(x))
        return lambda n: loop.run_until_complete(make(0, n))

    return {ASYNC + c.CLAIM_OP: pairs, c.JOB_OP: job}


REDIS_PEERS: dict[str, dict[str, Any]] = {
    c.RPY: {
        **lock_peer(
            lock_object(lambda x, r, name, ttl: r.lock(name, timeout=ttl), "blocking_timeout"), "rp"
        ),
        ASYNC + c.LOCK_OP: arpy_pairs,
    },
    c.PRL: lock_peer(lock_object(prl_lock, "timeout"), "prl"),
    c.FK: {
        **lock_peer(fencekit_lock, "fk", job=False),
        c.CLAIM_OP: fencekit_guard_pairs,
        c.JOB_OP: lambda x: fencekit_job(client(x), prefix=tag(x, new_prefix("fkj"))),
    },
    c.PT: {
        c.CLAIM_OP: lambda x: powertools(client(x), job=False),
        c.JOB_OP: lambda x: powertools(client(x), job=True),
    },
}
