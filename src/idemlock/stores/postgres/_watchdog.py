"""A client-side bound on PostgreSQL calls that holds when the network goes silent.

psycopg (sync) has no read timeout, and ``statement_timeout`` or TCP keepalives do
nothing when packets are dropped (or a middlebox ACKs and never forwards): a call
then waits for a reply forever. The watchdog is one daemon thread per process that
shuts down the socket of a call still running past its deadline. The blocked wait
(sync or asyncio: the socket becomes readable) then fails at once, libpq marks the
connection bad, and the pool discards it instead of handing it out again.

``shutdown()`` acts on this process's socket only; after fork a child never arms a
connection it inherited (the stores rebuild their pools in the child), and the
watchdog starts afresh in a child at its first ``arm`` (a pid check: the parent's
thread does not exist there and its locks may be held).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time
from typing import Any

from ... import _forks

#: how often the watchdog looks at running calls (seconds); a call is ended at most
#: this long after its deadline
TICK = 0.05
#: seconds without running calls after which the thread exits (it restarts on demand)
IDLE_EXIT = 2.0


class Armed:
    """One running call: its connection and deadline; ``fired`` once the watchdog
    ended it."""

    __slots__ = ("conn", "deadline", "fired", "key")

    def __init__(self, key: int, conn: Any, deadline: float) -> None:
        self.key = key
        self.conn = conn
        self.deadline = deadline
        self.fired = False


class Watchdog:
    def __init__(self) -> None:
        self._init()

    def _init(self) -> None:
        self._pid = os.getpid()
        self._active: dict[int, Armed] = {}
        # Held while a call is disarmed and while the thread ends a call, so a
        # connection that finished in time (and may serve another call at once) is
        # never shut down.
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._running = False
        self._ids = itertools.count()

    def arm(self, conn: Any, deadline: float) -> Armed:
        if self._pid != os.getpid():
            self._forked()
        entry = Armed(next(self._ids), conn, deadline)
        self._active[entry.key] = entry
        if not self._running:
            self._start()
        return entry

    def _forked(self) -> None:
        with _forks.LOCK:
            if self._pid != os.getpid():
                self._init()

    def disarm(self, entry: Armed) -> None:
        with self._lock:
            self._active.pop(entry.key, None)

    def _start(self) -> None:
        with self._start_lock:
            if self._running:
                return
            self._running = True
            threading.Thread(target=self._loop, name="idemlock-pg-watchdog", daemon=True).start()

    def _loop(self) -> None:
        idle = 0.0
        while True:
            time.sleep(TICK)
            if not self._active:
                idle += TICK
                if idle >= IDLE_EXIT:
                    with self._start_lock:
                        self._running = False
                        # A call armed after the flag went down starts a new thread;
                        # one armed just before it is seen here.
                        if not self._active:
                            return
                        self._running = True
                continue
            idle = 0.0
            now = time.monotonic()
            for entry in [e for e in list(self._active.values()) if e.deadline <= now]:
                with self._lock:
                    if self._active.pop(entry.key, None) is not None:
                        entry.fired = True
                        _shut(entry.conn)


def _shut(conn: Any) -> None:
    """Shut the connection's socket down in both directions (no close: the fd stays
    libpq's, which then reads EOF and marks the connection bad)."""
    try:
        fd = conn.pgconn.socket
    except Exception:
        return
    with contextlib.suppress(OSError, ValueError):
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()


WATCHDOG = Watchdog()
