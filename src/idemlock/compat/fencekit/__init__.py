"""fencekit's API over idemlock: ``from fencekit.X import Y`` becomes
``from idemlock.compat.fencekit.X import Y``.

Every class takes a redis-py client (as fencekit did) or an idemlock
``Coordinator`` on any store. See docs/migrating-from-fencekit.md.
"""

from __future__ import annotations

from .canonicalize import canonicalize, dumps_json, idempotency_key, loads_json
from .client import RedisClient, SyncRedis
from .errors import (
    CanonicalizeError,
    FencedOutError,
    FenceKitError,
    IdempotencyNotOwned,
    IdempotencyResultMissing,
    LockNotAcquired,
    LockNotOwned,
    TokenExpiredError,
)
from .fence import FenceGate
from .idempotency import IdempotencyGuard
from .lock import DistributedLock
from .types import BeginOutcome, FenceToken, LockHandle

#: the fencekit API level this façade mirrors
__version__ = "0.6.1"

__all__ = [
    "BeginOutcome",
    "CanonicalizeError",
    "DistributedLock",
    "FenceGate",
    "FenceKitError",
    "FenceToken",
    "FencedOutError",
    "IdempotencyGuard",
    "IdempotencyNotOwned",
    "IdempotencyResultMissing",
    "LockHandle",
    "LockNotAcquired",
    "LockNotOwned",
    "RedisClient",
    "SyncRedis",
    "TokenExpiredError",
    "__version__",
    "canonicalize",
    "dumps_json",
    "idempotency_key",
    "loads_json",
]
