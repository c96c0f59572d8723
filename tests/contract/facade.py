"""One awaitable face over a sync or an async coordinator, so each contract test is
written once and runs in both modes. In sync mode the blocking call runs inline."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from .harness import Harness

_PORTS = ("IdempotencyPort", "LockPort", "SemaphorePort", "ElectionPort", "FenceGate")


class Proxy:
    """Every method of the wrapped object becomes awaitable; ports are wrapped too."""

    def __init__(self, obj: Any, mode: str) -> None:
        self._obj = obj
        self._mode = mode

    @property
    def raw(self) -> Any:
        return self._obj

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._obj, name)
        if not callable(attr):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            if type(result).__name__.removeprefix("Async") in _PORTS:
                return Proxy(result, self._mode)
            return result

        return call


class Facade(Proxy):
    def __init__(self, harness: Harness, coord: Any, mode: str) -> None:
        super().__init__(coord, mode)
        self.harness = harness
        self.mode = mode
        self.coord = coord

    def idem(self, spec: Any) -> Proxy:
        return Proxy(self.coord.idempotency(spec), self.mode)

    def lock(self, spec: Any) -> LockProxy:
        return LockProxy(self.coord.lock(spec), self.mode)

    def election(self, spec: Any) -> LockProxy:
        return LockProxy(self.coord.election(spec), self.mode)

    def semaphore(self, spec: Any) -> LockProxy:
        return LockProxy(self.coord.semaphore(spec), self.mode)

    def fence(self, resource: str) -> Proxy:
        return Proxy(self.coord.fence(resource), self.mode)

    def wrap(self, spec: Any, fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
        """Decorate ``fn`` (a plain function) the way this mode's users would: as is
        in sync mode, as an ``async def`` in async mode. Returns an awaitable callable."""
        if self.mode == "sync":
            wrapped = self.coord.idempotent(spec, **options)(fn)

            async def call(*args: Any, **kwargs: Any) -> Any:
                return wrapped(*args, **kwargs)

            return call

        @functools.wraps(fn)
        async def afn(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            return result

        return self.coord.idempotent(spec, **options)(afn)  # type: ignore[no-any-return]

    def other(self, **options: Any) -> Facade:
        """A second coordinator on the same store and prefix (another client)."""
        if self.mode == "sync":
            return Facade(self.harness, self.harness.sync(**options), "sync")
        return Facade(self.harness, self.harness.aio(**options), "async")

    async def close(self) -> None:
        result = self.coord.close()
        if inspect.isawaitable(result):
            await result


class LockProxy(Proxy):
    def hold(self, key: str, **options: Any) -> Any:
        return self._block("hold", key, **options)

    def campaign(self, key: str, **options: Any) -> Any:
        return self._block("campaign", key, **options)

    @asynccontextmanager
    async def _block(self, name: str, key: str, **options: Any) -> AsyncIterator[Any]:
        if self._mode == "async":
            async with getattr(self._obj, name)(key, **options) as lease:
                yield lease
            return
        cm = getattr(self._obj, name)(key, **options)
        lease = cm.__enter__()
        try:
            yield lease
        except BaseException as exc:
            if not cm.__exit__(type(exc), exc, exc.__traceback__):
                raise
        else:
            cm.__exit__(None, None, None)


def sync_facade(harness: Harness, **options: Any) -> Facade:
    return Facade(harness, harness.sync(**options), "sync")


def async_facade(harness: Harness, **options: Any) -> Facade:
    return Facade(harness, harness.aio(**options), "async")


async def each_face(harness: Harness, scenario: Callable[[Facade], Awaitable[None]]) -> None:
    """Run ``scenario`` on a sync and on an async facade, each on a key prefix of its own.

    For a test whose subject takes real time (a lease running out, renewals over several
    leases): on a store that judges time by its own clock both faces run at once, the
    sync one in a thread with an event loop of its own, so the wait is spent once for the
    two faces and every check of each face is still made. On a store with a manual clock
    they run one after the other (moving the shared clock is not theirs to interleave).
    A failure names its face."""

    async def one(mode: str, h: Harness) -> None:
        facade = sync_facade(h) if mode == "sync" else async_facade(h)
        try:
            await scenario(facade)
        finally:
            await facade.close()

    await each_mode(harness, one)


async def each_mode(harness: Harness, run: Callable[[str, Harness], Awaitable[None]]) -> None:
    """``run(mode, h)`` for mode "sync" and "async", ``h`` a copy of ``harness`` on a key
    prefix of its own: at once (the sync one in a thread with an event loop of its own)
    on a store that judges time by its own clock, one after the other on a store with a
    manual clock (see :func:`each_face`). A failure names its mode."""

    async def one(mode: str, h: Harness) -> None:
        try:
            await run(mode, h)
        except BaseException as exc:
            exc.add_note(f"(on the {mode} face)")
            raise

    faces = {
        mode: dataclasses.replace(harness, prefix=f"{harness.prefix}{mode[0]}")
        for mode in ("sync", "async")
    }
    if harness.clock is not None:
        for mode, h in faces.items():
            await one(mode, h)
        return
    results = await asyncio.gather(
        asyncio.to_thread(asyncio.run, one("sync", faces["sync"])),
        one("async", faces["async"]),
        return_exceptions=True,
    )
    for result in results:
        if isinstance(result, BaseException):
            raise result
