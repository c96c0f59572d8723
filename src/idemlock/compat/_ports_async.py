"""The ports of :mod:`idemlock.compat.ports` over ``AsyncCoordinator``."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from datetime import timedelta
from types import TracebackType

from .._core.jsontypes import JSONValue
from .._core.types import Claim, Claimed, ClaimToken, IdempotencySpec, Lease
from .._core.types import LockSpec as DistributedLockSpec
from ..aio import AsyncCoordinator, AsyncLockPort
from ._ports_common import AcquiredLock, _async_coord, _lock_spec, _Specs, _token

# ---- idempotency ---------------------------------------------------------------------


class AsyncIdempotencyPort:
    """``begin`` claims (operation = spec name, key, payload hash); ``commit`` records
    the result; ``fail`` releases the claim so a retry runs again."""

    def __init__(self, coordinator: AsyncCoordinator) -> None:
        self._coord = _async_coord(coordinator)
        self._specs = _Specs()

    async def begin(
        self, spec: IdempotencySpec | str, key: str, payload: JSONValue = None
    ) -> Claim:
        """``Claimed`` (run it, then commit or fail), ``InFlight`` (another attempt
        holds a live claim) or ``Completed`` (its ``result`` is the stored one).
        ``PayloadMismatch`` if the key is live with another payload."""
        port = self._coord.idempotency(self._specs.seen(spec))
        return await port.claim(key, payload=payload)

    async def commit(self, claimed: Claimed | ClaimToken, result: JSONValue) -> None:
        """Store ``result`` (JSON data; sealed if the spec has ``encrypt_result``) for
        the spec's ttl. ``StaleClaim`` if another attempt took the key over."""
        token = _token(claimed)
        await self._coord.idempotency(self._specs.of(token)).complete(token, result)

    async def fail(self, claimed: Claimed | ClaimToken) -> None:
        """Release the claim: the next ``begin`` of the key runs it again."""
        token = _token(claimed)
        await self._coord.idempotency(self._specs.of(token)).abandon(token)


# ---- locks ------------------------------------------------------------------------------
#
# release and reset act by owner, as the contract asks: a process that restarted with
# the same owner id has no lease object. idemlock's same-owner rule makes this safe:
# acquiring a key this owner holds returns its lease (same token), and a key held by
# anyone else is never touched.


class AsyncDistributedLockCommandPort:
    """``acquire`` / ``release`` / ``reset`` of one :class:`DistributedLockSpec`."""

    def __init__(self, coordinator: AsyncCoordinator, spec: DistributedLockSpec | str) -> None:
        self._port: AsyncLockPort = _async_coord(coordinator).lock(_lock_spec(spec))
        self.spec = self._port.spec

    async def acquire(self, key: str, owner: str) -> AcquiredLock | None:
        """Take the lock for the spec's ttl; None if another owner holds it. The same
        owner acquiring again gets its lease back (same token)."""
        lease = await self._port.acquire(key, owner=owner)
        return None if lease is None else AcquiredLock.of(lease)

    async def _own(self, key: str, owner: str) -> Lease | None:
        if await self._port.owner(key) != owner:
            return None
        return await self._port.acquire(key, owner=owner)

    async def release(self, key: str, owner: str) -> bool:
        """Free the lock if ``owner`` holds it; whether it did."""
        lease = await self._own(key, owner)
        return False if lease is None else await self._port.release(lease)

    async def reset(self, key: str, owner: str) -> bool:
        """Renew ``owner``'s lease to the spec's ttl from now, token unchanged; whether
        it was held (an expired lease is not revived)."""
        lease = await self._own(key, owner)
        return False if lease is None else await self._port.renew(lease)


class AsyncDistributedLockQueryPort:
    """Who holds a key of one spec, and for how long (read only)."""

    def __init__(self, coordinator: AsyncCoordinator, spec: DistributedLockSpec | str) -> None:
        self._port: AsyncLockPort = _async_coord(coordinator).lock(_lock_spec(spec))

    async def is_locked(self, key: str) -> bool:
        return await self._port.is_locked(key)

    async def get_owner(self, key: str) -> str | None:
        return await self._port.owner(key)

    async def get_ttl(self, key: str) -> timedelta | None:
        """Time left on the holder's lease; None if free."""
        return await self._port.ttl(key)


class AsyncDistributedLockScope:
    """``async with AsyncDistributedLockScope(spec, key, owner, coordinator=c) as lease:``
    holds the lock for a long critical section, renewing it every ``extend_interval``
    (default: a third of the spec's ttl). Built on ``LockPort.hold``: raises
    ``LockNotAcquired`` if it is held past ``wait``, and ``LockLost`` on leaving if
    the lease was lost meanwhile (``lease.lost`` turns True as soon as it is; under
    asyncio a lost lease also cancels the body)."""

    def __init__(
        self,
        spec: DistributedLockSpec | str,
        key: str,
        owner: str,
        extend_interval: timedelta | float | None = None,
        *,
        coordinator: AsyncCoordinator,
        wait: timedelta | float | None = None,
    ) -> None:
        self._port: AsyncLockPort = _async_coord(coordinator).lock(_lock_spec(spec))
        self.key, self.owner, self.extend_interval, self.wait = key, owner, extend_interval, wait
        self._cm: AbstractAsyncContextManager[Lease] | None = None

    async def __aenter__(self) -> Lease:
        cm = self._port.hold(
            self.key, owner=self.owner, renew_every=self.extend_interval, wait=self.wait
        )
        lease = await cm.__aenter__()
        self._cm = cm
        return lease

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        cm, self._cm = self._cm, None
        assert cm is not None, f"leaving a {type(self).__name__} that was not entered"
        return await cm.__aexit__(et, e, tb)


# ---- wiring ------------------------------------------------------------------------------


class AsyncBackend:
    """Every port of the contract over one AsyncCoordinator."""

    def __init__(self, coordinator: AsyncCoordinator) -> None:
        self.coordinator = _async_coord(coordinator)
        self.idempotency = AsyncIdempotencyPort(self.coordinator)

    def commands(self, spec: DistributedLockSpec | str) -> AsyncDistributedLockCommandPort:
        return AsyncDistributedLockCommandPort(self.coordinator, spec)

    def queries(self, spec: DistributedLockSpec | str) -> AsyncDistributedLockQueryPort:
        return AsyncDistributedLockQueryPort(self.coordinator, spec)

    def scope(
        self,
        spec: DistributedLockSpec | str,
        key: str,
        owner: str,
        extend_interval: timedelta | float | None = None,
        *,
        wait: timedelta | float | None = None,
    ) -> AsyncDistributedLockScope:
        return AsyncDistributedLockScope(
            spec, key, owner, extend_interval, coordinator=self.coordinator, wait=wait
        )

    async def close(self) -> None:
        await self.coordinator.close()
