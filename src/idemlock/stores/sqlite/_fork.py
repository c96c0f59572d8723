"""Fork safety of the SQLite store: fork() waits for SQLite calls in progress (this
gate, on the library's one at-fork hook); a child drops the connections it inherited
at its first call (``Connections._forked``, a pid check)."""

from __future__ import annotations

import logging
import threading

from ..._forks import at_fork
from ..._logfields import fields as log_fields

log = logging.getLogger("idemlock")


class _ForkGate:
    """Keeps fork() out of SQLite calls in progress. SQLite tracks the file locks of a
    process in memory shared by all its connections; a child forked while another
    thread was inside a transaction inherits that record of a lock nobody in the child
    will ever release, and every connection it opens then gets "database is locked".
    So fork waits (at most ``FORK_WAIT`` seconds) for calls in progress, and calls wait
    while a fork is under way."""

    __slots__ = ("_active", "_forking", "_idle", "_lock")

    def __init__(self) -> None:
        self._init()

    def _init(self) -> None:
        # Entered as the bare lock (C code) on the hot path, not through the
        # Condition's Python-level __enter__; the Condition shares that lock.
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0
        self._forking = False

    def enter(self) -> None:
        with self._lock:
            while self._forking:
                self._idle.wait()
            self._active += 1

    def leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._forking and self._active == 0:
                self._idle.notify_all()

    def before_fork(self) -> None:
        self._lock.acquire()
        self._forking = True
        if not self._idle.wait_for(lambda: self._active == 0, FORK_WAIT):
            log.warning(
                "fork() while a SQLite call was still running after %gs: the child may "
                "find the database locked",
                FORK_WAIT,
                extra=log_fields(store="sqlite", operation="fork", outcome="slow"),
            )
        # The lock stays held across fork: no call can start until it is released.

    def after_fork_in_parent(self) -> None:
        self._forking = False
        self._idle.notify_all()
        self._lock.release()

    def after_fork_in_child(self) -> None:
        # Calls of the parent's other threads do not exist here.
        self._init()


#: how long fork() waits for SQLite calls in progress to end
FORK_WAIT = 5.0
GATE = _ForkGate()

at_fork(
    before=GATE.before_fork,
    after_in_parent=GATE.after_fork_in_parent,
    after_in_child=GATE.after_fork_in_child,
)
