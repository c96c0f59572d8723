"""What the sync and async ports of :mod:`idemlock.compat.ports` share, and the checks
that each is given the coordinator it is written for."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from .._core.types import Claimed, ClaimToken, IdempotencySpec, Lease
from .._core.types import LockSpec as DistributedLockSpec
from .._errors import ConfigurationError
from .._sync import Coordinator
from ..aio import AsyncCoordinator


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
