"""How the asyncio PostgreSQL store runs a statement: setting up per event loop,
borrowing and giving back connections (with the lane), probing an unreachable server,
making a cancelled call's outcome known, and its life cycle. The statements and
replies are in :mod:`._async`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import psycopg
import psycopg_pool

from ..._core.port import (
    Channel,
)
from ..._errors import StoreUnavailable
from .._local import subscribe_in_thread
from .._undo import Undoer
from ._listen import AsyncListenSubscription
from ._shared import (
    LaneFlag,
    _Base,
)


class _AsyncRunner(_Base[psycopg_pool.AsyncConnectionPool[Any]]):
    """The half of :class:`AsyncPostgresStore` that differs from the sync store's."""

    def _reset_runner(self) -> None:
        # What is bound to one event loop (and, in a forked child, inherited).
        self._setup_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lane_lock = LaneFlag()
        self._lane = None
        self._undoer = Undoer("postgres", "PostgreSQL")

    def _check_loop(self) -> None:
        """A pool of our own is bound to the event loop it was opened on: on another
        loop (a second ``asyncio.run``), start a fresh pool (A7)."""
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop is loop:
            return
        if not self._owns_pool:
            return  # the caller's pool, on the caller's loops
        # The old loop is gone or elsewhere: its pool cannot be closed from here; its
        # connections are closed when it is collected.
        self.pool = self._pool_factory()
        self._ready = False
        self._reset_runner()

    async def _open_and_check(self, deadline: float) -> None:
        raise NotImplementedError  # the store's, written once in _async.py

    async def _setup(self) -> None:
        self._check_loop()
        if self._ready:  # the caller's pool, on another loop
            self._loop = asyncio.get_running_loop()
            return
        if self._setup_lock is None:
            self._setup_lock = asyncio.Lock()
        try:
            await asyncio.wait_for(self._setup_lock.acquire(), self.timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise StoreUnavailable(
                f"the PostgreSQL store was still being set up after timeout={self.timeout:g}s; "
                "try again"
            ) from None
        try:
            if self._ready:
                return
            await self._open_and_check(time.monotonic() + self.timeout)
            self._loop = asyncio.get_running_loop()
            self._ready = True
        finally:
            self._setup_lock.release()

    async def _ensure_ready(self) -> None:
        if self._pid != os.getpid():
            self._forked()
        if not self._ready or self._loop is not asyncio.get_running_loop():
            await self._setup()

    @staticmethod
    async def _autocommit(conn: psycopg.AsyncConnection[Any], on: bool) -> None:
        await conn.set_autocommit(on)

    @staticmethod
    def _cancels() -> int:
        """How many cancels the running task has pending (Python 3.11+; 0 before)."""
        cancelling = getattr(asyncio.current_task(), "cancelling", None)
        return int(cancelling()) if cancelling is not None else 0

    @classmethod
    def _keep_cancel(cls, before: int) -> None:
        """Raise the CancelledError a driver swallowed during a statement. psycopg < 3.3
        waits on the socket through ``asyncio.wait_for``, which on Python < 3.12 returns
        the result instead of raising when a cancel lands as the reply arrives: the
        statement ran, and the caller must still see its cancellation. A cancel pending
        since before the statement (a clean-up that runs while cancelled) is not this."""
        if cls._cancels() > before:
            raise asyncio.CancelledError

    async def _probe(self, deadline: float, what: str) -> None:
        # As the sync store's; concurrent callers each probe (a refused connection
        # costs nothing, and each call stays bounded by its own deadline).
        try:
            conn = await asyncio.wait_for(
                self._adirect_connect(), max(0.0, deadline - time.monotonic())
            )
        except (psycopg.Error, TimeoutError, asyncio.TimeoutError) as exc:
            if isinstance(exc, psycopg.Error):
                self._health.down = exc
            raise self._pool_timeout(exc, what) from exc
        await conn.close()
        self._health.down = None

    async def _check_pool(self, deadline: float) -> None:
        # As the sync store's: the check goes on in its own task past the deadline.
        async def check() -> None:
            with contextlib.suppress(psycopg.Error):
                await self.pool.check()

        task = asyncio.ensure_future(check())
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - time.monotonic()))

    async def _undoable(self, call: Any, undo: Callable[[Any], Any], what: str) -> Any:
        """Run a call so that a cancellation cannot leave its outcome unknown (see
        :class:`~idemlock.stores._undo.Undoer`): what a claim or an acquire took is given
        back as soon as it ends, and a complete, abandon or release simply takes effect."""
        return await self._undoer.run(call, undo, what)

    async def subscribe(self, channel: Channel) -> AsyncListenSubscription:
        if self._pid != os.getpid():
            self._forked()
        if not self._ready:
            await self._setup()
        name = self._chan(*channel)
        observer = channel.kind == "leader"  # an election's observer: see _chan
        # Already listening: no I/O, no thread hop. Otherwise the LISTEN round trip
        # runs in a worker thread so the event loop never blocks on it.
        sub = self.listener.try_subscribe(name, observer)
        if sub is None:
            return await subscribe_in_thread(self.listener.subscribe, name, observer)
        return AsyncListenSubscription(sub)

    async def aclose(self) -> None:
        if self._pid != os.getpid():
            self._forked()  # the parent's pool and listener: never closed from here
        self._check_loop()  # a pool opened on a loop that is gone cannot be awaited here
        await asyncio.to_thread(self.listener.close)
        if self._owns_pool:
            if self._lane is not None and not self._lane_lock.busy:
                lane, self._lane = self._lane, None
                await self.pool.putconn(lane)
            await self.pool.close()
