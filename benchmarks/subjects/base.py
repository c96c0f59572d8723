"""idemlock's own subjects on any store, the one driver of every raw baseline (``Raw``),
and the adapter every store fills in (``Adapter``)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import common as c
from common import apeer, new_prefix, peer

import idemlock
import idemlock.aio
from idemlock import Claimed

# Powertools warns on every call outside Lambda that it cannot tell the time left (no
# Lambda context); its Redis layer's class is marked deprecated in favour of an alias.
warnings.filterwarnings("ignore", message="Couldn't determine the remaining time")
warnings.filterwarnings("ignore", message="RedisCachePersistenceLayer will be removed")

ASYNC = "asyncio "  # a peer's slot for the asyncio pairs: ASYNC + the operation
Write = Callable[[str, int], Any]  # the job's effect: write(key, fence)


def ours_lock_pairs(coord: idemlock.Coordinator) -> c.SyncFn:
    locks = coord.lock(c.LOCK)

    def run(count: int) -> None:
        for _ in range(count):
            lease = locks.acquire("k")
            assert lease is not None
            locks.release(lease)

    return run


def ours_job(
    coord: Any, write: Write | None = None, *, effect=True, together=False, spec=c.SPEC
) -> c.SyncFn:
    """claim -> ``write(key, fence)`` (by default through the store's fence gate) ->
    complete, on ``spec``'s port; ``effect=False``: claim+complete alone; ``together``: the
    effect written by the completing script (one commit, 2 round trips, no late write can
    land after it)."""
    port = coord.idempotency(spec)

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
                port.complete(claim.token, c.RESULT, writes={port.write_key(key, "out"): b"done"})
                continue
            if effect:
                do(key, claim.fence)
            port.complete(claim.token, c.RESULT)

    return run


def ours_claim_pairs(coord: Any, spec: idemlock.IdempotencySpec = c.SPEC) -> c.SyncFn:
    return ours_job(coord, effect=False, spec=spec)


def ours_job_together(coord: idemlock.Coordinator) -> c.SyncFn:
    return ours_job(coord, together=True)


def aio_pairs(coord: idemlock.aio.AsyncCoordinator, op: str, write: Write | None = None) -> c.Make:
    """The asyncio API's pairs; the job (``op`` is JOB_OP) awaits ``write(key, fence)``
    (by default the fence gate's) between claim and complete."""
    locks, port = coord.lock(c.LOCK), coord.idempotency(c.SPEC)

    async def gate(key: str, fence: int) -> None:
        await coord.fence(f"out:{key}").set_if_fresh(fence, f"out:{key}", b"done")

    do = write or gate

    async def make(t: int, count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            if op == c.LOCK_OP:
                lease = await locks.acquire(f"k{t}")
                assert lease is not None
                await locks.release(lease)
                continue
            key = f"{tag}-{t}-{i}"
            claim = await port.claim(key)
            assert isinstance(claim, Claimed)
            if op == c.JOB_OP:
                await do(key, claim.fence)
            await port.complete(claim.token, c.RESULT)

    return make


def aio_lock(coord: idemlock.aio.AsyncCoordinator) -> c.Make:
    return aio_pairs(coord, c.LOCK_OP)


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


def aport_pairs(coord: idemlock.aio.AsyncCoordinator, op: str) -> c.Make:
    """``port_pairs`` on the asyncio store port (each task its own lock key)."""
    store, owner = coord.store, uuid.uuid4().hex

    async def make(t: int, count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            if op == c.LOCK_OP:
                lease = await store.acquire("bench", f"k{t}", owner, 30_000)
                await store.release("bench", f"k{t}", owner, lease.token)
            else:
                key, token = f"{tag}-{t}-{i}", uuid.uuid4().hex
                await store.claim("bench", key, "fp", token, c.LEASE_MS)
                await store.complete("bench", key, token, c.RESULT_BYTES, c.TTL_MS)

    return make


@dataclass
class Ctx:
    """What a subject is built from: the store's target, the stack its clients close
    on and, for the job, its event loop and idemlock's coordinator."""

    t: dict[str, Any]
    stack: Any
    loop: asyncio.AbstractEventLoop | None = None
    coord: idemlock.Coordinator | None = None


def ours_contender(x: Ctx, aio: bool = False) -> tuple[Any, Any]:
    """idemlock's acquire (waiting up to 30 s) and release, for the contention runs; with
    ``aio``, through idemlock.aio on one event loop of this process, kept between calls:
    it runs while the contender waits, so the store's wake-up reaches the waiting task."""
    prefix = x.t["prefix"] or new_prefix()
    if aio:
        loop = asyncio.new_event_loop()
        x.stack.callback(loop.close)
        coord: Any = idemlock.aio.connect(x.t["url"], key_prefix=prefix)
        x.stack.callback(lambda: loop.run_until_complete(coord.close()))
    else:
        coord = idemlock.connect(x.t["url"], key_prefix=prefix)
        x.stack.callback(coord.close)
    locks = coord.lock(c.LOCK)
    done = loop.run_until_complete if aio else lambda value: value

    def acquire(key: str) -> Any:
        lease = done(locks.acquire(key, wait=30))
        if lease is None:
            raise RuntimeError("idemlock: no lease within 30 s")
        return lease

    return acquire, lambda lease: done(locks.release(lease))


class Raw:
    """A raw baseline as requests. A store gives ``steps(op, key)``: a pair's first
    request and how to make the second from the first's reply; ``send`` (or ``asend``,
    awaitable) to send one; ``write(key, reply)``: the job's fenced write between them."""

    spread = 1  # how many lock keys the sync pairs take in turn

    def run(self, op: str) -> c.SyncFn:
        """``count`` pairs of ``op`` (JOB_OP: claim, ``write``, complete) on fresh keys."""
        steps, send, job = self.steps, self.send, op == c.JOB_OP

        def run(count: int) -> None:
            tag = uuid.uuid4().hex[:6]
            for i in range(count):
                key = f"k{i % self.spread}" if op == c.LOCK_OP else f"{tag}-{i}"
                first, then = steps(op, key)
                reply = send(first)
                if job:
                    self.write(key, reply)
                send(then(reply))

        return run

    def make(self, op: str) -> c.Make:
        steps, send = self.steps, self.asend

        async def make(t: int, count: int) -> None:
            tag = uuid.uuid4().hex[:6]
            for i in range(count):
                first, then = steps(op, f"k{t}" if op == c.LOCK_OP else f"{tag}-{t}-{i}")
                await send(then(await send(first)))

        return make


#: peer -> slot (an operation, ASYNC + an operation, JOB_OP or HAND_OP) -> build(Ctx)
Peers = dict[str, dict[str, Callable[[Ctx], Any]]]


class Adapter:
    """One store's subjects. A store says how to open it (``target``, ``url``), what its
    raw baseline is (``raw(x)``, ``araw(x, tasks)``: a ``Raw``; ``contender(x)``), which
    effect idemlock's job writes (``effect(x, url, aio)``; None: the store's fence gate)
    and which peers run on it; the rest is the same for every store."""

    name = ""
    scale = 1
    counting: Any = None  # a context manager: (count of round trips, a target)
    peers: ClassVar[Peers] = {}

    def target(self) -> dict[str, Any]:
        return {}

    def contention_target(self) -> dict[str, Any]:
        return self.target()

    def url(self, t: dict[str, Any]) -> str:
        return str(t["url"])

    async def araw(self, x: Ctx, tasks: int) -> Raw:
        return self.raw(x)  # the same baseline; its make() drives it on asyncio

    def effect(self, x: Ctx, url: str, aio: bool) -> Write | None:
        return None

    def own_sql(self, x: Ctx) -> Raw | None:
        """idemlock's own statements through the raw driver (None: not measured)."""
        return None

    def builds(self, slot: str) -> dict[str, Callable[[Ctx], Any]]:
        return {name: of[slot] for name, of in self.peers.items() if slot in of}

    def coord(self, url: str, stack: contextlib.ExitStack) -> idemlock.Coordinator:
        coord = idemlock.connect(url, key_prefix=new_prefix())
        stack.callback(coord.close)
        return coord

    def with_peers(self, fns: dict[str, Any], res: c.Results, where: Any, x: Ctx) -> Any:
        """``fns`` and the peers of ``where``'s operation that can run."""
        for name, build in self.builds(where[1]).items():
            if (fn := peer(res, where, name, partial(build, x))) is not None:
                fns[name] = fn
        return fns

    def sync_fns(self, op: str, t: Any, stack: Any, res: c.Results) -> dict[str, c.SyncFn]:
        coord, x = self.coord(self.url(t), stack), Ctx(t, stack)
        fns = {
            c.BASE: self.raw(x).run(op),
            c.OURS: (ours_lock_pairs if op == c.LOCK_OP else ours_claim_pairs)(coord),
            c.OURS_PORT: port_pairs(coord, op),
        }
        if (sql := self.own_sql(x)) is not None:
            fns[c.OURS_SQL] = sql.run(op)
        return self.with_peers(fns, res, (c.UNC, op, self.name), x)

    async def async_fns(self, op: str, tasks: int, stack: Any, res: c.Results, where: Any) -> Any:
        x = Ctx(self.target(), stack)
        coord = idemlock.aio.connect(self.url(x.t), key_prefix=new_prefix())
        stack.push_async_callback(coord.close)
        fns = {
            c.BASE: (await self.araw(x, tasks)).make(op),
            c.OURS: aio_pairs(coord, op),
            c.OURS_PORT: aport_pairs(coord, op),
        }
        for name, build in self.builds(ASYNC + op).items():
            if (fn := await apeer(res, where, name, partial(build, x))) is not None:
                fns[name] = fn
        return fns

    def job_fns(self, t: Any, stack: Any, res: c.Results) -> dict[str, c.SyncFn]:
        # two url(t): SQLite's are a file each
        url, aurl, loop = self.url(t), self.url(t), asyncio.new_event_loop()
        stack.callback(loop.close)
        x = Ctx(t, stack, loop, self.coord(url, stack))
        acoord = idemlock.aio.connect(aurl, key_prefix=new_prefix())
        stack.callback(lambda: loop.run_until_complete(acoord.close()))
        ajob = aio_pairs(acoord, c.JOB_OP, self.effect(x, aurl, aio=True))
        fns = {
            c.BASE: self.raw(x).run(c.JOB_OP),
            c.OURS: ours_job(x.coord, self.effect(x, url, aio=False)),
            # 1 task, measured among the sync subjects on a loop kept between calls
            c.OURS_AIO: lambda n: loop.run_until_complete(ajob(0, n)),
        }
        return self.with_peers(fns, res, (c.JOB, c.JOB_OP, self.name), x)
