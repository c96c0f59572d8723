"""idemlock: make retried work safe.

* Idempotent operations: a keyed operation runs its side effect at most once per
  key within a TTL, and every retry gets the first result replayed.
* Fenced leases: mutual exclusion across processes and machines with a TTL,
  renewal and a strictly increasing fencing token.

Start with :func:`connect` (blocking) or :func:`idemlock.aio.connect` (asyncio).
"""

from __future__ import annotations

from typing import Any

from ._core.canonical import canonicalize, fingerprint
from ._core.clock import Clock, ManualClock, SystemClock
from ._core.codec import Codec, JsonCodec
from ._core.types import (
    Claim,
    Claimed,
    ClaimToken,
    Completed,
    IdempotencySpec,
    InFlight,
    Lease,
    LockInfo,
    LockSpec,
    RecordStatus,
)
from ._errors import (
    CanonicalizeError,
    ConfigurationError,
    FencedOut,
    IdemlockError,
    InFlightError,
    InvalidKey,
    LockLost,
    LockNotAcquired,
    LockNotHeld,
    PayloadMismatch,
    ResultDecodeError,
    ResultEncodeError,
    StaleClaim,
    StoreCorrupt,
    StoreFull,
    StoreUnavailable,
)
from ._sync import Coordinator, FenceGate, IdempotencyPort, LockPort

__version__ = "0.1.0"

__all__ = [
    "CanonicalizeError",
    "Claim",
    "ClaimToken",
    "Claimed",
    "Clock",
    "Codec",
    "Completed",
    "ConfigurationError",
    "Coordinator",
    "FenceGate",
    "FencedOut",
    "IdempotencyPort",
    "IdempotencySpec",
    "IdemlockError",
    "InFlight",
    "InFlightError",
    "InvalidKey",
    "JsonCodec",
    "Lease",
    "LockInfo",
    "LockLost",
    "LockNotAcquired",
    "LockNotHeld",
    "LockPort",
    "LockSpec",
    "ManualClock",
    "PayloadMismatch",
    "RecordStatus",
    "ResultDecodeError",
    "ResultEncodeError",
    "StaleClaim",
    "StoreCorrupt",
    "StoreFull",
    "StoreUnavailable",
    "SystemClock",
    "canonicalize",
    "connect",
    "fingerprint",
]


def connect(url: Any = None, *, key_prefix: str = "idemlock", **options: Any) -> Coordinator:
    """Open a :class:`Coordinator` on a store.

    ``url`` is ``memory://``, ``sqlite:///path/to/file.db``, ``redis://...``,
    ``rediss://...``, ``unix://...``, ``redis+cluster://h:p[,h:p...]``,
    ``postgresql://...``; or an existing redis-py client or psycopg_pool pool. None
    means ``$IDEMLOCK_URL``, else SQLite in the user's state directory. Store options
    (``max_keys=``, ``clock=`` for memory; ``busy_timeout=`` for SQLite; ...) are
    passed as keywords. ``key_prefix`` namespaces everything this coordinator stores.
    """
    from ._urls import open_store

    store, clock, shown = open_store(url, asynchronous=False, **options)
    return Coordinator(store, key_prefix=key_prefix, clock=clock, url=shown)
