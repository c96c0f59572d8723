"""What the sync and async coordinators share: validation, request building and the
meaning of store replies. The sync and async classes only add the calls."""

from __future__ import annotations

import functools
import inspect
import secrets
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ._core.canonical import fingerprint
from ._core.clock import Clock
from ._core.codec import Codec
from ._core.flows import RenewState
from ._core.keys import namespace, split_namespace, validate_key
from ._core.port import (
    Acquired,
    Busy,
    ClaimReply,
    Done,
    Granted,
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

IN_FLIGHT_MODES = ("raise", "wait")


def new_token() -> str:
    return secrets.token_hex(16)


def seconds(value: timedelta | float | None, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{what} must be a timedelta or seconds, got {value!r}")
    if value < 0:
        raise ConfigurationError(f"{what} must not be negative, got {value!r}")
    return float(value)


class CoordinatorBase:
    """Holds the store, the key prefix, the clock and the codec."""

    def __init__(
        self,
        store: Any,
        *,
        key_prefix: str = "idemlock",
        clock: Clock | None = None,
        codec: Codec | None = None,
        url: str | None = None,
    ) -> None:
        from ._core.clock import SYSTEM_CLOCK
        from ._core.codec import JSON_CODEC

        self._store = store
        self.key_prefix = validate_key(key_prefix, "key_prefix")
        self.clock: Clock = clock or getattr(store, "clock", None) or SYSTEM_CLOCK
        self.codec: Codec = codec or JSON_CODEC
        self.url = url
        #: longest wait between re-checks where notifications do not cross processes
        self.poll_cap: float | None = getattr(store, "poll_cap", None)

    @property
    def store(self) -> Any:
        """The store adapter (for store-specific extras)."""
        return self._store

    def _ns(self, name: str) -> str:
        return namespace(self.key_prefix, name)

    def _ns_prefix(self) -> str:
        return namespace(self.key_prefix, "x")[:-1]

    def _idem_spec(self, spec: IdempotencySpec | str) -> IdempotencySpec:
        if isinstance(spec, str):
            return IdempotencySpec(spec)
        if not isinstance(spec, IdempotencySpec):
            raise ConfigurationError(
                f"expected an IdempotencySpec or a spec name, got {type(spec).__name__}"
            )
        if spec.encrypt_result:
            raise ConfigurationError(
                f"spec {spec.name!r} has encrypt_result=True but this coordinator has no "
                "keyring to seal results with; configure a keyring or set encrypt_result=False"
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

    def _listing_name(self, ns: str) -> str:
        parts = split_namespace(ns)
        return parts[-1] if parts else ns

    def _lock_info(self, row: LockRow) -> LockInfo:
        return LockInfo(
            self._listing_name(row.ns), row.key, row.owner, row.token, from_ms(row.expires_ms)
        )

    def _record_status(self, row: RecordRow) -> RecordStatus:
        return RecordStatus(
            row.key, row.state, row.fence, from_ms(row.expires_ms), self._listing_name(row.ns)
        )


class IdempotencyBase:
    def __init__(self, coord: CoordinatorBase, spec: IdempotencySpec) -> None:
        self._coord = coord
        self._store = coord._store
        self.spec = spec
        self._ns = coord._ns(spec.name)
        self._lease_ms = to_ms(spec.lease, "lease")
        self._ttl_ms = to_ms(spec.ttl, "ttl")

    def _claim_args(self, key: str, payload: Any) -> tuple[str, str, str | None, str, int]:
        validate_key(key)
        fp = None if payload is None else fingerprint(payload)
        return (self._ns, key, fp, new_token(), self._lease_ms)

    def _interpret(self, key: str, reply: ClaimReply) -> Claim:
        if isinstance(reply, Granted):
            return Claimed(
                ClaimToken(
                    key,
                    reply.token,
                    reply.fence,
                    from_ms(reply.expires_ms),
                    self.spec.name,
                    self._ns,
                )
            )
        if isinstance(reply, Busy):
            return InFlight(from_ms(reply.expires_ms))
        if isinstance(reply, Done):
            return Completed(self._coord.codec.decode(reply.result), from_ms(reply.expires_ms))
        if isinstance(reply, Mismatch):
            raise PayloadMismatch(key)
        raise TypeError(f"unexpected store reply {reply!r}")  # pragma: no cover

    def _token_args(self, token: ClaimToken) -> tuple[str, str, str]:
        if not isinstance(token, ClaimToken):
            raise ConfigurationError(
                f"expected the ClaimToken from Claimed.token, got {type(token).__name__}"
            )
        if token._ns != self._ns:
            raise ConfigurationError(
                f"this claim token belongs to spec {token.spec!r}, not {self.spec.name!r}; "
                "complete or abandon it through the port that claimed it"
            )
        return (self._ns, token.key, token.token)

    def _stale(self, token: ClaimToken, what: str) -> Exception:
        from ._errors import StaleClaim

        return StaleClaim(
            f"cannot {what} key {token.key!r} (fence {token.fence}): this claim no longer "
            "holds the key (its lease ran out and another attempt took over, it was "
            "completed or abandoned already, or the record was forgotten); nothing changed"
        )

    def _status(self, row: RecordRow | None) -> RecordStatus | None:
        return None if row is None else self._coord._record_status(row)

    def _wait_for(self, wait: timedelta | float | None) -> float:
        s = seconds(wait, "wait")
        return self._lease_ms / 1000 if s is None else s

    def _replay_or_raise(self, key: str, reply: ClaimReply) -> Claim:
        claim = self._interpret(key, reply)
        if isinstance(claim, InFlight):
            raise InFlightError(key, claim.expires_at)
        return claim


class LockBase:
    def __init__(self, coord: CoordinatorBase, spec: LockSpec) -> None:
        self._coord = coord
        self._store = coord._store
        self.spec = spec
        self._ns = coord._ns(spec.name)
        self._ttl_ms = to_ms(spec.ttl, "ttl")

    def _owner(self, owner: str | None) -> str:
        return new_token() if owner is None else validate_key(owner, "owner")

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
        if not isinstance(lease, Lease):
            raise ConfigurationError(f"expected a Lease from acquire(), got {type(lease).__name__}")
        if lease._ns != self._ns:
            raise ConfigurationError(
                f"this lease belongs to lock spec {lease.spec!r}, not {self.spec.name!r}"
            )
        if getattr(lease, "_released", False):
            raise LockNotHeld(
                f"cannot {what} the lease on {lease.key!r}: it was already released; "
                "acquire the lock again"
            )
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
        lease._released = True  # type: ignore[attr-defined]  # the object is spent

    def _renewed(self, lease: Lease, sent: float, ttl_ms: int, new_exp: int | None) -> bool:
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

    @staticmethod
    def _sync_state(lease: Lease, state: RenewState) -> None:
        lease._sent = state.sent
        if state.expires_ms:
            lease.expires_at = from_ms(state.expires_ms)
        if state.lost:
            lease.lost = True


def validated(key: str, what: str = "key") -> str:
    return validate_key(key, what)


def check_token(token: object) -> int:
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise ConfigurationError(
            f"a fencing token is a non-negative int (lease.token or claim.fence), got {token!r}"
        )
    return token


def bind_payload(fn: Callable[..., Any]) -> Callable[..., dict[str, Any]]:
    """The canonical arguments of a call: parameter name -> value, defaults applied,
    so ``f(1, b=2)`` and ``f(1, 2)`` are the same call."""
    sig = inspect.signature(fn)

    def payload(*args: Any, **kwargs: Any) -> dict[str, Any]:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    return payload


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


def call_key(
    key: Callable[..., str] | None, payload: dict[str, Any], args: Any, kwargs: Any
) -> tuple[str, dict[str, Any]]:
    if key is None:
        return fingerprint(payload), payload
    return validate_key(key(*args, **kwargs)), payload


update_wrapper = functools.update_wrapper


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
