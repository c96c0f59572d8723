"""The Redis and Redis Cluster adapter; the baseline is raw redis-py calling EVALSHA
on idemlock's own scripts with the same arguments (the same round trips)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import common as c
import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from common import new_prefix

import idemlock
from idemlock.stores.redis import _common as C
from subjects import base as sb
from subjects import peers as pe


class Raw:
    """EVALSHA of idemlock's scripts with the arguments the store would send; each pair
    is its two calls' arguments (the second made from the first's reply), sent by the
    sync or the asyncio client."""

    def __init__(self, client: Any) -> None:
        self.r = client
        self.ns = "raw" + uuid.uuid4().hex[:6] + ":jobs"

    def lock_pair(self, key: str) -> tuple[tuple[Any, ...], Callable[[Any], tuple[Any, ...]]]:
        n, owner = C.names(self.ns, key), "owner-" + key
        acquire = (C.ACQUIRE.sha, 2, n.lock, n.waiters, owner, 30_000, c.KEEP, b"", b"")

        def release(reply: Any) -> tuple[Any, ...]:
            token = reply[1]
            return (C.RELEASE.sha, 2, n.lock, n.waiters, owner, token, c.KEEP, 10,
                    n.lock_channel, C.nonce())  # fmt: skip

        return (*acquire, C.REGISTER_MS), release

    def claim_pair(self, key: str) -> tuple[tuple[Any, ...], Callable[[Any], tuple[Any, ...]]]:
        n, tok = C.names(self.ns, key), C.pack_id(uuid.uuid4().hex)

        def complete(_: Any) -> tuple[Any, ...]:
            return (C.COMPLETE.sha, 1, n.claim, tok, c.RESULT_BYTES, c.TTL_MS, n.claim_channel,
                    C.nonce())  # fmt: skip

        return (C.CLAIM.sha, 1, n.claim, FP, tok, c.LEASE_MS, c.KEEP), complete

    def sync_pairs(self, op: str) -> c.SyncFn:
        def run(count: int) -> None:
            r, (first, then) = self.r, self.lock_pair("k")
            tag = uuid.uuid4().hex[:6]
            for i in range(count):
                if op != c.LOCK_OP:
                    first, then = self.claim_pair(f"{tag}-{i}")
                r.evalsha(*then(r.evalsha(*first)))

        return run

    def async_pairs(self, op: str) -> c.Make:
        async def make(t: int, count: int) -> None:
            r, (first, then) = self.r, self.lock_pair(f"k{t}")
            tag = uuid.uuid4().hex[:6]
            for i in range(count):
                if op != c.LOCK_OP:
                    first, then = self.claim_pair(f"{tag}-{t}-{i}")
                await r.evalsha(*then(await r.evalsha(*first)))

        return make


FP = C.pack_id("ab" * 32)
UNLOCK_LUA = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) "
    "else return 0 end"
)


def redis_client(t: dict[str, Any]) -> Any:
    if t["cluster"]:
        return redis.cluster.RedisCluster(host="127.0.0.1", port=t["ports"][0], **c.CLIENT)
    return redis.Redis(port=t["ports"][0], **c.CLIENT)


def redis_aclient(t: dict[str, Any]) -> Any:
    if t["cluster"]:
        return redis.asyncio.cluster.RedisCluster(host="127.0.0.1", port=t["ports"][0], **c.CLIENT)
    return redis.asyncio.Redis(port=t["ports"][0], **c.CLIENT)


def redis_raw_job(raw: Raw) -> c.SyncFn:
    """idemlock's job issued raw: EVALSHA of its claim, fence_set and complete scripts."""
    r = raw.r

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            claim, complete = raw.claim_pair(key)
            reply = r.evalsha(*claim)
            out = f"out:{key}"
            gate = C.gate_name(raw.ns, out)
            r.evalsha(C.FENCE_SET.sha, 2, gate, out.encode(), str(int(reply[1])), b"done")
            r.evalsha(*complete(reply))

    return run


class RedisBench(sb.Adapter):
    kinds = (c.BASE, c.OURS, c.RPY, c.PRL, c.FK)

    def __init__(self, url: str, ports: list[int], cluster: bool) -> None:
        self.name = "redis-cluster" if cluster else "redis"
        self.ports, self.cluster, self._url = ports, cluster, url
        r = redis_client(self.target())
        for s in (C.ACQUIRE, C.RELEASE, C.CLAIM, C.COMPLETE, C.FENCE_SET):
            assert r.script_load(s.text) == s.sha
        r.close()

    def target(self) -> dict[str, Any]:
        return {"url": self._url, "ports": self.ports, "cluster": self.cluster}

    @contextlib.contextmanager
    def counting(self) -> Iterator[tuple[Callable[[], int], dict[str, Any]]]:
        with sb.count_redis_requests() as count:
            yield count, self.target()

    def _tag(self, name: str) -> str:
        """A name whose keys share one Cluster slot (a hash tag) on a Cluster."""
        return "{" + name + "}" if self.cluster else name

    def _client(self, t: dict[str, Any], stack: contextlib.ExitStack) -> Any:
        r = redis_client(t)
        stack.callback(r.close)
        return r

    def raw_pairs(self, op: str, t: dict[str, Any], stack: contextlib.ExitStack) -> c.SyncFn:
        return Raw(self._client(t, stack)).sync_pairs(op)

    async def araw_pairs(self, op: str, tasks: int, stack: contextlib.AsyncExitStack) -> c.Make:
        return Raw(await self._aclient(self.target(), stack)).async_pairs(op)

    def raw_job(self, t: dict[str, Any], stack: contextlib.ExitStack) -> c.SyncFn:
        return redis_raw_job(Raw(self._client(t, stack)))

    async def _aclient(self, t: dict[str, Any], stack: contextlib.AsyncExitStack) -> Any:
        ar = redis_aclient(t)
        stack.push_async_callback(ar.aclose)
        if self.cluster:
            await ar.initialize()
        return ar

    def peers(self, op: str, t: dict[str, Any], stack: contextlib.ExitStack) -> sb.Builds:
        r = self._client(t, stack)
        if op == c.LOCK_OP:
            return {
                c.RPY: lambda: pe.redispy_lock_pairs(r, name=new_prefix("rp")),
                c.PRL: lambda: pe.prl_lock_pairs(
                    r, name=self._tag(new_prefix("prl")), strict=not self.cluster
                ),
                c.FK: lambda: pe.fencekit_lock_pairs(r, prefix=self._tag(new_prefix("fk"))),
            }
        return {
            c.FK: lambda: pe.fencekit_guard_pairs(r, prefix=self._tag(new_prefix("fk"))),
            c.PT: lambda: pe.powertools(r, job=False),
        }

    def apeers(self, op: str, t: dict[str, Any], stack: contextlib.AsyncExitStack) -> sb.ABuilds:
        if op == c.LOCK_OP:

            async def build_rpy() -> c.Make:
                ar, prefix = await self._aclient(t, stack), new_prefix("arp")

                async def make(t: int, count: int) -> None:
                    for _ in range(count):
                        lock = ar.lock(f"{prefix}:{t}", timeout=30)
                        assert await lock.acquire(blocking=False)
                        await lock.release()

                return make

            return {c.RPY: build_rpy}

        async def build_ik() -> c.Make:
            from idemkit.backends.redis import RedisBackend

            client = redis_aclient(t)
            if self.cluster:
                await client.initialize()
            backend = RedisBackend(client, namespace=new_prefix("ik"))
            stack.push_async_callback(backend.aclose)
            return pe.ik_claim(backend)

        return {c.IK: build_ik}

    def job_peers(
        self, coord: idemlock.Coordinator, t: dict[str, Any], stack: contextlib.ExitStack,
        loop: Any,
    ) -> sb.Builds:  # fmt: skip
        r = self._client(t, stack)

        def build_ik() -> c.SyncFn:
            from idemkit.backends.redis import RedisBackend

            ar = redis_aclient(t)
            backend = RedisBackend(ar, namespace=new_prefix("ik"))
            return pe.ik_job(backend, lambda key: ar.set(f"ikout:{key}", "done"), loop, stack)

        return {
            c.OURS_W: lambda: sb.ours_job_together(coord),
            c.FK: lambda: pe.fencekit_job(r, prefix=self._tag(new_prefix("fkj"))),
            c.RPY: lambda: pe.lock_job(r, lambda key: r.lock(f"rpj:{key}", timeout=300)),
            c.PRL: lambda: pe.lock_job(r, self._prl(r)),
            c.PT: lambda: pe.powertools(r, job=True),
            c.IK: build_ik,
        }

    def _prl(self, r: Any) -> Callable[[str], Any]:
        import redis_lock

        return lambda key: redis_lock.Lock(
            r, self._tag(f"prlj:{key}"), expire=300, strict=not self.cluster
        )
