"""The lock port's logic, shared by its two faces (:class:`idemlock.aio.AsyncLockPort`
and the generated :class:`idemlock.LockPort`): validation, leases, their renewal and
the steps of ``hold()``. The faces only add the calls; :mod:`idemlock._tasks` and
:mod:`idemlock._threads` what differs between a task and a thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from .._core.clock import duration, whole_ms
from .._core.events import answered
from .._core.flows import Renewal, RenewState
from .._core.keys import validate_key
from .._core.port import Acquired, Held, LockRow
from .._core.types import (
    MAX_VALUE_BYTES,
    ElectionSpec,
    Leader,
    Lease,
    LockInfo,
    LockSpec,
    SemaphoreSpec,
    from_ms,
)
from .._errors import ConfigurationError, LockNotAcquired, LockNotHeld
from .._logfields import port_fields
from .._tokens import check_token, new_token
from .events import Events, Waits, log, report_loss

if TYPE_CHECKING:
    from .coordinator import CoordinatorBase

#: an election's observer re-reads the leader at least this often (seconds), notified
#: or not: a notification only brings the read forward
OBSERVE_REREAD = 1.0


class LockBase:
    """What a lock port holds for one lock spec, and the steps its calls share."""

    _kind = "lock"

    def __init__(
        self, coord: CoordinatorBase, spec: LockSpec | SemaphoreSpec | ElectionSpec
    ) -> None:
        #: holders one key may have: 1 for a lock (the one-permit case of the same rows)
        self._limit = spec.limit if isinstance(spec, SemaphoreSpec) else 1
        if isinstance(spec, SemaphoreSpec):
            self._kind = "semaphore"
        elif isinstance(spec, ElectionSpec):
            self._kind = "election"
        self._coord = coord
        self._spec_name = spec.name
        self._store = coord._store
        self._ns = coord._ns(spec.name)
        self._events = Events(coord, self._kind, spec.name)
        self.spec = spec
        self._ttl_ms = whole_ms(duration(spec.ttl, "ttl", positive=True))

    def _waits(self) -> Waits | None:
        """What reports a semaphore's or an election's acquire waiting (the ``wait``
        events the permits-waiting gauge counts); None for a lock, whose events stay
        as they were, and when nobody listens."""
        return None if self._kind == "lock" else self._events.waits()

    def _owner(self, owner: str | None) -> str:
        return new_token() if owner is None else validate_key(owner, "owner")

    def _finish_acquire(
        self, key: str, owner: str, result: tuple[Acquired | Held, float, int], t0: float
    ) -> Lease | None:
        reply, sent, tries = result
        if not isinstance(reply, Acquired):
            self._events.emit("acquire", "timeout", t0)
            return None
        self._events.emit("acquire", "acquired" if tries == 1 else "waited", t0, reply.token)
        return self._lease(key, owner, reply, sent, self._ttl_ms)

    def _lease(self, key: str, owner: str, reply: Acquired, sent: float, ttl_ms: int) -> Lease:
        return Lease(
            key=key,
            owner=owner,
            token=reply.token,
            expires_at=from_ms(reply.expires_ms),
            spec=self.spec.name,
            _ns=self._ns,
            _ttl_ms=ttl_ms,
            _sent=sent,
            _clock=self._coord.clock,
        )

    def _check_lease(self, lease: Lease, what: str) -> tuple[str, str, str, int]:
        self._check_lease_object(lease)
        if lease._released:
            raise LockNotHeld(
                f"cannot {what} the lease on {lease.key!r}: it was already released; "
                "acquire the lock again"
            )
        return (self._ns, lease.key, lease.owner, lease.token)

    def _check_lease_object(self, lease: Lease) -> None:
        if not isinstance(lease, Lease):
            raise ConfigurationError(f"expected a Lease from acquire(), got {type(lease).__name__}")
        if lease._ns != self._ns:
            raise ConfigurationError(
                f"this lease belongs to lock spec {lease.spec!r}, not {self.spec.name!r}"
            )

    def _release_args(self, lease: Lease) -> tuple[str, str, str, int] | None:
        """The store arguments of a release, or None for a lease released already: a
        second release answers False ("not held"), so a release in ``finally`` never
        masks the body's own error."""
        self._check_lease_object(lease)
        if lease._released:
            return None
        return (self._ns, lease.key, lease.owner, lease.token)

    def _renew_ttl(self, ttl: timedelta | float | None) -> int:
        return self._ttl_ms if ttl is None else whole_ms(duration(ttl, "ttl", positive=True))

    def _renew_every(self, renew_every: timedelta | float | None) -> float:
        return self._coord._renewal_period(
            renew_every, self._ttl_ms, lambda: f"the lock ttl ({self._ttl_ms / 1000}s)"
        )

    @staticmethod
    def _mark_released(lease: Lease) -> None:
        lease._released = True  # the object is spent

    def _finish_release(self, lease: Lease, ok: bool, t0: float) -> bool:
        self._mark_released(lease)
        self._events.emit("release", answered("release", ok), t0, lease.token)
        return ok

    def _break_args(self, key: str, token: int | None) -> tuple[str, str, int | None]:
        return (self._ns, validate_key(key), None if token is None else check_token(token))

    def _holders(self, rows: Sequence[LockRow]) -> list[LockInfo]:
        return [self._coord._lock_info(r) for r in rows]

    @staticmethod
    def _value(value: str | None) -> bytes | None:
        """A value to publish with a lease, as the store keeps it (UTF-8)."""
        if value is None:
            return None
        if not isinstance(value, str):
            raise ConfigurationError(
                f"a published value must be a str (an address, a host name), got "
                f"{type(value).__name__}"
            )
        data = value.encode("utf-8")
        if len(data) > MAX_VALUE_BYTES:
            raise ConfigurationError(
                f"a published value may have at most {MAX_VALUE_BYTES} bytes (UTF-8), got "
                f"{len(data)}; publish a pointer (a URL, an id) instead"
            )
        return data

    def _observe_every(self) -> float:
        """How long an observer waits for a notification before it re-reads: a
        quarter of the ttl (a lapsed term is seen soon), at most ``OBSERVE_REREAD``,
        and at most the store's poll cap where it cannot wake other processes."""
        every = min(OBSERVE_REREAD, max(0.05, self._ttl_ms / 4000))
        cap = self._coord.poll_cap
        return every if cap is None else min(every, cap)

    @staticmethod
    def _leader(row: LockRow | None) -> Leader | None:
        if row is None or row.corrupt:
            return None
        value = None if row.value is None else row.value.decode("utf-8", "replace")
        return Leader(value, row.token, row.owner, from_ms(row.expires_ms))

    def _finish_break(self, ok: bool, t0: float) -> bool:
        self._events.emit("break", answered("break", ok), t0)
        return ok

    def _renew_state(self, lease: Lease, on_lost: Callable[[Lease], object] | None) -> RenewState:
        """The state shared by the renew loop, the watchdog and the block; its
        ``notify`` reports a loss: the ``lost`` event, then ``on_lost``."""
        state = RenewState(
            0, lease._sent, ttl_ms=lease._ttl_ms, lease=lease, guard=threading.Lock()
        )
        if self._coord._hooks:
            state.report = partial(self._events.deliver, "renew")

        def lost() -> None:
            lease.lost = True
            report_loss(self._events, on_lost, lease, "lock", "lease", lease.token)

        state.notify = lost
        return state

    def _renewal(
        self, lease: Lease, every: float, max_hold: float | None, state: RenewState
    ) -> Renewal:
        """What the coordinator's renewer keeps alive for a ``hold()`` block."""
        until = None if max_hold is None else self._coord.clock.monotonic() + max_hold
        return Renewal(
            "lock",
            (self._ns, lease.key, lease.owner, lease.token),
            lease._ttl_ms,
            every,
            state,
            lease._sent + every,
            until,
            f"max_hold of {max_hold}s reached" if max_hold is not None else "",
        )

    def _finish_renew(
        self, lease: Lease, sent: float, ttl_ms: int, new_exp: int | None, t0: float = 0.0
    ) -> bool:
        self._events.emit("renew", answered("renew", new_exp is not None), t0)
        if new_exp is None:
            lease.lost = True
            return False
        lease._sent, lease._ttl_ms, lease.expires_at = sent, ttl_ms, from_ms(new_exp)
        return True

    @staticmethod
    def _row_owner(row: LockRow | None) -> str | None:
        return None if row is None else row.owner

    def _row_ttl(self, row: LockRow | None) -> timedelta | None:
        if row is None:
            return None
        left = row.expires_ms / 1000 - self._coord.clock.time()
        return timedelta(seconds=max(0.0, left))

    def _not_acquired(self, key: str, wait: timedelta | float | None) -> str:
        waited = f"within wait={0 if wait is None else duration(wait, 'wait') or 0}s"
        if self._kind == "election":
            return (
                f"election {self.spec.name}:{key} kept its leader {waited}; campaign "
                "with a longer wait (None: until elected)"
            )
        if self._limit > 1:
            return (
                f"all {self._limit} permits of semaphore {self.spec.name}:{key} are held "
                f"and none was released {waited}; retry later, wait longer or raise the "
                "limit"
            )
        return (
            f"lock {self.spec.name}:{key} is held by another owner and was not released "
            f"{waited}; retry later or wait longer"
        )

    def _lost_message(self, lease: Lease, reason: str) -> str:
        what = {"election": "the term of election", "semaphore": "a permit of semaphore"}.get(
            self._kind, "the lock"
        )
        return (
            f"lost {what} {self.spec.name}:{lease.key} (token {lease.token}) while the "
            f"block ran: {reason or 'lease expired'}; another holder may have acted, so "
            "check fenced writes before relying on this block's work"
        )

    def _bound(self) -> float:
        """The longest one store call may take (agreement A1: ``store.timeout``):
        leaving a ``hold()`` block never waits longer for the store than this."""
        return self._coord._call_bound()

    # ---- the steps of hold() ---------------------------------------------------

    def _hold_options(
        self, renew_every: timedelta | float | None, max_hold: timedelta | float | None
    ) -> tuple[float, float | None]:
        limit = None if max_hold is None else duration(max_hold, "max_hold")
        return self._renew_every(renew_every), limit

    def _held(
        self,
        key: str,
        lease: Lease | None,
        wait: timedelta | float | None,
        on_lost: Callable[[Lease], object] | None,
    ) -> tuple[Lease, RenewState]:
        """The lease taken and its renewal state; ``LockNotAcquired`` if none was."""
        if lease is None:
            raise LockNotAcquired(self._not_acquired(key, wait))
        return lease, self._renew_state(lease, on_lost)

    def _start_renewing(
        self,
        state: RenewState,
        every: float,
        max_hold_s: float | None,
        expire: Callable[[], None],
    ) -> tuple[Any, Renewal]:
        """Watch the lease's local deadline (``expire`` runs when it passes) and have
        the coordinator's one renewer renew it, with every claim and lease it keeps."""
        assert state.lease is not None
        watchdog = self._coord._watchdog
        entry = watchdog.watch(state.deadline(), expire)
        state.moved = lambda at: watchdog.move(entry, at)
        renewal = self._renewal(state.lease, every, max_hold_s, state)
        self._coord._renewer.add(renewal)
        return entry, renewal

    def _stop_renewing(self, state: RenewState, entry: Any, renewal: Renewal) -> tuple[bool, Lease]:
        """End the renewal of a hold: (whether the lease was lost, the lease)."""
        lost = state.end(self._coord.clock.monotonic())
        self._coord._watchdog.cancel(entry)
        self._coord._renewer.remove(renewal)
        assert state.lease is not None
        return lost, state.lease

    def _unreleased(self, bound: float, then: str) -> None:
        """Log leaving a hold whose release the store did not answer within ``bound``."""
        log.warning(
            "leaving hold() of a lock of spec %s without its release: the store did not "
            "answer within %gs (its timeout); %s",
            self.spec.name,
            bound,
            then,
            extra=port_fields(self, "release", "timeout"),
        )

    def _release_failed(self) -> None:
        """Log a release that failed (called in an ``except`` block)."""
        log.warning(
            "could not release a lock of spec %s; it frees itself when its lease ends",
            self.spec.name,
            exc_info=True,
            extra=port_fields(self, "release", "error"),
        )
