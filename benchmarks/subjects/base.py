"""idemlock's own subjects on any store (its API and its store port), the helpers
every adapter uses, and the counters of round trips (Redis requests, SQLite
transactions; PostgreSQL's are the turns through the tests' TcpProxy)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import uuid
import warnings
from collections.abc import Awaitable, Callable, Iterator
from typing import Any
from unittest import mock

import common as c
from common import apeer, new_prefix, peer

import idemlock
import idemlock.aio
from idemlock import Claimed

# Powertools warns on every call outside Lambda that it cannot tell the time left (no
# Lambda context); its Redis layer's class is marked deprecated in favour of an alias.
warnings.filterwarnings("ignore", message="Couldn't determine the remaining time")
warnings.filterwarnings("ignore", message="RedisCachePersistenceLayer will be removed")


def ours_lock_pairs(coord: idemlock.Coordinator) -> Callable[[int], None]:
    locks = coord.lock(c.LOCK)

    def run(count: int) -> None:
        for _ in range(count):
            lease = locks.acquire("k")
            assert lease is not None
            locks.release(lease)

    return run


def ours_job(
    coord: idemlock.Coordinator,
    write: Callable[[str, int], Any] | None = None,
    *,
    effect: bool = True,
    together: bool = False,
) -> c.SyncFn:
    """claim -> ``write(key, fence)`` (by default through the store's fence gate) ->
    complete; ``effect=False``: claim+complete alone; ``together``: the effect written by
    the completing script (one commit, 2 round trips, no late write can land after it)."""
    port = coord.idempotency(c.SPEC)

    def gate(key: str, fence: int) -> None:
        coord.fence(f"out:{key}").set_if_fresh(fence, f"out:{key}", b"done")

    do = write or gate

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            claim = port.claim(key)
            assert isinstance(claim, Claimed)
            if together:
                port.complete(claim.token, c.RESULT, writes={f"out:{key}": b"done"})
                continue
            if effect:
                do(key, claim.fence)
            port.complete(claim.token, c.RESULT)

    return run


def ours_claim_pairs(coord: idemlock.Coordinator) -> c.SyncFn:
    return ours_job(coord, effect=False)


def ours_job_together(coord: idemlock.Coordinator) -> c.SyncFn:
    return ours_job(coord, together=True)


def ours_ajob(
    coord: idemlock.aio.AsyncCoordinator, write: Callable[[str, int], Awaitable[Any]] | None = None
) -> Callable[[int], Awaitable[None]]:
    """The same job on the asyncio API (1 task)."""
    port = coord.idempotency(c.SPEC)

    async def gate(key: str, fence: int) -> None:
        await coord.fence(f"out:{key}").set_if_fresh(fence, f"out:{key}", b"done")

    do = write or gate

    async def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            claim = await port.claim(key)
            assert isinstance(claim, Claimed)
            await do(key, claim.fence)
            await port.complete(claim.token, c.RESULT)

    return run


def port_pairs(coord: idemlock.Coordinator, op: str) -> c.SyncFn:
    """The store port alone: what the store adapter costs, without the API's own work
    per call (key checks, fingerprint, result encoding, typed outcomes)."""
    store, owner = coord.store, uuid.uuid4().hex

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            if op == c.LOCK_OP:
                store.release("bench", "k", owner, store.acquire("bench", "k", owner, 30_000).token)
            else:
                key, token = f"{tag}-{i}", uuid.uuid4().hex
                store.claim("bench", key, "fp", token, c.LEASE_MS)
                store.complete("bench", key, token, c.RESULT_BYTES, c.TTL_MS)

    return run


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


ENDS = ("COMMIT", "END", "ROLLBACK")


@contextlib.contextmanager
def count_sqlite_transactions() -> Iterator[Callable[[], int]]:
    """Transactions run on SQLite connections opened meanwhile (every BEGIN, and every
    statement run outside one, which SQLite runs as a transaction of its own)."""
    real, box = sqlite3.connect, [0]

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn, inside = real(*args, **kwargs), [False]

        def trace(sql: str) -> None:
            head = sql.lstrip()[:8].upper()
            box[0] += head.startswith("BEGIN") or not (inside[0] or head.startswith(ENDS))
            if head.startswith(("BEGIN", *ENDS)):
                inside[0] = head.startswith("BEGIN")

        conn.set_trace_callback(trace)
        return conn

    with mock.patch.object(sqlite3, "connect", connect):
        yield lambda: box[0]


def aio_pairs(coord: idemlock.aio.AsyncCoordinator, op: str) -> c.Make:
    locks, port = coord.lock(c.LOCK), coord.idempotency(c.SPEC)

    async def make(t: int, count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            if op == c.LOCK_OP:
                lease = await locks.acquire(f"k{t}")
                assert lease is not None
                await locks.release(lease)
            else:
                claim = await port.claim(f"{tag}-{t}-{i}")
                assert isinstance(claim, Claimed)
                await port.complete(claim.token, c.RESULT)

    return make


def aio_lock(coord: idemlock.aio.AsyncCoordinator) -> c.Make:
    return aio_pairs(coord, c.LOCK_OP)


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[int], Awaitable[None]]) -> c.SyncFn:
    """An asyncio subject measured among sync ones (1 task, its loop kept between calls)."""
    return lambda n: loop.run_until_complete(fn(n))


def new_loop(stack: contextlib.ExitStack) -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    stack.callback(loop.close)
    return loop


Builds = dict[str, Callable[[], c.SyncFn]]
ABuilds = dict[str, Callable[[], Awaitable[c.Make]]]


class Adapter:
    """One store's subjects. A store says how to open it (``url``) and what its raw
    baseline is (``raw_pairs``, ``araw_pairs``, ``raw_job``), which effect its job
    writes (``write``/``awrite``; none: the store's fence gate) and which peers run on
    it; idemlock's subjects and the way peers join are the same for every store."""

    name = ""
    scale = 1
    kinds: tuple[str, ...] = (c.BASE, c.OURS)
    counting: Any = None

    def target(self) -> dict[str, Any]:
        return {}

    def contention_target(self) -> dict[str, Any]:
        return self.target()

    def url(self, t: dict[str, Any]) -> str:
        return str(t["url"])

    # every store defines raw_pairs(op, t, stack), araw_pairs(op, tasks, stack), raw_job(t, stack)

    def write(self, url: str, stack: contextlib.ExitStack) -> Callable[[str, int], Any] | None:
        return None

    def awrite(
        self, url: str, stack: contextlib.ExitStack, loop: asyncio.AbstractEventLoop
    ) -> Callable[[str, int], Awaitable[Any]] | None:
        return None

    def peers(self, op: str, t: dict[str, Any], stack: contextlib.ExitStack) -> Builds:
        return {}

    def apeers(self, op: str, t: dict[str, Any], stack: contextlib.AsyncExitStack) -> ABuilds:
        return {}

    def job_peers(
        self, coord: idemlock.Coordinator, t: dict[str, Any], stack: contextlib.ExitStack,
        loop: asyncio.AbstractEventLoop,
    ) -> Builds:  # fmt: skip
        return {}

    def coord(self, url: str, stack: contextlib.ExitStack) -> idemlock.Coordinator:
        coord = idemlock.connect(url, key_prefix=new_prefix())
        stack.callback(coord.close)
        return coord

    def sync_fns(
        self, op: str, t: dict[str, Any], stack: contextlib.ExitStack, res: c.Results
    ) -> dict[str, c.SyncFn]:
        coord = self.coord(self.url(t), stack)
        fns = {
            c.BASE: self.raw_pairs(op, t, stack),
            c.OURS: (ours_lock_pairs if op == c.LOCK_OP else ours_claim_pairs)(coord),
            c.OURS_PORT: port_pairs(coord, op),
        }
        return add_peers(fns, res, (c.UNC, op, self.name), self.peers(op, t, stack))

    async def async_fns(
        self, op: str, tasks: int, stack: contextlib.AsyncExitStack, res: c.Results, where: Any
    ) -> dict[str, c.Make]:
        t = self.target()
        coord = idemlock.aio.connect(self.url(t), key_prefix=new_prefix())
        stack.push_async_callback(coord.close)
        fns = {
            c.BASE: await self.araw_pairs(op, tasks, stack),
            c.OURS: aio_pairs(coord, op),
        }
        for name, build in self.apeers(op, t, stack).items():
            if (fn := await apeer(res, where, name, build)) is not None:
                fns[name] = fn
        return fns

    def job_fns(
        self, t: dict[str, Any], stack: contextlib.ExitStack, res: c.Results
    ) -> dict[str, c.SyncFn]:
        url, aurl, loop = self.url(t), self.url(t), new_loop(stack)
        coord = self.coord(url, stack)
        acoord = idemlock.aio.connect(aurl, key_prefix=new_prefix())
        stack.callback(lambda: loop.run_until_complete(acoord.close()))
        fns = {
            c.BASE: self.raw_job(t, stack),
            c.OURS: ours_job(coord, self.write(url, stack)),
            c.OURS_AIO: on_loop(loop, ours_ajob(acoord, self.awrite(aurl, stack, loop))),
        }
        builds = self.job_peers(coord, t, stack, loop)
        return add_peers(fns, res, (c.JOB, c.JOB_OP, self.name), builds)


def add_peers(
    fns: dict[str, c.SyncFn], res: c.Results, where: tuple[str, str, str], builds: Builds
) -> dict[str, c.SyncFn]:
    for name, build in builds.items():
        if (fn := peer(res, where, name, build)) is not None:
            fns[name] = fn
    return fns
