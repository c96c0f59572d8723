"""Public value types: specs, claim outcomes, leases and listings."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

from .._errors import ConfigurationError
from .clock import Clock, duration
from .codec import RecordedError
from .keys import validate_key

__all__ = [
    "Claim",
    "ClaimToken",
    "Claimed",
    "ElectionSpec",
    "Completed",
    "IdempotencySpec",
    "InFlight",
    "Lease",
    "Leader",
    "LockInfo",
    "LockSpec",
    "Permit",
    "RecordStatus",
    "SemaphoreSpec",
    "from_ms",
]


def _flag(value: object, what: str) -> None:
    # A bool only: encrypt_result="no" would be truthy and seal every result.
    if not isinstance(value, bool):
        raise ConfigurationError(f"{what} must be True or False, got {value!r}")


def from_ms(ms: int) -> datetime:
    """Store milliseconds since the epoch as an aware UTC datetime."""
    return _fromtimestamp(ms / 1000, _UTC)  # positional: half the cost of tz=


_fromtimestamp = datetime.fromtimestamp
_UTC = timezone.utc


@dataclass(frozen=True)
class IdempotencySpec:
    """How one kind of idempotent operation behaves.

    ``name`` is the namespace of its keys: keep it stable, it is never derived from
    code. ``ttl`` is how long a completed result is remembered and replayed.
    ``lease`` is how long after a crash an unfinished claim frees itself: the
    decorator, ``port.run()`` and the integrations renew it (heartbeats) while the
    work runs, so it need not be longer than the operation takes. Both are a
    ``timedelta`` or a number of seconds (``ttl=3600`` is one hour).
    """

    name: str
    ttl: timedelta | float = timedelta(hours=24)
    lease: timedelta | float = timedelta(seconds=30)
    encrypt_result: bool = False

    def __post_init__(self) -> None:
        validate_key(self.name, "spec name")
        duration(self.ttl, "IdempotencySpec.ttl", positive=True)
        duration(self.lease, "IdempotencySpec.lease", positive=True)
        _flag(self.encrypt_result, "IdempotencySpec.encrypt_result")


@dataclass(frozen=True)
class LockSpec:
    """How one family of locks behaves. ``ttl`` is the lease length (a ``timedelta``
    or a number of seconds); a holder that neither renews nor releases loses the lock
    after it."""

    name: str
    ttl: timedelta | float = timedelta(seconds=30)
    requires_fencing_token: bool = False

    def __post_init__(self) -> None:
        validate_key(self.name, "spec name")
        duration(self.ttl, "LockSpec.ttl", positive=True)
        _flag(self.requires_fencing_token, "LockSpec.requires_fencing_token")


#: the largest ``limit`` a semaphore may have (each acquire counts its live holders)
MAX_LIMIT = 10_000


@dataclass(frozen=True)
class SemaphoreSpec:
    """How one family of semaphores behaves: up to ``limit`` holders per key at once,
    each with its own lease of ``ttl`` (a ``timedelta`` or seconds) and fencing token.
    A lock is the one-permit case of the same records: a :class:`LockSpec` of the same
    name shares its keys, its holder counting as one. ``limit`` travels with each
    acquire, so after lowering it the holders above the new limit drain as they
    release; nobody new gets a permit until fewer than ``limit`` hold the key."""

    name: str
    limit: int
    ttl: timedelta | float = timedelta(seconds=30)

    def __post_init__(self) -> None:
        validate_key(self.name, "spec name")
        if (
            isinstance(self.limit, bool)
            or not isinstance(self.limit, int)
            or not 1 <= self.limit <= MAX_LIMIT
        ):
            raise ConfigurationError(
                f"SemaphoreSpec.limit must be an int from 1 to {MAX_LIMIT} (the most "
                f"holders of one key at once), got {self.limit!r}"
            )
        duration(self.ttl, "SemaphoreSpec.ttl", positive=True)


#: the most bytes (UTF-8) a holder may publish with ``value=``
MAX_VALUE_BYTES = 4096


@dataclass(frozen=True)
class ElectionSpec:
    """How one family of elections behaves: one leader per key at a time, whose term
    lasts while it renews within ``ttl`` (a ``timedelta`` or seconds). The leader is a
    lock's holder that publishes a value: a :class:`LockSpec` of the same name shares
    its keys."""

    name: str
    ttl: timedelta | float = timedelta(seconds=15)

    def __post_init__(self) -> None:
        validate_key(self.name, "spec name")
        duration(self.ttl, "ElectionSpec.ttl", positive=True)


@dataclass(frozen=True, slots=True)
class Leader:
    """The leader of one election key: its published ``value``, its ``term`` (a
    fencing token: strictly increasing over the key's terms), its ``owner`` and when
    its lease ends unless renewed."""

    value: str | None
    term: int
    owner: str
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class ClaimToken:
    """Proof of one claim attempt. ``fence`` strictly increases with every new claim
    of the key: pass it to fenced writes so a late write of an expired attempt is refused."""

    key: str
    token: str
    fence: int
    expires_at: datetime
    spec: str
    _ns: str = field(repr=False, compare=False, default="")
    #: the key as the store holds it (an HMAC when a keyring is set)
    _skey: str = field(repr=False, compare=False, default="")
    #: True once a heartbeat-renewed claim is lost (see ``Coordinator.idempotent``)
    lost: bool = field(compare=False, default=False)
    #: the steps earlier attempts recorded, as the grant carried them (``port.StepRow``)
    _steps: tuple[Any, ...] = field(repr=False, compare=False, default=())

    # Steps from inside the operation this claim belongs to (``current_claim()`` in a
    # decorated function or an idempotent job): the attempt's own methods, so
    # ``idemlock.current_claim().step(...)`` is ``attempt.step(...)`` (awaited in an
    # ``async def``). See ``idemlock.Attempt``.

    def step(self, name: str, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        """``attempt.step(name, fn, *args, **kwargs)`` of this claim's operation
        (``once=`` and ``replay_errors=`` too); await it in an ``async def``."""
        return self._attempt("step").step(name, fn, *args, **kwargs)

    def settle(self, name: str, value: Any) -> Any:
        """``attempt.settle(name, value)`` of this claim's operation."""
        return self._attempt("settle").settle(name, value)

    def retry_step(self, name: str) -> Any:
        """``attempt.retry_step(name)`` of this claim's operation."""
        return self._attempt("retry_step").retry_step(name)

    def key_for(self, name: str) -> str:
        """``attempt.key_for(name)``: a stable key for step ``name`` (see ``Attempt``)."""
        key: str = self._attempt("key_for").key_for(name)
        return key

    def _attempt(self, what: str) -> Any:
        attempt = CURRENT_ATTEMPT.get()
        if attempt is None or attempt.token is not self:
            raise ConfigurationError(
                f"claim.{what}() works inside the operation the claim belongs to (the body "
                "of an @idempotent function or an idempotent job, where "
                "idemlock.current_claim() returns it); in a port.run() block use "
                f"attempt.{what}()"
            )
        return attempt


#: the attempt (``Attempt``/``AsyncAttempt``) of the operation running in this context,
#: set with its claim by the decorator, ``port.run()`` and the job integrations
CURRENT_ATTEMPT: ContextVar[Any] = ContextVar("idemlock_attempt", default=None)


@dataclass(frozen=True, slots=True)
class Claimed:
    """The caller holds the claim and must run the operation, then ``complete`` or ``abandon``."""

    token: ClaimToken
    kind: Literal["claimed"] = field(default="claimed", init=False)

    @property
    def fence(self) -> int:
        return self.token.fence


@dataclass(frozen=True, slots=True)
class InFlight:
    """Another attempt holds an unexpired claim until ``expires_at``."""

    expires_at: datetime
    kind: Literal["in_flight"] = field(default="in_flight", init=False)


@dataclass(frozen=True, slots=True)
class Completed:
    """The operation already ran; ``result`` is the recorded result to replay. When the
    operation's exception was recorded (``replay_errors``), ``error`` describes it and
    ``result`` is None. ``result`` is typed ``Any``, as ``json.loads`` is: it is the
    decoded JSON (a :data:`~idemlock.JSONValue`) of what was recorded."""

    result: Any
    expires_at: datetime | None = None
    error: RecordedError | None = None
    kind: Literal["completed"] = field(default="completed", init=False)


Claim = Claimed | InFlight | Completed


@dataclass(frozen=True, slots=True)
class StepInfo:
    """One recorded step of an operation (``RecordStatus.steps``): ``state`` "done" with
    a result of ``size`` bytes as stored, or "started" (a ``once=True`` step whose
    attempt never recorded a result); ``fence`` of the attempt that wrote it."""

    name: str
    state: Literal["done", "started"]
    size: int
    fence: int


@dataclass(frozen=True)
class RecordStatus:
    """What the store holds for an idempotency key. ``expires_at`` is the end of the
    lease while in flight, the end of the ttl once completed. ``state`` is
    ``"corrupt"`` for a value under the prefix the store cannot read (foreign or
    damaged data, listed with a warning instead of failing the listing). ``tenant`` is
    the tenant whose namespace holds it (None: the root's own), so a listed record can
    be acted on: ``coord.for_tenant(tenant).idempotency(spec).forget(key)``. ``steps``:
    the operation's recorded steps, by name (``port.status(key)`` on a store that
    records steps; empty in listings)."""

    key: str
    state: Literal["in_flight", "completed", "corrupt"]
    fence: int
    expires_at: datetime
    spec: str = ""
    tenant: str | None = None
    steps: tuple[StepInfo, ...] = ()


@dataclass(frozen=True)
class LockInfo:
    """A held lock, as listed by ``locks()`` and the CLI. ``tenant`` as in
    :class:`RecordStatus`; ``corrupt`` marks a value the store cannot read (owner "",
    token 0)."""

    spec: str
    key: str
    owner: str
    token: int | None
    expires_at: datetime
    tenant: str | None = None
    corrupt: bool = False
    #: what the holder published with ``value=`` (an election's leader), or None
    value: str | None = None


@dataclass(eq=False, slots=True)
class Lease:
    """A held lock or semaphore permit (:data:`Permit` is this class). Ownership lives
    in this object (never in thread- or task-locals).

    ``token`` is the fencing token: it strictly increases per key over all
    acquisitions and stays the same across renewals. ``remaining()`` is measured
    from when the acquire or last renew request was *sent*, so it errs early.
    """

    key: str
    owner: str
    token: int
    expires_at: datetime
    spec: str = ""
    lost: bool = False
    _ns: str = field(default="", repr=False)
    _ttl_ms: int = field(default=0, repr=False)
    _sent: float = field(default=0.0, repr=False)
    #: the coordinator's clock (None: a lease not from a port, with no local deadline)
    _clock: Clock | None = field(default=None, repr=False)
    _released: bool = field(default=False, repr=False)

    def remaining(self) -> timedelta:
        """Time the holder may still rely on the lease (zero once lost or expired)."""
        if self.lost or self._clock is None:
            return timedelta(0)
        return timedelta(seconds=max(0.0, self.deadline() - self._clock.monotonic()))

    def deadline(self) -> float:
        """When the lease ends here, on its clock's ``monotonic()`` scale (the system
        clock's is ``time.monotonic()``): ``ttl`` after the acquire or last renewal was
        sent. A lost lease keeps it, so an ``on_lost`` hook can tell how late it heard."""
        return self._sent + self._ttl_ms / 1000

    def remaining_seconds(self) -> float:
        return self.remaining().total_seconds()


#: A semaphore's permit: the same object as a lock's lease (a lock is a one-permit
#: semaphore), with its own fencing token per permit.
Permit = Lease
