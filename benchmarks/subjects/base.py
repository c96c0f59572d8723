"""idemlock's own subjects on any store, the generic driver of a raw baseline, and the
adapter every store fills in (how to open it, its raw requests, its peers)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
import warnings
from collections.abc import Awaitable, Callable
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

ASYNC = "asyncio "  # a peer slot's prefix for the asyncio pairs (e.g. "asyncio acquire+release")


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


def aio_pairs(
    coord: idemlock.aio.AsyncCoordinator,
    op: str,
    write: Callable[[str, int], Awaitable[Any]] | None = None,
) -> c.Make:
    """The asyncio API's pairs; the job (``op`` is JOB_OP) writes ``write(key, fence)``
    (by default through the fence gate) between claim and complete."""
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


def ours_contender(t: dict[str, Any], stack: contextlib.ExitStack) -> tuple[Any, Any]:
    """idemlock's acquire (waiting up to 30 s) and release, for the contention runs."""
    coord = idemlock.connect(t["url"], key_prefix=t["prefix"] or new_prefix())
    stack.callback(coord.close)
    locks = coord.lock(c.LOCK)

    def acquire(key: str) -> Any:
        lease = locks.acquire(key, wait=30)
        if lease is None:
            raise RuntimeError("idemlock: no lease within 30 s")
        return lease

    return acquire, locks.release


class Raw:
    """A raw baseline as requests: ``steps(op, key)`` gives a pair's first request and
    how to make the second from the first's reply; ``send`` (``asend``: awaitable) sends
    one; ``write(key, reply)`` is the job's fenced write between the two."""

    spread = 1  # how many lock keys the sync pairs take in turn

    def steps(self, op: str, key: str) -> tuple[Any, Callable[[Any], Any]]:
        raise NotImplementedError

    def send(self, request: Any) -> Any:
        raise NotImplementedError

    def asend(self, request: Any) -> Awaitable[Any]:
        raise NotImplementedError

    def write(self, key: str, reply: Any) -> None:
        raise NotImplementedError

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


@dataclass
class Ctx:
    """What a peer's subject is built from: the store's target, the stack its clients
    close on and, for the job, its event loop and idemlock's coordinator."""

    t: dict[str, Any]
    stack: Any
    loop: asyncio.AbstractEventLoop | None = None
    coord: idemlock.Coordinator | None = None


#: peer -> slot (an operation, ASYNC + an operation, JOB_OP or HAND_OP) -> build(Ctx)
Peers = dict[str, dict[str, Callable[[Ctx], Any]]]


def on_loop(loop: asyncio.AbstractEventLoop, make: c.Make) -> c.SyncFn:
    """An asyncio subject measured among sync ones (1 task, its loop kept between calls)."""
    return lambda n: loop.run_until_complete(make(0, n))


class Adapter:
    """One store's subjects. A store says how to open it (``url``), what its raw
    baseline is (``raw``, ``araw``: a ``Raw``; ``contender``), which effect its job
    writes (``write``/``awrite``; none: the store's fence gate) and which peers run on it
    (``peers``); idemlock's subjects and the way peers join are the same everywhere."""

    name = ""
    scale = 1
    counting: Any = None
    peers: ClassVar[Peers] = {}

    def target(self) -> dict[str, Any]:
        return {}

    def contention_target(self) -> dict[str, Any]:
        return self.target()

    def url(self, t: dict[str, Any]) -> str:
        return str(t["url"])

    def raw(self, t: dict[str, Any], stack: contextlib.ExitStack) -> Raw:
        raise NotImplementedError

    async def araw(self, tasks: int, stack: contextlib.AsyncExitStack) -> Raw:
        raise NotImplementedError

    def write(self, url: str, stack: contextlib.ExitStack) -> Callable[[str, int], Any] | None:
        return None

    def awrite(
        self, url: str, stack: contextlib.ExitStack, loop: asyncio.AbstractEventLoop
    ) -> Callable[[str, int], Awaitable[Any]] | None:
        return None

    def builds(self, slot: str) -> dict[str, Callable[[Ctx], Any]]:
        return {name: of[slot] for name, of in self.peers.items() if slot in of}

    @property
    def kinds(self) -> tuple[str, ...]:
        """The contention run's subjects."""
        return (c.BASE, c.OURS, *self.builds(c.HAND_OP))

    def coord(self, url: str, stack: contextlib.ExitStack) -> idemlock.Coordinator:
        coord = idemlock.connect(url, key_prefix=new_prefix())
        stack.callback(coord.close)
        return coord

    def add_peers(
        self, fns: dict[str, c.SyncFn], res: c.Results, where: tuple[str, str, str], ctx: Ctx
    ) -> dict[str, c.SyncFn]:
        """The peers of ``where``'s operation that can run, after ``fns``."""
        for name, build in self.builds(where[1]).items():
            if (fn := peer(res, where, name, partial(build, ctx))) is not None:
                fns[name] = fn
        return fns

    def sync_fns(
        self, op: str, t: dict[str, Any], stack: contextlib.ExitStack, res: c.Results
    ) -> dict[str, c.SyncFn]:
        coord = self.coord(self.url(t), stack)
        fns = {
            c.BASE: self.raw(t, stack).run(op),
            c.OURS: (ours_lock_pairs if op == c.LOCK_OP else ours_claim_pairs)(coord),
            c.OURS_PORT: port_pairs(coord, op),
        }
        return self.add_peers(fns, res, (c.UNC, op, self.name), Ctx(t, stack))

    async def async_fns(
        self, op: str, tasks: int, stack: contextlib.AsyncExitStack, res: c.Results, where: Any
    ) -> dict[str, c.Make]:
        t = self.target()
        coord = idemlock.aio.connect(self.url(t), key_prefix=new_prefix())
        stack.push_async_callback(coord.close)
        fns = {c.BASE: (await self.araw(tasks, stack)).make(op), c.OURS: aio_pairs(coord, op)}
        for name, build in self.builds(ASYNC + op).items():
            if (fn := await apeer(res, where, name, partial(build, Ctx(t, stack)))) is not None:
                fns[name] = fn
        return fns

    def job_fns(
        self, t: dict[str, Any], stack: contextlib.ExitStack, res: c.Results
    ) -> dict[str, c.SyncFn]:
        # every url(t) of SQLite is a file of its own
        url, aurl, loop = self.url(t), self.url(t), asyncio.new_event_loop()
        stack.callback(loop.close)
        coord = self.coord(url, stack)
        acoord = idemlock.aio.connect(aurl, key_prefix=new_prefix())
        stack.callback(lambda: loop.run_until_complete(acoord.close()))
        ajob = aio_pairs(acoord, c.JOB_OP, self.awrite(aurl, stack, loop))
        fns = {
            c.BASE: self.raw(t, stack).run(c.JOB_OP),
            c.OURS: ours_job(coord, self.write(url, stack)),
            c.OURS_AIO: on_loop(loop, ajob),
        }
        return self.add_peers(fns, res, (c.JOB, c.JOB_OP, self.name), Ctx(t, stack, loop, coord))
