"""The blocking etcd store's I/O: the ops of :mod:`._ops` driven on ``grpc.Channel``
(client, watcher, fork hook), and :class:`_SyncRunner`, the half of
:class:`~._sync.EtcdStore` that differs from the async store's."""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from ... import _forks
from ..._core.port import Channel
from ..._errors import IdemlockError, StoreUnavailable
from ..._logfields import fields as log_fields
from . import _conf
from ._calls_sync import SyncCalls, drive
from ._ops import Op, Ops, Rpc, Waiter
from ._pb.etcdserverpb import rpc_pb2 as _rpc_pb2
from ._pb.etcdserverpb import rpc_pb2_grpc as _rpc_pb2_grpc
from ._watches import Book, Group, quiet_key, wakes, watch_range

pb: Any = _rpc_pb2  # generated without type information
stubs: Any = _rpc_pb2_grpc

log = logging.getLogger("idemlock")


class _Stubs:
    """The calls of one endpoint's channel, by method name (a blocking or a grpc.aio
    channel: the generated stubs serve both)."""

    __slots__ = ("channel", "endpoint", "methods", "watch")

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel, endpoint: str) -> None:
        self.channel = channel
        self.endpoint = endpoint
        kv, lease = stubs.KVStub(channel), stubs.LeaseStub(channel)
        auth = stubs.AuthStub(channel)
        self.methods: dict[str, Any] = {
            "Range": kv.Range,
            "Txn": kv.Txn,
            "DeleteRange": kv.DeleteRange,
            "Put": kv.Put,
            "LeaseGrant": lease.LeaseGrant,
            "LeaseRevoke": lease.LeaseRevoke,
            "LeaseTimeToLive": lease.LeaseTimeToLive,
            "Authenticate": auth.Authenticate,
            "Status": stubs.MaintenanceStub(channel).Status,
        }
        self.watch = stubs.WatchStub(channel).Watch


class SyncClient(SyncCalls):
    """Channels to the endpoints; every call has a deadline and fails over."""

    def __init__(self, conf: _conf.Config) -> None:
        self.conf = conf
        self._lock = threading.Lock()
        self._stubs: dict[int, _Stubs] = {}
        self._current = random.randrange(len(conf.endpoints))
        self._token: str | None = None
        self._pending: set[Any] = set()
        self._closed = False
        #: pauses under way, and when the last one ended (see close())
        self._pausing = 0
        self._paused_at = -_POLL_SETTLE
        self._paused = threading.Condition(self._lock)

    # -- channels ------------------------------------------------------------------------

    def stubs(self) -> _Stubs:
        with self._lock:
            if self._closed:
                raise StoreUnavailable("the etcd store is closed")
            i = self._current
            s = self._stubs.get(i)
            if s is None:
                target = self.conf.endpoints[i]
                if self.conf.tls:
                    ch = grpc.secure_channel(
                        target, self.conf.credentials(), self.conf.channel_options()
                    )
                else:
                    ch = grpc.insecure_channel(target, self.conf.channel_options())
                s = self._stubs[i] = _Stubs(ch, target)
            return s

    def pause(self, seconds: float) -> None:
        """The wait before the next attempt, spent waiting for the next endpoint's
        channel to be ready: before grpcio 1.6x a blocking channel's connection attempt
        made progress only while a thread waited on it, so calls failing fast (between
        sleeps) left it stalled until gRPC's connect deadline, long after the member
        was back. (A standing subscription would poll it for good, but its thread
        makes gRPC skip its fork handlers: a forked child could crash.)"""
        try:
            channel = self.stubs().channel
        except StoreUnavailable:  # closed
            time.sleep(seconds)
            return
        with self._lock:
            self._pausing += 1
        ready = grpc.channel_ready_future(channel)
        try:
            ready.result(timeout=seconds)
        except grpc.FutureTimeoutError:
            pass
        finally:
            ready.cancel()
            with self._lock:
                self._pausing -= 1
                self._paused_at = time.monotonic()
                self._paused.notify_all()

    def failover(self, seen: _Stubs) -> None:
        """Move to the next endpoint, unless another caller already did."""
        with self._lock:
            if self._stubs.get(self._current) is seen and len(self.conf.endpoints) > 1:
                self._current = (self._current + 1) % len(self.conf.endpoints)

    def background(self, rpc: Rpc) -> None:
        """Send and forget (a lease revoke): nothing waits for it, a failure is harmless."""
        try:
            s = self.stubs()
            fut = s.methods[rpc.method].future(
                rpc.request, timeout=self.conf.timeout, metadata=self.metadata(s, _far())
            )
        except (grpc.RpcError, IdemlockError):
            return
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            chans, self._stubs = list(self._stubs.values()), {}
            # A readiness future's polling thread (gRPC's) goes on for up to 0.2 s
            # after the future is cancelled, and raises in that thread if its channel
            # is closed meanwhile: let it end first (bounded; only after a pause).
            end = time.monotonic() + 2 * _POLL_SETTLE
            while (now := time.monotonic()) < end:
                settled = self._paused_at + _POLL_SETTLE
                if not self._pausing and now >= settled:
                    break
                self._paused.wait((end if self._pausing else min(end, settled)) - now)
        for s in chans:
            s.channel.close()


#: how long gRPC's connectivity polling thread may go on after its future is cancelled
#: (it re-checks every 0.2 s), with a margin
_POLL_SETTLE = 0.4


def _far() -> float:
    return time.monotonic() + 5.0


# ---- watches -----------------------------------------------------------------------------


class _Group(Group["SyncSubscription"]):
    __slots__ = ("created",)

    def __init__(self, wid: int, key: bytes, end: bytes, channel: Channel) -> None:
        super().__init__(wid, key, end, channel)
        self.created = False


class SyncSubscription:
    __slots__ = ("_cond", "_flag", "_group", "_watcher")

    def __init__(self, watcher: SyncWatcher, group: _Group) -> None:
        self._watcher = watcher
        self._group = group
        self._flag = False
        self._cond = threading.Condition(watcher._lock)

    def _fire(self) -> None:  # with the watcher's lock held
        self._flag = True
        self._cond.notify()

    def wait(self, timeout: float) -> bool:
        with self._cond:
            if not self._flag and timeout > 0:
                self._cond.wait(timeout)
            fired, self._flag = self._flag, False
            return fired

    def close(self) -> None:
        self._watcher.remove(self)


_STOP = object()


class SyncWatcher:
    """One Watch stream per store, read by a daemon thread; an event on a watched key
    wakes that key's local waiters. When the stream breaks, every waiter is woken
    once (it re-checks the store) and the watches are created again."""

    def __init__(self, client: SyncClient, root: bytes) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._created = threading.Condition(self._lock)
        self._book = Book(root, _Group)
        self._queue: queue.Queue[Any] | None = None
        self._thread: threading.Thread | None = None
        self._call: Any = None
        self._closed = False

    def subscribe(self, key: bytes, end: bytes, channel: Channel) -> SyncSubscription:
        with self._lock:
            if self._closed:
                raise StoreUnavailable("the etcd store is closed")
            g, new = self._book.group(key, end, channel)
            if new and self._queue is not None:
                self._queue.put(g.create())
            sub = SyncSubscription(self, g)
            g.subs.add(sub)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="idemlock-etcd-watch", daemon=True
                )
                self._thread.start()
            if not g.created:
                # Bounded: a waiter re-checks the store at least every second anyway.
                self._created.wait_for(lambda: g.created, min(1.0, self._client.conf.timeout))
        return sub

    def waiting(self, key: bytes) -> Waiter | None:
        """This process's place in the queue of the lock named ``key``, if a caller of
        this store waits for it."""
        return self._book.waiting(key)

    def remove(self, sub: SyncSubscription) -> None:
        g = sub._group
        with self._lock:
            gone = self._book.leave(g, sub, self._client.background)
            if gone and self._queue is not None and g.created:
                self._queue.put(g.cancel())

    def _fire_all(self) -> None:  # with the lock held
        for g in self._book.groups.values():
            g.created = False
            for s in g.subs:
                s._fire()
        self._created.notify_all()

    def _handle(self, resp: Any) -> None:
        with self._lock:
            g = self._book.by_id.get(resp.watch_id)
            if g is None:
                return
            if resp.created:
                g.created = True
                self._created.notify_all()
            if wakes(g.quiet, resp.events) or resp.canceled:
                for s in g.subs:
                    s._fire()
            if resp.canceled and self._queue is not None:
                g.created = False
                self._queue.put(g.create())  # compaction or a server-side cancel

    def _requests(self, q: queue.Queue[Any]) -> Iterator[Any]:
        while True:
            item = q.get()
            if item is _STOP:
                return
            yield item

    def _run(self) -> None:
        backoff = 0.05
        while True:
            with self._lock:
                if self._closed:
                    return
                q: queue.Queue[Any] = queue.Queue()
                self._queue = q
                for g in self._book.groups.values():
                    q.put(g.create())
            s = None
            try:
                s = self._client.stubs()
                md = self._client.metadata(s, time.monotonic() + self._client.conf.timeout)
                call = s.watch(self._requests(q), metadata=md)
                with self._lock:
                    self._call = call
                for resp in call:
                    backoff = 0.05
                    self._handle(resp)
            except (grpc.RpcError, IdemlockError, ValueError) as exc:
                # The stream broke (member down, failover): every waiter re-checks now.
                log.debug(
                    "idemlock: etcd watch stream ended (%s); watching again",
                    type(exc).__name__,
                    extra=log_fields(store="etcd", operation="watch", outcome="error"),
                )
            with self._lock:
                q.put(_STOP)
                self._queue = None
                self._call = None
                if self._closed:
                    return
                self._fire_all()
            if s is not None:
                self._client.failover(s)
            time.sleep(backoff)
            backoff = min(1.0, backoff * 2)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            call, self._call = self._call, None
            if self._queue is not None:
                self._queue.put(_STOP)
            for g in self._book.groups.values():
                for s in g.subs:
                    s._fire()
        if call is not None:
            call.cancel()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2.0)


# ---- the store's own half ------------------------------------------------------------------


class _SyncRunner:
    """What :class:`~._sync.EtcdStore` does its own way: its client and watcher, the
    fork hand-over, running an op, waiting and closing."""

    def __init__(self, conf: _conf.Config) -> None:
        self.conf = conf
        self.timeout = conf.timeout
        self.client = SyncClient(conf)
        self.ops = Ops(conf.root)
        self._watcher = SyncWatcher(self.client, conf.root)
        #: after os.fork(), the child's calls go over etcd's HTTP gateway (A6)
        self._gateway: Any = None
        self._pid = os.getpid()

    def _forked(self) -> None:
        """In a forked child (the pid check of every call): gRPC's core is not
        fork-safe, so the child drops the parent's client and watcher without closing
        or freeing them (that would call into gRPC state the fork copied mid-flight)
        and goes over etcd's HTTP gateway."""
        from ._gateway import GatewayClient, GatewayWatcher

        with _forks.LOCK:
            if self._pid == os.getpid():
                return
            _forks.INHERITED.append((self.client, self._watcher))
            self.client = GatewayClient(self.conf)  # type: ignore[assignment]
            self._gateway = GatewayWatcher(self.client)  # type: ignore[arg-type]
            self._pid = os.getpid()

    def _waiting(self, name: bytes) -> Waiter | None:
        """This process's place in the queue of the lock ``name`` (None over the
        gateway, which keeps no queue)."""
        if self._pid != os.getpid():
            self._forked()
        return None if self._gateway is not None else self._watcher.waiting(name)

    def _run(self, op: Op) -> Any:
        if self._pid != os.getpid():
            self._forked()
        return drive(self.client, op)

    def _undoable(self, op: Op, undo: Callable[[Any], Op | None]) -> Any:
        """Run the op: a thread is not cancelled in the middle of one."""
        return self._run(op)

    def subscribe(self, channel: Channel) -> Any:
        if self._pid != os.getpid():
            self._forked()
        key, end = watch_range(self.conf.root, channel)
        if self._gateway is not None:
            return self._gateway.subscribe(
                key, end, channel.kind == "lock", quiet_key(channel, end)
            )
        return self._watcher.subscribe(key, end, channel)

    def close(self) -> None:
        if self._pid != os.getpid():
            self._forked()
        if self._gateway is not None:
            return  # a forked child: nothing of gRPC's may be touched
        self._watcher.close()
        self.client.close()
