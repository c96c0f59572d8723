"""The one error hierarchy of idemlock.

Every failure a caller can cause is a subclass of :class:`IdemlockError` whose
message says what was wrong and what to do about it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

__all__ = [
    "CanonicalizeError",
    "ConfigurationError",
    "DuplicateStep",
    "FencedOut",
    "IdemlockError",
    "InFlightError",
    "InvalidKey",
    "LockLost",
    "LockNotAcquired",
    "LockNotHeld",
    "PayloadMismatch",
    "ResultDecodeError",
    "ResultEncodeError",
    "ResultTooLarge",
    "SealError",
    "StaleClaim",
    "StepInterrupted",
    "StoreCorrupt",
    "StoreFull",
    "StoreUnavailable",
]


def _rebuild(cls: type[IdemlockError], args: tuple[Any, ...]) -> IdemlockError:
    """Unpickle an error without calling its ``__init__``: the pickled args are the
    finished message, not the constructor's arguments (``FencedOut(resource, token,
    current)`` pickles as one string), so calling ``cls(*args)`` would fail or wrap
    the message a second time."""
    err = cls.__new__(cls)
    err.args = args
    return err


class IdemlockError(Exception):
    """Base class of every error idemlock raises on purpose.

    Every subclass pickles back to an equal error (same type, message and attributes),
    so it survives Celery's result backend, multiprocessing and concurrent.futures,
    and ``except FencedOut`` still matches on the other side."""

    def __reduce__(self) -> tuple[Any, ...]:
        # The attributes (key, token, ...) travel as the instance dict, restored by
        # BaseException.__setstate__.
        return (_rebuild, (type(self), self.args), self.__dict__ or None)


class ConfigurationError(IdemlockError, ValueError):
    """The coordinator, a store URL or a spec is wired wrongly."""


class CanonicalizeError(IdemlockError, TypeError):
    """A payload is not JSON-like and cannot be fingerprinted."""


class InvalidKey(IdemlockError, ValueError):
    """A key, spec name, owner or prefix is empty, too long or has forbidden characters."""


class PayloadMismatch(IdemlockError):
    """The key is live with a different payload: the key was reused for another request."""

    def __init__(self, key: str, message: str | None = None) -> None:
        self.key = key
        super().__init__(
            message
            or f"idempotency key {key!r} was already used with a different payload; "
            "use a new key for a different request (a retry must send the same payload)"
        )


class StaleClaim(IdemlockError):
    """The claim token no longer holds its key (its lease ran out and it was re-claimed,
    it was completed or abandoned already, or the record was forgotten)."""


class ClaimLost(StaleClaim):
    """A claim kept alive by heartbeats was lost while its work ran: a renewal was
    refused (another attempt took the key over) or none was confirmed before the lease
    ran out (a paused process, a silent store), and the store no longer let this
    attempt record its outcome. Nothing was recorded; a retry runs with a higher fence."""


class DuplicateStep(IdemlockError):
    """A step name was used twice in one attempt: a step's name is its identity (its
    recorded result is found by it on a retry), so each step of an operation needs a
    name of its own."""

    def __init__(self, name: str, key: str, *, earlier: bool = False) -> None:
        self.name = name
        self.key = key
        if earlier:  # recording it in a transaction of the caller's would repeat its writes
            super().__init__(
                f"step {name!r} of idempotency key {key!r} was recorded by an earlier "
                "attempt; record it in your transaction inside attempt.step(name, fn), "
                "which replays the recorded result instead of running fn again"
            )
            return
        super().__init__(
            f"step {name!r} already ran in this attempt of idempotency key {key!r}; give "
            "each step of an operation its own name (a loop: put the item in the name)"
        )


class StepInterrupted(IdemlockError):
    """A ``once=True`` step was started by an earlier attempt (fence ``fence``) that
    ended before recording its result: its effect may or may not have happened, and the
    step will not run again by itself. Check the outside world, then record what
    happened with ``attempt.settle(name, value)`` or allow one more run with
    ``attempt.retry_step(name)``."""

    def __init__(self, name: str, key: str, fence: int) -> None:
        self.name = name
        self.key = key
        self.fence = fence
        super().__init__(
            f"step {name!r} of idempotency key {key!r} was started by the attempt with fence "
            f"{fence} and never recorded a result (once=True): it may have taken effect; "
            "check, then attempt.settle(name, value) to record its result or "
            "attempt.retry_step(name) to run it again"
        )


class InFlightError(IdemlockError):
    """Another attempt holds an unexpired claim on the key.

    ``waited`` (seconds this call waited for it, None if it did not) and ``wait_with``
    (the setting that makes this caller wait, None where it has none, as in the job
    integrations) only shape the message; the attributes stay ``key`` and
    ``expires_at``."""

    def __init__(
        self,
        key: str,
        expires_at: datetime | None,
        *,
        waited: float | None = None,
        wait_with: str | None = None,
    ) -> None:
        self.key = key
        self.expires_at = expires_at
        # Heartbeats renew a running claim, so its expiry moves on while the work runs.
        lease = (
            f" (its lease ends at {expires_at.isoformat()} unless renewed)" if expires_at else ""
        )
        then = "then its result is replayed, or the call runs if that attempt failed"
        if waited is None:
            what = f"is being processed by another attempt{lease}; retry once it ends ({then})"
            how = f", or wait for it with {wait_with}" if wait_with else ""
        else:
            what = (
                f"was still being processed by another attempt after a wait of {waited:g}s"
                f"{lease}; a claim kept alive by heartbeats stays in flight for as long as "
                f"its work runs, so work longer than the wait outlasts it; retry later ({then})"
            )
            how = f", or wait longer with {wait_with}" if wait_with else ""
        super().__init__(f"idempotency key {key!r} {what}{how}")


class StoreFull(IdemlockError):
    """The store reached its capacity and nothing in it has expired."""


class LockNotAcquired(IdemlockError):
    """A lock could not be acquired within the allowed wait."""


class LockNotHeld(IdemlockError):
    """An operation needs a lease that is not (or no longer) held."""


class LockLost(IdemlockError):
    """A held lease was lost (renewal failed or came too late) while its block ran."""


class FencedOut(IdemlockError):
    """A fencing token is lower than one already accepted: the writer's lease is stale."""

    def __init__(self, resource: str, token: int, current: int | None) -> None:
        self.resource = resource
        self.token = token
        self.current = current
        super().__init__(
            f"fencing token {token} for {resource!r} is older than the highest accepted "
            f"token {current}; this writer's lease or claim expired and another holder "
            "took over, so its write was refused"
        )


class StoreUnavailable(IdemlockError):
    """The store failed (unreachable, timed out, locked, disk full, read-only, ...).

    The original exception is chained as ``__cause__``. No claim or lease is left
    half-made by the failed call.
    """


class StoreCorrupt(StoreUnavailable):
    """The store holds data idemlock did not write, or cannot parse what it wrote."""


class ResultEncodeError(IdemlockError, TypeError):
    """A result cannot be stored faithfully by the configured codec."""


class ResultDecodeError(IdemlockError):
    """A stored result cannot be decoded (corrupt, tampered with, or from another version)."""


class ResultTooLarge(ResultEncodeError):
    """A result is larger than the configured limit; nothing was stored."""


class SealError(ResultDecodeError):
    """A sealed result cannot be opened: unknown key id, wrong key, or the record was
    moved to another key, spec or tenant (its associated data no longer matches)."""
