"""In-process notification of freed keys, usable from threads and from asyncio.

The memory store uses it for every hand-off; the SQLite store uses it for waiters
in the same process (other processes fall back to a short jittered backoff). A
:class:`LocalSubscription` is also the mailbox the listeners of the Redis (sync) and
PostgreSQL stores and the etcd gateway's watch streams fire; the async store faces
wrap it (or SQLite's own) in an :class:`AsyncLocalSubscription`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import asyncio


class LocalSubscription:
    """One waiter's mailbox. A fire before ``wait`` is remembered (no lost wake-up).

    ``lock`` is its owner's lock, held by whoever fires it; ``on_close`` tells the
    owner the waiter left (it may be called more than once).
    """

    __slots__ = ("_async", "_cond", "_flag", "_lock", "_on_close")

    def __init__(self, lock: threading.Lock, on_close: Callable[[LocalSubscription], None]) -> None:
        self._lock = lock
        self._on_close = on_close
        self._flag = False
        self._cond = threading.Condition(lock)
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None

    def _fire(self) -> None:  # with the owner's lock held
        self._flag = True
        self._cond.notify_all()
        if self._async is not None:
            loop, fut = self._async
            self._async = None
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits there
                loop.call_soon_threadsafe(_resolve, fut)

    def wait(self, timeout: float) -> bool:
        with self._lock:
            if not self._flag and timeout > 0:
                self._cond.wait(timeout)
            fired, self._flag = self._flag, False
            return fired

    async def wait_async(self, timeout: float) -> bool:
        import asyncio  # here: the blocking API must not load asyncio

        loop = asyncio.get_running_loop()
        with self._lock:
            if self._flag:
                self._flag = False
                return True
            fut: asyncio.Future[None] = loop.create_future()
            self._async = (loop, fut)
        # A timer resolves the future rather than wait_for: before Python 3.12 wait_for
        # may swallow a cancellation that lands as the future completes.
        timer = loop.call_later(max(0.0, timeout), _resolve, fut)
        try:
            await fut
        finally:
            timer.cancel()
            with self._lock:
                self._async = None
        with self._lock:
            fired, self._flag = self._flag, False
            return fired

    def close(self) -> None:
        self._on_close(self)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class LocalHub:
    """Registry of subscriptions per channel key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subs: dict[Hashable, set[LocalSubscription]] = {}

    def subscribe(self, key: Hashable) -> LocalSubscription:
        sub = LocalSubscription(self._lock, partial(self._remove, key))
        with self._lock:
            self._subs.setdefault(key, set()).add(sub)
        return sub

    def notify(self, key: Hashable) -> None:
        with self._lock:
            subs = self._subs.get(key)
            if subs:
                for sub in subs:
                    sub._fire()

    def _remove(self, key: Hashable, sub: LocalSubscription) -> None:
        with self._lock:
            subs = self._subs.get(key)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[key]


class DualSubscription(Protocol):
    """A mailbox waited on from threads and from asyncio (a :class:`LocalSubscription`
    or a store's own, such as SQLite's)."""

    def wait(self, timeout: float) -> bool: ...

    async def wait_async(self, timeout: float) -> bool: ...

    def close(self) -> None: ...


class AsyncLocalSubscription:
    """The async face of a :class:`DualSubscription`."""

    __slots__ = ("_sub",)

    def __init__(self, sub: DualSubscription) -> None:
        self._sub = sub

    async def wait(self, timeout: float) -> bool:
        return await self._sub.wait_async(timeout)

    async def aclose(self) -> None:
        self._sub.close()


async def subscribe_in_thread(
    subscribe: Callable[..., DualSubscription], *args: Any
) -> AsyncLocalSubscription:
    """``subscribe(*args)`` (a blocking LISTEN or watch round trip) in a worker thread,
    as the async face of its subscription. If the caller is cancelled meanwhile, the
    subscription the thread still makes is closed as it arrives: nobody else would
    close it, and it would keep its group waiting (its waiter registered) for good."""
    import asyncio

    made = asyncio.ensure_future(asyncio.to_thread(subscribe, *args))
    try:
        return AsyncLocalSubscription(await asyncio.shield(made))
    except asyncio.CancelledError:
        made.add_done_callback(_close_made)
        raise


def _close_made(made: asyncio.Future[DualSubscription]) -> None:
    if not made.cancelled() and made.exception() is None:
        made.result().close()
