"""The asyncio Redis store and its notification listener."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque
from collections.abc import Sequence
from typing import Any

from redis.client import NEVER_DECODE
from redis.exceptions import NoScriptError

from ..._core.port import Acquired, Channel, ClaimReply, Held, LockRow, RecordRow
from ..._errors import StoreUnavailable
from . import _common as C
from ._sync import IDLE_S, _now_ms, check_claim_slot, check_same_slot

_ND = {NEVER_DECODE: True}
_ERRORS = C.redis_errors()


class AsyncRedisStore:
    """The port on ``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster``."""

    kind = "redis"
    issues_fence_tokens = True

    def __init__(self, client: Any, *, cluster: bool, options: C.Options, owned: bool) -> None:
        self.client = client
        self.cluster = cluster
        self._owned = owned
        self._keep = options.keep_ms
        self._handoff = options.handoff_ms
        self._exec = client.execute_command
        self._listener = AsyncListener(
            self._listener_connection, self._unregister, options.handoff_ms / 1000 + 0.005
        )
        # A cluster client is initialised once, by one task: redis-py's asyncio cluster
        # client fails commands that race with its lazy first initialisation.
        self._ready = not cluster
        self._init_lock: asyncio.Lock | None = None

    async def _prepare(self) -> None:
        if self._init_lock is None:
            self._init_lock = asyncio.Lock()
        async with self._init_lock:
            if not self._ready:
                try:
                    await self.client.initialize()
                except _ERRORS as exc:
                    raise C.store_error(exc, "connect") from exc
                self._ready = True

    async def _eval(self, script: C.Script, keys: tuple[bytes, ...], args: tuple[Any, ...]) -> Any:
        if not self._ready:
            await self._prepare()
        task = asyncio.current_task()
        before = _cancelling(task)
        try:
            try:
                reply = await self._exec("EVALSHA", script.sha, len(keys), *keys, *args, **_ND)
            except NoScriptError:
                await self.client.script_load(script.text)
                reply = await self._exec("EVALSHA", script.sha, len(keys), *keys, *args, **_ND)
        except _ERRORS as exc:
            raise C.store_error(exc, script.name) from exc
        if _cancelling(task) > before:
            # On Python < 3.12 asyncio.wait_for (used by redis-py to open a connection)
            # can swallow a cancellation that races with its completion; deliver it.
            raise asyncio.CancelledError()
        return reply

    async def _unregister(self, channel: bytes, gid: bytes) -> None:
        # See RedisStore._unregister.
        with contextlib.suppress(StoreUnavailable):
            await self._eval(C.UNREGISTER, (C.waiters_of(channel),), (gid,))

    async def _listener_connection(self) -> Any:
        if self.cluster:
            if not self._ready:
                await self._prepare()
            nodes = self.client.get_primaries() or self.client.get_nodes()
            node = random.choice(nodes)
            cls, kwargs = node.connection_class, node.connection_kwargs
        else:
            pool = self.client.connection_pool
            cls, kwargs = pool.connection_class, pool.connection_kwargs
        conn = cls(**C.listener_kwargs(kwargs))
        await conn.connect()
        return conn

    # ---- idempotency records -------------------------------------------------------------

    async def claim(
        self, ns: str, key: str, fp: str | None, token: str, lease_ms: int
    ) -> ClaimReply:
        n = C.names(ns, key)
        args = (C.pack_id(fp), C.pack_id(token), lease_ms, self._keep)
        return C.claim_reply(await self._eval(C.CLAIM, (n.claim,), args), token)

    async def complete(self, ns: str, key: str, token: str, result: bytes, ttl_ms: int) -> bool:
        return await self.complete_with(ns, key, token, result, ttl_ms, ())

    async def complete_with(
        self,
        ns: str,
        key: str,
        token: str,
        result: bytes,
        ttl_ms: int,
        writes: Sequence[tuple[str, bytes]],
    ) -> bool:
        """Complete the claim and SET the caller's keys in the same script: the effects
        and the record commit together. On Cluster the keys must share the claim's slot
        (the ConfigurationError names the tag to use)."""
        n = C.names(ns, key)
        users = check_claim_slot(self.cluster, n.claim, writes)
        args = (C.pack_id(token), bytes(result), ttl_ms, n.claim_channel, C.nonce())
        values = tuple(bytes(v) for _, v in writes)
        return bool(await self._eval(C.COMPLETE, (n.claim, *users), args + values) == 1)

    async def abandon(self, ns: str, key: str, token: str) -> bool:
        n = C.names(ns, key)
        args = (C.pack_id(token), self._keep, n.claim_channel, C.nonce())
        return bool(await self._eval(C.ABANDON, (n.claim,), args) == 1)

    async def extend(self, ns: str, key: str, token: str, lease_ms: int) -> int | None:
        args = (C.pack_id(token), lease_ms, self._keep)
        exp = await self._eval(C.EXTEND, (C.names(ns, key).claim,), args)
        return None if exp == -1 else int(exp)

    async def record(self, ns: str, key: str) -> RecordRow | None:
        reply = await self._eval(C.PEEK_CLAIM, (C.names(ns, key).claim,), ())
        return C.record_row(ns, key, reply)

    async def forget(self, ns: str, key: str) -> bool:
        n = C.names(ns, key)
        args = (self._keep, n.claim_channel, C.nonce())
        return bool(await self._eval(C.FORGET, (n.claim,), args) == 1)

    async def records(self, ns_prefix: str) -> Sequence[RecordRow]:
        rows: list[RecordRow] = await self._listing("c", ns_prefix)
        return rows

    # ---- locks -------------------------------------------------------------------------

    async def acquire(self, ns: str, key: str, owner: str, ttl_ms: int) -> Acquired | Held:
        n = C.names(ns, key)
        g = self._listener.waiting(n.lock_channel)
        args = (owner, ttl_ms, self._keep, g.gid if g is not None else b"", C.REGISTER_MS)
        reply = C.lock_reply(await self._eval(C.ACQUIRE, (n.lock, n.waiters), args))
        if g is not None:
            g.registered = isinstance(reply, Held)
        return reply

    async def release(self, ns: str, key: str, owner: str, token: int) -> bool:
        n = C.names(ns, key)
        args = (owner, str(token), self._keep, self._handoff, n.lock_channel, C.nonce())
        return bool(await self._eval(C.RELEASE, (n.lock, n.waiters), args) == 1)

    async def renew(self, ns: str, key: str, owner: str, token: int, ttl_ms: int) -> int | None:
        n = C.names(ns, key)
        exp = await self._eval(C.RENEW, (n.lock,), (owner, str(token), ttl_ms, self._keep))
        return None if exp == -1 else int(exp)

    async def lock(self, ns: str, key: str) -> LockRow | None:
        reply = await self._eval(C.PEEK_LOCK, (C.names(ns, key).lock,), ())
        return C.lock_row(ns, key, reply)

    async def locks(self, ns_prefix: str) -> Sequence[LockRow]:
        rows: list[LockRow] = await self._listing("l", ns_prefix)
        return rows

    # ---- fences ------------------------------------------------------------------------

    async def fence_advance(self, ns: str, resource: str, token: int) -> tuple[bool, int]:
        reply = await self._eval(C.FENCE_ADVANCE, (C.gate_name(ns, resource),), (str(token),))
        return C.fence_reply(reply)

    async def fence_current(self, ns: str, resource: str) -> int | None:
        reply = await self._eval(C.FENCE_CURRENT, (C.gate_name(ns, resource),), ())
        return None if reply is None else int(reply)

    async def fence_set(
        self, ns: str, resource: str, token: int, key: str, value: bytes
    ) -> tuple[bool, int]:
        """See :meth:`RedisStore.fence_set`."""
        gate = C.gate_name(ns, resource)
        user = key.encode("utf-8", "surrogatepass")
        check_same_slot(self.cluster, resource, key, gate, user)
        reply = await self._eval(C.FENCE_SET, (gate, user), (str(token), bytes(value)))
        return C.fence_reply(reply)

    async def purge(self) -> int:
        return 0  # Redis expires every key by itself

    async def _listing(self, kind: C.Kind, ns_prefix: str) -> list[Any]:
        if not self._ready:
            await self._prepare()
        try:
            keys = [
                k if isinstance(k, bytes) else str(k).encode("utf-8", "surrogatepass")
                async for k in self.client.scan_iter(
                    match=C.match_pattern(kind, ns_prefix), count=1000
                )
            ]
            now = _now_ms(await self.client.time())
            rows: list[Any] = []
            for i in range(0, len(keys), 500):
                batch = keys[i : i + 500]
                pipe = self.client.pipeline(transaction=False)
                for k in batch:
                    if kind == "c":
                        pipe.execute_command("GET", k, **_ND)
                    else:
                        pipe.hmget(k, *C.LOCK_FIELDS)
                values = await pipe.execute(raise_on_error=False)
                rows += C.listing_rows(kind, batch, values, now, ns_prefix)
            return rows
        except _ERRORS as exc:
            raise C.store_error(exc, "listing") from exc

    # ---- waiting and life cycle ----------------------------------------------------------

    async def subscribe(self, channel: Channel) -> AsyncSubscription:
        name = C.channel_name(channel.kind, channel.ns, channel.key)
        return await self._listener.subscribe(name)

    async def aclose(self) -> None:
        await self._listener.aclose()
        if self._owned:
            with contextlib.suppress(*_ERRORS):
                await self.client.aclose()


def _cancelling(task: asyncio.Task[Any] | None) -> int:
    """Pending cancellation requests of ``task`` (Python 3.11+; 0 before)."""
    fn = getattr(task, "cancelling", None)
    return int(fn()) if fn is not None else 0


# ---- notifications ---------------------------------------------------------------------


class _Group:
    __slots__ = ("channel", "confirmed", "gid", "linger", "registered", "subs", "wake")

    def __init__(self, channel: bytes) -> None:
        self.channel = channel
        self.subs: set[AsyncSubscription] = set()
        self.confirmed = asyncio.Event()
        self.gid = C.waiter_id()
        self.registered = False
        #: pending deferred wake-up and pending unsubscribe (timer handles)
        self.wake: asyncio.TimerHandle | None = None
        self.linger: asyncio.TimerHandle | None = None


class AsyncSubscription:
    """One waiter's mailbox: a notification that arrives before ``wait`` is kept."""

    __slots__ = ("_event", "_group", "_listener")

    def __init__(self, listener: AsyncListener, group: _Group) -> None:
        self._listener = listener
        self._group = group
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> bool:
        if not self._event.is_set() and timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._event.wait(), timeout)
        fired = self._event.is_set()
        self._event.clear()
        return fired

    async def aclose(self) -> None:
        await self._listener.remove(self)


def _cancel(handle: asyncio.TimerHandle | None) -> None:
    if handle is not None:
        handle.cancel()


class AsyncListener:
    """One pub/sub connection per store, read by a task of the event loop; same
    behaviour as :class:`~idemlock.stores.redis._sync.SyncListener`."""

    LINGER_S = 2.0

    def __init__(self, connect: Any, on_idle: Any, defer_s: float) -> None:
        self._connect = connect
        self._on_idle = on_idle
        self._defer_s = defer_s
        self._confirm_timeout = 5.0
        self._groups: dict[bytes, _Group] = {}
        self._pending: dict[bytes, deque[_Group | None]] = {}
        self._conn: Any = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._connecting: asyncio.Lock | None = None
        self._background: set[asyncio.Task[None]] = set()

    def waiting(self, channel: bytes) -> _Group | None:
        g = self._groups.get(channel)
        return g if g is not None and g.subs else None

    async def subscribe(self, channel: bytes) -> AsyncSubscription:
        if self._closed:
            raise StoreUnavailable("the Redis store is closed")
        g = self._groups.get(channel)
        new = g is None
        if g is None:
            g = self._groups[channel] = _Group(channel)
        _cancel(g.linger)
        g.linger = None
        sub = AsyncSubscription(self, g)
        g.subs.add(sub)
        if new:
            try:
                await self._start()
            except _ERRORS as exc:
                g.subs.discard(sub)
                if self._groups.get(channel) is g:
                    del self._groups[channel]
                raise C.store_error(exc, "subscribe") from exc
            await self._send_subscribe([g])
        if not g.confirmed.is_set() and self._conn is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(g.confirmed.wait(), self._confirm_timeout)
        return sub

    async def _start(self) -> None:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._conn is None and self._task is None:
                self._conn = await self._connect()
            if self._task is None or self._task.done():
                self._task = asyncio.get_running_loop().create_task(self._run())

    async def _send(self, conn: Any, *args: bytes) -> None:
        try:
            await conn.send_command(*args, check_health=False)
        except _ERRORS:
            await self._drop(conn)

    async def _send_subscribe(self, groups: list[_Group]) -> None:
        conn = self._conn
        if conn is None:
            return
        for g in groups:
            self._pending.setdefault(g.channel, deque()).append(g)
        await self._send(conn, b"SUBSCRIBE", *[g.channel for g in groups])

    async def remove(self, sub: AsyncSubscription) -> None:
        g = sub._group
        g.subs.discard(sub)
        if g.subs or self._groups.get(g.channel) is not g:
            return
        _cancel(g.wake)
        g.wake = None
        # Linger: stay subscribed a while in case this process waits on it again.
        loop = asyncio.get_running_loop()
        g.linger = loop.call_later(self.LINGER_S, self._expire, g)
        if g.registered:
            g.registered = False
            await self._on_idle(g.channel, g.gid)

    def _expire(self, g: _Group) -> None:
        g.linger = None
        if g.subs or self._groups.get(g.channel) is not g:
            return
        del self._groups[g.channel]
        conn = self._conn
        if conn is not None:
            self._pending.setdefault(g.channel, deque()).append(None)
            task = asyncio.get_running_loop().create_task(
                self._send(conn, b"UNSUBSCRIBE", g.channel)
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _drop(self, conn: Any) -> None:
        """Forget a failed connection and wake every waiter; the reader, parked on the
        closed connection, fails too and reconnects."""
        if self._conn is not conn:
            return
        self._conn = None
        self._pending.clear()
        for channel, g in list(self._groups.items()):
            if not g.subs:
                _cancel(g.linger)
                del self._groups[channel]
                continue
            g.confirmed = asyncio.Event()
            for s in g.subs:
                s._event.set()
        with contextlib.suppress(Exception):
            await conn.disconnect(nowait=True)

    def _fire(self, g: _Group) -> None:
        g.wake = None
        for s in g.subs:
            s._event.set()

    def _dispatch(self, msg: Any) -> None:
        if not isinstance(msg, list) or len(msg) < 3:
            return
        kind, channel = msg[0], msg[1]
        if kind == b"message":
            g = self._groups.get(channel)
            if g is None or not g.subs:
                return
            _cancel(g.wake)
            if msg[2] == b"*" or msg[2] == g.gid:
                self._fire(g)
            else:  # handed to another process; wake ours only if it does not take it
                g.wake = asyncio.get_running_loop().call_later(self._defer_s, self._fire, g)
        elif kind in (b"subscribe", b"unsubscribe"):
            q = self._pending.get(channel)
            item = q.popleft() if q else None
            if q is not None and not q:
                del self._pending[channel]
            if kind == b"subscribe" and item is not None:
                item.confirmed.set()

    async def _run(self) -> None:
        backoff = 0.05
        ping_sent = False
        while not self._closed:
            conn = self._conn
            if conn is None:
                try:
                    conn = await self._connect()
                except Exception:
                    await asyncio.sleep(backoff)
                    backoff = min(1.0, backoff * 2)
                    continue
                if self._closed:
                    await conn.disconnect(nowait=True)
                    return
                self._conn = conn
                groups = list(self._groups.values())
                for g in groups:
                    for s in g.subs:
                        s._event.set()  # something may have been missed meanwhile
                if groups:
                    await self._send_subscribe(groups)
                backoff, ping_sent = 0.05, False
                continue
            try:
                msg = await conn.read_response(timeout=IDLE_S, disconnect_on_error=False)
                if msg is not None:
                    self._dispatch(msg)
                    ping_sent = False
                elif ping_sent:
                    raise ConnectionError("the pub/sub connection did not answer a PING")
                else:
                    await conn.send_command("PING", check_health=False)
                    ping_sent = True
            except asyncio.CancelledError:
                raise
            except Exception:
                if self._closed:
                    return
                await self._drop(conn)

    async def aclose(self) -> None:
        self._closed = True
        for g in self._groups.values():
            _cancel(g.wake)
            _cancel(g.linger)
            for s in g.subs:
                s._event.set()
        self._groups.clear()
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.disconnect(nowait=True)
