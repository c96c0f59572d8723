"""The framework contract's idempotency and lock ports, backed by idemlock.

A framework written against its "Idempotency & locks" contract wires these over a
:class:`~idemlock.Coordinator` (blocking classes) or an
:class:`~idemlock.aio.AsyncCoordinator` (the ``Async*`` classes), so it gets every
idemlock store. The names, arguments and return values are the contract's; every
decision is idemlock's (see docs/framework-contract.md for what differs).

* :class:`IdempotencySpec` and :class:`DistributedLockSpec` are idemlock's
  ``IdempotencySpec`` (``name``, ``ttl=24h``, ``encrypt_result``, plus ``lease``) and
  ``LockSpec`` (``name``, ``ttl=30s``, ``requires_fencing_token``).
* :class:`IdempotencyPort`: ``begin`` / ``commit`` / ``fail``.
* :class:`DistributedLockCommandPort`: ``acquire`` / ``release`` / ``reset``, by owner.
* :class:`DistributedLockQueryPort`: ``is_locked`` / ``get_owner`` / ``get_ttl``.
* :class:`DistributedLockScope`: a renewing ``with`` block, built on ``hold()``.
* :func:`mock_backend` / :func:`async_mock_backend`: the same ports on the memory store.

A spec with ``requires_fencing_token=True`` fails closed when a lock port is wired
on a store that cannot issue tokens (``ConfigurationError``), never at first use.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any

from .._core.clock import Clock
from .._core.types import Claim, Claimed, ClaimToken, Completed, IdempotencySpec, InFlight, Lease
from .._core.types import LockSpec as DistributedLockSpec
from .._errors import ConfigurationError
from .._sync import Coordinator, LockPort
from ..aio import AsyncCoordinator, AsyncLockPort

__all__ = [
    "AcquiredLock",
    "AsyncDistributedLockCommandPort",
    "AsyncDistributedLockQueryPort",
    "AsyncDistributedLockScope",
    "AsyncIdempotencyPort",
    "Backend",
    "AsyncBackend",
    "Claim",
    "Claimed",
    "Completed",
    "DistributedLockCommandPort",
    "DistributedLockQueryPort",
    "DistributedLockScope",
    "DistributedLockSpec",
    "IdempotencyPort",
    "IdempotencySpec",
    "InFlight",
    "async_mock_backend",
    "mock_backend",
]


@dataclass(frozen=True, slots=True)
class AcquiredLock:
    """A lock ``acquire`` took (or already held for this owner). ``token`` is the
    fencing token: strictly increasing per key, the same across ``reset``."""

    key: str
    owner: str
    token: int | None
    expires_at: datetime

    @classmethod
    def of(cls, lease: Lease) -> AcquiredLock:
        return cls(lease.key, lease.owner, lease.token, lease.expires_at)


def _sync_coord(coordinator: object) -> Coordinator:
    if not isinstance(coordinator, Coordinator):
        raise ConfigurationError(
            f"expected an idemlock.Coordinator (idemlock.connect(...)), got "
            f"{type(coordinator).__name__}; for an AsyncCoordinator use the Async* classes"
        )
    return coordinator


def _async_coord(coordinator: object) -> AsyncCoordinator:
    if not isinstance(coordinator, AsyncCoordinator):
        raise ConfigurationError(
            f"expected an idemlock.aio.AsyncCoordinator (idemlock.aio.connect(...)), got "
            f"{type(coordinator).__name__}; for a Coordinator use the blocking classes"
        )
    return coordinator


def _token(handle: Claimed | ClaimToken) -> ClaimToken:
    return handle.token if isinstance(handle, Claimed) else handle


def _lock_spec(spec: DistributedLockSpec | str) -> DistributedLockSpec:
    return DistributedLockSpec(spec) if isinstance(spec, str) else spec


# ---- idempotency ---------------------------------------------------------------------


class _Specs:
    """The spec each name was last begun with, so ``commit`` records for that spec's
    ttl and sealing (a claim token carries only the spec's name). A token of a spec
    this port never began (another process's) gets the spec of that name's defaults."""

    def __init__(self) -> None:
        self._by_name: dict[str, IdempotencySpec] = {}

    def seen(self, spec: IdempotencySpec | str) -> IdempotencySpec | str:
        if isinstance(spec, IdempotencySpec):
            self._by_name[spec.name] = spec
            return spec
        return self._by_name.get(spec, spec)

    def of(self, token: ClaimToken) -> IdempotencySpec | str:
        return self._by_name.get(token.spec, token.spec)


class IdempotencyPort:
    """``begin`` claims (operation = spec name, key, payload hash); ``commit`` records
    the result; ``fail`` releases the claim so a retry runs again."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coord = _sync_coord(coordinator)
        self._specs = _Specs()

    def begin(self, spec: IdempotencySpec | str, key: str, payload: Any = None) -> Claim:
        """``Claimed`` (run it, then commit or fail), ``InFlight`` (another attempt
        holds a live claim) or ``Completed`` (its ``result`` is the stored one).
        ``PayloadMismatch`` if the key is live with another payload."""
        return self._coord.idempotency(self._specs.seen(spec)).claim(key, payload=payload)

    def commit(self, claimed: Claimed | ClaimToken, result: Any) -> None:
        """Store ``result`` (JSON data; sealed if the spec has ``encrypt_result``) for
        the spec's ttl. ``StaleClaim`` if another attempt took the key over."""
        token = _token(claimed)
        self._coord.idempotency(self._specs.of(token)).complete(token, result)

    def fail(self, claimed: Claimed | ClaimToken) -> None:
        """Release the claim: the next ``begin`` of the key runs it again."""
        token = _token(claimed)
        self._coord.idempotency(self._specs.of(token)).abandon(token)


class AsyncIdempotencyPort:
    """:class:`IdempotencyPort` over an AsyncCoordinator."""

    def __init__(self, coordinator: AsyncCoordinator) -> None:
        self._coord = _async_coord(coordinator)
        self._specs = _Specs()

    async def begin(self, spec: IdempotencySpec | str, key: str, payload: Any = None) -> Claim:
        port = self._coord.idempotency(self._specs.seen(spec))
        return await port.claim(key, payload=payload)

    async def commit(self, claimed: Claimed | ClaimToken, result: Any) -> None:
        token = _token(claimed)
        await self._coord.idempotency(self._specs.of(token)).complete(token, result)

    async def fail(self, claimed: Claimed | ClaimToken) -> None:
        token = _token(claimed)
        await self._coord.idempotency(self._specs.of(token)).abandon(token)


# ---- locks ------------------------------------------------------------------------------
#
# release and reset act by owner, as the contract asks: a process that restarted with
# the same owner id has no lease object. idemlock's same-owner rule makes this safe:
# acquiring a key this owner holds returns its lease (same token), and a key held by
# anyone else is never touched.


class DistributedLockCommandPort:
    """``acquire`` / ``release`` / ``reset`` of one :class:`DistributedLockSpec`."""

    def __init__(self, coordinator: Coordinator, spec: DistributedLockSpec | str) -> None:
        # coord.lock() refuses requires_fencing_token=True on a tokenless store.
        self._port: LockPort = _sync_coord(coordinator).lock(_lock_spec(spec))
        self.spec = self._port.spec

    def acquire(self, key: str, owner: str) -> AcquiredLock | None:
        """Take the lock for the spec's ttl; None if another owner holds it. The same
        owner acquiring again gets its lease back (same token)."""
        lease = self._port.acquire(key, owner=owner)
        return None if lease is None else AcquiredLock.of(lease)

    def _own(self, key: str, owner: str) -> Lease | None:
        if self._port.owner(key) != owner:
            return None
        return self._port.acquire(key, owner=owner)

    def release(self, key: str, owner: str) -> bool:
        """Free the lock if ``owner`` holds it; whether it did."""
        lease = self._own(key, owner)
        return False if lease is None else self._port.release(lease)

    def reset(self, key: str, owner: str) -> bool:
        """Renew ``owner``'s lease to the spec's ttl from now, token unchanged; whether
        it was held (an expired lease is not revived)."""
        lease = self._own(key, owner)
        return False if lease is None else self._port.renew(lease)


class AsyncDistributedLockCommandPort:
    """:class:`DistributedLockCommandPort` over an AsyncCoordinator."""

    def __init__(self, coordinator: AsyncCoordinator, spec: DistributedLockSpec | str) -> None:
        self._port: AsyncLockPort = _async_coord(coordinator).lock(_lock_spec(spec))
        self.spec = self._port.spec

    async def acquire(self, key: str, owner: str) -> AcquiredLock | None:
        lease = await self._port.acquire(key, owner=owner)
        return None if lease is None else AcquiredLock.of(lease)

    async def _own(self, key: str, owner: str) -> Lease | None:
        if await self._port.owner(key) != owner:
            return None
        return await self._port.acquire(key, owner=owner)

    async def release(self, key: str, owner: str) -> bool:
        lease = await self._own(key, owner)
        return False if lease is None else await self._port.release(lease)

    async def reset(self, key: str, owner: str) -> bool:
        lease = await self._own(key, owner)
        return False if lease is None else await self._port.renew(lease)


class DistributedLockQueryPort:
    """Who holds a key of one spec, and for how long (read only)."""

    def __init__(self, coordinator: Coordinator, spec: DistributedLockSpec | str) -> None:
        self._port: LockPort = _sync_coord(coordinator).lock(_lock_spec(spec))

    def is_locked(self, key: str) -> bool:
        return self._port.is_locked(key)

    def get_owner(self, key: str) -> str | None:
        return self._port.owner(key)

    def get_ttl(self, key: str) -> timedelta | None:
        """Time left on the holder's lease; None if free."""
        return self._port.ttl(key)


class AsyncDistributedLockQueryPort:
    """:class:`DistributedLockQueryPort` over an AsyncCoordinator."""

    def __init__(self, coordinator: AsyncCoordinator, spec: DistributedLockSpec | str) -> None:
        self._port: AsyncLockPort = _async_coord(coordinator).lock(_lock_spec(spec))

    async def is_locked(self, key: str) -> bool:
        return await self._port.is_locked(key)

    async def get_owner(self, key: str) -> str | None:
        return await self._port.owner(key)

    async def get_ttl(self, key: str) -> timedelta | None:
        return await self._port.ttl(key)


class DistributedLockScope:
    """``with DistributedLockScope(spec, key, owner, coordinator=c) as lease:`` holds
    the lock for a long critical section, renewing it every ``extend_interval``
    (default: a third of the spec's ttl). Built on ``LockPort.hold``: raises
    ``LockNotAcquired`` if it is held past ``wait``, and ``LockLost`` on leaving if
    the lease was lost meanwhile (``lease.lost`` turns True as soon as it is)."""

    def __init__(
        self,
        spec: DistributedLockSpec | str,
        key: str,
        owner: str,
        extend_interval: timedelta | float | None = None,
        *,
        coordinator: Coordinator,
        wait: timedelta | float | None = None,
    ) -> None:
        self._port: LockPort = _sync_coord(coordinator).lock(_lock_spec(spec))
        self.key, self.owner, self.extend_interval, self.wait = key, owner, extend_interval, wait
        self._cm: AbstractContextManager[Lease] | None = None

    def __enter__(self) -> Lease:
        cm = self._port.hold(
            self.key, owner=self.owner, renew_every=self.extend_interval, wait=self.wait
        )
        lease = cm.__enter__()
        self._cm = cm
        return lease

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        cm, self._cm = self._cm, None
        assert cm is not None, "leaving a DistributedLockScope that was not entered"
        return cm.__exit__(et, e, tb)


class AsyncDistributedLockScope:
    """:class:`DistributedLockScope` for ``async with`` over an AsyncCoordinator (a
    lost lease also cancels the body)."""

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
        assert cm is not None, "leaving an AsyncDistributedLockScope that was not entered"
        return await cm.__aexit__(et, e, tb)


# ---- wiring ------------------------------------------------------------------------------


class Backend:
    """Every port of the contract over one Coordinator."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = _sync_coord(coordinator)
        self.idempotency = IdempotencyPort(self.coordinator)

    def commands(self, spec: DistributedLockSpec | str) -> DistributedLockCommandPort:
        return DistributedLockCommandPort(self.coordinator, spec)

    def queries(self, spec: DistributedLockSpec | str) -> DistributedLockQueryPort:
        return DistributedLockQueryPort(self.coordinator, spec)

    def scope(
        self,
        spec: DistributedLockSpec | str,
        key: str,
        owner: str,
        extend_interval: timedelta | float | None = None,
        *,
        wait: timedelta | float | None = None,
    ) -> DistributedLockScope:
        return DistributedLockScope(
            spec, key, owner, extend_interval, coordinator=self.coordinator, wait=wait
        )

    def close(self) -> None:
        self.coordinator.close()


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


def mock_backend(*, clock: Clock | None = None) -> Backend:
    """The contract's test double: the real ports on idemlock's in-process memory store
    (pass a ``ManualClock`` to move time by hand)."""
    from .. import connect

    return Backend(connect("memory://", clock=clock) if clock else connect("memory://"))


def async_mock_backend(*, clock: Clock | None = None) -> AsyncBackend:
    """:func:`mock_backend` for asyncio."""
    from ..aio import connect

    return AsyncBackend(connect("memory://", clock=clock) if clock else connect("memory://"))
