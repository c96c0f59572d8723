"""The Redis and Redis Cluster adapter; the baseline is raw redis-py calling EVALSHA
on idemlock's own scripts with the same arguments (the same round trips)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from common import (
    BASE,
    CLIENT,
    FK,
    IK,
    JOB,
    JOB_OP,
    KEEP,
    LOCK_OP,
    OURS,
    OURS_AIO,
    OURS_PORT,
    OURS_W,
    PRL,
    PT,
    RPY,
    UNC,
    Make,
    Results,
    SyncFn,
    apeer,
    new_prefix,
    peer,
)

import idemlock
import idemlock.aio
from idemlock.stores.redis import _common as C
from subjects.base import (
    LEASE_MS,
    RESULT_BYTES,
    TTL_MS,
    aio_claim,
    aio_lock,
    count_redis_requests,
    ik_claim,
    ik_job,
    new_loop,
    on_loop,
    ours_ajob,
    ours_claim_pairs,
    ours_job,
    ours_job_together,
    ours_lock_pairs,
    port_claim_pairs,
    port_lock_pairs,
)
from subjects.peers import (
    fencekit_guard_pairs,
    fencekit_job,
    fencekit_lock_pairs,
    lock_job,
    powertools_job,
    powertools_pairs,
    prl_lock_pairs,
    redispy_lock_pairs,
)


class Raw:
    """EVALSHA of idemlock's scripts with the arguments the store would send."""

    def __init__(self, client: Any) -> None:
        self.r = client
        self.ns = "raw" + uuid.uuid4().hex[:6] + ":jobs"

    def lock_args(self, key: str) -> tuple[C.Names, tuple[Any, ...]]:
        n = C.names(self.ns, key)
        return n, ("owner-" + key, 30_000, KEEP, b"", b"", C.REGISTER_MS)

    def sync_lock_pairs(self, count: int, key: str = "k") -> None:
        n, args = self.lock_args(key)
        r = self.r
        for _ in range(count):
            reply = r.evalsha(C.ACQUIRE.sha, 2, n.lock, n.waiters, *args)
            r.evalsha(
                C.RELEASE.sha, 2, n.lock, n.waiters, args[0], reply[1], KEEP, 10,
                n.lock_channel, C.nonce(),
            )  # fmt: skip

    def sync_claim_pairs(self, count: int) -> None:
        r = self.r
        fp = C.pack_id("ab" * 32)
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            n = C.names(self.ns, f"{tag}-{i}")
            tok = C.pack_id(uuid.uuid4().hex)
            r.evalsha(C.CLAIM.sha, 1, n.claim, fp, tok, 300_000, KEEP)
            r.evalsha(C.COMPLETE.sha, 1, n.claim, tok, b"J" + b"x" * 40, 3_600_000,
                      n.claim_channel, C.nonce())  # fmt: skip

    async def async_lock_pairs(self, count: int, key: str = "k") -> None:
        n, args = self.lock_args(key)
        r = self.r
        for _ in range(count):
            reply = await r.evalsha(C.ACQUIRE.sha, 2, n.lock, n.waiters, *args)
            await r.evalsha(
                C.RELEASE.sha, 2, n.lock, n.waiters, args[0], reply[1], KEEP, 10,
                n.lock_channel, C.nonce(),
            )  # fmt: skip

    async def async_claim_pairs(self, count: int, tag: str = "") -> None:
        r = self.r
        fp = C.pack_id("ab" * 32)
        tag = tag or uuid.uuid4().hex[:6]
        for i in range(count):
            n = C.names(self.ns, f"{tag}-{i}")
            tok = C.pack_id(uuid.uuid4().hex)
            await r.evalsha(C.CLAIM.sha, 1, n.claim, fp, tok, 300_000, KEEP)
            await r.evalsha(C.COMPLETE.sha, 1, n.claim, tok, b"J" + b"x" * 40, 3_600_000,
                            n.claim_channel, C.nonce())  # fmt: skip


def load_scripts(r: redis.Redis) -> None:
    for s in (C.ACQUIRE, C.RELEASE, C.CLAIM, C.COMPLETE):
        assert r.script_load(s.text) == s.sha


UNLOCK_LUA = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) "
    "else return 0 end"
)


def redis_client(t: dict[str, Any]) -> Any:
    if t["cluster"]:
        return redis.cluster.RedisCluster(host="127.0.0.1", port=t["ports"][0], **CLIENT)
    return redis.Redis(port=t["ports"][0], **CLIENT)


def redis_aclient(t: dict[str, Any]) -> Any:
    if t["cluster"]:
        return redis.asyncio.cluster.RedisCluster(host="127.0.0.1", port=t["ports"][0], **CLIENT)
    return redis.asyncio.Redis(port=t["ports"][0], **CLIENT)


def redis_raw_job(raw: Raw) -> SyncFn:
    """idemlock's job issued raw: EVALSHA of its claim, fence_set and complete scripts."""
    r, fp = raw.r, C.pack_id("ab" * 32)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            n, tok = C.names(raw.ns, key), C.pack_id(uuid.uuid4().hex)
            reply = r.evalsha(C.CLAIM.sha, 1, n.claim, fp, tok, LEASE_MS, KEEP)
            fence = int(reply[1])
            out = f"out:{key}"
            gate = C.gate_name(raw.ns, out)
            r.evalsha(C.FENCE_SET.sha, 2, gate, out.encode(), str(fence), b"done")
            r.evalsha(C.COMPLETE.sha, 1, n.claim, tok, RESULT_BYTES, TTL_MS,
                      n.claim_channel, C.nonce())  # fmt: skip

    return run


class RedisBench:
    scale = 1
    trips_unit = "requests"
    kinds = (BASE, OURS, RPY, PRL, FK)

    def __init__(self, url: str, ports: list[int], cluster: bool) -> None:
        self.name = "redis-cluster" if cluster else "redis"
        self.url, self.ports, self.cluster = url, ports, cluster
        r = redis_client(self.target())
        load_scripts(r)
        assert r.script_load(C.FENCE_SET.text) == C.FENCE_SET.sha
        r.close()

    def target(self) -> dict[str, Any]:
        return {"url": self.url, "ports": self.ports, "cluster": self.cluster}

    @contextlib.contextmanager
    def counting(self) -> Iterator[tuple[Callable[[], int], dict[str, Any]]]:
        with count_redis_requests() as count:
            yield count, self.target()

    def _tag(self, name: str) -> str:
        """A name whose keys share one Cluster slot (a hash tag) on a Cluster."""
        return "{" + name + "}" if self.cluster else name

    def _sync(self, t: dict[str, Any], stack: contextlib.ExitStack) -> tuple[Any, Any]:
        r = redis_client(t)
        stack.callback(r.close)
        coord = idemlock.connect(t["url"], key_prefix=new_prefix())
        stack.callback(coord.close)
        return r, coord

    def sync_fns(
        self, op: str, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        where = (UNC, op, self.name)
        r, coord = self._sync(t, stack)
        raw = Raw(r)
        fns: dict[str, SyncFn]
        builds: dict[str, Callable[[], SyncFn]]
        if op == LOCK_OP:
            fns = {
                BASE: raw.sync_lock_pairs,
                OURS: ours_lock_pairs(coord),
                OURS_PORT: port_lock_pairs(coord),
            }
            builds = {
                RPY: lambda: redispy_lock_pairs(r, name=new_prefix("rp")),
                PRL: lambda: prl_lock_pairs(
                    r, name=self._tag(new_prefix("prl")), strict=not self.cluster
                ),
                FK: lambda: fencekit_lock_pairs(r, prefix=self._tag(new_prefix("fk"))),
            }
        else:
            fns = {
                BASE: raw.sync_claim_pairs,
                OURS: ours_claim_pairs(coord),
                OURS_PORT: port_claim_pairs(coord),
            }
            builds = {
                FK: lambda: fencekit_guard_pairs(r, prefix=self._tag(new_prefix("fk"))),
                PT: lambda: powertools_pairs(r),
            }
        for name, build in builds.items():
            if (fn := peer(res, where, name, build)) is not None:
                fns[name] = fn
        return fns

    async def async_fns(
        self, op: str, tasks: int, stack: contextlib.AsyncExitStack, res: Results, where: Any
    ) -> dict[str, Make]:
        t = self.target()
        ar = redis_aclient(t)
        stack.push_async_callback(ar.aclose)
        if self.cluster:
            await ar.initialize()
        coord = idemlock.aio.connect(t["url"], key_prefix=new_prefix())
        stack.push_async_callback(coord.close)
        raw = Raw(ar)
        fns: dict[str, Make]
        if op == LOCK_OP:

            async def raw_lock(t: int, count: int) -> None:
                await raw.async_lock_pairs(count, key=f"k{t}")

            fns = {BASE: raw_lock, OURS: aio_lock(coord)}
            prefix = new_prefix("arp")

            async def build_rpy() -> Make:
                async def make(t: int, count: int) -> None:
                    for _ in range(count):
                        lock = ar.lock(f"{prefix}:{t}", timeout=30)
                        assert await lock.acquire(blocking=False)
                        await lock.release()

                return make

            if (fn := await apeer(res, where, RPY, build_rpy)) is not None:
                fns[RPY] = fn
            return fns

        async def raw_claim(t: int, count: int) -> None:
            await raw.async_claim_pairs(count, tag=f"{uuid.uuid4().hex[:6]}-{t}")

        fns = {BASE: raw_claim, OURS: aio_claim(coord)}

        async def build_ik() -> Make:
            from idemkit.backends.redis import RedisBackend

            client = redis_aclient(t)
            if self.cluster:
                await client.initialize()
            backend = RedisBackend(client, namespace=new_prefix("ik"))
            stack.push_async_callback(backend.aclose)
            return ik_claim(backend)

        if (fn := await apeer(res, where, IK, build_ik)) is not None:
            fns[IK] = fn
        return fns

    def job_fns(
        self, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        where = (JOB, JOB_OP, self.name)
        r, coord = self._sync(t, stack)
        loop = new_loop(stack)
        acoord = idemlock.aio.connect(t["url"], key_prefix=new_prefix())
        stack.callback(lambda: loop.run_until_complete(acoord.close()))
        fns: dict[str, SyncFn] = {
            BASE: redis_raw_job(Raw(r)),
            OURS: ours_job(coord),
            OURS_AIO: on_loop(loop, ours_ajob(acoord)),
        }

        def build_ik() -> SyncFn:
            from idemkit.backends.redis import RedisBackend

            ar = redis_aclient(t)
            backend = RedisBackend(ar, namespace=new_prefix("ik"))
            stack.callback(lambda: loop.run_until_complete(backend.aclose()))

            async def write(key: str) -> None:
                await ar.set(f"ikout:{key}", "done")

            return on_loop(loop, ik_job(backend, write))

        builds: dict[str, Callable[[], SyncFn]] = {
            OURS_W: lambda: ours_job_together(coord),
            FK: lambda: fencekit_job(r, prefix=self._tag(new_prefix("fkj"))),
            RPY: lambda: lock_job(r, lambda key: r.lock(f"rpj:{key}", timeout=300)),
            PRL: lambda: lock_job(r, self._prl(r)),
            PT: lambda: powertools_job(r),
            IK: build_ik,
        }
        for name, build in builds.items():
            if (fn := peer(res, where, name, build)) is not None:
                fns[name] = fn
        return fns

    def _prl(self, r: Any) -> Callable[[str], Any]:
        import redis_lock

        return lambda key: redis_lock.Lock(
            r, self._tag(f"prlj:{key}"), expire=300, strict=not self.cluster
        )
