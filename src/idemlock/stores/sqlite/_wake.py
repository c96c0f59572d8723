"""Wake-ups across processes for the SQLite store's lock waiters (Linux).

A process that waits for a lock binds one Unix datagram socket in the abstract
namespace under a random name (128 bits from ``os.urandom``: nobody can predict it, so
nobody can bind it first), and queues each of its waiters in the file with that name
(``lock_waiters.wake``). A process that reserves a free lock for a waiter of another
process sends that name, after its commit, one datagram of fixed layout: a 4-byte magic
and a 16-byte tag, a keyed BLAKE2b of the lock's namespace and key under the file's own
random secret (``meta.wake_key``). The waiter's reader thread looks the tag up among
the locks its waiters wait for and wakes them at once, instead of at their next poll.

So a wake-up carries no key, tenant, spec name or path, and who cannot read the file
cannot even tell which lock a tag stands for, nor confirm a guess. Anyone on the
machine (in the same network namespace) can see the names (``/proc/net/unix``) and send
them datagrams: the reader takes anything (no parser, only a length check and a
dictionary lookup), drops what is not a tag it knows (counted in a debug log), and
survives whatever happens while it handles one. A forged or replayed tag can only make
a waiter look at the file once more; the file decides who gets the lock.

Nothing depends on a wake-up arriving: a lost, refused or dropped datagram (the process
exited, a full buffer, another network namespace, a socket that could not be bound)
costs only the time until the waiter's next poll, which stays the fallback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeGuard

from ... import _forks
from ..._logfields import fields as log_fields

log = logging.getLogger("idemlock")

#: abstract socket names are Linux's
SUPPORTED = sys.platform.startswith("linux")
#: every name starts so (then 32 hex digits); a name read from the file that does not
#: is never sent to
PREFIX = "\0idemlock-sqlite-wake-"
_NAME_LEN = len(PREFIX) + 32
_HEX = frozenset("0123456789abcdef")
#: a datagram: the magic, then the tag
MAGIC = b"ILW1"
TAG_SIZE = 16
SIZE = len(MAGIC) + TAG_SIZE
#: routes kept per process (the least recently registered go first)
MAX_ROUTES = 4096
#: names tried before giving up on wake-ups in this process
_BIND_TRIES = 3


def _random_name() -> str:
    return PREFIX + os.urandom(16).hex()


def valid_name(name: object) -> TypeGuard[str]:
    """Whether ``name`` (read from the file) is one of ours."""
    return (
        type(name) is str
        and len(name) == _NAME_LEN
        and name.startswith(PREFIX)
        and _HEX.issuperset(name[len(PREFIX) :])
    )


def tag(secret: bytes, ns: str, key: str) -> bytes:
    """The tag a wake-up for the lock ``(ns, key)`` of the file with ``secret`` carries."""
    import hashlib  # first use only: a process that never waits never loads it

    nsb = ns.encode("utf-8", "surrogatepass")
    data = len(nsb).to_bytes(8, "big") + nsb + key.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(
        data, key=secret[:64], digest_size=TAG_SIZE, person=b"idemlock-wake"
    ).digest()


class Doorbell:
    """This process's socket (bound by :meth:`listen`), its routes from tags to the
    locks its waiters wait for, and the sending of wake-ups."""

    def __init__(self, on_ring: Callable[[str, str, str], None]) -> None:
        self._on_ring = on_ring
        self._lock = threading.Lock()
        self._made = os.getpid()  # the process its sockets, lock and routes are of
        self._pid = 0  # the process that bound ``_sock`` or tried to (0: none yet)
        self._name = ""
        self._sock: Any = None
        self._out: Any = None
        self._routes: dict[bytes, tuple[str, str, str]] = {}
        #: datagrams the reader dropped (not a tag of this process's waiters)
        self.dropped = 0

    @property
    def name(self) -> str:
        """This process's name ("" while it has none: its waiters poll)."""
        if self._made != os.getpid():
            self._forget()
        return self._name

    def _forget(self) -> None:
        # A forked child has no reader: close its copies of the parent's sockets
        # (datagram sockets: that sends nothing, and the name stays the parent's), and
        # bind a name of its own when it first waits.
        with _forks.LOCK:
            if self._made == os.getpid():
                return
            self._lock = threading.Lock()  # a thread of the parent may have held it
            for sock in (self._sock, self._out):
                if sock is not None:
                    sock.close()
            self._sock = self._out = None
            self._pid = 0
            self._name = ""
            self._routes = {}
            self.dropped = 0
            self._made = os.getpid()

    def listen(self) -> str:
        """Make sure this process receives wake-ups, once per process (a forked child
        binds its own name); its name, or "" if it has none (its waiters poll)."""
        if self._pid == os.getpid() or not SUPPORTED:
            return self._name
        if self._made != os.getpid():
            self._forget()
        import socket

        with self._lock:
            pid = os.getpid()
            if self._pid == pid:
                return self._name
            self._pid = pid
            sock: Any = None
            failure: OSError | None = None
            for _ in range(_BIND_TRIES):
                name = _random_name()
                try:
                    candidate = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                except OSError as exc:  # out of descriptors
                    failure = exc
                    break
                try:
                    candidate.bind(name)
                except OSError as exc:  # taken (nobody can guess it: a fluke) or refused
                    candidate.close()
                    failure = exc
                    continue
                sock = candidate
                break
            if sock is None:
                log.debug(
                    "idemlock: SQLite wake-ups are off in process %d (could not bind a "
                    "socket: %s); its lock waiters poll the file instead",
                    pid,
                    failure,
                    extra=log_fields(store="sqlite", operation="wake", outcome="poll"),
                )
                return ""
            self._sock, self._name = sock, name
            threading.Thread(
                target=self._read, args=(sock,), name="idemlock-sqlite-wake", daemon=True
            ).start()
            return name

    def route(self, secret: bytes, path: str, ns: str, key: str) -> bytes:
        """Route wake-ups for the lock ``(ns, key)`` of the file ``path`` (its secret
        ``secret``) to this process's waiters; the tag they carry."""
        t = tag(secret, ns, key)
        if self._made != os.getpid():
            self._forget()
        with self._lock:
            routes = self._routes
            routes.pop(t, None)  # to the end: the most recently registered
            routes[t] = (path, ns, key)
            while len(routes) > MAX_ROUTES:
                del routes[next(iter(routes))]
        return t

    def _read(self, sock: Any) -> None:
        while self._sock is sock:
            try:
                data = sock.recv(SIZE + 1)  # one more: a longer datagram is not ours
            except OSError as exc:
                if self._sock is not sock or sock.fileno() < 0:
                    return  # closed
                log.debug(
                    "idemlock: SQLite wake-ups: receive failed: %s",
                    exc,
                    extra=log_fields(store="sqlite", operation="wake", outcome="error"),
                )
                time.sleep(0.01)
                continue
            if self._sock is not sock:
                return
            try:
                where = (
                    self._routes.get(data[len(MAGIC) :])
                    if len(data) == SIZE and data[: len(MAGIC)] == MAGIC
                    else None
                )
                if where is None:
                    self.dropped += 1
                    if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, 8...: bounded
                        log.debug(
                            "idemlock: SQLite wake-ups: dropped a datagram of %d bytes that "
                            "is no wake-up for a waiter of this process (%d dropped so far)",
                            len(data),
                            self.dropped,
                            extra=log_fields(store="sqlite", operation="wake", outcome="dropped"),
                        )
                    continue
                self._on_ring(*where)
            except Exception:  # never let one datagram end the reader
                log.debug(
                    "idemlock: SQLite wake-ups: handling a datagram failed",
                    exc_info=True,
                    extra=log_fields(store="sqlite", operation="wake", outcome="error"),
                )

    def ring(self, name: str, t: bytes) -> None:
        """Send the tag ``t`` to the process named ``name``; never blocks nor raises."""
        if not SUPPORTED or not valid_name(name) or len(t) != TAG_SIZE:
            return
        if self._made != os.getpid():
            self._forget()
        try:
            out = self._out
            if out is None:
                import socket

                out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                out.setblocking(False)
                self._out = out
            out.sendto(MAGIC + t, name)
        except OSError:
            pass  # nobody listens there (exited, or a full buffer): it polls

    def close(self) -> None:
        """Stop receiving (the reader thread ends); for tests."""
        if self._made != os.getpid():
            self._forget()  # the parent's socket: never shut down from here
        with self._lock:
            sock, self._sock = self._sock, None
            self._name = ""
        if sock is not None:
            import socket

            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the reader's recv
            sock.close()
