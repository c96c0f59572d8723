"""The two ways the asyncio Redis store runs a script on one event loop, behind one
small interface, :class:`ScriptClient`: redis-py's command layer (:class:`PlainClient`)
and the store's own pipelined connection (:class:`PipelinedClient`, over
:mod:`._pipeline`). :func:`choose` picks one per loop from the client the store was
given; a caller sees the same replies and errors from both. Notifications go through
the listener (:mod:`._listen`), on redis-py connections, whichever is chosen.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from redis.exceptions import NoScriptError

from ..._errors import StoreUnavailable
from . import _common as C
from ._calls import (
    ND,
    eval_head,
    eval_text_args,
    noscript,
    pack_eval,
    pack_eval_text,
    pack_script_load,
    readonly,
)
from ._compat import StartupNodes
from ._orphans import retrieved
from ._pipeline import Lost, Orphan, Pipe, connect

_ERRORS = C.redis_errors()


class ScriptClient(Protocol):
    """What the asyncio store's flows call to reach Redis on one event loop."""

    #: the pipelined connection while it is up: a call may be queued on it directly,
    #: with the policy for a caller that stops waiting (None on redis-py's path)
    pipe: Pipe | None
    #: whether a call on the pipe lost with its connection (not stalled) is sent once
    #: more, as the client's retry policy would (redis-py's path retries by itself)
    retries: bool

    async def eval(
        self, script: C.Script, keys: tuple[bytes, ...], args: tuple[Any, ...], load: bool
    ) -> Any:
        """The script's reply; an idemlock error if it failed or was refused.
        ``load``: NOSCRIPT met already, send the script's text."""
        ...

    async def aclose(self) -> None:
        """Close what this client opened itself (not the user's redis-py client)."""
        ...


def choose(client: Any, durable: bool) -> bool:
    """Whether ``client`` (redis.asyncio) gets the pipelined connection: a standalone
    client with a plain or Sentinel pool of redis-py's own connection classes, not
    single-connection, and no ``durability=`` (a write and its WAIT share a pooled
    connection: on the shared pipelined one, a WAIT would hold up every other caller).
    A connection class of the user's may connect otherwise (a proxy, a transport of its
    own), which the pipe's socket would bypass: it keeps redis-py's path, as does
    anything else."""
    import redis.asyncio
    import redis.asyncio.connection as rc
    import redis.asyncio.sentinel as rs

    pools = (redis.asyncio.ConnectionPool, rs.SentinelConnectionPool)
    classes = (rc.Connection, rc.SSLConnection, rc.UnixDomainSocketConnection)
    return (
        not durable
        and isinstance(client, redis.asyncio.Redis)
        and type(client.connection_pool) in pools
        and client.connection_pool.connection_class in (*classes, rs.SentinelManagedConnection)
        and not client.single_connection_client
    )


class PlainClient:
    """Scripts through redis-py's ``execute_command`` (a Cluster, a limited or custom
    pool, a single-connection client, ``durability=``): at most ``slots`` at once,
    queueing instead of redis-py's MaxConnectionsError."""

    pipe: Pipe | None = None
    retries = False

    def __init__(
        self,
        client: Any,
        slots: asyncio.Semaphore,
        durability: Any,
        loaded: set[str],
        timeout: float,
        startup: StartupNodes | None = None,
    ) -> None:
        self._exec = client.execute_command
        self._client = client
        #: a Cluster client's startup nodes, put back before a call if redis-py (up to 6.4)
        #: dropped them all after calls failed on every node (see _compat.StartupNodes)
        self._restore = startup.restore if startup is not None else _nothing
        self._slots = slots
        #: durability=: the script and its WAIT/WAITAOF go in one redis-py pipeline
        self._durability = durability
        self._waits = bool(C.wait_commands(durability, timeout))
        self._loaded = loaded  # scripts a durable write's SCRIPT LOAD loaded
        self._timeout = timeout

    async def eval(
        self, script: C.Script, keys: tuple[bytes, ...], args: tuple[Any, ...], load: bool
    ) -> Any:
        async with self._slots:
            self._restore()
            if self._waits and script.sha in C.DURABLE:
                return await self._acked(script, keys, args)
            try:
                if not load:
                    try:
                        return await self._exec(
                            "EVALSHA", script.sha, len(keys), *keys, *args, **ND
                        )
                    except NoScriptError:
                        pass  # not in the cache: the call did not run; as EVAL (see _calls)
                return await self._exec(*eval_text_args(script, keys, args), **ND)
            except _ERRORS as exc:
                raise C.store_error(exc, script.name) from exc

    async def _acked(self, script: C.Script, keys: tuple[bytes, ...], args: tuple[Any, ...]) -> Any:
        """A write with ``durability=``: the script and its WAIT/WAITAOF in one redis-py
        pipeline (one round trip, one connection; WAIT counts the writes of its
        connection), behind a SCRIPT LOAD the first time (so a NOSCRIPT never costs a
        second WAIT)."""
        t0 = time.monotonic()
        try:
            replies = await self._with_waits(script, keys, args, self._timeout)
            if isinstance(replies[0], NoScriptError):
                # Flushed (a failover, a restart): the call did not run; again behind a
                # SCRIPT LOAD, waiting only for what is left of the bound.
                self._loaded.discard(script.sha)
                left = self._timeout - (time.monotonic() - t0)
                replies = await self._with_waits(script, keys, args, left)
        except _ERRORS as exc:
            raise C.store_error(exc, script.name) from exc
        first = replies[0]
        if isinstance(first, Exception):
            raise C.store_error(first, script.name) from first
        C.check_acks(self._durability, replies[1:], script.name)
        return first

    async def _with_waits(
        self, script: C.Script, keys: tuple[bytes, ...], args: tuple[Any, ...], left: float
    ) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        load = script.sha not in self._loaded
        if load:
            pipe.execute_command("SCRIPT", "LOAD", script.text)
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args, **ND)
        for wait in C.wait_commands(self._durability, left):
            pipe.execute_command(*wait)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        if load:
            if not isinstance(replies[0], Exception):
                self._loaded.add(script.sha)
            replies = replies[1:]
        return replies

    async def aclose(self) -> None:
        return None  # its connections are the redis-py client's


class PipelinedClient:
    """Scripts pre-encoded over one pipelined connection of the store's own per loop
    (any number at once), opened with the pool's settings (see :func:`._pipeline.connect`).
    After a NOSCRIPT a call goes as EVAL, behind one SCRIPT LOAD for all the calls that
    met it at once; a connection found broken (a restart, a reset) is replaced and the
    call sent once more when the client's retry policy retries (``retries``)."""

    def __init__(self, client: Any, timeout: float, orphan: Orphan, retries: bool) -> None:
        self._pool = client.connection_pool
        self._timeout = timeout
        self._orphan = orphan
        self.retries = retries
        self.pipe: Pipe | None = None
        self._connecting: asyncio.Task[Pipe] | None = None
        self._closed = False

    async def eval(
        self, script: C.Script, keys: tuple[bytes, ...], args: tuple[Any, ...], load: bool
    ) -> Any:
        retried = False
        while True:
            pipe = await self._up()
            if load:
                loading = pipe.loading.get(script.sha)
                if loading is None or loading.done():
                    # For the calls that follow (its reply, even a refusal, changes
                    # nothing here).
                    pipe.loading[script.sha] = pipe.send(pack_script_load(script)).fut
                reply = await pipe.send(pack_eval_text(script, keys, args)).fut
            else:
                reply = await pipe.send(pack_eval(eval_head(script.sha), keys, args)).fut
            if not isinstance(reply, Exception):
                return reply
            if isinstance(reply, Lost):
                if reply.stalled or retried or not self.retries:
                    raise failure(reply, script.name)
                retried = True
            elif noscript(reply) and not load:
                load = True
            else:
                if readonly(reply):  # demoted: the next call connects anew
                    pipe.close("the server is a replica now (READONLY)")
                raise failure(reply, script.name)

    async def _up(self) -> Pipe:
        """The pipelined connection, opened once for all callers waiting."""
        pipe = self.pipe
        if pipe is not None and pipe.lost is None:
            return pipe
        task = self._connecting
        if task is None or task.done():
            task = self._connecting = asyncio.ensure_future(self._open())
            task.add_done_callback(retrieved)
        return await asyncio.shield(task)

    async def _open(self) -> Pipe:
        # RESP2 and raw bytes, as for the listener: the scripts' replies are the same
        # in RESP3, and a RESP3 push frame (which hiredis cannot tell from a reply)
        # would put the matching out of step.
        pool = self._pool
        settings = pool.connection_class(**C.listener_kwargs(pool.connection_kwargs))
        try:
            pipe = await connect(settings, pool, self._timeout, self._orphan)
        except _ERRORS as exc:
            raise C.store_error(exc, "connect") from exc
        if self._closed:
            pipe.close()
        else:
            self.pipe = pipe
        return pipe

    async def aclose(self) -> None:
        self._closed = True
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        pipe, self.pipe = self.pipe, None
        if pipe is not None:
            await pipe.aclose()


def _nothing() -> bool:
    return False


def failure(reply: Exception, what: str) -> Exception:
    """The idemlock error for a pipelined call's error reply or lost connection."""
    if isinstance(reply, Lost):
        return StoreUnavailable(f"redis {what} failed: {reply}; the call may have been applied")
    return C.store_error(reply, what)
