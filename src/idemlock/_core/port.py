"""The store port: what every store must do, each call one atomic transition.

A store is an adapter with a sync class (:class:`SyncStore`) and an async class
(:class:`AsyncStore`) of the same methods. The coordinator and the flows decide
what to ask and what a reply means; the store only performs the transition in one
round trip (a Lua script, one SQL statement, one SQLite transaction, one critical
section) and reports what happened.

Conventions every store follows:

* ``ns`` is an opaque namespace string built by :func:`idemlock._core.keys.namespace`;
  ``key`` is a validated user key. A store must keep (ns, key) pairs apart exactly:
  no two distinct pairs may share a record.
* Times are integer milliseconds since the epoch **on the store's clock**
  (Redis ``TIME``, PostgreSQL ``clock_timestamp()``, the machine's wall clock for
  memory and SQLite). Replies carry both the absolute ``expires_ms`` and the
  remaining ``ttl_ms`` so a client never compares its clock with the store's.
* Fences and lock tokens are positive integers that strictly increase per (ns, key)
  for the life of the store: the counter outlives records (abandon, expiry, forget,
  release never lower it). A store may use one counter for everything.
* Transitions that free a key (complete, abandon, forget, release) notify the key's
  :class:`Channel` so waiters wake up; notification is a hint, waiters re-check.
* Driver errors become :class:`~idemlock.StoreUnavailable` (cause chained); data
  the store did not write becomes :class:`~idemlock.StoreCorrupt`.

Claim transitions (``claim``)::

    absent, or expired (in-flight lease over / completed ttl over)
        -> in_flight(token, fence = next)                       => Granted
    in_flight with the same token (a retried request)            => Granted (same fence)
    in_flight, lease running, same fp                            => Busy
    completed, same fp                                           => Done(result)
    live record (in flight or completed), different fp           => Mismatch

``fp`` is compared exactly (``None`` equals only ``None``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal, NamedTuple, Protocol, runtime_checkable

__all__ = [
    "Acquired",
    "AsyncStore",
    "AsyncSubscription",
    "Busy",
    "Capabilities",
    "Channel",
    "ClaimReply",
    "Done",
    "Granted",
    "Held",
    "LockRow",
    "Mismatch",
    "RecordRow",
    "SyncStore",
    "StepRow",
    "SyncSubscription",
]


# ---- claim replies -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepRow:
    """One recorded step of a claim key: its name, the fence of the attempt that
    wrote it, and its result bytes, or None for a "started" marker (``once=True``)."""

    name: str
    fence: int
    result: bytes | None


@dataclass(frozen=True, slots=True)
class Granted:
    """The caller now holds the claim (``token``) with fencing token ``fence``;
    ``steps``: the key's recorded steps (stores declaring ``steps``), so a retry
    resumes after them with no extra round trip."""

    token: str
    fence: int
    expires_ms: int
    ttl_ms: int
    steps: tuple[StepRow, ...] = ()


@dataclass(frozen=True, slots=True)
class Busy:
    """Another attempt holds an unexpired claim."""

    expires_ms: int
    ttl_ms: int


@dataclass(frozen=True, slots=True)
class Done:
    """The key is completed; ``result`` is the stored result bytes."""

    result: bytes
    expires_ms: int


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The key is live with another fingerprint."""

    state: Literal["in_flight", "completed"]


ClaimReply = Granted | Busy | Done | Mismatch


# ---- lock replies --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Acquired:
    """The caller holds the lock (or already held it: same owner, same token)."""

    token: int
    expires_ms: int
    ttl_ms: int


@dataclass(frozen=True, slots=True)
class Held:
    """Someone else holds the lock for ``ttl_ms`` more."""

    expires_ms: int
    ttl_ms: int


# ---- listings ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RecordRow:
    """One listed record. ``state`` is "corrupt" for a value under the prefix that
    the store cannot read (foreign or damaged data): listings show it, with a warning
    logged by the store, instead of failing for every other record."""

    ns: str
    key: str
    state: Literal["in_flight", "completed", "corrupt"]
    fence: int
    expires_ms: int


@dataclass(frozen=True, slots=True)
class LockRow:
    """One listed holder of a lock or permit; ``corrupt`` marks a value the store
    cannot read (owner "", token 0), listed rather than failing the whole listing.
    ``value`` is what the holder published (an election's leader), or None."""

    ns: str
    key: str
    owner: str
    token: int
    expires_ms: int
    corrupt: bool = False
    value: bytes | None = None


class Channel(NamedTuple):
    """What a waiter waits on: the freeing of one claim key or one lock key; or, for
    an election's observer (``"leader"``), every change of one lock key: whatever
    wakes its waiters, and also a grant or renew that publishes a value (a term
    began or its value changed), which the key's waiters are not woken for."""

    kind: Literal["claim", "lock", "leader"]
    ns: str
    key: str


# ---- subscriptions -------------------------------------------------------------


@runtime_checkable
class SyncSubscription(Protocol):
    def wait(self, timeout: float) -> bool:
        """Block until the channel is notified (True) or ``timeout`` seconds pass (False).
        A notification sent after ``subscribe`` returned and before ``wait`` is not lost."""

    def close(self) -> None: ...


@runtime_checkable
class AsyncSubscription(Protocol):
    async def wait(self, timeout: float) -> bool: ...

    async def aclose(self) -> None: ...


# ---- what a store can do beyond the port ---------------------------------------


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a store does beyond the methods every store has, declared by each store
    class as its ``capabilities`` attribute and read (never probed) by the coordinator,
    its ports and the contract suite. Every store issues fencing tokens (the port
    requires it), so that is not a capability."""

    #: a release with a waiter keeps the free lock reserved for the oldest waiter for a
    #: short window (state ``reserved``, rows ``lock.handoff`` and ``lock.handoff.take``)
    handoff: bool = False
    #: ``renew_many(items)``: renew many claims and leases in one round trip (the
    #: coordinator's renewer batches its heartbeats through it)
    renew_many: bool = False
    #: ``complete_with(...)``: complete a claim and SET keys of the store in the same
    #: atomic step (``complete(writes=...)``)
    complete_with: bool = False
    #: ``fence_set(ns, resource, token, key, value)``: advance a fence and SET a key in
    #: one atomic step (``FencedResource.set_if_fresh``)
    fence_set: bool = False
    #: a release or completion wakes waiters in other processes; when False the store
    #: has a ``poll_cap`` (seconds) and waiters re-check at most that far apart
    cross_process_wakeups: bool = True
    #: steps inside a claim (rows ``step.*``): ``step(ns, key, token, name, result,
    #: lease_ms, ttl_ms)`` records a step's result (or, result None, a "started"
    #: marker), ``drop_step(ns, key, token, name, lease_ms)`` removes one, both fenced
    #: by the claim's token and renewing its lease; ``steps(ns, key)`` lists them; a
    #: grant carries them (``Granted.steps``)
    steps: bool = False

    def names(self) -> frozenset[str]:
        """The capabilities declared, by name (as the state table's capability column
        names them)."""
        return frozenset(name for name, on in asdict(self).items() if on)


# ---- the store itself ----------------------------------------------------------


class SyncStore(Protocol):
    #: short name for messages and metrics: "memory", "sqlite", "redis", "postgres"
    kind: str
    #: what it does beyond these methods (a class attribute of every store)
    capabilities: Capabilities
    #: the bound on one call, seconds
    timeout: float

    # idempotency records
    def claim(self, ns: str, key: str, fp: str | None, token: str, lease_ms: int) -> ClaimReply: ...

    def complete(self, ns: str, key: str, token: str, result: bytes, ttl_ms: int) -> bool:
        """in_flight with this token -> completed(result) for ttl_ms; else False, no change."""

    def abandon(self, ns: str, key: str, token: str) -> bool:
        """in_flight with this token -> absent (fence counter kept); else False, no change."""

    def extend(self, ns: str, key: str, token: str, lease_ms: int) -> int | None:
        """in_flight with this token, lease not over -> lease ends now + lease_ms; returns
        the new expires_ms. Else None, no change (an expired claim is never revived)."""

    def record(self, ns: str, key: str) -> RecordRow | None:
        """The live record, or None if absent or expired."""

    def forget(self, ns: str, key: str) -> bool:
        """Delete the record whatever its state (counter kept). True if a live one existed."""

    def records(self, ns_prefix: str) -> Sequence[RecordRow]:
        """Live records whose ns starts with ``ns_prefix``."""

    # locks and permits: a lock is the one-permit case (``limit=1``) of the same rows
    def acquire(
        self, ns: str, key: str, owner: str, ttl_ms: int, limit: int = 1, value: bytes | None = None
    ) -> Acquired | Held:
        """Held by the same owner -> same token, expiry reset to now + ttl_ms (a retried
        acquire; ``value`` replaces the published one when given). Else fewer live
        holders than ``limit`` (a hand-off window kept for another waiter counts as
        one) -> a new holder with the next token. Else ``Held`` until the earliest live
        holder's expiry. ``limit`` is the caller's, never stored: callers with another
        limit on the same key count the same holders."""

    def release(self, ns: str, key: str, owner: str, token: int) -> bool:
        """Held by (owner, token) -> that permit freed. Else False, no change."""

    def break_lock(self, ns: str, key: str, token: int | None = None) -> bool:
        """Free every holder (``token`` None) or only the permit with ``token``: an
        operator's forced unlock. True if something held was freed. The token counter
        stays, so the next acquire gets a higher token and the old holder's renew and
        release fail."""

    def renew(
        self, ns: str, key: str, owner: str, token: int, ttl_ms: int, value: bytes | None = None
    ) -> int | None:
        """Held by (owner, token), not expired -> expiry = now + ttl_ms (and the
        published value replaced when ``value`` is given); returns new expires_ms. Else
        None, no change (an expired lease is never revived)."""

    def lock(self, ns: str, key: str) -> LockRow | None:
        """The unexpired holder of a lock (of a key with many: the lowest token), or None."""

    def holders(self, ns: str, key: str) -> Sequence[LockRow]:
        """Every unexpired holder of a key, lowest token first."""

    def locks(self, ns_prefix: str) -> Sequence[LockRow]:
        """Unexpired holders (one row per permit) whose ns starts with ``ns_prefix``."""

    # fences
    def fence_advance(self, ns: str, resource: str, token: int) -> tuple[bool, int]:
        """Accept ``token`` if >= the highest accepted (then it becomes the highest).
        Returns (accepted, highest accepted after the call)."""

    def fence_current(self, ns: str, resource: str) -> int | None: ...

    def purge(self, dry_run: bool = False) -> int:
        """Delete expired records and locks (and counters the store may drop safely);
        return how many rows/keys were removed. Stores that expire data by
        themselves (Redis) return 0. With ``dry_run`` nothing is deleted (read-only)
        and the return is how many records and locks a purge now would remove."""

    # waiting and life cycle
    def subscribe(self, channel: Channel) -> SyncSubscription: ...

    def close(self) -> None: ...

    # Optional methods, present where ``capabilities`` declares them:
    #   renew_many(items) -> list[int | None]                   (renew_many)
    #   complete_with(ns, key, token, result, ttl_ms, writes)   (complete_with)
    #   fence_set(ns, resource, token, key, value: bytes) -> tuple[bool, int]
    #       atomically check_and_advance the fence and, if accepted, SET key=value in
    #       the store (Redis). Same reply as fence_advance.          (fence_set)
    #   step(ns, key, token, name, result: bytes | None, lease_ms, ttl_ms) -> int | None
    #   drop_step(ns, key, token, name, lease_ms) -> int | None
    #       the claim's new expiry, or None: not this attempt's claim (rows step.*)
    #   steps(ns, key) -> list[StepRow]                                   (steps)
    # and ``poll_cap: float`` where ``cross_process_wakeups`` is False.


class AsyncStore(Protocol):
    kind: str
    capabilities: Capabilities
    timeout: float

    async def claim(
        self, ns: str, key: str, fp: str | None, token: str, lease_ms: int
    ) -> ClaimReply: ...

    async def complete(self, ns: str, key: str, token: str, result: bytes, ttl_ms: int) -> bool: ...

    async def abandon(self, ns: str, key: str, token: str) -> bool: ...

    async def extend(self, ns: str, key: str, token: str, lease_ms: int) -> int | None: ...

    async def record(self, ns: str, key: str) -> RecordRow | None: ...

    async def forget(self, ns: str, key: str) -> bool: ...

    async def records(self, ns_prefix: str) -> Sequence[RecordRow]: ...

    async def acquire(
        self, ns: str, key: str, owner: str, ttl_ms: int, limit: int = 1, value: bytes | None = None
    ) -> Acquired | Held: ...

    async def release(self, ns: str, key: str, owner: str, token: int) -> bool: ...

    async def break_lock(self, ns: str, key: str, token: int | None = None) -> bool: ...

    async def renew(
        self, ns: str, key: str, owner: str, token: int, ttl_ms: int, value: bytes | None = None
    ) -> int | None: ...

    async def lock(self, ns: str, key: str) -> LockRow | None: ...

    async def holders(self, ns: str, key: str) -> Sequence[LockRow]: ...

    async def locks(self, ns_prefix: str) -> Sequence[LockRow]: ...

    async def fence_advance(self, ns: str, resource: str, token: int) -> tuple[bool, int]: ...

    async def fence_current(self, ns: str, resource: str) -> int | None: ...

    async def purge(self, dry_run: bool = False) -> int: ...

    async def subscribe(self, channel: Channel) -> AsyncSubscription: ...

    async def aclose(self) -> None: ...
