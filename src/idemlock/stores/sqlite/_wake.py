"""Wake-ups across processes for the SQLite store's lock waiters (Linux).

A process that waits for a lock binds one Unix datagram socket in the abstract
namespace, named for its pid (no file: the name goes with the process). A process
that reserves a free lock for a waiter of another process on this machine sends that
process the file and key after its commit; the waiter's reader thread wakes the
waiters of the key at once, instead of at their next poll.

Nothing depends on a wake-up arriving: a lost, refused or misdirected datagram (the
process exited, its pid reused, another network namespace) costs only the time until
the waiter's next poll, which stays the fallback. A datagram from anyone else can only
make a waiter look at the file once more.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

#: abstract socket names are Linux's
SUPPORTED = sys.platform.startswith("linux")
_NAME = "\0idemlock-sqlite-wake-{}"


class Doorbell:
    """This process's socket (bound by :meth:`listen`) and the sending of wake-ups."""

    def __init__(self, on_ring: Callable[[str, str, str], None]) -> None:
        self._on_ring = on_ring
        self._lock = threading.Lock()
        self._pid = 0  # the process that bound ``_sock`` (0: none yet)
        self._sock: Any = None
        self._out: Any = None
        self._out_pid = 0
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        # A forked child has no reader: close its copy of the parent's socket, so that
        # the name goes with the parent, and bind its own when it first waits.
        self._lock = threading.Lock()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._pid = 0

    def listen(self) -> None:
        """Make sure this process receives wake-ups (once per process: a forked child
        binds its own name)."""
        if self._pid == os.getpid() or not SUPPORTED:
            return
        import socket

        with self._lock:
            pid = os.getpid()
            if self._pid == pid:
                return
            self._pid = pid
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sock.bind(_NAME.format(pid))
            except OSError:
                return  # waiters here poll, as without wake-ups
            self._sock = sock
            threading.Thread(
                target=self._read, args=(sock,), name="idemlock-sqlite-wake", daemon=True
            ).start()

    def _read(self, sock: Any) -> None:
        while True:
            try:
                data = sock.recv(1 << 16)
            except OSError:  # closed (after fork, the child's copy)
                return
            try:
                path, ns, key = json.loads(data)
            except (ValueError, TypeError):
                continue  # not ours
            if isinstance(path, str) and isinstance(ns, str) and isinstance(key, str):
                self._on_ring(path, ns, key)

    def ring(self, pid: int, path: str, ns: str, key: str) -> None:
        """Wake the waiters of ``key`` in process ``pid``; never blocks nor raises."""
        if not SUPPORTED:
            return
        try:
            out = self._out
            if out is None or self._out_pid != os.getpid():
                import socket

                out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                out.setblocking(False)
                self._out, self._out_pid = out, os.getpid()
            out.sendto(json.dumps([path, ns, key]).encode(), _NAME.format(pid))
        except OSError:
            pass  # nobody listens there (exited, or a full buffer): it polls
