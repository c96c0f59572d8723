"""fencekit's ``DistributedLock`` over idemlock's lock port.

Each lock is an idemlock lease of spec ``<prefix>.lock``; its fencing token is the
lease token (strictly increasing per resource, not consecutive on Redis).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

from ..._core.types import Lease, LockSpec
from ..._errors import LockNotHeld
from ..._sync import LockPort
from .client import RedisClient, SyncRedis, coordinator_for, notify
from .errors import LockNotAcquired, LockNotOwned
from .keys import DEFAULT_PREFIX, KeySpace
from .types import FenceToken, LockHandle

__all__ = ["DistributedLock"]

_RETRY = timedelta(milliseconds=50)


def _ttl(ttl: timedelta) -> timedelta:
    if ttl.total_seconds() * 1000 < 1:
        raise ValueError(f"ttl must be at least 1ms, got {ttl}")
    return ttl


class DistributedLock:
    """Fenced locks on resources, one idemlock lease each."""

    def __init__(
        self,
        redis: SyncRedis | RedisClient | Any,
        *,
        prefix: str = DEFAULT_PREFIX,
        hooks: Any = None,
    ) -> None:
        self._keys = KeySpace(prefix)
        self._coord = coordinator_for(redis)
        self._spec_name = f"{prefix}.lock"
        self._hooks = hooks
        self._ports: dict[timedelta, LockPort] = {}

    def _port(self, ttl: timedelta) -> LockPort:
        # One port per ttl: all share the spec name, so a lease taken with one ttl is
        # released or renewed by any of them.
        port = self._ports.get(ttl)
        if port is None:
            port = self._ports[ttl] = self._coord.lock(LockSpec(self._spec_name, ttl=ttl))
        return port

    def acquire(
        self,
        resource: str,
        *,
        ttl: timedelta,
        owner_id: str | None = None,
        blocking: bool = False,
        wait: timedelta | None = None,
        retry_interval: timedelta = _RETRY,
    ) -> LockHandle:
        """Take ``resource`` for ``ttl``; LockNotAcquired if it is held (after up to
        ``wait`` when ``blocking``). Waiting wakes on the release, so
        ``retry_interval`` is only checked, not slept."""
        if retry_interval.total_seconds() <= 0:
            raise ValueError(f"retry_interval must be positive, got {retry_interval}")
        if blocking:
            if wait is None:
                raise ValueError("blocking=True needs wait= (how long to wait at most)")
            if wait.total_seconds() < 0:
                raise ValueError(f"wait must not be negative, got {wait}")
        owner = owner_id or str(uuid.uuid4())
        port = self._port(_ttl(ttl))
        lease = port.acquire(resource, owner=owner, wait=wait if blocking else None)
        if lease is None or lease.token is None:
            notify(self._hooks, "lock_acquire_failed", resource)
            if blocking:
                raise LockNotAcquired(
                    f"lock {resource!r} stayed held by another owner for {wait}; retry later"
                )
            raise LockNotAcquired(f"lock {resource!r} is held by another owner; retry later")
        notify(self._hooks, "lock_acquired", resource, lease.token)
        return LockHandle(
            resource=resource,
            owner_id=owner,
            token=FenceToken(value=lease.token, resource=resource),
            ttl=ttl,
            _lease=lease,
        )

    def _lease_of(self, handle: LockHandle, what: str) -> Lease:
        lease = handle._lease
        if isinstance(lease, Lease):
            return lease
        # A handle built by hand: find the lease by owner. Re-acquiring by the same
        # owner returns its lease (same token) while it is held; anything else means
        # the handle no longer holds the lock.
        port = self._port(handle.ttl)
        if port.owner(handle.resource) == handle.owner_id:
            found = port.acquire(handle.resource, owner=handle.owner_id)
            if found is not None and found.token == handle.token.value:
                return found
            if found is not None:
                port.release(found)  # ours lapsed in between: give back the new lease
        raise self._not_owned(handle, what)

    @staticmethod
    def _not_owned(handle: LockHandle, what: str) -> LockNotOwned:
        return LockNotOwned(
            f"cannot {what} lock {handle.resource!r} (token {handle.token.value}): it "
            "expired, was released, or is held by another owner; acquire it again"
        )

    def release(self, handle: LockHandle) -> None:
        """Free the lock; LockNotOwned if this handle no longer holds it."""
        lease = self._lease_of(handle, "release")
        if not self._port(handle.ttl).release(lease):
            raise self._not_owned(handle, "release")
        notify(self._hooks, "lock_released", handle.resource)

    def extend(self, handle: LockHandle, *, ttl: timedelta) -> None:
        """Reset the lease to ``ttl`` from now (token unchanged); LockNotOwned if it
        had expired or is not this handle's."""
        lease = self._lease_of(handle, "extend")
        try:
            ok = self._port(handle.ttl).renew(lease, _ttl(ttl))
        except LockNotHeld:
            ok = False
        if not ok:
            raise self._not_owned(handle, "extend")

    @contextmanager
    def hold(
        self,
        resource: str,
        *,
        ttl: timedelta,
        owner_id: str | None = None,
        blocking: bool = False,
        wait: timedelta | None = None,
    ) -> Iterator[LockHandle]:
        """Acquire for a block and release after it (no renewal, as in fencekit; for
        renewal use idemlock's ``LockPort.hold``). A release that finds the lease gone
        raises LockNotOwned, unless the block already raised."""
        handle = self.acquire(resource, ttl=ttl, owner_id=owner_id, blocking=blocking, wait=wait)
        try:
            yield handle
        except BaseException:
            with suppress(LockNotOwned):
                self.release(handle)
            raise
        self.release(handle)

    def lock_key(self, resource: str) -> str:
        """fencekit's name for the lock of ``resource`` (informational: see keys)."""
        return self._keys.lock(resource)
