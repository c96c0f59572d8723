"""LISTEN/NOTIFY hand-off: one dedicated connection per store, shared by all its waiters.

Each waited-on key has its own channel (a hash, see ``Statements.channel``); the
listener LISTENs on a channel while at least one subscription to it is open, so the
server only sends this process the notifications it waits for. Freeing statements
call ``pg_notify`` in the same statement, so the notification is sent exactly when
the change commits.

A background thread reads the socket and wakes subscriptions through a
:class:`~idemlock.stores._local.LocalHub`, which serves threads and asyncio alike
(the async store uses the same listener). ``subscribe`` registers the waiter first and
returns only once the server has confirmed the LISTEN, so a notification sent after
``subscribe`` returned is never missed. If the connection drops, every waiter is
woken to re-check the store and the thread reconnects and LISTENs again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from ..._errors import StoreUnavailable
from .._local import LocalHub, LocalSubscription
from . import _watchdog

log = logging.getLogger("idemlock")

#: longest pause between reconnection attempts while the server is away (seconds)
RECONNECT_MAX = 1.0
#: seconds a channel stays LISTENed after its last waiter left
LINGER = 2.0
#: channels kept LISTENed without waiters, at most
MAX_LINGERING = 1000


class Listener:
    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], timeout: float) -> None:
        self._connect = connect
        #: the bound on one LISTEN/UNLISTEN round trip (seconds), even on a silent network
        self._timeout = timeout
        self._hub = LocalHub()
        # _io serializes every use of the connection (LISTEN, UNLISTEN, reading);
        # _state guards the reference counts, and is never held across I/O.
        self._io = threading.Lock()
        self._state = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        self._refs: dict[str, int] = {}
        self._listening: set[str] = set()  # channels LISTENed on the current connection
        # Channels nobody waits on any more, since when: they stay LISTENed for LINGER
        # seconds, so waiting again on a busy key subscribes without a round trip.
        self._idle: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe already means "wake up"
        self._closed = False
        #: notifications received (for tests and metrics)
        self.received = 0

    # ---- subscriptions ------------------------------------------------------------

    def subscribe(self, channel: str) -> ListenSubscription:
        """Listen on ``channel`` (one server round trip unless already listening)."""
        sub = self._hub.subscribe(channel)  # before LISTEN: nothing received after it is lost
        with self._state:
            self._refs[channel] = self._refs.get(channel, 0) + 1
        try:
            with self._io:
                if self._closed:
                    raise StoreUnavailable("the PostgreSQL store is closed")
                conn = self._ensure_conn()
                if channel not in self._listening:
                    self._run(conn, "LISTEN", channel)
                    self._listening.add(channel)
        except BaseException:
            self._release(channel)
            sub.close()
            raise
        self._start_thread()
        return ListenSubscription(self, channel, sub)

    def try_subscribe(self, channel: str) -> ListenSubscription | None:
        """Subscribe without I/O and without blocking, if the channel is already listened
        on; else None (the caller then calls ``subscribe`` from a worker thread)."""
        if not self._io.acquire(blocking=False):
            return None
        try:
            if self._closed or self._conn is None or channel not in self._listening:
                return None
            sub = self._hub.subscribe(channel)
            with self._state:
                self._refs[channel] = self._refs.get(channel, 0) + 1
            return ListenSubscription(self, channel, sub)
        finally:
            self._io.release()

    def is_listening(self, channel: str) -> bool:
        """Whether ``channel`` is LISTENed on a live connection (for tests and health
        checks; False while reconnecting)."""
        conn = self._conn
        return conn is not None and not conn.closed and channel in self._listening

    def _release(self, channel: str) -> None:
        with self._state:
            left = self._refs.get(channel, 0) - 1
            if left > 0:
                self._refs[channel] = left
                return
            self._refs.pop(channel, None)
            self._idle[channel] = time.monotonic()
        # The reader thread UNLISTENs later (LINGER), so closing never waits on I/O.
        self._nudge()

    def _nudge(self) -> None:
        with self._state:
            if self._wake_w < 0:
                return  # closed: the descriptor number may belong to another file now
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")

    # ---- connection -----------------------------------------------------------------

    def _ensure_conn(self) -> psycopg.Connection[Any]:
        # Called with _io held.
        if self._conn is not None and not self._conn.closed:
            return self._conn
        try:
            conn = self._connect()
        except psycopg.Error as exc:
            raise StoreUnavailable(
                f"cannot open the PostgreSQL connection that waits for notifications: {exc}"
            ) from exc
        conn.add_notify_handler(self._on_notify)
        self._conn = conn
        self._listening = set()
        with self._state:
            wanted = list(self._refs)
        try:
            for channel in wanted:
                self._run(conn, "LISTEN", channel)
                self._listening.add(channel)
        except StoreUnavailable:
            self._drop()
            raise
        return conn

    def _run(self, conn: psycopg.Connection[Any], verb: str, channel: str) -> None:
        query = sql.SQL(verb + " {}").format(sql.Identifier(channel))
        wd = _watchdog.WATCHDOG
        armed = wd.arm(conn, time.monotonic() + self._timeout)
        try:
            conn.execute(query)
            # libpq may already hold notifications read along with the reply.
            self._drain(conn)
        except psycopg.Error as exc:
            self._drop()
            if armed.fired:
                raise StoreUnavailable(
                    f"PostgreSQL did not answer {verb} within timeout={self._timeout:g}s on the "
                    "notification connection (the server or the network is stuck or silent)"
                ) from exc
            raise StoreUnavailable(f"{verb} failed on the notification connection: {exc}") from exc
        finally:
            wd.disarm(armed)

    def _drain(self, conn: psycopg.Connection[Any]) -> None:
        while (n := conn.pgconn.notifies()) is not None:
            self._dispatch(n.relname.decode())

    def _on_notify(self, n: psycopg.Notify) -> None:
        # Notifications psycopg read while a LISTEN/UNLISTEN ran.
        self._dispatch(n.channel)

    def _dispatch(self, channel: str) -> None:
        self.received += 1
        self._wake(channel)

    def _wake(self, channel: str) -> None:
        try:
            self._hub.notify(channel)
        except Exception:  # e.g. a waiter's event loop closed: never kill the reader
            log.warning("idemlock: could not wake a waiter", exc_info=True)

    def _drop(self) -> None:
        """Forget a broken connection and wake every waiter to re-check the store."""
        conn, self._conn = self._conn, None
        self._listening = set()
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
        self._wake_all()

    def _wake_all(self) -> None:
        with self._state:
            channels = list(self._refs)
        for channel in channels:
            self._wake(channel)

    # ---- the reader thread --------------------------------------------------------

    def _start_thread(self) -> None:
        with self._state:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(
                target=self._loop, name="idemlock-pg-listener", daemon=True
            )
        self._thread.start()

    def _loop(self) -> None:
        delay = 0.05
        while not self._closed:
            try:
                delay = self._step(delay)
            except Exception:  # a bug here must not end hand-offs for good
                log.exception("idemlock: PostgreSQL notification reader failed; restarting it")
                with self._io:
                    self._drop()
                time.sleep(delay)

    def _step(self, delay: float) -> float:
        """Wait for the socket or a nudge, then read notifications, reconnect or
        UNLISTEN idle channels. Returns the next reconnection delay."""
        conn = self._conn
        fd = -1
        if conn is not None:
            with contextlib.suppress(Exception):
                fd = conn.fileno()
        with self._state:
            want = bool(self._refs)
            wake = self._wake_r
        if wake < 0:
            return delay  # closed
        poller = select.poll()  # not select(): it fails on descriptors above 1023
        poller.register(wake, select.POLLIN)
        if fd >= 0:
            poller.register(fd, select.POLLIN)
        # While away (no connection) and someone waits, retry the connection soon; else
        # wake up when the first lingering channel is due for UNLISTEN.
        timeout: float | None = delay if fd < 0 and want else None
        with self._state:
            if self._idle and fd >= 0:
                due = min(self._idle.values()) + LINGER - time.monotonic()
                timeout = max(0.0, due) if timeout is None else min(timeout, max(0.0, due))
        timeout_ms = None if timeout is None else timeout * 1000
        ready = {f for f, _ in poller.poll(timeout_ms)}
        if wake in ready:
            with contextlib.suppress(OSError):
                os.read(wake, 4096)
        with self._io:
            if self._closed:
                return delay
            if self._conn is None or self._conn.closed:
                if not want:
                    return delay
                try:
                    self._ensure_conn()
                except StoreUnavailable:
                    return min(delay * 2, RECONNECT_MAX)
                self._wake_all()  # notifications may have been lost while away
                return 0.05
            conn = self._conn
            try:
                if fd in ready:
                    conn.pgconn.consume_input()
                    self._drain(conn)
                self._unlisten_idle(conn)
            except (psycopg.Error, OSError) as exc:
                log.warning("idemlock: PostgreSQL notification connection lost: %s", exc)
                self._drop()
        return delay

    def _unlisten_idle(self, conn: psycopg.Connection[Any]) -> None:
        now = time.monotonic()
        with self._state:
            for channel in [c for c in self._idle if c in self._refs]:
                del self._idle[channel]  # waited on again
            # Past their linger, or too many lingering: oldest first.
            ordered = sorted(self._idle, key=self._idle.__getitem__)
            excess = max(0, len(ordered) - MAX_LINGERING)
            due = [c for i, c in enumerate(ordered) if i < excess or now - self._idle[c] >= LINGER]
        for channel in due:
            if channel in self._listening:
                self._run(conn, "UNLISTEN", channel)
                self._listening.discard(channel)
            with self._state:
                if channel not in self._refs:
                    self._idle.pop(channel, None)

    def close(self) -> None:
        with self._state:
            self._closed = True
            thread = self._thread
        self._nudge()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        with self._io:
            conn, self._conn = self._conn, None
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
        self._wake_all()
        with self._state:
            fds, (self._wake_r, self._wake_w) = (self._wake_r, self._wake_w), (-1, -1)
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


class ListenSubscription:
    """One waiter on one channel; works from threads (``wait``) and asyncio
    (``wait_async``). A notification before ``wait`` is remembered."""

    __slots__ = ("_channel", "_closed", "_listener", "_sub")

    def __init__(self, listener: Listener, channel: str, sub: LocalSubscription) -> None:
        self._listener = listener
        self._channel = channel
        self._sub = sub
        self._closed = False

    def wait(self, timeout: float) -> bool:
        return self._sub.wait(timeout)

    async def wait_async(self, timeout: float) -> bool:
        return await self._sub.wait_async(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sub.close()
        self._listener._release(self._channel)


class AsyncListenSubscription:
    """The asyncio face of a :class:`ListenSubscription`."""

    __slots__ = ("_sub",)

    def __init__(self, sub: ListenSubscription) -> None:
        self._sub = sub

    async def wait(self, timeout: float) -> bool:
        return await self._sub.wait_async(timeout)

    async def aclose(self) -> None:
        self._sub.close()
