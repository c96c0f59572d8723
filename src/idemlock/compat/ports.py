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

A spec with ``requires_fencing_token=True`` always wires: every store idemlock ships
issues fencing tokens.
"""

from __future__ import annotations

from .._core.clock import Clock
from .._core.types import Claim, Claimed, Completed, IdempotencySpec, InFlight
from .._core.types import LockSpec as DistributedLockSpec
from ._ports_async import (
    AsyncBackend,
    AsyncDistributedLockCommandPort,
    AsyncDistributedLockQueryPort,
    AsyncDistributedLockScope,
    AsyncIdempotencyPort,
)
from ._ports_common import AcquiredLock

# generated from _ports_async.py by tools/async_to_sync.py
from ._ports_sync import (
    Backend,
    DistributedLockCommandPort,
    DistributedLockQueryPort,
    DistributedLockScope,
    IdempotencyPort,
)

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


def mock_backend(*, clock: Clock | None = None) -> Backend:
    """The contract's test double: the real ports on idemlock's in-process memory store
    (pass a ``ManualClock`` to move time by hand)."""
    from .. import connect

    return Backend(connect("memory://", clock=clock) if clock else connect("memory://"))


def async_mock_backend(*, clock: Clock | None = None) -> AsyncBackend:
    """:func:`mock_backend` for asyncio."""
    from ..aio import connect

    return AsyncBackend(connect("memory://", clock=clock) if clock else connect("memory://"))
