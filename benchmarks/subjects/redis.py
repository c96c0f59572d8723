"""The Redis and Redis Cluster adapter; the baseline is raw redis-py calling EVALSHA
on idemlock's own scripts with the same arguments (the same round trips)."""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, ClassVar
from unittest import mock

import common as c
from common import new_prefix

from idemlock.stores.redis import _common as C
from subjects import peers as pe
from subjects.base import Adapter, Ctx, Peers, Raw, ours_job_together

FP = C.pack_id("ab" * 32)
UNLOCK_LUA = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) "
    "else return 0 end"
)


@contextlib.contextmanager
def count_redis_requests() -> Iterator[Callable[[], int]]:
    """Requests written to Redis sockets (redis-py's, sync and asyncio, and the asyncio
    store's own writes): one per command, one per pipeline. Counted on the client
    because the server's INFO commandstats also counts every command a Lua script calls,
    which is no round trip."""
    import redis.asyncio.connection as aconn
    import redis.connection as sconn

    from idemlock.stores.redis._pipeline import Pipe

    box = [0]

    def counted(orig: Any) -> Any:
        def send(*args: Any, **kwargs: Any) -> Any:
            box[0] += 1
            return orig(*args, **kwargs)

        return send

    def flush(self: Any, orig: Any = Pipe._flush) -> None:
        box[0] += bool(self._out and self.lost is None)
        orig(self)

    with contextlib.ExitStack() as stack:
        for conn in (sconn.AbstractConnection, aconn.AbstractConnection):
            send = counted(conn.send_packed_command)
            stack.enter_context(mock.patch.object(conn, "send_packed_command", send))
        # The asyncio store's own writes, past redis-py's command layer: pipelined, one
        # write per event-loop turn, whatever it carries.
        stack.enter_context(mock.patch.object(Pipe, "_flush", flush))
        yield lambda: box[0]


class RedisRaw(Raw):
    """EVALSHA of idemlock's scripts with the arguments the store would send, on the
    sync or the asyncio client (``asend`` is ``send``: the asyncio client's is awaitable);
    the job's write is idemlock's fence_set script."""

    def __init__(self, client: Any) -> None:
        self.r = client
        self.ns = "raw" + uuid.uuid4().hex[:6] + ":jobs"
        # a lock's key is the same pair after pair: its names are hashed once
        self.lock_names = functools.cache(functools.partial(C.names, self.ns))

    def steps(self, op: str, key: str) -> tuple[Any, Callable[[Any], Any]]:
        if op == c.LOCK_OP:
            n, owner = self.lock_names(key), "owner-" + key

            def release(reply: Any) -> tuple[Any, ...]:
                return (C.RELEASE.sha, 2, n.lock, n.waiters, owner, reply[1], c.KEEP, 10,
                        n.lock_channel, C.nonce())  # fmt: skip

            # ARGV: owner, ttl_ms, keep_ms, gid, register_ms, limit (a lock: 1), value
            acquire = (C.ACQUIRE.sha, 2, n.lock, n.waiters, owner, 30_000, c.KEEP, b"")
            return (*acquire, C.REGISTER_MS, 1, b""), release
        n, tok = C.names(self.ns, key), C.pack_id(uuid.uuid4().hex)

        def complete(_: Any) -> tuple[Any, ...]:
            return (C.COMPLETE.sha, 2, n.claim, n.steps, tok, c.RESULT_BYTES, c.TTL_MS,
                    n.claim_channel, C.nonce())  # fmt: skip

        return (C.CLAIM.sha, 2, n.claim, n.steps, FP, tok, c.LEASE_MS, c.KEEP), complete

    def send(self, request: tuple[Any, ...]) -> Any:
        return self.r.evalsha(*request)

    asend = send

    def write(self, key: str, reply: Any) -> None:
        out = f"out:{key}"
        gate = C.gate_name(self.ns, out)
        self.r.evalsha(C.FENCE_SET.sha, 2, gate, out.encode(), str(int(reply[1])), b"done")


async def ik_backend(x: Ctx, max_size: int) -> Any:
    from idemkit.backends.redis import RedisBackend

    client = pe.redis_client(x.t, aio=True)
    if x.t["cluster"]:
        await client.initialize()
    return RedisBackend(client, namespace=new_prefix("ik"))


def ik_write(x: Ctx) -> Any:
    """The job's effect: a SET."""
    ar, loop = pe.redis_client(x.t, aio=True), x.loop
    assert loop is not None
    x.stack.callback(lambda: loop.run_until_complete(ar.aclose()))
    return lambda key: ar.set(f"ikout:{key}", "done")


class RedisBench(Adapter):
    peers: ClassVar[Peers] = {
        c.OURS_W: {c.JOB_OP: lambda x: ours_job_together(x.coord)},
        **pe.REDIS_PEERS,
        c.IK: pe.ik_peer(ik_backend, ik_write),
    }

    def __init__(self, url: str, ports: list[int], cluster: bool) -> None:
        self.name = "redis-cluster" if cluster else "redis"
        self.ports, self.cluster, self._url = ports, cluster, url
        r = pe.redis_client(self.target())
        for s in (C.ACQUIRE, C.RELEASE, C.CLAIM, C.COMPLETE, C.FENCE_SET):
            assert r.script_load(s.text) == s.sha
        r.close()

    def target(self) -> dict[str, Any]:
        return {"url": self._url, "ports": self.ports, "cluster": self.cluster}

    @contextlib.contextmanager
    def counting(self) -> Iterator[tuple[Callable[[], int], dict[str, Any]]]:
        with count_redis_requests() as count:
            yield count, self.target()

    def raw(self, x: Ctx) -> Raw:
        return RedisRaw(pe.client(x))

    async def araw(self, x: Ctx, tasks: int) -> Raw:
        return RedisRaw(await pe.aclient(x))

    @staticmethod
    def contender(x: Ctx) -> tuple[Any, Any]:
        """SET NX PX, retried every 1 ms while another holds it; compare-and-delete."""
        r = pe.client(x)
        unlock = r.register_script(UNLOCK_LUA)

        def acquire(key: str) -> Any:
            name, token = f"{x.t['prefix']}:raw:{key}", uuid.uuid4().hex
            while not r.set(name, token, nx=True, px=30_000):
                time.sleep(0.001)
            return name, token

        return acquire, lambda held: unlock(keys=[held[0]], args=[held[1]])
