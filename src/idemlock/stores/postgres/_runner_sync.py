"""How the sync PostgreSQL store runs a statement: setting up, borrowing and giving
back connections (with the lane), probing an unreachable server, and its life cycle.
The statements and replies are in :mod:`._async`, from which :mod:`._sync` is generated.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
import psycopg_pool

from ..._core.port import (
    Channel,
)
from ..._errors import StoreUnavailable
from ._listen import ListenSubscription
from ._shared import (
    _Base,
)

T = TypeVar("T")


class _SyncRunner(_Base[psycopg_pool.ConnectionPool[Any]]):
    """The half of :class:`PostgresStore` that differs from the async store's."""

    def _reset_runner(self) -> None:
        self._setup_lock = threading.Lock()
        self._probe_lock = threading.Lock()
        self._probing = False
        #: held by the one call that uses the lane
        self._lane_lock = threading.Lock()

    # ---- running statements ------------------------------------------------------------

    def _open_and_check(self, deadline: float) -> None:
        raise NotImplementedError  # the store's, generated from _async.py

    def _setup(self) -> None:
        deadline = time.monotonic() + self.timeout
        if not self._setup_lock.acquire(timeout=self.timeout):
            raise StoreUnavailable(
                f"the PostgreSQL store was still being set up by another thread after "
                f"timeout={self.timeout:g}s; try again"
            )
        try:
            if self._ready:
                return
            self._open_and_check(deadline)
            self._ready = True
        finally:
            self._setup_lock.release()

    def _ensure_ready(self) -> None:
        if self._pid != os.getpid():
            self._forked()
        if not self._ready:
            self._setup()

    @staticmethod
    def _autocommit(conn: psycopg.Connection[Any], on: bool) -> None:
        conn.autocommit = on

    # A blocking call has no cancellation to lose (see the async runner's).
    @staticmethod
    def _cancels() -> int:
        return 0

    @classmethod
    def _keep_cancel(cls, before: int) -> None:
        pass

    def _undoable(self, result: T, undo: Callable[[Any], Any], what: str) -> T:
        """The call has run: a thread is not cancelled in the middle of one."""
        return result

    def _probe(self, deadline: float, what: str) -> None:
        """The pool's last connection attempt failed: connect once ourselves, so the
        call fails now with the cause (refused, bad password, missing database...)
        instead of waiting for a connection that is not coming."""
        if not self._probe_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise self._pool_timeout(psycopg_pool.PoolTimeout("no connection"), what) from (
                self._health.down
            )
        try:
            if self._health.down is None:
                return
            # psycopg's connect timeout is whole seconds, at least 2: with less time
            # left, report the cause last met now and probe in the background.
            left = int(deadline - time.monotonic())
            if left < 2:
                self._probe_later()
                raise self._pool_timeout(psycopg_pool.PoolTimeout("no connection"), what) from (
                    self._health.down
                )
            try:
                self._direct_connect(left).close()
            except psycopg.Error as exc:
                self._health.down = exc
                raise self._pool_timeout(exc, what) from exc
            self._health.down = None  # reachable again: the pool reconnects soon
        finally:
            self._probe_lock.release()

    def _probe_later(self) -> None:
        if self._probing:
            return
        self._probing = True

        def probe() -> None:
            try:
                self._direct_connect().close()
                self._health.down = None
            except psycopg.Error as exc:
                self._health.down = exc
            finally:
                self._probing = False

        threading.Thread(target=probe, name="idemlock-pg-probe", daemon=True).start()

    def _check_pool(self, deadline: float) -> None:
        """pool.check() runs a round trip per idle connection in the calling thread,
        with no bound of its own: run it aside and wait for it until the deadline."""

        def check() -> None:
            with contextlib.suppress(psycopg.Error):
                self.pool.check()

        th = threading.Thread(target=check, name="idemlock-pg-check", daemon=True)
        th.start()
        th.join(max(0.0, deadline - time.monotonic()))

    # ---- waiting and life cycle ----------------------------------------------------------

    def subscribe(self, channel: Channel) -> ListenSubscription:
        self._ensure_ready()
        # an election's observer ("leader") listens on the lock channel as an observer
        return self.listener.subscribe(self._chan(*channel), channel.kind == "leader")

    def close(self) -> None:
        if self._pid != os.getpid():
            self._forked()  # the parent's pool and listener: never closed from here
        self.listener.close()
        if self._owns_pool:
            with self._lane_lock:
                if self._lane is not None:
                    self.pool.putconn(self._lane)
                    self._lane = None
            self.pool.close()
