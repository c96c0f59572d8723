"""The generic async face of a store whose sync calls never wait on a network.

``ThreadedAsyncStore`` runs each call in a worker thread (SQLite: a call may wait on
the file lock up to the busy timeout, which must not block the event loop); the
memory store's face (``MemoryAsyncStore``) runs a call inline when the store is free.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .._core.port import (
    Acquired,
    Capabilities,
    Channel,
    ClaimReply,
    Granted,
    Held,
    LockRow,
    RecordRow,
    SyncStore,
)
from .._logfields import fields as log_fields
from ._local import AsyncLocalSubscription, DualSubscription

log = logging.getLogger("idemlock")


class ThreadedAsyncStore:
    """Forwards every port method to the sync store, each call in a worker thread."""

    def __init__(self, sync: SyncStore) -> None:
        self.sync = sync
        self.kind = sync.kind
        self.capabilities: Capabilities = sync.capabilities
        #: the same store, for the optional methods its capabilities declare (renew_many,
        #: step, ...), which the SyncStore protocol does not list
        self._optional: Any = sync
        #: the bound on one call (seconds), the sync store's
        self.timeout: float = float(sync.timeout)
        if self.capabilities.renew_many:
            # The batched renewal of a coordinator's renewer, only where the sync store has it.
            self.renew_many = self._renew_many
        if self.capabilities.steps:
            self.step, self.drop_step, self.steps = self._step, self._drop_step, self._steps

    async def _step(self, *args: Any) -> int | None:
        r: int | None = await self._call(self._optional.step, *args)
        return r

    async def _drop_step(self, *args: Any) -> int | None:
        r: int | None = await self._call(self._optional.drop_step, *args)
        return r

    async def _steps(self, ns: str, key: str) -> list[Any]:
        r: list[Any] = await self._call(self._optional.steps, ns, key)
        return r

    async def _renew_many(self, items: list[tuple[Any, ...]]) -> list[int | None]:
        r: list[int | None] = await self._call(self._optional.renew_many, items)
        return r

    async def _call(self, fn: Any, *args: Any) -> Any:
        import asyncio  # here: the blocking API must not load asyncio

        return await asyncio.to_thread(fn, *args)

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

    async def renew(
        self, ns: str, key: str, owner: str, token: int, ttl_ms: int, value: bytes | None = None
    ) -> int | None:
        r: int | None = await self._call(self.sync.renew, ns, key, owner, token, ttl_ms, value)
        return r

    async def lock(self, ns: str, key: str) -> LockRow | None:
        r: LockRow | None = await self._call(self.sync.lock, ns, key)
        return r

    async def holders(self, ns: str, key: str) -> Sequence[LockRow]:
        r: Sequence[LockRow] = await self._call(self.sync.holders, ns, key)
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

    async def purge(self, dry_run: bool = False) -> int:
        return int(await self._call(self.sync.purge, dry_run))

    async def subscribe(self, channel: Channel) -> AsyncLocalSubscription:
        sub: DualSubscription = self.sync.subscribe(channel)  # type: ignore[assignment]  # local stores return dual subscriptions
        return AsyncLocalSubscription(sub)

    async def aclose(self) -> None:
        await self._call(self.sync.close)

    # A cancelled await does not stop the worker thread: the call still happens. A
    # claim or an acquire that took the key is therefore given back, by the worker
    # thread itself or right after it, so no cancelled task leaves a key taken until
    # its lease ends (issue 10 item 7). The CancelledError still reaches the caller.

    async def _undoable(self, fn: Any, undo: Callable[[Any], None], *args: Any) -> Any:
        import asyncio

        run = _Undoable(fn, undo, args)
        # Shielded: a cancellation must not drop the call from the executor's queue
        # either, or its outcome would depend on when the cancel came (a settling call
        # dropped leaves a claim in flight that nobody completes).
        fut = asyncio.ensure_future(asyncio.to_thread(run))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            run.cancel()
            raise

    # Settling calls take effect even when the caller is cancelled: the record or lock
    # is then in the state the caller's token led to, never half-way.

    async def complete(self, ns: str, key: str, token: str, result: bytes, ttl_ms: int) -> bool:
        return bool(
            await self._undoable(self.sync.complete, _no_undo, ns, key, token, result, ttl_ms)
        )

    async def abandon(self, ns: str, key: str, token: str) -> bool:
        return bool(await self._undoable(self.sync.abandon, _no_undo, ns, key, token))

    async def release(self, ns: str, key: str, owner: str, token: int) -> bool:
        return bool(await self._undoable(self.sync.release, _no_undo, ns, key, owner, token))

    async def break_lock(self, ns: str, key: str, token: int | None = None) -> bool:
        return bool(await self._undoable(self.sync.break_lock, _no_undo, ns, key, token))

    async def claim(
        self, ns: str, key: str, fp: str | None, token: str, lease_ms: int
    ) -> ClaimReply:
        def undo(reply: ClaimReply) -> None:
            if isinstance(reply, Granted):
                self.sync.abandon(ns, key, token)

        r: ClaimReply = await self._undoable(self.sync.claim, undo, ns, key, fp, token, lease_ms)
        return r

    async def acquire(
        self, ns: str, key: str, owner: str, ttl_ms: int, limit: int = 1, value: bytes | None = None
    ) -> Acquired | Held:
        def undo(reply: Acquired | Held) -> None:
            if isinstance(reply, Acquired):
                self.sync.release(ns, key, owner, reply.token)

        r: Acquired | Held = await self._undoable(
            self.sync.acquire, undo, ns, key, owner, ttl_ms, limit, value
        )
        return r


def _no_undo(reply: Any) -> None:
    return None


class _Undoable:
    """One call run in a worker thread that may be cancelled from the event loop."""

    __slots__ = ("_args", "_cancelled", "_done", "_fn", "_lock", "_result", "_undo")

    def __init__(self, fn: Any, undo: Callable[[Any], None], args: tuple[Any, ...]) -> None:
        self._fn = fn
        self._undo = undo
        self._args = args
        self._lock = threading.Lock()
        self._cancelled = False
        self._done = False
        self._result: Any = None

    def __call__(self) -> Any:
        result = self._fn(*self._args)
        with self._lock:
            self._result = result
            self._done = True
            cancelled = self._cancelled
        if cancelled:  # the awaiting task is gone: nobody will use what was taken
            self._give_back(result)
        return result

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            done, result = self._done, self._result
        if done:
            # The thread finished just before the cancellation reached the task: its
            # result is lost to the caller, so give it back (off the event loop).
            threading.Thread(
                target=self._give_back, args=(result,), name="idemlock-undo", daemon=False
            ).start()

    def _give_back(self, result: Any) -> None:
        try:
            self._undo(result)
        except Exception:
            log.warning(
                "idemlock: could not undo a cancelled call; what it took frees itself "
                "when its lease ends",
                exc_info=True,
                extra=log_fields(
                    store=getattr(getattr(self._fn, "__self__", None), "kind", None),
                    operation="undo",
                    outcome="error",
                ),
            )
