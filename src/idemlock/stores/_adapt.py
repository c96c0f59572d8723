"""Generic async faces for stores whose sync calls never wait on a network.

``InlineAsyncStore`` calls the sync store directly (memory: each call is a short
critical section). ``ThreadedAsyncStore`` runs each call in a worker thread (SQLite:
a call may wait on the file lock up to the busy timeout, which must not block the
event loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from .._core.port import (
    Acquired,
    Channel,
    ClaimReply,
    Held,
    LockRow,
    RecordRow,
    SyncStore,
)


class DualSubscription(Protocol):
    def wait(self, timeout: float) -> bool: ...

    async def wait_async(self, timeout: float) -> bool: ...

    def close(self) -> None: ...


class _AsyncSub:
    __slots__ = ("_sub",)

    def __init__(self, sub: DualSubscription) -> None:
        self._sub = sub

    async def wait(self, timeout: float) -> bool:
        return await self._sub.wait_async(timeout)

    async def aclose(self) -> None:
        self._sub.close()


class _AsyncFace:
    """Forwards every port method; subclasses decide how a sync call is run."""

    def __init__(self, sync: SyncStore) -> None:
        self.sync = sync
        self.kind = sync.kind
        self.issues_fence_tokens = sync.issues_fence_tokens
        self.poll_cap: float | None = getattr(sync, "poll_cap", None)
        #: the bound on one call (seconds), the sync store's
        self.timeout: float = float(getattr(sync, "timeout", 5.0))

    async def _call(self, fn: Any, *args: Any) -> Any:
        raise NotImplementedError

    async def claim(
        self, ns: str, key: str, fp: str | None, token: str, lease_ms: int
    ) -> ClaimReply:
        r: ClaimReply = await self._call(self.sync.claim, ns, key, fp, token, lease_ms)
        return r

    async def complete(self, ns: str, key: str, token: str, result: bytes, ttl_ms: int) -> bool:
        return bool(await self._call(self.sync.complete, ns, key, token, result, ttl_ms))

    async def abandon(self, ns: str, key: str, token: str) -> bool:
        return bool(await self._call(self.sync.abandon, ns, key, token))

    async def extend(self, ns: str, key: str, token: str, lease_ms: int) -> int | None:
        r: int | None = await self._call(self.sync.extend, ns, key, token, lease_ms)
        return r

    async def record(self, ns: str, key: str) -> RecordRow | None:
        r: RecordRow | None = await self._call(self.sync.record, ns, key)
        return r

    async def forget(self, ns: str, key: str) -> bool:
        return bool(await self._call(self.sync.forget, ns, key))

    async def records(self, ns_prefix: str) -> Sequence[RecordRow]:
        r: Sequence[RecordRow] = await self._call(self.sync.records, ns_prefix)
        return r

    async def acquire(self, ns: str, key: str, owner: str, ttl_ms: int) -> Acquired | Held:
        r: Acquired | Held = await self._call(self.sync.acquire, ns, key, owner, ttl_ms)
        return r

    async def release(self, ns: str, key: str, owner: str, token: int) -> bool:
        return bool(await self._call(self.sync.release, ns, key, owner, token))

    async def renew(self, ns: str, key: str, owner: str, token: int, ttl_ms: int) -> int | None:
        r: int | None = await self._call(self.sync.renew, ns, key, owner, token, ttl_ms)
        return r

    async def lock(self, ns: str, key: str) -> LockRow | None:
        r: LockRow | None = await self._call(self.sync.lock, ns, key)
        return r

    async def locks(self, ns_prefix: str) -> Sequence[LockRow]:
        r: Sequence[LockRow] = await self._call(self.sync.locks, ns_prefix)
        return r

    async def fence_advance(self, ns: str, resource: str, token: int) -> tuple[bool, int]:
        r: tuple[bool, int] = await self._call(self.sync.fence_advance, ns, resource, token)
        return r

    async def fence_current(self, ns: str, resource: str) -> int | None:
        r: int | None = await self._call(self.sync.fence_current, ns, resource)
        return r

    async def purge(self) -> int:
        return int(await self._call(self.sync.purge))

    async def subscribe(self, channel: Channel) -> _AsyncSub:
        sub: DualSubscription = self.sync.subscribe(channel)  # type: ignore[assignment]  # local stores return dual subscriptions
        return _AsyncSub(sub)

    async def aclose(self) -> None:
        await self._call(self.sync.close)


class InlineAsyncStore(_AsyncFace):
    async def _call(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


class ThreadedAsyncStore(_AsyncFace):
    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)
