"""fencekit's exception classes, as subclasses of :class:`idemlock.IdemlockError`.

``except fencekit.LockNotOwned`` code keeps working, and ``except IdemlockError``
catches these too.
"""

from __future__ import annotations

from ..._errors import IdemlockError

__all__ = [
    "CanonicalizeError",
    "FenceKitError",
    "FencedOutError",
    "IdempotencyNotOwned",
    "IdempotencyResultMissing",
    "LockNotAcquired",
    "LockNotOwned",
    "TokenExpiredError",
]


class FenceKitError(IdemlockError):
    """Base of the errors the fencekit façade raises."""


class LockNotAcquired(FenceKitError):
    """The lock stayed held by another owner for the whole wait."""


class LockNotOwned(FenceKitError):
    """release/extend of a handle whose lease expired, was released, or belongs to
    another owner."""


class IdempotencyNotOwned(FenceKitError):
    """mark_done by a guard that does not hold the key's current claim."""


class IdempotencyResultMissing(FenceKitError):
    """No recorded result to return: the key is absent, still pending, or was marked
    done without a result."""


class FencedOutError(FenceKitError):
    """A write presented a fencing token lower than the highest one accepted."""


class TokenExpiredError(FenceKitError):
    """For callers that track a handle's local expiry before writing."""


class CanonicalizeError(FenceKitError):
    """A payload or result is not plain JSON data (NaN, datetime, non-str keys...)."""
