"""idemlock: make retried work safe.

* Idempotent operations: a keyed operation runs its side effect at most once per
  key within a TTL, and every retry gets the first result replayed.
* Fenced leases: mutual exclusion across processes and machines with a TTL,
  renewal and a strictly increasing fencing token.

Start with :func:`connect` (blocking) or :func:`idemlock.aio.connect` (asyncio).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ._clock import ManualClock, SystemClock
from ._context import current_claim
from ._core.canonical import canonicalize, fingerprint
from ._core.clock import MAX_TTL, Clock
from ._core.codec import COMPRESS_OVER, MAX_RESULT_BYTES, RecordedError  # noqa: F401 (kept)
from ._core.events import Event, Hook
from ._core.jsontypes import JSONValue
from ._core.types import (
    Claim,
    Claimed,
    ClaimToken,
    Completed,
    ElectionSpec,
    IdempotencySpec,
    InFlight,
    Leader,
    Lease,
    LockInfo,
    LockSpec,
    Permit,
    RecordStatus,
    SemaphoreSpec,
    StepInfo,
)
from ._errors import (
    CanonicalizeError,
    ClaimLost,
    ConfigurationError,
    DuplicateStep,
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
    ResultTooLarge,
    SealError,
    StaleClaim,
    StepInterrupted,
    StoreCorrupt,
    StoreFull,
    StoreUnavailable,
)
from ._log_fallback import FallbackHandler
from ._sync import (
    Coordinator,
    ElectionPort,
    FenceGate,
    IdempotencyPort,
    LockPort,
    SemaphorePort,
    Term,
    connect,
)
from ._threads import Attempt

if TYPE_CHECKING:
    from ._keyring import Keyring

# Warnings reach stderr while the application configures no logging (uvicorn's and
# gunicorn's defaults configure only their own loggers); silent once it does.
logging.getLogger(__name__).addHandler(FallbackHandler())


def _version() -> str:
    # From the installed distribution's metadata, so the package, the CLI and pip agree.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("idemlock")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"


#: the installed version; read on first use (importlib.metadata costs more than the rest
#: of ``import idemlock``)
__version__: str

#: submodules reachable as attributes without their own import; loaded on first use so
#: that ``import idemlock`` stays free of asyncio and the optional drivers
_LAZY_SUBMODULES = frozenset({"aio", "integrations", "stores", "compat"})


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value = globals()["__version__"] = _version()
        return value
    if name == "Keyring":  # hmac and base64 load with it, on first use
        from ._keyring import Keyring

        globals()["Keyring"] = Keyring
        return Keyring
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Attempt",
    "CanonicalizeError",
    "ClaimLost",
    "Claim",
    "ClaimToken",
    "Claimed",
    "Clock",
    "Completed",
    "ConfigurationError",
    "DuplicateStep",
    "Coordinator",
    "ElectionPort",
    "ElectionSpec",
    "FenceGate",
    "FencedOut",
    "IdempotencyPort",
    "IdempotencySpec",
    "IdemlockError",
    "InFlight",
    "InFlightError",
    "InvalidKey",
    "JSONValue",
    "Keyring",
    "Event",
    "Hook",
    "Leader",
    "Lease",
    "LockInfo",
    "LockLost",
    "LockNotAcquired",
    "LockNotHeld",
    "LockPort",
    "LockSpec",
    "MAX_TTL",
    "ManualClock",
    "PayloadMismatch",
    "Permit",
    "RecordStatus",
    "StepInfo",
    "RecordedError",
    "ResultDecodeError",
    "ResultEncodeError",
    "ResultTooLarge",
    "SemaphorePort",
    "SemaphoreSpec",
    "Term",
    "SealError",
    "StaleClaim",
    "StepInterrupted",
    "StoreCorrupt",
    "StoreFull",
    "StoreUnavailable",
    "SystemClock",
    "canonicalize",
    "connect",
    "current_claim",
    "fingerprint",
]
