"""Automatic pipelining for the asyncio Redis store: one connection per event loop
carries every concurrent call. What callers queue during one event-loop turn goes out
in one write; replies come back in the order the commands were written, so each is
matched to the oldest call still waiting.

Matching by order is only sound while the connection is in step, so the connection is
dropped (and every call on it fails) as soon as that is in doubt: the oldest call had
no reply within its bound (a silent network or server), the connection broke, or the
bytes were not RESP. A later call gets a new connection with a fresh parser and queue:
a reply can never reach a caller of another connection.

A caller that stops waiting (cancelled) leaves its call in the queue: its reply is
still read in turn, and handed to ``orphan`` (the store's policy: undo a claim or an
acquire, finish a complete after NOSCRIPT).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._compat import credentials
from ._resp import ProtocolError
from ._resp import Reader as _PyReader

try:
    import hiredis

    def new_reader() -> Any:
        return hiredis.Reader(replyError=ResponseError, protocolError=ProtocolError)

    HIREDIS = True
except ImportError:

    def new_reader() -> Any:
        return _PyReader(ResponseError)

    HIREDIS = False


def pack(*parts: bytes) -> bytes:
    """One RESP command of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(p), p))
    return b"".join(out)


class Lost(Exception):
    """The connection was dropped before this call's reply came: whether Redis ran the
    call is unknown. ``stalled``: because a reply was overdue (the bound passed)."""

    def __init__(self, why: str, stalled: bool) -> None:
        super().__init__(why)
        self.stalled = stalled


class Call:
    """One command written (or about to be) on a :class:`Pipe`, waiting for its reply.

    ``undo`` / ``undo_late`` / ``redo`` are the store's policy for a caller that stops
    waiting (see ``AsyncPlumbing._eval``); the pipe only carries them to ``orphan``."""

    __slots__ = ("deadline", "fut", "redo", "undo", "undo_late")

    def __init__(
        self,
        fut: asyncio.Future[Any],
        deadline: float,
        undo: Callable[[Any], Any] | None,
        undo_late: bool,
        redo: Any,
    ) -> None:
        self.fut = fut
        self.deadline = deadline
        self.undo = undo
        self.undo_late = undo_late
        self.redo = redo


#: orphan(call, reply): a reply (or a Lost) for a call whose caller stopped waiting
Orphan = Callable[[Call, Any], None]


class Pipe(asyncio.Protocol):
    """One Redis connection, pipelined: an asyncio protocol on a socket of its own
    (:func:`connect` opens it and handshakes with the client's settings). Only this
    protocol reads and writes it; any transport with ``write`` and ``abort`` will do
    (the tests drive it over an in-memory one)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float, orphan: Orphan) -> None:
        self._loop = loop
        self.transport: Any = None  # set by connection_made
        self._timeout = timeout
        self._orphan = orphan
        self._reader = new_reader()
        self._out: list[bytes] = []
        self._pending: deque[Call] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self.lost: Lost | None = None
        #: SCRIPT LOADs sent, by sha (the calls that meet NOSCRIPT at once send one)
        self.loading: dict[str, asyncio.Future[Any]] = {}
        self._gone = loop.create_future()  # the socket is closed

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    # ---- sending -----------------------------------------------------------------------

    def send(
        self,
        packed: bytes,
        undo: Callable[[Any], Any] | None = None,
        undo_late: bool = False,
        redo: Any = None,
    ) -> Call:
        """Queue ``packed`` (one whole RESP command) for this turn's write; the reply
        resolves ``call.fut`` (an error reply as its ResponseError, not raised). The
        caller checks ``lost`` first."""
        loop = self._loop
        call = Call(loop.create_future(), loop.time() + self._timeout, undo, undo_late, redo)
        if self.lost is not None:  # dropped meanwhile: never written
            call.fut.set_result(Lost(str(self.lost), stalled=False))
            return call
        out = self._out
        if not out:
            loop.call_soon(self._flush)
        out.append(packed)
        pending = self._pending
        pending.append(call)
        if self._timer is None:
            self._timer = loop.call_at(pending[0].deadline, self._check)
        return call

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.lost is None and out:
            self.transport.write(b"".join(out) if len(out) > 1 else out[0])

    def _check(self) -> None:
        """The watchdog: one timer for the whole queue, at its oldest call's deadline
        (every call has the same bound, so the oldest is the first due)."""
        self._timer = None
        pending = self._pending
        if not pending:
            return
        first = pending[0].deadline
        if first <= self._loop.time():
            self._drop(Lost(f"no reply within timeout={self._timeout:g}s", stalled=True))
        else:
            self._timer = self._loop.call_at(first, self._check)

    # ---- receiving ---------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        pending = self._pending
        try:
            while True:
                reply = reader.gets()
                if reply is False:
                    return
                try:
                    call = pending.popleft()
                except IndexError:
                    raise ProtocolError("a reply nothing was sent for") from None
                fut = call.fut
                if fut.done():  # its caller stopped waiting
                    self._orphan(call, reply)
                else:
                    fut.set_result(reply)
        except ProtocolError as exc:
            self._drop(Lost(f"connection out of step: {exc}", stalled=False))

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        why = f"connection lost ({exc})" if exc is not None else "connection closed by Redis"
        self._fail(Lost(why, stalled=False))
        if not self._gone.done():
            self._gone.set_result(None)

    # ---- ending ------------------------------------------------------------------------

    def close(self, why: str = "the store closed the connection") -> None:
        self._drop(Lost(why, stalled=False))

    async def aclose(self) -> None:
        """Close, and wait until the socket is closed."""
        self.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._gone), self._timeout)

    def _drop(self, lost: Lost) -> None:
        self._fail(lost)
        if self.transport is not None:
            self.transport.abort()  # nothing more is read: unread replies are moot

    def _fail(self, lost: Lost) -> None:
        if self.lost is None:
            self.lost = lost
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._out = []
        pending, self._pending = self._pending, deque()
        for call in pending:
            fut = call.fut
            if fut.done():
                self._orphan(call, lost)
            else:
                fut.set_result(Lost(str(lost), lost.stalled))


# ---- opening -----------------------------------------------------------------------------


async def connect(settings: Any, pool: Any, timeout: float, orphan: Orphan) -> Pipe:
    """A :class:`Pipe` on a socket of its own, opened and handshaken as redis-py would
    with ``settings``: a redis.asyncio connection made from the pool's options and
    never connected, of which only public attributes are read (address or unix path,
    TLS context, keepalive, credentials, client name, database). A Sentinel pool is
    asked for the primary's address first. Opening the socket follows the
    connection's retry policy; RESP2 always (see ``AsyncPlumbing._open_pipe``)."""
    loop = asyncio.get_running_loop()

    async def attempt() -> Pipe:
        return await _open(loop, settings, pool, timeout, orphan)

    retry = getattr(settings, "retry", None)
    pipe = await (retry.call_with_retry(attempt, _no_op) if retry is not None else attempt())
    try:
        await _handshake(pipe, settings)
    except BaseException:
        pipe.close("the handshake failed")
        raise
    return pipe


async def _no_op(_: Exception) -> None:
    return None


async def _open(
    loop: asyncio.AbstractEventLoop, s: Any, pool: Any, timeout: float, orphan: Orphan
) -> Pipe:
    def factory() -> Pipe:
        return Pipe(loop, timeout, orphan)

    path = getattr(s, "path", None)
    where = path
    try:
        if isinstance(path, str) and path:  # a UnixDomainSocketConnection
            opening = loop.create_unix_connection(factory, path)
        else:
            host, port = s.host, s.port
            if isinstance(pool, SentinelConnectionPool) and pool.is_master:
                # redis-py leaves this coroutine unannotated (nothing to fix on our side)
                host, port = await pool.get_master_address()  # type: ignore[no-untyped-call]
            where = f"{host}:{port}"
            tls = getattr(s, "ssl_context", None)  # an SSLConnection's (redis-py's object)
            opening = loop.create_connection(
                factory, host, port, ssl=tls.get() if tls is not None else None
            )
        _, pipe = await asyncio.wait_for(opening, s.socket_connect_timeout or timeout)
    except asyncio.TimeoutError:
        raise RedisTimeoutError(f"Timeout connecting to {where}") from None
    except OSError as exc:
        raise RedisConnectionError(f"Error connecting to {where}: {exc}") from exc
    sock = pipe.transport.get_extra_info("socket")
    if sock is not None and getattr(s, "socket_keepalive", False):
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for k, v in (s.socket_keepalive_options or {}).items():
                sock.setsockopt(socket.SOL_TCP, k, v)
        except (OSError, TypeError):
            pipe.close("bad socket_keepalive_options")
            raise
    return pipe


async def _handshake(pipe: Pipe, s: Any) -> None:
    """AUTH, CLIENT SETNAME and SELECT, pipelined: one round trip."""
    steps: list[tuple[str, bytes]] = []
    creds = await credentials(s)
    if creds:
        steps.append(("AUTH", pack(b"AUTH", *(_b(c) for c in creds))))
    if s.client_name:
        steps.append(("CLIENT SETNAME", pack(b"CLIENT", b"SETNAME", _b(s.client_name))))
    if s.db:
        steps.append(("SELECT", pack(b"SELECT", b"%d" % int(s.db))))
    calls = [pipe.send(packed) for _, packed in steps]
    for (what, _), call in zip(steps, calls, strict=True):
        reply = await call.fut
        if isinstance(reply, Lost):
            raise RedisConnectionError(f"{what} on connecting: {reply}")
        if isinstance(reply, Exception):
            if what == "AUTH":
                raise AuthenticationError(str(reply))
            raise RedisConnectionError(f"{what} on connecting: {reply}")


def _b(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()
