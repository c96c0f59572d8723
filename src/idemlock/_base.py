"""What the sync and async coordinators share: validation, request building and the
meaning of store replies. The sync and async classes only add the calls."""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import secrets
import typing
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar, Token
from datetime import datetime, timedelta, timezone
from time import perf_counter
from typing import Any

from ._core.canonical import canonicalize, fingerprint
from ._core.clock import Clock, duration
from ._core.codec import (
    COMPRESS_OVER,
    MAX_RESULT_BYTES,
    RecordedError,
    ResultFormat,
    type_name,
)
from ._core.events import Event, Hook
from ._core.flows import Renewal, RenewState
from ._core.keys import namespace, split_namespace, validate_key
from ._core.port import (
    Acquired,
    Busy,
    ClaimReply,
    Done,
    Granted,
    Held,
    LockRow,
    Mismatch,
    RecordRow,
)
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
    from_ms,
    to_ms,
)
from ._errors import (
    ConfigurationError,
    InFlightError,
    LockNotHeld,
    PayloadMismatch,
)
from ._keyring import Keyring

IN_FLIGHT_MODES = ("raise", "wait")
#: the bound on one store call when a store does not say (agreement A1's default)
DEFAULT_CALL_BOUND = 5.0
log = logging.getLogger("idemlock")

_CURRENT_CLAIM: ContextVar[ClaimToken | None] = ContextVar("idemlock_claim", default=None)


def current_claim() -> ClaimToken | None:
    """The claim of the ``@idempotent`` call running in this context (thread or task),
    or None. Its ``fence`` is the fencing token for the call's writes."""
    return _CURRENT_CLAIM.get()


def enter_claim(token: ClaimToken) -> Token[ClaimToken | None]:
    return _CURRENT_CLAIM.set(token)


def leave_claim(mark: Token[ClaimToken | None]) -> None:
    _CURRENT_CLAIM.reset(mark)


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
    (``None`` if never set); an exception abandons the claim instead."""

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


class _Tokens:
    """Unique, unguessable attempt tokens, cheaply: 64 random bits per process (drawn
    again after fork) and a counter."""

    def __init__(self) -> None:
        self.reseed()

    def reseed(self) -> None:
        self.prefix = secrets.token_hex(8)
        self.counter = itertools.count(1)

    def __call__(self) -> str:
        return f"{self.prefix}{next(self.counter):x}"


new_token = _Tokens()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=new_token.reseed)


def seconds(value: timedelta | float | None, what: str) -> float | None:
    """A wait, timeout or interval given by the caller, in seconds (None stays None).
    The one duration check (NaN, infinity, negative and above ``MAX_TTL`` refused)."""
    if value is None:
        return None
    return duration(value, what)


class CoordinatorBase:
    """Holds the store, the key prefix, the tenant, the clock, the result format and
    the keyring."""

    def __init__(
        self,
        store: Any,
        *,
        key_prefix: str = "idemlock",
        clock: Clock | None = None,
        url: str | None = None,
        keyring: Keyring | None = None,
        tenant: str | None = None,
        max_result_bytes: int = MAX_RESULT_BYTES,
        compress_over: int | None = COMPRESS_OVER,
        hooks: Iterable[Hook] | None = None,
    ) -> None:
        from ._core.clock import SYSTEM_CLOCK

        self._store = store
        self.key_prefix = validate_key(key_prefix, "key_prefix")
        self.tenant = None if tenant is None else validate_key(tenant, "tenant")
        self.clock: Clock = clock or getattr(store, "clock", None) or SYSTEM_CLOCK
        self.url = url
        if keyring is not None and type(keyring).__name__ != "Keyring":
            raise ConfigurationError(f"keyring must be an idemlock.Keyring, got {keyring!r}")
        self.keyring = keyring
        self.result_format = ResultFormat(max_result_bytes, compress_over)
        #: longest wait between re-checks where notifications do not cross processes
        self.poll_cap: float | None = getattr(store, "poll_cap", None)
        #: a tenant view shares its parent's store and must not close it
        self._owns_store = True
        #: event hooks; shared with tenant views and ports, so add_hook applies to all
        self._hooks: list[Hook] = list(hooks or ())
        #: the one timer for every local deadline this coordinator (and its tenant
        #: views) holds: a lease in hold() is lost when it passes
        self._watchdog: Any = self._make_watchdog(self.clock)
        #: the one renewer (heartbeats) for every claim this coordinator keeps alive
        self._renewer: Any = self._make_renewer(store, self.clock)

    def _make_watchdog(self, clock: Clock) -> Any:
        raise NotImplementedError

    def _make_renewer(self, store: Any, clock: Clock) -> Any:
        raise NotImplementedError

    def add_hook(self, hook: Hook) -> None:
        """Call ``hook(event)`` for every outcome (see :class:`idemlock.Event`)."""
        if not callable(hook):
            raise ConfigurationError(f"a hook must be callable, got {hook!r}")
        self._hooks.append(hook)

    def _view_of(self, parent: CoordinatorBase, tenant: str) -> None:
        self.__dict__.update(parent.__dict__)
        self.tenant = validate_key(tenant, "tenant")
        self._owns_store = False

    def _call_bound(self) -> float:
        store = self._store
        bound = getattr(store, "timeout", None)
        if bound is None:
            # Generic async faces keep the sync store they call.
            bound = getattr(getattr(store, "sync", None), "timeout", None)
        return DEFAULT_CALL_BOUND if bound is None else float(bound)

    @property
    def store(self) -> Any:
        """The store adapter (for store-specific extras)."""
        return self._store

    def _ns(self, name: str) -> str:
        return namespace(self.key_prefix, name, self.tenant)

    def _ns_prefix(self) -> str:
        return namespace(self.key_prefix, "x", self.tenant)[:-1]

    def _idem_spec(self, spec: IdempotencySpec | str) -> IdempotencySpec:
        if isinstance(spec, str):
            return IdempotencySpec(spec)
        if not isinstance(spec, IdempotencySpec):
            raise ConfigurationError(
                f"expected an IdempotencySpec or a spec name, got {type(spec).__name__}"
            )
        if spec.encrypt_result and self.keyring is None:
            raise ConfigurationError(
                f"spec {spec.name!r} has encrypt_result=True but this coordinator has no "
                "keyring to seal results with; pass keyring=idemlock.Keyring.from_env() (or "
                "another Keyring) to connect(), or set encrypt_result=False"
            )
        return spec

    def _lock_spec(self, spec: LockSpec | str) -> LockSpec:
        if isinstance(spec, str):
            spec = LockSpec(spec)
        if not isinstance(spec, LockSpec):
            raise ConfigurationError(
                f"expected a LockSpec or a spec name, got {type(spec).__name__}"
            )
        if spec.requires_fencing_token and not getattr(self._store, "issues_fence_tokens", False):
            raise ConfigurationError(
                f"lock spec {spec.name!r} requires fencing tokens, but the "
                f"{self._store.kind} store cannot issue them; use another store"
            )
        return spec

    def _listing_place(self, ns: str) -> tuple[str, str | None]:
        """(spec name, tenant or None) of a listed namespace. The root's listing covers
        its tenants' namespaces too (``prefix:t=<tenant>:<spec>``), so each row says
        whose it is and can be acted on through ``for_tenant``."""
        parts = split_namespace(ns)
        if not parts:
            return ns, None
        tenant = None
        # namespace() escapes ':' in every part, so a tenant's namespace has 3 parts.
        if len(parts) == 3 and ns.split(":")[1].startswith("t="):
            tenant = parts[1][2:]
        return parts[-1], tenant

    def _lock_info(self, row: LockRow) -> LockInfo:
        spec, tenant = self._listing_place(row.ns)
        return LockInfo(
            spec,
            row.key,
            row.owner,
            row.token,
            _listed_time(row.expires_ms),
            tenant,
            bool(getattr(row, "corrupt", False)),
        )

    def _record_status(self, row: RecordRow) -> RecordStatus:
        spec, tenant = self._listing_place(row.ns)
        return RecordStatus(
            row.key, row.state, row.fence, _listed_time(row.expires_ms), spec, tenant
        )


def _listed_time(ms: int) -> datetime:
    # A corrupt row may carry any number: list it rather than fail on its date.
    try:
        return from_ms(int(ms))
    except (OverflowError, ValueError, OSError, TypeError):
        return datetime.max.replace(tzinfo=timezone.utc)


class Emitter:
    """Builds and delivers events; costs one truthiness check when nobody listens."""

    _coord: CoordinatorBase
    _kind: str
    _spec_name: str

    def _t0(self) -> float:
        return perf_counter() if self._coord._hooks else 0.0

    def _emit(self, name: str, outcome: str, t0: float) -> None:
        if self._coord._hooks:
            self._deliver(name, outcome, perf_counter() - t0)

    def _failed(self, name: str, exc: BaseException, t0: float) -> None:
        """A store call raised (the store down, a timeout): outcome "error", so an
        outage shows in the metrics instead of silence."""
        if self._coord._hooks:
            self._deliver(name, "error", perf_counter() - t0, type(exc).__name__)

    def _deliver(self, name: str, outcome: str, duration: float, error: str | None = None) -> None:
        hooks = self._coord._hooks
        event = Event(
            name,
            outcome,
            self._kind,
            self._spec_name,
            self._coord._store.kind,
            duration,
            self._coord.tenant,
            error,
        )
        for hook in hooks:
            try:
                hook(event)
            except Exception:
                # A broken metrics hook must never break the operation it observes.
                log.warning("event hook %r failed", hook, exc_info=True)


_CLAIM_OUTCOME = {"claimed": "claimed", "in_flight": "in_flight", "completed": "replayed"}


class IdempotencyBase(Emitter):
    _kind = "idempotency"

    def __init__(self, coord: CoordinatorBase, spec: IdempotencySpec) -> None:
        self._coord = coord
        self._spec_name = spec.name
        self._store = coord._store
        self.spec = spec
        self._ns = coord._ns(spec.name)
        self._lease_ms = to_ms(spec.lease, "lease")
        self._ttl_ms = to_ms(spec.ttl, "ttl")
        self._format = coord.result_format
        self._keyring = coord.keyring
        self._seal = spec.encrypt_result

    # ---- keys as the store sees them ------------------------------------------------

    def _skey(self, key: str) -> str:
        """The key as stored: the key itself, or its HMAC when a keyring is set (the
        store then never sees callers' keys)."""
        validate_key(key)
        if self._keyring is None:
            return key
        return self._keyring.lookup("key", self._ns.encode() + b"\0" + key.encode())

    def _fp(self, payload: Any) -> str | None:
        if payload is None:
            return None
        if self._keyring is None:
            return fingerprint(payload)
        # An HMAC, not a bare hash: guessable payloads cannot be brute-forced from it.
        return self._keyring.lookup("fp", canonicalize(payload))

    def _claim_args(
        self, key: str, payload: Any, lease: timedelta | float | None = None
    ) -> tuple[str, str, str | None, str, int]:
        lease_ms = self._lease_ms if lease is None else to_ms(lease, "lease")
        return (self._ns, self._skey(key), self._fp(payload), new_token(), lease_ms)

    def _ad(self, key: str) -> bytes:
        # Associated data: the record only opens under this prefix, tenant, spec and key.
        return b"idemlock/1\0" + self._ns.encode() + b"\0" + key.encode()

    # ---- results ---------------------------------------------------------------------

    def _encode(self, key: str, value: Any, dump: Any = None, load: Any = None) -> bytes:
        if dump is None:
            framed = self._format.encode(value)
        else:
            framed = self._format.encode(value, dump, load)
        return self._sealed(key, framed)

    def _encode_error(self, key: str, exc: BaseException) -> bytes:
        return self._sealed(key, self._format.encode_error(exc))

    def _sealed(self, key: str, framed: bytes) -> bytes:
        if not self._seal:
            return framed
        assert self._keyring is not None
        return self._keyring.seal(framed, self._ad(key))

    def _decode(self, key: str, data: bytes, load: Any = None) -> tuple[Any, RecordedError | None]:
        if self._seal:
            assert self._keyring is not None
            data = self._keyring.open(bytes(data), self._ad(key))
        elif data[:1] == b"s":
            from ._errors import SealError

            raise SealError(
                f"the stored result of {key!r} is sealed but spec {self.spec.name!r} does not "
                "use encrypt_result; set encrypt_result=True with the keyring that sealed it"
            )
        if load is None:
            return self._format.decode(data)
        return self._format.decode(data, load)

    def _interpret(
        self, key: str, reply: ClaimReply, load: Any = None, t0: float = 0.0, skey: str = ""
    ) -> Claim:
        if self._coord._hooks:
            try:
                claim = self._interpret_reply(key, reply, load, skey)
            except PayloadMismatch:
                self._emit("claim", "mismatch", t0)
                raise
            self._emit("claim", _CLAIM_OUTCOME[claim.kind], t0)
            return claim
        return self._interpret_reply(key, reply, load, skey)

    def _interpret_reply(self, key: str, reply: ClaimReply, load: Any, skey: str) -> Claim:
        if isinstance(reply, Granted):
            return Claimed(
                ClaimToken(
                    key,
                    reply.token,
                    reply.fence,
                    from_ms(reply.expires_ms),
                    self.spec.name,
                    self._ns,
                    skey or self._skey(key),
                )
            )
        if isinstance(reply, Busy):
            return InFlight(from_ms(reply.expires_ms))
        if isinstance(reply, Done):
            result, error = self._decode(key, reply.result, load)
            return Completed(result, from_ms(reply.expires_ms), error)
        if isinstance(reply, Mismatch):
            raise PayloadMismatch(key)
        raise TypeError(f"unexpected store reply {reply!r}")  # pragma: no cover

    # ---- heartbeats -------------------------------------------------------------

    def _heartbeat_every(self, renew_every: timedelta | float | None) -> float:
        s = seconds(renew_every, "renew_every")
        if s is None:
            return self._lease_ms / 3000
        if s <= 0 or s * 1000 >= self._lease_ms:
            raise ConfigurationError(
                f"renew_every must be positive and shorter than the lease of spec "
                f"{self.spec.name!r} ({self._lease_ms / 1000:g}s), got {s}s"
            )
        return s

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
        state = RenewState(0, sent, ttl_ms=self._lease_ms, claim=token)
        if coord._hooks:
            state.report = lambda outcome, took, error: self._deliver("renew", outcome, took, error)

        def lost() -> None:
            if coord._hooks:
                self._deliver("lost", "lost", 0.0)
            if on_lost is not None:
                try:
                    on_lost(token)
                except Exception:
                    log.warning(
                        "on_lost callback %r for claim %s:%s raised; the claim is lost all "
                        "the same",
                        on_lost,
                        self.spec.name,
                        token.key,
                        exc_info=True,
                    )
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

    def _lost_claim(self, token: ClaimToken, reason: str) -> Exception:
        from ._errors import ClaimLost

        return ClaimLost(
            f"lost the claim on key {token.key!r} (fence {token.fence}) of spec "
            f"{self.spec.name!r} while its work ran: {reason or 'its lease ran out'}; "
            "another attempt took the key over, so nothing was recorded and a retry "
            "runs again with a higher fence (check fenced writes before relying on this "
            "attempt's work)"
        )

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

    def _done(self, token: ClaimToken, ok: bool, what: str, t0: float) -> None:
        """Report a complete/abandon; raise StaleClaim if the store refused it."""
        self._emit(what, "ok" if ok else "stale", t0)
        if not ok:
            raise self._stale(token, what)

    def _extended(self, token: ClaimToken, new_exp: int | None) -> ClaimToken:
        if new_exp is None:
            raise self._stale(token, "extend")
        return ClaimToken(
            token.key,
            token.token,
            token.fence,
            from_ms(new_exp),
            token.spec,
            token._ns,
            token._skey,
        )

    def _complete_with(self) -> Any:
        fn = getattr(self._store, "complete_with", None)
        if fn is None:
            raise ConfigurationError(
                f"complete(writes=...) writes into the store itself, which the "
                f"{self._store.kind} store does not hold user data for; on PostgreSQL use "
                "complete_in_transaction with your own write, elsewhere write first with "
                "the claim's fence"
            )
        return fn

    @staticmethod
    def _writes(writes: Mapping[str, bytes | str]) -> list[tuple[str, bytes]]:
        out = []
        for name, value in writes.items():
            validate_key(name, "write key")
            out.append((name, value.encode("utf-8") if isinstance(value, str) else bytes(value)))
        return out

    def _stale(self, token: ClaimToken, what: str) -> Exception:
        from ._errors import StaleClaim

        return StaleClaim(
            f"cannot {what} key {token.key!r} (fence {token.fence}): this claim no longer "
            "holds the key (its lease ran out and another attempt took over, it was "
            "completed or abandoned already, or the record was forgotten); nothing changed"
        )

    def _status(self, key: str, row: RecordRow | None) -> RecordStatus | None:
        if row is None:
            return None
        status = self._coord._record_status(row)
        return RecordStatus(
            key, status.state, status.fence, status.expires_at, status.spec, status.tenant
        )

    def _wait_for(self, wait: timedelta | float | None) -> float:
        s = seconds(wait, "wait")
        return self._lease_ms / 1000 if s is None else s

    def _error_record(self, plan: WrapPlan, token: ClaimToken, exc: BaseException) -> bytes | None:
        """The stored form of a listed exception, or None to abandon the claim."""
        if not plan.errors or not isinstance(exc, plan.errors):
            return None
        try:
            return self._encode_error(token.key, exc)
        except Exception:
            log.warning(
                "cannot record %s for %r (its args are not JSON data); abandoning the "
                "claim instead",
                type(exc).__name__,
                token.key,
                exc_info=True,
            )
            return None

    def _replay_or_raise(
        self, key: str, reply: ClaimReply, load: Any = None, t0: float = 0.0, skey: str = ""
    ) -> Claim:
        claim = self._interpret(key, reply, load, t0, skey)
        if isinstance(claim, InFlight):
            raise InFlightError(key, claim.expires_at)
        return claim


class LockBase(Emitter):
    _kind = "lock"

    def __init__(self, coord: CoordinatorBase, spec: LockSpec) -> None:
        self._coord = coord
        self._spec_name = spec.name
        self._store = coord._store
        self.spec = spec
        self._ns = coord._ns(spec.name)
        self._ttl_ms = to_ms(spec.ttl, "ttl")

    def _owner(self, owner: str | None) -> str:
        return new_token() if owner is None else validate_key(owner, "owner")

    def _acquired(
        self, key: str, owner: str, result: tuple[Acquired | Held, float, int], t0: float
    ) -> Lease | None:
        reply, sent, tries = result
        if not isinstance(reply, Acquired):
            self._emit("acquire", "timeout", t0)
            return None
        self._emit("acquire", "acquired" if tries == 1 else "waited", t0)
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
        assert lease.token is not None
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
        assert lease.token is not None
        return (self._ns, lease.key, lease.owner, lease.token)

    def _renew_ttl(self, ttl: timedelta | float | None) -> int:
        return self._ttl_ms if ttl is None else to_ms(ttl, "ttl")

    def _renew_every(self, renew_every: timedelta | float | None) -> float:
        s = seconds(renew_every, "renew_every")
        if s is None:
            return self._ttl_ms / 3000
        if s <= 0 or s * 1000 >= self._ttl_ms:
            raise ConfigurationError(
                f"renew_every must be positive and shorter than the lock ttl "
                f"({self._ttl_ms / 1000}s), got {s}s"
            )
        return s

    @staticmethod
    def _mark_released(lease: Lease) -> None:
        lease._released = True  # the object is spent

    def _released(self, lease: Lease, ok: bool, t0: float) -> bool:
        self._mark_released(lease)
        self._emit("release", "ok" if ok else "not_held", t0)
        return ok

    def _renew_state(self, lease: Lease, on_lost: Callable[[Lease], object] | None) -> RenewState:
        """The state shared by the renew loop, the watchdog and the block; its
        ``notify`` reports a loss: the ``lost`` event, then ``on_lost``."""
        state = RenewState(0, lease._sent, ttl_ms=lease._ttl_ms, lease=lease)
        if self._coord._hooks:
            state.report = lambda outcome, took, error: self._deliver("renew", outcome, took, error)

        def lost() -> None:
            lease.lost = True
            if self._coord._hooks:
                self._deliver("lost", "lost", 0.0)
            if on_lost is not None:
                try:
                    on_lost(lease)
                except Exception:
                    # The loss is what matters: the block still raises LockLost (and an
                    # async body is still cancelled) whatever the callback did.
                    log.warning(
                        "on_lost callback %r for lock %s:%s raised; the lease is lost all the same",
                        on_lost,
                        self.spec.name,
                        lease.key,
                        exc_info=True,
                    )

        state.notify = lost
        return state

    def _renewal(
        self, lease: Lease, every: float, max_hold: float | None, state: RenewState
    ) -> Renewal:
        """What the coordinator's renewer keeps alive for a ``hold()`` block."""
        assert lease.token is not None
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

    def _renewed(
        self, lease: Lease, sent: float, ttl_ms: int, new_exp: int | None, t0: float = 0.0
    ) -> bool:
        self._emit("renew", "failed" if new_exp is None else "ok", t0)
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
            f"within wait={seconds(wait, 'wait') or 0}s; retry later or wait longer"
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


def validated(key: str, what: str = "key") -> str:
    return validate_key(key, what)


#: Fencing tokens are ints in [0, MAX_TOKEN] (A4): what a signed 64-bit column holds,
#: so every store gives the same answer and none can overflow.
MAX_TOKEN = 2**63 - 1


def _int_repr(value: int) -> str:
    # repr() of an int of thousands of digits raises ValueError.
    return repr(value) if value.bit_length() <= 128 else f"an int of {value.bit_length()} bits"


def check_token(token: object) -> int:
    """The one check of a fencing token given to a gate: an int in [0, 2**63-1]."""
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN:
        shown = repr(token) if not isinstance(token, int) else _int_repr(token)
        raise ConfigurationError(
            f"a fencing token is an int from 0 to 2**63-1 (lease.token or claim.fence), got {shown}"
        )
    return int(token)


class WrapPlan:
    """What a decorated function needs on every call: its key, payload, result types
    and the exceptions whose outcome is recorded and replayed."""

    def __init__(
        self,
        fn: Callable[..., Any],
        key: Callable[..., str] | None,
        replay_errors: tuple[type[BaseException], ...],
    ) -> None:
        self.fn = fn
        self.key = key
        self.sig = inspect.signature(fn)
        if isinstance(replay_errors, type):
            replay_errors = (replay_errors,)
        for tp in replay_errors:
            if not (isinstance(tp, type) and issubclass(tp, Exception)):
                raise ConfigurationError(f"replay_errors must be exception classes, got {tp!r}")
        self.errors = tuple(replay_errors)
        # Types are resolved only from this allow-list, never imported by stored name.
        self.by_name = {type_name(tp): tp for tp in self.errors}
        self._types: tuple[Any, Any] | None = None

    def types(self) -> tuple[Any, Any]:
        """(dump, load) for the declared return type, resolved on first use so forward
        references defined later in the module work."""
        if self._types is None:
            from ._core.typed import TypedError, dumper, loader

            try:
                hints = typing.get_type_hints(self.fn)
            except Exception as exc:
                raise ConfigurationError(
                    f"cannot resolve the return annotation of {self.fn.__qualname__}: {exc}"
                ) from None
            tp = hints.get("return", Any)
            try:
                self._types = (dumper(tp), loader(tp))
            except TypedError as exc:
                raise ConfigurationError(f"{self.fn.__qualname__}: {exc}") from None
        return self._types

    def key_payload(self, args: Any, kwargs: Any) -> tuple[str, dict[str, Any]]:
        bound = self.sig.bind(*args, **kwargs)
        bound.apply_defaults()
        payload = dict(bound.arguments)
        if self.key is None:
            return fingerprint(payload), payload
        return validate_key(self.key(*args, **kwargs)), payload

    def replay(self, claim: Completed) -> Any:
        if claim.error is None:
            return claim.result
        tp = self.by_name.get(claim.error.type)
        if tp is None:
            from ._errors import ResultDecodeError

            raise ResultDecodeError(
                f"the recorded outcome is an exception of type {claim.error.type}, which is "
                "not in replay_errors of this function; add it, or forget the key"
            )
        raise tp(*claim.error.args)


def wrap_options(
    spec_or_name: IdempotencySpec | str,
    key: Callable[..., str] | None,
    on_in_flight: str,
    wait: timedelta | float | None,
) -> None:
    if on_in_flight not in IN_FLIGHT_MODES:
        raise ConfigurationError(
            f"on_in_flight must be one of {IN_FLIGHT_MODES}, got {on_in_flight!r}"
        )
    if key is not None and not callable(key):
        raise ConfigurationError("key must be a callable of the call's arguments, or None")
    seconds(wait, "wait")


def heartbeat_options(
    port: IdempotencyBase,
    heartbeat: bool,
    renew_every: timedelta | float | None,
    max_run: timedelta | float | None,
    on_lost: Callable[[ClaimToken], object] | None,
) -> tuple[float | None, float | None]:
    """(renewal interval or None for no heartbeat, max_run seconds or None)."""
    if not isinstance(heartbeat, bool):
        raise ConfigurationError(f"heartbeat must be True or False, got {heartbeat!r}")
    if on_lost is not None and not callable(on_lost):
        raise ConfigurationError(f"on_lost must be a callable of the claim token, got {on_lost!r}")
    every = port._heartbeat_every(renew_every)
    limit = seconds(max_run, "max_run")
    if limit is not None and limit <= 0:
        raise ConfigurationError(f"max_run must be positive, got {limit}s")
    return (every if heartbeat else None), limit


class FenceBase:
    def __init__(self, coord: CoordinatorBase, resource: str) -> None:
        self._store = coord._store
        self.resource = validate_key(resource, "resource")
        self._ns = coord._ns("fence")

    def _fence_set(self) -> Any:
        fence_set = getattr(self._store, "fence_set", None)
        if fence_set is None:
            raise ConfigurationError(
                f"set_if_fresh writes into the store itself, which the {self._store.kind} "
                "store does not hold user data for; use check_and_advance and guard your "
                "own write, or use the Redis store"
            )
        return fence_set
