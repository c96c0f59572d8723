"""The asyncio Redis store and its notification listener."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from redis.client import NEVER_DECODE
from redis.exceptions import NoScriptError

from ..._core.port import Acquired, Channel, ClaimReply, Held, LockRow, RecordRow
from ..._errors import ConfigurationError, StoreUnavailable
from . import _common as C
from ._sync import IDLE_S, RenewCall, _now_ms, check_claim_slot, check_same_slot, renew_calls

_ND = {NEVER_DECODE: True}
_ERRORS = C.redis_errors()


class _LoopState:
    """What the store keeps per event loop: asyncio connections belong to the loop
    that opened them, so each loop gets its own client, listener and queue."""

    __slots__ = ("client", "exec", "init_lock", "listener", "loop", "owned", "ready", "slots")

    def __init__(self, loop: asyncio.AbstractEventLoop, client: Any, owned: bool) -> None:
        self.loop: Callable[[], asyncio.AbstractEventLoop | None]
        try:
            self.loop = weakref.ref(loop)
        except TypeError:  # a loop class without weak references
            self.loop = lambda: loop
        self.client = client
        self.exec = client.execute_command
        self.owned = owned
        self.ready = False
        self.init_lock = asyncio.Lock()
        self.slots = asyncio.Semaphore(_max_connections(client))
        self.listener: AsyncListener


class AsyncRedisStore:
    """The port on ``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster``.

    Works on any event loop: the first loop uses ``client``; another loop (a second
    ``asyncio.run()``, a test client's own loop, a forked child) gets a client of its
    own, built from the URL again (or, for a standalone client passed in, a copy of its
    connection pool's settings). A burst of calls queues for a connection (at most the
    pool's ``max_connections`` at once), and each call, queueing included, is bounded
    by ``timeout``.
    """

    kind = "redis"
    issues_fence_tokens = True

    def __init__(
        self,
        client: Any,
        *,
        cluster: bool,
        options: C.Options,
        owned: bool,
        factory: Callable[[], Any] | None = None,
    ) -> None:
        self.client = client
        self.cluster = cluster
        self._owned = owned
        self._factory = factory
        self._keep = options.keep_ms
        self._handoff = options.handoff_ms
        #: the bound (seconds) on one call, queueing for a connection included (A1)
        self.timeout = options.timeout
        # Keyed by the loop object (compared by identity through `_LoopState.loop`);
        # states of closed loops are dropped when another loop arrives.
        self._states: dict[int, _LoopState] = {}
        self._last: _LoopState | None = None
        self._base_taken = False  # whether `client` serves a loop already (or is inherited)
        self._closed = False
        # undo calls of cancelled claims/acquires, kept from being collected
        self._undoing: set[asyncio.Task[Any]] = set()
        _STORES.add(self)

    # ---- per-loop state ------------------------------------------------------------------

    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        st = self._last
        if st is not None and st.loop() is loop:
            return st
        st = self._states.get(id(loop))
        if st is None or st.loop() is not loop:
            st = self._new_state(loop)
        self._last = st
        return st

    def _new_state(self, loop: asyncio.AbstractEventLoop) -> _LoopState:
        if self._closed:
            raise StoreUnavailable("the Redis store is closed")
        if not self._base_taken:
            self._base_taken = True
            st = _LoopState(loop, self.client, self._owned)
        else:
            st = _LoopState(loop, self._client_for_another_loop(), True)
        st.ready = not self.cluster
        for key, old in list(self._states.items()):
            gone = old.loop()
            if gone is None or gone.is_closed():
                # Its connections belong to a loop that is over: nothing can close them
                # properly any more; dropping them closes the sockets.
                del self._states[key]
        st.listener = AsyncListener(
            lambda: self._listener_connection(st),
            self._unregister,
            self._handoff / 1000 + 0.005,
            self.timeout,
        )
        self._states[id(loop)] = st
        return st

    def _client_for_another_loop(self) -> Any:
        if self._factory is not None:
            return self._factory()
        if self.cluster:
            raise ConfigurationError(
                "this redis.asyncio RedisCluster client belongs to the event loop it was "
                "first used on, and idemlock cannot copy it for another loop; pass the "
                "cluster URL to idemlock.aio.connect() (idemlock then opens connections per "
                "loop), or create the client and the coordinator inside each loop"
            )
        return _copy_standalone(self.client)

    def _after_fork_in_child(self) -> None:
        """A forked child never touches what it inherited (the parent's sockets, the
        parent's loop): forget every loop's state unclosed; the child's first call
        builds its own client."""
        self._states = {}
        self._last = None
        self._base_taken = True

    async def _prepare(self, st: _LoopState) -> None:
        async with st.init_lock:
            if not st.ready:
                try:
                    await st.client.initialize()
                except _ERRORS as exc:
                    raise C.store_error(exc, "connect") from exc
                st.ready = True

    # ---- plumbing ------------------------------------------------------------------------

    async def _eval(
        self,
        script: C.Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        *,
        finish: bool = False,
        undo: Callable[[Any], Any] | None = None,
        undo_late: bool = False,
    ) -> Any:
        """Run one script within ``timeout``, queueing for a connection included.

        The script runs in a task of its own and the caller waits on it through a
        shield, so the deadline and the caller's cancellation always reach the caller
        at once: redis-py waits with asyncio.wait_for, which on Python < 3.12 can
        swallow a cancellation (then the script would go on to its socket timeouts).
        What happens to the script when the caller stops waiting is the call's policy:
        ``undo`` (claim, acquire: give back what it took once its reply is in),
        ``finish`` (complete, abandon, release: run to the end, so the caller's token
        still settles it), else it is cancelled. After the deadline the caller has
        been told the call may have been applied and may repeat it (the same owner
        re-acquiring gets the same lease), so only an undo that cannot hit such a
        repetition (``undo_late``: a claim's token is never reused) still runs.
        """
        st = self._last
        if st is None or st.loop() is not asyncio.get_running_loop():
            st = self._state()
        task = asyncio.ensure_future(self._run(st, script, keys, args))
        try:
            return await _bounded(asyncio.shield(task), self.timeout)
        except asyncio.TimeoutError:
            late = undo if undo_late else None
            keep = finish or late is not None  # runs on to its own socket timeouts
            self._abandon_task(task, late, script.name, cancel=not keep)
            raise StoreUnavailable(
                f"redis {script.name}: no reply within timeout={self.timeout:g}s (Redis or "
                "the network is stalled, or more calls at once than the pool's "
                "max_connections queued that long); the call may have been applied"
            ) from None
        except asyncio.CancelledError:
            keep = finish or undo is not None
            self._abandon_task(task, undo, script.name, cancel=not keep)
            raise

    def _abandon_task(
        self,
        task: asyncio.Task[Any],
        undo: Callable[[Any], Any] | None,
        what: str,
        cancel: bool,
    ) -> None:
        """The caller stopped waiting for ``task``: cancel it, let it finish, or undo
        what it did once it ends."""
        if task.done() and undo is None:
            if not task.cancelled():
                task.exception()  # retrieved: a failure nobody waits for is no error
            return
        if cancel:
            task.cancel()
        self._undoing.add(task)
        if undo is not None:
            task.add_done_callback(lambda t: self._undo_after(t, undo, what))
        task.add_done_callback(self._undone)

    async def _run(
        self, st: _LoopState, script: C.Script, keys: tuple[bytes, ...], args: tuple[Any, ...]
    ) -> Any:
        if not st.ready:
            await self._prepare(st)
        # Queue for a connection instead of failing with MaxConnectionsError.
        async with st.slots:
            try:
                try:
                    return await st.exec("EVALSHA", script.sha, len(keys), *keys, *args, **_ND)
                except NoScriptError:
                    await st.client.script_load(script.text)
                    return await st.exec("EVALSHA", script.sha, len(keys), *keys, *args, **_ND)
            except _ERRORS as exc:
                raise C.store_error(exc, script.name) from exc

    def _undo_after(self, task: asyncio.Task[Any], undo: Callable[[Any], Any], what: str) -> None:
        if task.cancelled():
            # Cancelled by the deadline (or the loop shutting down): the outcome is
            # unknown; undo what can be undone without the reply.
            reply: Any = None
        else:
            exc = task.exception()
            if exc is not None and not isinstance(exc, StoreUnavailable):
                return  # refused: nothing was taken
            # A StoreUnavailable (a timeout after the script was sent) leaves the
            # outcome unknown too.
            reply = None if exc is not None else task.result()
        try:
            aw = undo(reply)
        except Exception:  # the store is closed, the loop is going away
            return
        if aw is None:
            return
        try:
            undo_task = asyncio.ensure_future(aw)
        except RuntimeError:  # the loop is closing
            aw.close()
            return
        self._undoing.add(undo_task)
        undo_task.add_done_callback(self._undone)

    def _undone(self, task: asyncio.Task[Any]) -> None:
        self._undoing.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, StoreUnavailable):
            C.log.warning(
                "idemlock: a Redis call its caller stopped waiting for failed; what it "
                "holds frees itself when its lease ends",
                exc_info=exc,
            )

    async def _unregister(self, channel: bytes, gid: bytes) -> None:
        # See RedisStore._unregister.
        with contextlib.suppress(StoreUnavailable):
            await self._eval(C.UNREGISTER, (C.waiters_of(channel),), (gid,))

    async def _listener_connection(self, st: _LoopState) -> Any:
        client = st.client
        if self.cluster:
            if not st.ready:
                await self._prepare(st)
            nodes = client.get_primaries() or client.get_nodes()
            node = random.choice(nodes)
            cls, kwargs = node.connection_class, node.connection_kwargs
        else:
            pool = client.connection_pool
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

        def undo(reply: Any) -> Any:
            # Our own token only: abandoning a claim that never happened changes nothing.
            if reply is None or reply[0] == 1:
                return self.abandon(ns, key, token)
            return None

        reply = await self._eval(C.CLAIM, (n.claim,), args, undo=undo, undo_late=True)
        return C.claim_reply(reply, token)

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
        reply = await self._eval(C.COMPLETE, (n.claim, *users), args + values, finish=True)
        return bool(reply == 1)

    async def abandon(self, ns: str, key: str, token: str) -> bool:
        n = C.names(ns, key)
        args = (C.pack_id(token), self._keep, n.claim_channel, C.nonce())
        return bool(await self._eval(C.ABANDON, (n.claim,), args, finish=True) == 1)

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
        g = self._state().listener.waiting(n.lock_channel)
        args = (owner, ttl_ms, self._keep, g.gid if g is not None else b"", C.REGISTER_MS)

        def undo(raw: Any) -> Any:
            # Only a lease this call took (not one the owner held before); without the
            # reply the token is unknown and that lease ends with its ttl.
            if raw is not None and raw[0] == 1 and len(raw) > 4 and raw[4] == 1:
                return self.release(ns, key, owner, int(raw[1]))
            return None

        raw = await self._eval(C.ACQUIRE, (n.lock, n.waiters), args, undo=undo)
        reply = C.lock_reply(raw)
        if g is not None:
            g.registered = isinstance(reply, Held)
        return reply

    async def release(self, ns: str, key: str, owner: str, token: int) -> bool:
        n = C.names(ns, key)
        args = (owner, str(token), self._keep, self._handoff, n.lock_channel, C.nonce())
        return bool(await self._eval(C.RELEASE, (n.lock, n.waiters), args, finish=True) == 1)

    async def break_lock(self, ns: str, key: str) -> bool:
        n = C.names(ns, key)
        args = (self._keep, n.lock_channel)
        return bool(await self._eval(C.BREAK, (n.lock,), args, finish=True) == 1)

    async def renew_many(self, items: Sequence[tuple[Any, ...]]) -> list[int | None]:
        """Renew many claims and leases in one round trip (a pipeline of EXTEND/RENEW
        scripts; one script per item on a Cluster), for a coordinator's renewer; see
        ``RedisStore.renew_many``. Bounded by ``timeout``; a cancelled batch is moot."""
        calls = renew_calls(items, self._keep)
        if self.cluster:
            replies = [await self._eval(*call) for call in calls]
        else:
            st = self._last
            if st is None or st.loop() is not asyncio.get_running_loop():
                st = self._state()
            try:
                replies = await asyncio.wait_for(self._pipelined(st, calls), self.timeout)
            except asyncio.TimeoutError:
                raise StoreUnavailable(
                    f"redis renew_many: no reply within timeout={self.timeout:g}s (Redis or "
                    "the network is stalled)"
                ) from None
        return [None if r == -1 else int(r) for r in replies]

    async def _pipelined(self, st: _LoopState, calls: list[RenewCall]) -> list[Any]:
        if not st.ready:
            await self._prepare(st)
        async with st.slots:
            for attempt in range(2):
                try:
                    pipe = st.client.pipeline(transaction=False)
                    for script, keys, args in calls:
                        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args, **_ND)
                    replies = await pipe.execute(raise_on_error=False)
                    if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
                        for script in {c[0] for c in calls}:
                            await st.client.script_load(script.text)
                        continue
                except _ERRORS as exc:
                    raise C.store_error(exc, "renew_many") from exc
                # A script error concerns its one key (a corrupt value): refused.
                return [-1 if isinstance(r, Exception) else r for r in replies]
        raise AssertionError("unreachable")  # pragma: no cover

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
        st = self._state()
        if not st.ready:
            await self._prepare(st)
        async with st.slots:
            return await self._listing_in(st.client, kind, ns_prefix)

    async def _listing_in(self, client: Any, kind: C.Kind, ns_prefix: str) -> list[Any]:
        # Not bounded as a whole (a listing of a large keyspace takes as long as it
        # takes); every round trip is, by the socket timeout.
        try:
            keys = [
                k if isinstance(k, bytes) else str(k).encode("utf-8", "surrogatepass")
                async for k in client.scan_iter(match=C.match_pattern(kind, ns_prefix), count=1000)
            ]
            now = _now_ms(await client.time())
            rows: list[Any] = []
            for i in range(0, len(keys), 500):
                batch = keys[i : i + 500]
                pipe = client.pipeline(transaction=False)
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
        task = asyncio.current_task()
        before = _cancelling(task)
        sub = await self._state().listener.subscribe(name)
        if _cancelling(task) > before:
            # Opening the listener's connection went through asyncio.wait_for inside
            # redis-py, which (Python < 3.12) can swallow a cancellation: deliver it,
            # without leaving the subscription behind.
            await sub.aclose()
            raise asyncio.CancelledError()
        return sub

    async def aclose(self) -> None:
        """Close this loop's connections, and those of loops still running in other
        threads (on their loop); those of loops that are over are dropped."""
        self._closed = True
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        states, self._states, self._last = self._states, {}, None
        for st in states.values():
            other = st.loop()
            if other is loop:
                await self._close_state(st)
            elif other is not None and other.is_running() and not other.is_closed():
                with contextlib.suppress(RuntimeError):  # it stopped meanwhile
                    asyncio.run_coroutine_threadsafe(self._close_state(st), other)

    @staticmethod
    async def _close_state(st: _LoopState) -> None:
        await st.listener.aclose()
        if st.owned:
            with contextlib.suppress(*_ERRORS):
                await st.client.aclose()


_TIMEOUT = getattr(asyncio, "timeout", None)  # Python 3.11+


async def _bounded(coro: Any, timeout: float) -> Any:
    """``await coro`` within ``timeout`` seconds (asyncio.TimeoutError past it). On
    Python 3.11 asyncio.wait_for can swallow a cancellation that lands as the awaited
    thing completes (a waiter cancelled as its notification arrives would then wait
    on); asyncio.timeout cannot."""
    if _TIMEOUT is not None:
        async with _TIMEOUT(timeout):
            return await coro
    return await asyncio.wait_for(coro, timeout)


def _max_connections(client: Any) -> int:
    """How many calls may run at once on ``client`` without redis-py's pool raising
    MaxConnectionsError (a cluster client limits each node: at most that in all)."""
    pool = getattr(client, "connection_pool", None)
    value = getattr(pool, "max_connections", None)
    if value is None:
        manager = getattr(client, "nodes_manager", None)
        value = getattr(manager, "connection_kwargs", {}).get("max_connections")
    if not isinstance(value, int) or value <= 0:
        value = 100
    return min(value, 10_000)


def _copy_standalone(client: Any) -> Any:
    """A client with the same connection settings as ``client``, for another loop."""
    import redis.asyncio

    pool = client.connection_pool
    kwargs = {
        k: v for k, v in pool.connection_kwargs.items() if k != "maint_notifications_pool_handler"
    }
    if isinstance(pool, redis.asyncio.BlockingConnectionPool):
        kwargs["timeout"] = pool.timeout
    new_pool = type(pool)(
        connection_class=pool.connection_class, max_connections=pool.max_connections, **kwargs
    )
    return redis.asyncio.Redis(connection_pool=new_pool)


_STORES: weakref.WeakSet[AsyncRedisStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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
                await _bounded(self._event.wait(), timeout)
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

    def __init__(self, connect: Any, on_idle: Any, defer_s: float, timeout: float) -> None:
        self._connect = connect
        self._on_idle = on_idle
        self._defer_s = defer_s
        self._confirm_timeout = timeout
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
                await _bounded(g.confirmed.wait(), self._confirm_timeout)
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
