"""The asyncio etcd store, :class:`AsyncEtcdStore`: each port method runs one op of
:mod:`._ops`. It is the source of :mod:`._sync` (:class:`EtcdStore`), which
tools/async_to_sync.py generates from it; what differs (gRPC channels, watches,
cancellation, closing) is hand-written in :mod:`._grpc_aio` and :mod:`._grpc_sync`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._core.port import (
    Acquired,
    Capabilities,
    ClaimReply,
    Granted,
    Held,
    LockRow,
    RecordRow,
    StepRow,
)
from . import _codec as K
from ._grpc_aio import _AsyncRunner
from ._ops import Op


def _none(reply: Any) -> None:
    """Nothing to undo: the call frees what it touches (complete, abandon, release)."""
    return None


class AsyncEtcdStore(_AsyncRunner):
    """The store port on etcd v3 (3.4+)."""

    kind = "etcd"
    #: the hand-off through its waiters' queue; steps inside a claim (keys beside its
    #: record, see _codec)
    capabilities = Capabilities(handoff=True, steps=True)

    async def claim(
        self, ns: str, key: str, fp: str | None, token: str, lease_ms: int
    ) -> ClaimReply:
        def undo(reply: ClaimReply | None) -> Op | None:
            # Our own token only: abandoning a claim that never happened changes nothing.
            if reply is None or isinstance(reply, Granted):
                return self.ops.abandon(ns, key, token)
            return None

        r: ClaimReply = await self._undoable(self.ops.claim(ns, key, fp, token, lease_ms), undo)
        return r

    async def complete(self, ns: str, key: str, token: str, result: bytes, ttl_ms: int) -> bool:
        # Runs to its end even if the caller is cancelled: a finished job's result is kept.
        return bool(await self._undoable(self.ops.complete(ns, key, token, result, ttl_ms), _none))

    async def abandon(self, ns: str, key: str, token: str) -> bool:
        return bool(await self._undoable(self.ops.abandon(ns, key, token), _none))

    async def extend(self, ns: str, key: str, token: str, lease_ms: int) -> int | None:
        r: int | None = await self._run(self.ops.extend(ns, key, token, lease_ms))
        return r

    async def step(
        self,
        ns: str,
        key: str,
        token: str,
        name: str,
        result: bytes | None,
        lease_ms: int,
        ttl_ms: int,
    ) -> int | None:
        r: int | None = await self._run(
            self.ops.step(ns, key, token, name, result, lease_ms, ttl_ms)
        )
        return r

    async def drop_step(
        self, ns: str, key: str, token: str, name: str, lease_ms: int
    ) -> int | None:
        r: int | None = await self._run(self.ops.drop_step(ns, key, token, name, lease_ms))
        return r

    async def steps(self, ns: str, key: str) -> list[StepRow]:
        r: list[StepRow] = await self._run(self.ops.steps(ns, key))
        return r

    async def record(self, ns: str, key: str) -> RecordRow | None:
        r: RecordRow | None = await self._run(self.ops.record(ns, key))
        return r

    async def forget(self, ns: str, key: str) -> bool:
        return bool(await self._run(self.ops.forget(ns, key)))

    async def records(self, ns_prefix: str) -> Sequence[RecordRow]:
        r: Sequence[RecordRow] = await self._run(self.ops.records(ns_prefix))
        return r

    async def acquire(
        self, ns: str, key: str, owner: str, ttl_ms: int, limit: int = 1, value: bytes | None = None
    ) -> Acquired | Held:
        name = K.lock_name(self.conf.root, ns, key)
        waiter = self._waiting(name)

        def undo(reply: Acquired | Held | None) -> Op | None:
            if isinstance(reply, Acquired):
                return self.ops.release(ns, key, owner, reply.token)
            # The caller may have stopped waiting before this attempt queued the process
            # up: a place nobody here waits for would hold off every other process's
            # acquire until it expires (WAITER_S), so it is given back too.
            stranded = (
                waiter if waiter is not None and self._watcher.waiting(name) is not waiter else None
            )
            # Outcome unknown: free it if it is held by this owner (owners are per call).
            if reply is None:
                return self.ops.release_owner(ns, key, owner, stranded)
            return None if stranded is None else self.ops.leave_queue(ns, key, stranded)

        r: Acquired | Held = await self._undoable(
            self.ops.acquire(ns, key, owner, ttl_ms, limit, value, waiter), undo
        )
        return r

    async def release(self, ns: str, key: str, owner: str, token: int) -> bool:
        return bool(await self._undoable(self.ops.release(ns, key, owner, token), _none))

    async def break_lock(self, ns: str, key: str, token: int | None = None) -> bool:
        return bool(await self._undoable(self.ops.break_lock(ns, key, token), _none))

    async def renew(
        self, ns: str, key: str, owner: str, token: int, ttl_ms: int, value: bytes | None = None
    ) -> int | None:
        r: int | None = await self._run(self.ops.renew(ns, key, owner, token, ttl_ms, value))
        return r

    async def lock(self, ns: str, key: str) -> LockRow | None:
        r: LockRow | None = await self._run(self.ops.lock(ns, key))
        return r

    async def holders(self, ns: str, key: str) -> Sequence[LockRow]:
        r: Sequence[LockRow] = await self._run(self.ops.holders(ns, key))
        return r

    async def locks(self, ns_prefix: str) -> Sequence[LockRow]:
        r: Sequence[LockRow] = await self._run(self.ops.locks(ns_prefix))
        return r

    async def fence_advance(self, ns: str, resource: str, token: int) -> tuple[bool, int]:
        r: tuple[bool, int] = await self._run(self.ops.fence_advance(ns, resource, token))
        return r

    async def fence_current(self, ns: str, resource: str) -> int | None:
        r: int | None = await self._run(self.ops.fence_current(ns, resource))
        return r

    async def purge(self, dry_run: bool = False) -> int:
        return int(await self._run(self.ops.purge(dry_run)))
