"""The port bases the sync and async faces share: validation, request building and
what a port keeps for one spec (idempotency), one lock spec or one fence resource.
The sync and async classes only add the calls."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from ._coordinator import CoordinatorBase
from ._core.clock import duration, whole_ms
from ._core.events import answered
from ._core.flows import Renewal, RenewState
from ._core.keys import validate_key
from ._core.port import Acquired, Held, LockRow
from ._core.types import ClaimToken, IdempotencySpec, Lease, LockSpec, from_ms
from ._errors import ConfigurationError, LockNotHeld
from ._events import Events, log
from ._logfields import port_fields
from ._replies import ClaimReplies
from ._sealing import Records
from ._tokens import check_token, new_token

if TYPE_CHECKING:
    from ._decorator import WrapPlan


def _report_loss(
    port: _SpecPort, on_lost: Callable[[Any], object] | None, lost: object, what: str, thing: str
) -> None:
    """A claim or lease was lost: the ``lost`` event, then ``on_lost(lost)``. The loss is
    what matters (the block still raises, an async body is still cancelled), so the
    callback's error is logged, never raised."""
    if port._coord._hooks:
        port._events.deliver("lost", "lost", 0.0)
    if on_lost is None:
        return
    try:
        on_lost(lost)
    except Exception:
        log.warning(
            "on_lost callback %r for a %s of spec %s raised; the %s is lost all the same",
            on_lost,
            what,
            port._spec_name,
            thing,
            exc_info=True,
            extra=port_fields(port, "on_lost", "error"),
        )


def _renewal_period(
    renew_every: timedelta | float | None, of_ms: int, of: Callable[[], str]
) -> float:
    """The period of a claim's heartbeat or a lock's renewal, in seconds (default: a third
    of ``of_ms``, what each renewal extends); ``of()`` names that in the error."""
    if renew_every is None:
        return of_ms / 3000
    s = duration(renew_every, "renew_every", positive=True)
    if s * 1000 >= of_ms:
        raise ConfigurationError(f"renew_every must be positive and shorter than {of()}, got {s}s")
    return s


class Heartbeat:
    """One claim kept alive by its coordinator's renewer (see ``port.run()`` and the
    decorator's ``heartbeat``)."""

    __slots__ = ("_coord", "_entry", "renewal", "state")

    def __init__(self, coord: Any, state: RenewState, renewal: Renewal, entry: Any) -> None:
        self._coord = coord
        self.state = state
        self.renewal = renewal
        self._entry = entry

    @property
    def lost(self) -> bool:
        return self.state.lost

    @property
    def reason(self) -> str:
        return self.state.reason

    def stop(self) -> bool:
        """Stop renewing; True if the claim was lost (a deadline that passed
        unnoticed counts: it is reported now)."""
        lost = self.state.end(self._coord.clock.monotonic())
        self._coord._renewer.remove(self.renewal)
        self._coord._watchdog.cancel(self._entry)
        return lost


class Attempt:
    """What ``with port.run(key, payload=...) as attempt:`` gives the block.

    ``attempt.replayed`` is True when the key had completed already: ``result`` is
    then the recorded result, the block must not do the work again, and nothing is
    recorded on exit. Otherwise this attempt holds the claim (renewed while the block
    runs): do the work, set ``attempt.result``, and leaving the block records it
    (``None`` if never set); an exception abandons the claim instead.

    ``result`` is typed ``Any``: set it to a :data:`~idemlock.JSONValue` (anything else
    raises ``ResultEncodeError`` on leaving); on a replay it is the decoded JSON."""

    __slots__ = ("key", "replayed", "result", "token")

    def __init__(self, key: str, token: ClaimToken | None, result: Any = None) -> None:
        self.key = key
        self.token = token
        self.replayed = token is None
        self.result = result

    @property
    def fence(self) -> int | None:
        """The fencing token for this attempt's writes (None on a replay)."""
        return None if self.token is None else self.token.fence

    @property
    def lost(self) -> bool:
        """True once the claim was lost while the block ran."""
        return self.token is not None and self.token.lost

    def __repr__(self) -> str:
        what = "replayed" if self.replayed else f"fence={self.fence}"
        return f"Attempt({self.key!r}, {what}, lost={self.lost})"


class _SpecPort:
    """What every port of a spec holds: its coordinator, the store, the namespace and
    its events (``_events``, which the hooks receive)."""

    _kind: str

    def __init__(self, coord: CoordinatorBase, spec_name: str) -> None:
        self._coord = coord
        self._spec_name = spec_name
        self._store = coord._store
        self._ns = coord._ns(spec_name)
        self._events = Events(coord, self._kind, spec_name)


class IdempotencyBase(_SpecPort):
    _kind = "idempotency"
    #: the key and the payload fingerprint as stored (``_records.skey``/``fp``, bound
    #: once: a call costs what a method of the port would)
    _skey: Callable[[str], str]
    _fp: Callable[[Any], str | None]

    def __init__(self, coord: CoordinatorBase, spec: IdempotencySpec) -> None:
        super().__init__(coord, spec.name)
        self.spec = spec
        self._lease_ms = whole_ms(duration(spec.lease, "lease", positive=True))
        self._ttl_ms = whole_ms(duration(spec.ttl, "ttl", positive=True))
        records = Records(
            self._ns, spec.name, coord.result_format, coord.keyring, spec.encrypt_result
        )
        self._records = records
        self._replies = ClaimReplies(coord, self._events, records)
        self._skey = records.skey
        self._fp = records.fp

    def _claim_args(
        self, key: str, payload: Any, lease: timedelta | float | None = None
    ) -> tuple[str, str, str | None, str, int]:
        lease_ms = (
            self._lease_ms if lease is None else whole_ms(duration(lease, "lease", positive=True))
        )
        return (self._ns, self._skey(key), self._fp(payload), new_token(), lease_ms)

    # ---- heartbeats -------------------------------------------------------------

    def _heartbeat_every(self, renew_every: timedelta | float | None) -> float:
        return _renewal_period(
            renew_every,
            self._lease_ms,
            lambda: f"the lease of spec {self.spec.name!r} ({self._lease_ms / 1000:g}s)",
        )

    def _heartbeat(
        self,
        token: ClaimToken,
        sent: float,
        every: float,
        max_run: float | None,
        on_lost: Callable[[ClaimToken], object] | None,
        also: Callable[[RenewState], None] | None = None,
    ) -> Heartbeat:
        """Keep ``token``'s claim alive on the coordinator's renewer until
        :meth:`Heartbeat.stop`. Its local deadline (``sent`` + lease, moved by each
        confirmed renewal) is watched by the coordinator's watchdog; on loss the
        ``lost`` event is emitted, ``token.lost`` set, ``on_lost(token)`` called (its
        error logged) and then ``also(state)`` (the async faces cancel the body)."""
        coord = self._coord
        state = RenewState(0, sent, ttl_ms=self._lease_ms, claim=token, guard=threading.Lock())
        if coord._hooks:
            state.report = partial(self._events.deliver, "renew")

        def lost() -> None:
            _report_loss(self, on_lost, token, "claim", "claim")
            if also is not None:
                also(state)

        state.notify = lost
        watchdog = coord._watchdog
        entry = watchdog.watch(state.deadline(), self._expire_callback(state))
        state.moved = lambda at: watchdog.move(entry, at)
        until = None if max_run is None else coord.clock.monotonic() + max_run
        renewal = Renewal(
            "claim",
            (self._ns, token._skey or self._skey(token.key), token.token),
            self._lease_ms,
            every,
            state,
            sent + every,
            until,
            f"max_run of {max_run}s reached" if max_run is not None else "",
        )
        coord._renewer.add(renewal)
        return Heartbeat(coord, state, renewal, entry)

    def _expire_callback(self, state: RenewState) -> Callable[[], None]:
        raise NotImplementedError

    def _token_args(self, token: ClaimToken) -> tuple[str, str, str]:
        if not isinstance(token, ClaimToken):
            raise ConfigurationError(
                f"expected the ClaimToken from Claimed.token, got {type(token).__name__}"
            )
        if token._ns != self._ns:
            raise ConfigurationError(
                f"this claim token belongs to spec {token.spec!r} (or another tenant), not "
                f"{self.spec.name!r}; complete or abandon it through the port that claimed it"
            )
        return (self._ns, token._skey or self._skey(token.key), token.token)

    def _completion(
        self, token: ClaimToken, result: Any
    ) -> tuple[Any, tuple[str, str, str, bytes, int]]:
        """(the store, the arguments of its ``complete``) for ``result`` on ``token``."""
        return self._store, (
            *self._token_args(token),
            self._records.encode(token.key, result),
            self._ttl_ms,
        )

    def _complete_with(self) -> Any:
        if not self._store.capabilities.complete_with:
            raise ConfigurationError(
                f"complete(writes=...) writes into the store itself, which the "
                f"{self._store.kind} store does not hold user data for; on PostgreSQL use "
                "idemlock.stores.postgres.fenced.complete_in_transaction with your own "
                "write, elsewhere write first with the claim's fence"
            )
        return self._store.complete_with

    def write_key(self, key: str, name: str) -> str:
        """The name to give a key that ``complete(writes=...)`` sets for ``key``'s claim:
        ``name`` behind the claim's hash tag, ``"{tag}:" + name``, so that on Redis Cluster
        it lands in the claim's slot. Standalone Redis takes the same names, so one
        program runs on both. ``ConfigurationError`` on a store whose ``complete`` takes
        no writes."""
        self._complete_with()
        validate_key(name, "write key")
        tag: str = self._store.claim_tag(self._ns, self._skey(key))
        return f"{{{tag}}}:{name}"

    @staticmethod
    def _writes(writes: Mapping[str, bytes | str]) -> list[tuple[str, bytes]]:
        out = []
        for name, value in writes.items():
            validate_key(name, "write key")
            out.append((name, value.encode("utf-8") if isinstance(value, str) else bytes(value)))
        return out

    def _wait_for(self, wait: timedelta | float | None) -> float:
        return self._lease_ms / 1000 if wait is None else duration(wait, "wait")

    def _error_record(self, plan: WrapPlan, token: ClaimToken, exc: BaseException) -> bytes | None:
        """The stored form of a listed exception, or None to abandon the claim."""
        if not plan.errors or not isinstance(exc, plan.errors):
            return None
        try:
            return self._records.encode_error(token.key, exc)
        except Exception:
            log.warning(
                "cannot record %s for a %s call (its args are not JSON data); abandoning "
                "the claim instead",
                type(exc).__name__,
                self.spec.name,
                exc_info=True,
                extra=port_fields(self, "complete", "unrecordable"),
            )
            return None


class LockBase(_SpecPort):
    _kind = "lock"

    def __init__(self, coord: CoordinatorBase, spec: LockSpec) -> None:
        super().__init__(coord, spec.name)
        self.spec = spec
        self._ttl_ms = whole_ms(duration(spec.ttl, "ttl", positive=True))

    def _owner(self, owner: str | None) -> str:
        return new_token() if owner is None else validate_key(owner, "owner")

    def _finish_acquire(
        self, key: str, owner: str, result: tuple[Acquired | Held, float, int], t0: float
    ) -> Lease | None:
        reply, sent, tries = result
        if not isinstance(reply, Acquired):
            self._events.emit("acquire", "timeout", t0)
            return None
        self._events.emit("acquire", "acquired" if tries == 1 else "waited", t0)
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
        return _renewal_period(
            renew_every, self._ttl_ms, lambda: f"the lock ttl ({self._ttl_ms / 1000}s)"
        )

    @staticmethod
    def _mark_released(lease: Lease) -> None:
        lease._released = True  # the object is spent

    def _finish_release(self, lease: Lease, ok: bool, t0: float) -> bool:
        self._mark_released(lease)
        self._events.emit("release", answered("release", ok), t0)
        return ok

    def _break_args(self, key: str, token: int | None) -> tuple[str, str, int | None]:
        return (self._ns, validate_key(key), None if token is None else check_token(token))

    @staticmethod
    def _break_guarded(row: LockRow | None, token: int) -> tuple[str, int] | None:
        """The (owner, token) to release for a break guarded by ``token``: only the
        holder that still has that token (a new holder meanwhile is left alone)."""
        if row is None or row.corrupt or row.token != token:
            return None
        return row.owner, token

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
            _report_loss(self, on_lost, lease, "lock", "lease")

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
        return (
            f"lock {self.spec.name}:{key} is held by another owner and was not released "
            f"within wait={0 if wait is None else duration(wait, 'wait') or 0}s; "
            "retry later or wait longer"
        )

    def _lost_message(self, lease: Lease, reason: str) -> str:
        return (
            f"lost the lock {self.spec.name}:{lease.key} (token {lease.token}) while the "
            f"block ran: {reason or 'lease expired'}; another holder may have acted, so "
            "check fenced writes before relying on this block's work"
        )

    def _bound(self) -> float:
        """The longest one store call may take (agreement A1: ``store.timeout``):
        leaving a ``hold()`` block never waits longer for the store than this."""
        return self._coord._call_bound()


class FenceBase:
    def __init__(self, coord: CoordinatorBase, resource: str) -> None:
        self._store = coord._store
        self.resource = validate_key(resource, "resource")
        self._ns = coord._ns("fence")

    def _fence_set(self) -> Any:
        if not self._store.capabilities.fence_set:
            raise ConfigurationError(
                f"set_if_fresh writes into the store itself, which the {self._store.kind} "
                "store does not hold user data for. check_and_advance followed by your own "
                "write is not atomic (a newer holder may write in between); for rows of "
                "your own PostgreSQL tables put the check in the write with "
                "idemlock.stores.postgres.fenced.fenced_update or fenced_upsert (check and "
                "write in one statement, on the table's fence column), or keep the value "
                "in the Redis store, whose set_if_fresh is atomic"
            )
        return self._store.fence_set
