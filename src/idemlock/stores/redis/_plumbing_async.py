"""How the asyncio Redis store reaches Redis: a client, a listener and a queue per
event loop, bounded calls with a policy for a caller that stops waiting, and closing.

The port methods themselves are :class:`~idemlock.stores.redis._async.AsyncRedisStore`'s,
written once on top of this class (and generated for the blocking store).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from ..._core.port import Channel
from ..._core.wakeups import Group
from ..._errors import ConfigurationError, StoreUnavailable
from ..._logfields import fields as log_fields
from . import _common as C
from ._calls import ND, eval_head, pack_eval
from ._listen import AsyncListener, AsyncSubscription, bounded, cancelling

_ERRORS = C.redis_errors()


class _LoopState:
    """What the store keeps per event loop: asyncio connections belong to the loop
    that opened them, so each loop gets its own client, listener and queue."""

    __slots__ = (
        "client",
        "direct",
        "exec",
        "free",
        "init_lock",
        "listener",
        "loop",
        "owned",
        "ready",
        "slots",
    )

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
        # As in the blocking store: scripts on a plain pool's standalone client go
        # pre-encoded over connections of the store's own (at most `slots` of them).
        import redis.asyncio

        self.direct = (
            isinstance(client, redis.asyncio.Redis)
            and type(client.connection_pool) is redis.asyncio.ConnectionPool
            and not client.single_connection_client
        )
        self.free: list[Any] = []
        self.listener: AsyncListener


class AsyncPlumbing:
    """The store on ``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster``.

    Works on any event loop: the first loop uses ``client``; another loop (a second
    ``asyncio.run()``, a test client's own loop, a forked child) gets a client of its
    own, built from the URL again (or, for a standalone client passed in, a copy of its
    connection pool's settings). A burst of calls queues for a connection (at most the
    pool's ``max_connections`` at once), and each call, queueing included, is bounded
    by ``timeout``.
    """

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
            return await bounded(asyncio.shield(task), self.timeout)
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
            if st.direct:
                return await self._run_direct(st, script, keys, args)
            try:
                try:
                    return await st.exec("EVALSHA", script.sha, len(keys), *keys, *args, **ND)
                except NoScriptError:
                    await st.client.script_load(script.text)
                    return await st.exec("EVALSHA", script.sha, len(keys), *keys, *args, **ND)
            except _ERRORS as exc:
                raise C.store_error(exc, script.name) from exc

    @staticmethod
    async def _run_direct(
        st: _LoopState, script: C.Script, keys: tuple[bytes, ...], args: tuple[Any, ...]
    ) -> Any:
        """``_run`` on a connection of the store's own (see the blocking store's
        ``_eval_direct``): the connection's retry policy and timeouts, without the pool
        checkout and the rest of ``execute_command``."""
        packed = pack_eval(eval_head(script.sha), keys, args)
        try:
            conn = st.free.pop()
        except IndexError:
            pool = st.client.connection_pool
            conn = pool.connection_class(**pool.connection_kwargs)

        async def once() -> Any:
            writer = getattr(conn, "_writer", None)
            if writer is None or conn.health_check_interval:
                await conn.send_packed_command(packed)  # connects, checks health
            else:
                await _write(conn, writer, packed)
            return await conn.read_response(disable_decoding=True)

        async def failed(_: Exception) -> None:
            await conn.disconnect()

        clean = False
        try:
            try:
                reply = await conn.retry.call_with_retry(once, failed)
            except NoScriptError:
                await conn.send_command("SCRIPT", "LOAD", script.text)
                await conn.read_response()
                reply = await conn.retry.call_with_retry(once, failed)
            clean = True
            return reply
        except ResponseError as exc:
            clean = True  # a refusal in a complete reply: the connection is in step
            raise C.store_error(exc, script.name) from exc
        except _ERRORS as exc:
            raise C.store_error(exc, script.name) from exc
        finally:
            if not clean or conn.should_reconnect():
                # A timeout, a reset, a cancellation between writing and reading: a
                # reply may still come, and the next call must not read it.
                with contextlib.suppress(Exception):
                    await conn.disconnect(nowait=True)
            st.free.append(conn)

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
                extra=log_fields(store="redis", operation="undo", outcome="error"),
            )

    async def _unregister(self, channel: bytes, gid: bytes) -> None:
        # This process stopped waiting without the lock: a release need not hold the
        # lock back for it. Best effort; the registration expires anyway.
        with contextlib.suppress(StoreUnavailable):
            await self._eval(C.UNREGISTER, (C.waiters_of(channel),), (gid,))

    @contextlib.asynccontextmanager
    async def _client(self) -> AsyncIterator[Any]:
        """This loop's client, with a connection slot held (listings, pipelines)."""
        st = self._last
        if st is None or st.loop() is not asyncio.get_running_loop():
            st = self._state()
        if not st.ready:
            await self._prepare(st)
        async with st.slots:
            yield st.client

    async def _bounded(self, call: Awaitable[Any], what: str) -> Any:
        """``await call`` within ``timeout``; a cancelled or late batch is moot."""
        try:
            return await asyncio.wait_for(call, self.timeout)
        except asyncio.TimeoutError:
            raise StoreUnavailable(
                f"redis {what}: no reply within timeout={self.timeout:g}s (Redis or "
                "the network is stalled)"
            ) from None

    def _waiting(self, channel: bytes) -> Group[bytes, Any] | None:
        """This loop's waiters on ``channel``, if a caller waits on it."""
        return self._state().listener.waiting(channel)

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

    # ---- waiting and life cycle ----------------------------------------------------------

    async def subscribe(self, channel: Channel) -> AsyncSubscription:
        name = C.channel_name(channel.kind, channel.ns, channel.key)
        task = asyncio.current_task()
        before = cancelling(task)
        sub = await self._state().listener.subscribe(name)
        if cancelling(task) > before:
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
        free, st.free = st.free, []
        for conn in free:
            with contextlib.suppress(*_ERRORS):
                await conn.disconnect()
        if st.owned:
            with contextlib.suppress(*_ERRORS):
                await st.client.aclose()


async def _write(conn: Any, writer: asyncio.StreamWriter, packed: bytes) -> None:
    """What redis-py's ``send_packed_command`` does on a live connection, without its
    ``asyncio.wait_for`` around every write (a task per call on Python 3.11): the
    socket takes a command at once nearly always, so only a write that has to wait
    for the buffer to drain is bounded, by the socket timeout as there."""
    import redis.exceptions as rx

    try:
        writer.write(packed)
        if writer.transport.get_write_buffer_size():
            await asyncio.wait_for(writer.drain(), conn.socket_timeout)
    except asyncio.TimeoutError:
        await conn.disconnect(nowait=True)
        raise rx.TimeoutError("Timeout writing to socket") from None
    except OSError as exc:
        await conn.disconnect(nowait=True)
        raise rx.ConnectionError(f"Error while writing to socket: {exc}") from exc


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


_STORES: weakref.WeakSet[AsyncPlumbing] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
