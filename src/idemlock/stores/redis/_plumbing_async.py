"""How the asyncio Redis store reaches Redis: a client, a listener and a queue per
event loop (kept in :mod:`._loops`), bounded calls with a policy for a caller that
stops waiting (carried out by :mod:`._orphans`), and closing.

The port methods themselves are :class:`~idemlock.stores.redis._async.AsyncRedisStore`'s,
written once on top of this class (and generated for the blocking store).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

from redis.exceptions import ResponseError

from ... import _forks
from ..._core.port import Channel
from ..._core.wakeups import Group
from ..._errors import StoreUnavailable
from . import _common as C
from ._calls import (
    eval_head,
    noscript,
    pack_eval,
    readonly,
)
from ._clients import PipelinedClient, PlainClient, choose
from ._compat import aclose_client
from ._listen import AsyncListener, AsyncNodeListeners, AsyncSubscription, bounded, cancelling
from ._loops import LoopState, client_for_another_loop, node_of
from ._orphans import Orphans
from ._pipeline import Call, Lost, Pipe

_ERRORS = C.redis_errors()
_getpid = os.getpid


class AsyncPlumbing:
    """The store on ``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster``.

    Works on any event loop: the first loop uses ``client``; another loop (a second
    ``asyncio.run()``, a test client's own loop, a forked child) gets a client of its
    own, built from the URL again (or, for a standalone client passed in, a copy of its
    connection pool's settings). On a standalone client with a plain connection pool,
    scripts share one pipelined connection per loop (any number at once); otherwise a
    burst of calls queues for a connection (at most the pool's ``max_connections`` at
    once). Each call, queueing included, is bounded by ``timeout``.
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
        #: durability=: what a write waits for, and the commands that wait (WAIT...)
        self._durability = options.durability
        self._waits = C.wait_commands(options.durability, options.timeout)
        #: scripts loaded by a durable write's SCRIPT LOAD (forgotten on NOSCRIPT)
        self._loaded: set[str] = set()
        # Keyed by the loop object (compared by identity through `LoopState.loop`);
        # states of closed loops are dropped when another loop arrives.
        self._states: dict[int, LoopState] = {}
        self._last: LoopState | None = None
        self._base_taken = False  # whether `client` serves a loop already (or is inherited)
        self._closed = False
        # calls whose callers stopped waiting, and their undo calls
        self._orphans = Orphans()
        #: the process the loops' states are of (see ``_forked``)
        self._pid = os.getpid()

    # ---- per-loop state ------------------------------------------------------------------

    def _state(self) -> LoopState:
        loop = asyncio.get_running_loop()
        if self._pid != os.getpid():
            self._forked()
        st = self._last
        if st is not None and st.loop() is loop:
            return st
        st = self._states.get(id(loop))
        if st is None or st.loop() is not loop:
            st = self._new_state(loop)
        self._last = st
        return st

    def _new_state(self, loop: asyncio.AbstractEventLoop) -> LoopState:
        if self._closed:
            raise StoreUnavailable("the Redis store is closed")
        if not self._base_taken:
            self._base_taken = True
            st = LoopState(loop, self.client, self._owned)
        else:
            st = LoopState(
                loop, client_for_another_loop(self.client, self.cluster, self._factory), True
            )
        st.backend = (
            PipelinedClient(st.client, self.timeout, self._orphan, st.retries)
            if choose(st.client, bool(self._waits))
            else PlainClient(
                st.client,
                st.slots,
                self._durability,
                self._loaded,
                self.timeout,
                st.startup if self.cluster else None,
            )
        )
        st.ready = not self.cluster
        for key, old in list(self._states.items()):
            gone = old.loop()
            if gone is None or gone.is_closed():
                # Its connections belong to a loop that is over: nothing can close them
                # properly any more; dropping them closes the sockets.
                del self._states[key]

        def listener(node: str) -> AsyncListener:
            return AsyncListener(
                lambda: self._listener_connection(st, node),
                self._unregister,
                self._handoff / 1000 + 0.005,
                self.timeout,
            )

        # On a Cluster, one listener per node: each channel on its slot's node (see
        # SyncNodeListeners, in _listen).
        st.listener = (
            AsyncNodeListeners(partial(node_of, st.client), listener)
            if self.cluster
            else listener("")
        )
        self._states[id(loop)] = st
        return st

    def _forked(self) -> None:
        """In a forked child (the pid check of every call): never touch what was
        inherited (the parent's sockets, the parent's loop): drop every loop's state
        unclosed; the child's first call builds its own client."""
        with _forks.LOCK:
            if self._pid == os.getpid():
                return
            _forks.INHERITED.append(self._states)
            self._states = {}
            self._last = None
            self._base_taken = True
            self._pid = os.getpid()

    async def _prepare(self, st: LoopState) -> None:
        async with st.init_lock:
            if not st.ready:
                st.startup.restore()
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

        On a live pipelined connection the call is queued on it directly, without a
        task: the pipe's watchdog bounds it, and a caller that stops waiting leaves
        its call queued, its reply going to :meth:`_orphan` with the policy below.

        Otherwise (connecting, loading a script, a Cluster or a limited pool's client)
        the script runs in a task of its own and the caller waits on it through a
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
        if st is None or st.loop() is not asyncio.get_running_loop() or self._pid != _getpid():
            st = self._state()
        pipe = st.backend.pipe
        if pipe is None or pipe.lost is not None:
            return await self._eval_task(st, script, keys, args, finish, undo, undo_late)
        call = pipe.send(
            pack_eval(eval_head(script.sha), keys, args),
            undo,
            undo_late,
            (script, keys, args) if finish else None,
        )
        try:
            reply = await call.fut
        except asyncio.CancelledError:
            if not call.fut.cancelled():
                # The reply came in as the caller was cancelled: the policy's now.
                self._orphan(call, call.fut.result())
            raise
        if isinstance(reply, Exception):
            return await self._refused(st, script, keys, args, call, reply, finish, pipe)
        return reply

    async def _refused(
        self,
        st: LoopState,
        script: C.Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        call: Call,
        reply: Exception,
        finish: bool,
        pipe: Pipe,
    ) -> Any:
        """A pipelined call answered with an error or dropped with its connection."""
        if isinstance(reply, Lost):
            if reply.stalled:
                if call.undo_late and call.undo is not None:
                    self._orphans.undo_now(call.undo, None)
                raise StoreUnavailable(
                    f"redis {script.name}: no reply within timeout={self.timeout:g}s "
                    "(Redis or the network is stalled); the call may have been applied"
                )
            if st.backend.retries:
                # A connection found broken (a restart, a reset) when this call was on
                # it: once more on a new one, as redis-py's retry policy would.
                return await self._eval_task(
                    st, script, keys, args, finish, call.undo, call.undo_late, call.deadline
                )
            raise StoreUnavailable(
                f"redis {script.name} failed: {reply}; the call may have been applied"
            )
        if readonly(reply):
            # The pipe reached a primary demoted since (a failover): the call did not
            # run. Drop the pipe; once more on a new one, which connects to the primary
            # the Sentinels name now, within what is left of the bound.
            pipe.close("the server is a replica now (READONLY)")
            return await self._eval_task(
                st, script, keys, args, finish, call.undo, call.undo_late, call.deadline
            )
        if noscript(reply):
            # Scripts flushed (a restart, SCRIPT FLUSH, a failover): the call did not
            # run. Run it again as EVAL within what is left of the bound, as a task
            # with the same policy for a caller that stops waiting.
            return await self._eval_task(
                st, script, keys, args, finish, call.undo, call.undo_late, call.deadline, True
            )
        raise C.store_error(reply, script.name) from reply

    def _orphan(self, call: Call, reply: Any) -> None:
        """The reply (or a :class:`Lost`) of a pipelined call whose caller stopped
        waiting: undo what a claim or an acquire took, and run a complete, abandon or
        release again in the background where its caller would have (NOSCRIPT: it
        did not run; a broken connection: retried as redis-py's policy would)."""
        if call.redo is not None:
            st = self._last
            again = False
            if isinstance(reply, ResponseError):  # it did not run
                again = noscript(reply) or readonly(reply)
            if isinstance(reply, Lost) and not reply.stalled:
                again = st is not None and st.backend.retries
            if again:
                script, keys, args = call.redo
                self._orphans.background(self._eval(script, keys, args, finish=True))
            return
        self._orphans.undo_reply(call.undo, reply)

    async def _eval_task(
        self,
        st: LoopState,
        script: C.Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        finish: bool,
        undo: Callable[[Any], Any] | None,
        undo_late: bool,
        deadline: float | None = None,
        load: bool = False,
    ) -> Any:
        """``_eval`` as a task of its own, waited on through a shield (connecting,
        loading scripts, a Cluster or a pool's client); ``deadline``: the loop time
        the bound ends at, when a first attempt used some of it; ``load``: load the
        script as EVAL (NOSCRIPT met already)."""
        bound = self.timeout
        if deadline is not None:
            bound = max(0.0, deadline - asyncio.get_running_loop().time())
        task = asyncio.ensure_future(self._run(st, script, keys, args, load))
        try:
            return await bounded(asyncio.shield(task), bound)
        except asyncio.TimeoutError:
            late = undo if undo_late else None
            keep = finish or late is not None  # runs on to its own socket timeouts
            self._orphans.abandon_task(task, late, script.name, cancel=not keep)
            raise StoreUnavailable(
                f"redis {script.name}: no reply within timeout={self.timeout:g}s (Redis or "
                "the network is stalled, or more calls at once than the pool's "
                "max_connections queued that long); the call may have been applied"
            ) from None
        except asyncio.CancelledError:
            keep = finish or undo is not None
            self._orphans.abandon_task(task, undo, script.name, cancel=not keep)
            raise

    async def _run(
        self,
        st: LoopState,
        script: C.Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        load: bool = False,
    ) -> Any:
        if not st.ready:
            await self._prepare(st)
        return await st.backend.eval(script, keys, args, load)

    async def _unregister(self, channel: bytes, gid: bytes) -> None:
        # This process stopped waiting without the lock: a release need not hold the
        # lock back for it. Best effort; the registration expires anyway.
        with contextlib.suppress(StoreUnavailable):
            await self._eval(C.UNREGISTER, (C.waiters_of(channel),), (gid,))

    @contextlib.asynccontextmanager
    async def _client(self) -> AsyncIterator[Any]:
        """This loop's client, with a connection slot held (listings, pipelines)."""
        st = self._last
        if st is None or st.loop() is not asyncio.get_running_loop() or self._pid != _getpid():
            st = self._state()
        if not st.ready:
            await self._prepare(st)
        st.startup.restore()  # see _compat.StartupNodes
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

    async def _listener_connection(self, st: LoopState, name: str = "") -> Any:
        client = st.client
        if self.cluster:
            if not st.ready:
                await self._prepare(st)
            node = client.get_node(node_name=name) if name else None
            if node is None:  # unknown or gone: any node gets every PUBLISH, later
                node = random.choice(C.known_nodes(client))
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
        sub = await self._state().listener.subscribe(name, channel.kind == "leader")
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
        if self._pid != os.getpid():
            self._forked()  # the parent's connections: never closed from here
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
    async def _close_state(st: LoopState) -> None:
        await st.listener.aclose()
        await st.backend.aclose()
        if st.owned:
            with contextlib.suppress(*_ERRORS):
                await aclose_client(st.client)
