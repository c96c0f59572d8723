"""The asyncio etcd store's I/O: the ops of :mod:`._ops` driven on ``grpc.aio``
(client, watcher), and :class:`_AsyncRunner`, the half of
:class:`~._async.AsyncEtcdStore` that differs from the sync store's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio

from ... import _forks
from ..._core.port import Channel
from ..._errors import IdemlockError, StoreUnavailable
from ..._logfields import fields as log_fields
from .._undo import Undoer
from . import _conf
from ._calls_async import AsyncCalls, drive
from ._grpc_sync import _Stubs
from ._ops import Op, Ops, Rpc, Waiter
from ._pb.etcdserverpb import rpc_pb2 as _rpc_pb2
from ._watches import Book, Group, wakes, watch_range

log = logging.getLogger("idemlock")
pb: Any = _rpc_pb2  # generated without type information


class AsyncClient(AsyncCalls):
    """grpc.aio channels to the endpoints, made on the event loop that uses them (a new
    loop gets new channels); every call has a deadline and fails over."""

    def __init__(self, conf: _conf.Config) -> None:
        self.conf = conf
        self._stubs: dict[int, _Stubs] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._current = random.randrange(len(conf.endpoints))
        self._token: str | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False

    def stubs(self) -> _Stubs:
        if self._closed:
            raise StoreUnavailable("the etcd store is closed")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # Channels belong to the loop that made them; a closed loop's are dropped.
            self._stubs, self._loop, self._background = {}, loop, set()
        i = self._current
        s = self._stubs.get(i)
        if s is None:
            target = self.conf.endpoints[i]
            if self.conf.tls:
                ch = grpc.aio.secure_channel(
                    target, self.conf.credentials(), self.conf.channel_options()
                )
            else:
                ch = grpc.aio.insecure_channel(target, self.conf.channel_options())
            s = self._stubs[i] = _Stubs(ch, target)
        return s

    def failover(self, seen: _Stubs) -> None:
        if self._stubs.get(self._current) is seen and len(self.conf.endpoints) > 1:
            self._current = (self._current + 1) % len(self.conf.endpoints)

    def background(self, rpc: Rpc) -> None:
        async def send() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, IdemlockError, asyncio.CancelledError):
                s = self.stubs()
                md = await self.metadata(s, time.monotonic() + self.conf.timeout)
                await s.methods[rpc.method](rpc.request, timeout=self.conf.timeout, metadata=md)

        task = asyncio.get_running_loop().create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        self._closed = True
        chans, self._stubs = list(self._stubs.values()), {}
        same_loop = self._loop is asyncio.get_running_loop()
        if same_loop:
            pending = list(self._background)
            if pending:
                await asyncio.wait(pending, timeout=1.0)
            for s in chans:
                with contextlib.suppress(Exception):
                    await s.channel.close()


class _AsyncGateway:
    """The gateway client (blocking HTTP) for a forked child's event loop."""

    def __init__(self, sync: Any) -> None:
        self.sync = sync
        self.conf = sync.conf
        self._background: set[asyncio.Task[Any]] = set()

    async def call(self, rpc: Rpc, deadline: float) -> Any:
        return await asyncio.to_thread(self.sync.call, rpc, deadline)

    def background(self, rpc: Rpc) -> None:
        self.sync.background(rpc)

    async def close(self) -> None:
        return None


# ---- watches -----------------------------------------------------------------------------


async def _until(event: asyncio.Event, timeout: float) -> None:
    """Wait until ``event`` is set or ``timeout`` seconds pass. asyncio.wait, not
    wait_for: on Python 3.11 wait_for returns normally (or times out) when a
    cancellation lands as the event is set, and a cancelled waiter would wait on."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((waiter,), timeout=timeout)
    finally:
        waiter.cancel()


class _Group(Group["AsyncSubscription"]):
    __slots__ = ("created",)

    def __init__(self, wid: int, key: bytes, end: bytes, channel: Channel) -> None:
        super().__init__(wid, key, end, channel)
        self.created = asyncio.Event()


class AsyncSubscription:
    __slots__ = ("_event", "_group", "_watcher")

    def __init__(self, watcher: AsyncWatcher, group: _Group) -> None:
        self._watcher = watcher
        self._group = group
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> bool:
        if not self._event.is_set() and timeout > 0:
            await _until(self._event, timeout)
        fired = self._event.is_set()
        self._event.clear()
        return fired

    async def aclose(self) -> None:
        self._watcher.remove(self)


class AsyncWatcher:
    """One Watch stream per store and event loop, read by a task; see SyncWatcher."""

    def __init__(self, client: AsyncClient, root: bytes) -> None:
        self._client = client
        self._book = Book(root, _Group)
        self._call: Any = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    async def subscribe(self, key: bytes, end: bytes, channel: Channel) -> AsyncSubscription:
        if self._closed:
            raise StoreUnavailable("the etcd store is closed")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._book.reset()
            self._call, self._task = None, None
            self._loop = loop
        g, new = self._book.group(key, end, channel)
        sub = AsyncSubscription(self, g)
        g.subs.add(sub)
        try:
            if new:
                await self._send(g.create())
            if self._task is None or self._task.done():
                self._task = loop.create_task(self._run())
            if not g.created.is_set():
                await _until(g.created, min(1.0, self._client.conf.timeout))
        except BaseException:
            # Cancelled before the caller got ``sub``: nobody would remove it, and its
            # group would name this process a waiter (queueing its every attempt).
            self.remove(sub)
            raise
        return sub

    async def _send(self, req: Any) -> None:
        call = self._call
        if call is None:
            return  # the reader sends every create when it (re)connects
        with contextlib.suppress(Exception):
            await call.write(req)

    def waiting(self, key: bytes) -> Waiter | None:
        return self._book.waiting(key)

    def remove(self, sub: AsyncSubscription) -> None:
        g = sub._group
        if not self._book.leave(g, sub, self._client.background):
            return
        call = self._call
        if call is not None and g.created.is_set() and self._loop is not None:
            task = self._loop.create_task(self._send(g.cancel()))
            self._client._background.add(task)
            task.add_done_callback(self._client._background.discard)

    def _handle(self, resp: Any) -> None:
        g = self._book.by_id.get(resp.watch_id)
        if g is None:
            return
        if resp.created:
            g.created.set()
        if wakes(g.quiet, resp.events) or resp.canceled:
            for s in g.subs:
                s._event.set()
        if resp.canceled:
            g.created = asyncio.Event()
            task = asyncio.get_running_loop().create_task(self._send(g.create()))
            self._client._background.add(task)
            task.add_done_callback(self._client._background.discard)

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closed:
            s = None
            try:
                s = self._client.stubs()
                md = await self._client.metadata(s, time.monotonic() + self._client.conf.timeout)
                call = s.watch(metadata=md)
                self._call = call
                for g in list(self._book.groups.values()):
                    await call.write(g.create())
                while True:
                    resp = await call.read()
                    if resp is grpc.aio.EOF:
                        break
                    backoff = 0.05
                    self._handle(resp)
            except asyncio.CancelledError:
                raise
            except (grpc.aio.AioRpcError, IdemlockError, ValueError, RuntimeError) as exc:
                # The stream broke (member down, failover): every waiter re-checks now.
                log.debug(
                    "idemlock: etcd watch stream ended (%s); watching again",
                    type(exc).__name__,
                    extra=log_fields(store="etcd", operation="watch", outcome="error"),
                )
            call, self._call = self._call, None
            if call is not None:
                call.cancel()
            if self._closed:
                return
            for g in self._book.groups.values():
                g.created = asyncio.Event()
                for sub in g.subs:
                    sub._event.set()
            if s is not None:
                self._client.failover(s)
            await asyncio.sleep(backoff)
            backoff = min(1.0, backoff * 2)

    async def aclose(self) -> None:
        self._closed = True
        for g in self._book.groups.values():
            for s in g.subs:
                s._event.set()
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        task, self._task = self._task, None
        if task is not None and not task.done() and self._loop is asyncio.get_running_loop():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


# ---- the store's own half ------------------------------------------------------------------


class _AsyncRunner:
    """What :class:`~._async.AsyncEtcdStore` does its own way: its client and watcher,
    the fork hand-over, running an op so that a cancellation strands nothing, waiting
    and closing."""

    def __init__(self, conf: _conf.Config) -> None:
        self.conf = conf
        self.timeout = conf.timeout
        self.client = AsyncClient(conf)
        self.ops = Ops(conf.root)
        self._watcher = AsyncWatcher(self.client, conf.root)
        self._undoer = Undoer("etcd", "etcd")
        #: after os.fork(), the child's calls go over etcd's HTTP gateway (A6)
        self._gateway: Any = None
        self._pid = os.getpid()

    def _forked(self) -> None:
        """In a forked child: as the blocking store's (gRPC's core is not fork-safe)."""
        from ._gateway import GatewayClient, GatewayWatcher

        with _forks.LOCK:
            if self._pid == os.getpid():
                return
            _forks.INHERITED.append((self.client, self._watcher))
            sync = GatewayClient(self.conf)
            self.client = _AsyncGateway(sync)  # type: ignore[assignment]
            self._gateway = GatewayWatcher(sync)
            self._pid = os.getpid()

    def _waiting(self, name: bytes) -> Waiter | None:
        """This process's place in the queue of the lock ``name`` (None over the
        gateway, which keeps no queue)."""
        if self._pid != os.getpid():
            self._forked()
        return None if self._gateway is not None else self._watcher.waiting(name)

    async def _run(self, op: Op) -> Any:
        if self._pid != os.getpid():
            self._forked()
        return await drive(self.client, op)

    async def _undoable(self, op: Op, undo: Callable[[Any], Op | None]) -> Any:
        """Run an op that may take a key (claim, acquire) so that a cancellation cannot
        strand it: the op runs on in a task of its own (bounded by ``timeout``) and what
        it took is given back as soon as it ends."""

        def undo_call(reply: Any) -> Any:
            back = undo(reply)
            return None if back is None else self._run(back)

        return await self._undoer.run(self._run(op), undo_call, getattr(op, "__name__", "call"))

    async def subscribe(self, channel: Channel) -> Any:
        if self._pid != os.getpid():
            self._forked()
        key, end = watch_range(self.conf.root, channel)
        if self._gateway is not None:
            from .._local import subscribe_in_thread

            return await subscribe_in_thread(
                self._gateway.subscribe, key, end, channel.kind == "lock"
            )
        return await self._watcher.subscribe(key, end, channel)

    async def aclose(self) -> None:
        if self._pid != os.getpid():
            self._forked()
        if self._gateway is not None:
            return  # a forked child: nothing of gRPC's may be touched
        await self._watcher.aclose()
        await self.client.close()
