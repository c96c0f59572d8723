"""The idempotency port's logic, shared by its two faces
(:class:`idemlock.aio.AsyncIdempotencyPort` and the generated
:class:`idemlock.IdempotencyPort`): validation, request building, heartbeats and the
steps of ``run()``, with what a port holds for one spec: its events, its records
(:mod:`.records`) and the meaning of its store's replies (:class:`ClaimReplies`). The
faces only add the calls; :mod:`idemlock._tasks` and :mod:`idemlock._threads` what
differs between a task and a thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from functools import partial
from time import perf_counter
from typing import TYPE_CHECKING, Any

from .._core import table
from .._core.clock import duration, whole_ms
from .._core.codec import type_name
from .._core.events import answered
from .._core.flows import Renewal, RenewState
from .._core.keys import validate_key
from .._core.port import Busy, ClaimReply, Done, Granted, Mismatch, RecordRow, StepRow
from .._core.types import (
    Claim,
    Claimed,
    ClaimToken,
    Completed,
    IdempotencySpec,
    InFlight,
    RecordStatus,
    StepInfo,
    from_ms,
)
from .._decorator import heartbeat_options
from .._errors import (
    ConfigurationError,
    DuplicateStep,
    InFlightError,
    PayloadMismatch,
    ResultDecodeError,
    ResultTooLarge,
    StepInterrupted,
)
from .._logfields import port_fields
from .._tokens import new_token
from .events import Events, log, report_loss
from .records import Records

if TYPE_CHECKING:
    from .._decorator import WrapPlan
    from .coordinator import CoordinatorBase

#: port reply type -> the claim event's outcome, as the table names it
_CLAIM_OUTCOME: dict[type, str] = {
    Granted: table.outcome("claim", table.GRANTED),
    Busy: table.outcome("claim", table.BUSY),
    Done: table.outcome("claim", table.DONE),
    Mismatch: table.outcome("claim", table.MISMATCH),
}


class ClaimReplies:
    """Turns one spec's store replies into outcomes, events and errors. An idempotency
    port holds one, made with the port (``port._replies``) over its events and records."""

    __slots__ = ("_coord", "_events", "_ns", "_records", "_spec_name")

    def __init__(self, coord: CoordinatorBase, events: Events, records: Records) -> None:
        self._coord = coord
        self._events = events
        self._records = records
        self._ns = records._ns
        self._spec_name = records._spec_name

    def interpret(
        self, key: str, reply: ClaimReply, load: Any = None, t0: float = 0.0, skey: str = ""
    ) -> Claim:
        if self._coord._hooks:
            outcome = _CLAIM_OUTCOME[type(reply)]
            try:
                claim = self._reply(key, reply, load, skey)
            except PayloadMismatch:
                self._events.emit("claim", outcome, t0)
                raise
            self._events.emit("claim", outcome, t0)
            return claim
        return self._reply(key, reply, load, skey)

    def _reply(self, key: str, reply: ClaimReply, load: Any, skey: str) -> Claim:
        if isinstance(reply, Granted):
            return Claimed(
                ClaimToken(
                    key,
                    reply.token,
                    reply.fence,
                    from_ms(reply.expires_ms),
                    self._spec_name,
                    self._ns,
                    skey or self._records.skey(key),
                    _steps=reply.steps,
                )
            )
        if isinstance(reply, Busy):
            return InFlight(from_ms(reply.expires_ms))
        if isinstance(reply, Done):
            try:
                result, error = self._records.decode(key, reply.result, load)
            except ResultDecodeError as exc:
                # The format and the keyring do not know the key; name the record so
                # its advice (forget it) can be followed. The caller's key, never
                # the stored one (an HMAC under a keyring).
                exc.args = (f"record of key {key!r} (spec {self._spec_name!r}): {exc}",)
                raise
            return Completed(result, from_ms(reply.expires_ms), error)
        if isinstance(reply, Mismatch):
            raise PayloadMismatch(key)
        raise TypeError(f"unexpected store reply {reply!r}")  # pragma: no cover

    def lost_claim(self, token: ClaimToken, reason: str) -> Exception:
        from .._errors import ClaimLost

        return ClaimLost(
            f"lost the claim on key {token.key!r} (fence {token.fence}) of spec "
            f"{self._spec_name!r} while its work ran: {reason or 'its lease ran out'}; "
            "another attempt took the key over, so nothing was recorded and a retry "
            "runs again with a higher fence (check fenced writes before relying on this "
            "attempt's work)"
        )

    def finish_claim(self, token: ClaimToken, ok: bool, what: str, t0: float) -> None:
        """Report a complete/abandon; raise StaleClaim if the store refused it."""
        self._events.emit(what, answered(what, ok), t0)
        if not ok:
            raise self.stale(token, what)

    def extend_token(self, token: ClaimToken, new_exp: int | None) -> ClaimToken:
        if new_exp is None:
            raise self.stale(token, "extend")
        return ClaimToken(
            token.key,
            token.token,
            token.fence,
            from_ms(new_exp),
            token.spec,
            token._ns,
            token._skey,
        )

    def stale(self, token: ClaimToken, what: str) -> Exception:
        from .._errors import StaleClaim

        return StaleClaim(
            f"cannot {what} key {token.key!r} (fence {token.fence}): this claim no longer "
            "holds the key (its lease ran out and another attempt took over, it was "
            "completed or abandoned already, or the record was forgotten); nothing changed"
        )

    def status(
        self, key: str, row: RecordRow | None, steps: Sequence[StepRow] = ()
    ) -> RecordStatus | None:
        if row is None:
            return None
        status = self._coord._record_status(row)
        infos = tuple(
            StepInfo(s.name, "started", 0, s.fence)
            if s.result is None
            else StepInfo(s.name, "done", len(s.result), s.fence)
            for s in sorted(steps, key=lambda s: s.name)
        )
        return RecordStatus(
            key, status.state, status.fence, status.expires_at, status.spec, status.tenant, infos
        )

    def replay_or_raise(
        self,
        key: str,
        reply: ClaimReply,
        load: Any = None,
        t0: float = 0.0,
        skey: str = "",
        waited: float | None = None,
        wait_with: str | None = None,
    ) -> Claim:
        """The claim of ``reply``; ``InFlightError`` if in flight, saying whether the
        caller waited (``waited`` seconds) and, if it has one, its setting to wait."""
        claim = self.interpret(key, reply, load, t0, skey)
        if isinstance(claim, InFlight):
            raise InFlightError(key, claim.expires_at, waited=waited, wait_with=wait_with)
        return claim


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


class AttemptBase:
    """What ``with port.run(key, payload=...) as attempt:`` gives the block; the faces
    (:class:`idemlock.Attempt`, :class:`idemlock.aio.AsyncAttempt`) add the steps'
    calls.

    ``attempt.replayed`` is True when the key had completed already: ``result`` is
    then the recorded result, the block must not do the work again, and nothing is
    recorded on exit. Otherwise this attempt holds the claim (renewed while the block
    runs): do the work, set ``attempt.result``, and leaving the block records it
    (``None`` if never set); an exception abandons the claim instead.

    ``result`` is typed ``Any``: set it to a :data:`~idemlock.JSONValue` (anything else
    raises ``ResultEncodeError`` on leaving); on a replay it is the decoded JSON.

    Steps (``attempt.step(name, fn, ...)``, on stores whose capabilities declare
    ``steps``): each finished step's result is recorded under the claim, fenced by it,
    so a retry after a crash finds it and returns it without running ``fn`` again."""

    __slots__ = ("_port", "_recorded", "_seen", "_txn", "key", "replayed", "result", "token")

    def __init__(
        self,
        key: str,
        token: ClaimToken | None,
        result: Any = None,
        port: IdempotencyBase | None = None,
    ) -> None:
        self.key = key
        self.token = token
        self.replayed = token is None
        self.result = result
        self._port = port
        self._recorded: dict[str, StepRow] = (
            {} if token is None else {s.name: s for s in token._steps}
        )
        self._seen: set[str] = set()
        #: steps this attempt recorded in a transaction of the caller's (PostgreSQL's
        #: record_step_in_transaction), by name: their data, until it is known whether
        #: that transaction committed
        self._txn: dict[str, bytes] = {}

    @property
    def fence(self) -> int | None:
        """The fencing token for this attempt's writes (None on a replay)."""
        return None if self.token is None else self.token.fence

    @property
    def lost(self) -> bool:
        """True once the claim was lost while the block ran."""
        return self.token is not None and self.token.lost

    def key_for(self, name: str) -> str:
        """A key for step ``name`` to hand to an outside API that takes an idempotency
        key (Stripe's ``idempotency_key``): the same in every attempt of this operation,
        different for every namespace (key prefix, tenant and spec), key and step. It is
        ``"idemlock-"`` and the first 32 hex digits of the SHA-256 of the namespace, the
        key and the step name, each followed by a NUL byte; under a keyring an HMAC
        instead, so it cannot be guessed from the key."""
        validate_key(name, "step name")
        port = self._steps_port()
        return port._records.step_key(self.key, name)

    def _steps_port(self) -> IdempotencyBase:
        port = self._port
        if port is None or self.token is None:
            raise ConfigurationError(
                f"idempotency key {self.key!r} was completed already: attempt.result holds "
                "its result and no step runs (check attempt.replayed before the work)"
            )
        if not port._store.capabilities.steps:
            raise ConfigurationError(
                f"the {port._store.kind} store does not record steps yet; steps run on "
                "the stores that declare them"
            )
        return port

    def _step_begin(self, name: str, once: bool) -> StepRow | None:
        """Before step ``name``: its record from an earlier attempt, if any (the caller
        replays it); ``DuplicateStep`` if this attempt ran it already;
        ``StepInterrupted`` for a ``once=True`` step an earlier attempt started and
        never finished."""
        validate_key(name, "step name")
        self._steps_port()
        if name in self._seen or name in self._txn:
            raise DuplicateStep(name, self.key)
        row = self._recorded.get(name)
        if row is not None and row.result is None and once:
            # Not counted as run: the caller may settle it or retry_step it now.
            self._step_event("interrupted", 0.0)
            raise StepInterrupted(name, self.key, row.fence)
        self._seen.add(name)
        if row is not None and row.result is None:
            return None  # a marker of a step that is not once=True now: run it
        return row

    def _replay(self, name: str, row: StepRow, errors: tuple[type[BaseException], ...]) -> Any:
        """A recorded step's result, or its recorded exception raised again (its type
        found among ``errors``, the step's ``replay_errors``: never imported by name)."""
        port = self._steps_port()
        assert row.result is not None
        self._step_event("replayed", 0.0)
        value, error = port._records.decode(self.key, row.result)
        if error is None:
            return value
        for tp in errors:
            if type_name(tp) == error.type:
                raise tp(*error.args)
        raise ResultDecodeError(
            f"step {name!r} of idempotency key {self.key!r} recorded an exception of type "
            f"{error.type}, which is not in the step's replay_errors; add it there"
        )

    def _step_data(self, name: str, value: Any) -> bytes:
        try:
            return self._steps_port()._records.encode(self.key, value)
        except ResultTooLarge as exc:
            raise ResultTooLarge(
                f"the result of step {name!r} is too large: {exc}; record a pointer to it "
                "(a row id, an object-store key) instead"
            ) from None

    def _error_data(
        self, exc: BaseException, errors: tuple[type[BaseException], ...]
    ) -> bytes | None:
        """The recorded form of a step's exception listed in its ``replay_errors``, or
        None (nothing is recorded: the exception propagates and a retry runs the step)."""
        if not errors or not isinstance(exc, errors):
            return None
        return self._steps_port()._records.encode_error(self.key, exc)

    def _step_event(self, outcome: str, t0: float) -> None:
        """Report a step (event ``step``): ``recorded``, ``replayed``, ``interrupted``,
        ``stale`` (the store refused the write), or a store call that raised
        (``error``). Its duration is the store call's, never the step's own work."""
        port = self._port
        if port is not None and port._coord._hooks:
            port._events.deliver("step", outcome, perf_counter() - t0 if t0 else 0.0)

    def _step_error(self, exc: BaseException, t0: float) -> None:
        port = self._port
        if port is not None:
            port._events.error("step", exc, t0)

    def _step_t0(self) -> float:
        port = self._port
        return 0.0 if port is None else port._events.t0()

    def _step_args(self, name: str, data: bytes | None) -> tuple[Any, ...]:
        port = self._steps_port()
        assert self.token is not None
        if self.token.lost:
            self._step_event("stale", 0.0)
            raise port._replies.lost_claim(self.token, "the claim was lost before the step")
        ns, skey, token = port._token_args(self.token)
        return (ns, skey, token, name, data, port._lease_ms, port._ttl_ms)

    def _drop_args(self, name: str) -> tuple[Any, ...]:
        validate_key(name, "step name")
        port = self._steps_port()
        assert self.token is not None
        ns, skey, token = port._token_args(self.token)
        return (ns, skey, token, name, port._lease_ms)

    def _stepped(
        self, name: str, expires: int | None, data: bytes | None, t0: float, final: bool
    ) -> None:
        """After a step write (``final``: the step's record, not its started marker
        nor a drop): ``ClaimLost`` if the store refused it (the claim is no longer this
        attempt's)."""
        assert self.token is not None
        if expires is None:
            self._step_event("stale", t0)
            raise self._refused(name)
        if final:
            self._step_event("recorded", t0)
        if data is not None:
            self._recorded[name] = StepRow(name, self.token.fence, data)
        else:
            self._recorded.pop(name, None)
            self._txn.pop(name, None)

    def _refused(self, name: str) -> Exception:
        """The ``ClaimLost`` of a step write the store refused."""
        assert self.token is not None
        return self._steps_port()._replies.lost_claim(
            self.token, f"the store refused step {name!r}: another attempt holds the key"
        )

    # ---- a step recorded in a transaction of the caller's (PostgreSQL) ----------------

    def _txn_step(self, name: str, value: Any) -> tuple[tuple[Any, ...], bytes]:
        """Before recording step ``name`` in the caller's transaction: the store's
        ``step`` arguments and the encoded ``value``. ``DuplicateStep`` if this attempt
        recorded it already, or an earlier attempt did (the caller's writes would run
        twice); ``ResultTooLarge`` naming the step; ``ClaimLost`` if the claim is lost.
        Allowed inside ``attempt.step(name, fn)``'s ``fn``, whose record it becomes."""
        validate_key(name, "step name")
        self._steps_port()
        assert self.token is not None
        row = self._recorded.get(name)
        if name in self._txn or (row is not None and row.fence == self.token.fence):
            raise DuplicateStep(name, self.key)
        if row is not None and row.result is not None:
            raise DuplicateStep(name, self.key, earlier=True)
        data = self._step_data(name, value)
        return self._step_args(name, data), data

    def _txn_stepped(self, name: str, expires: int | None, data: bytes) -> None:
        """After the step statement ran in the caller's transaction: ``ClaimLost`` if
        the store refused it; else the step waits for that transaction's end."""
        if expires is None:
            raise self._refused(name)
        self._txn[name] = data

    def _txn_unsure(self, name: str) -> bool:
        """Whether ``step(name)`` must first look in the store for a step this attempt
        recorded in a transaction of the caller's, which may have rolled back."""
        return name in self._txn and name not in self._seen

    def _txn_ended(self, name: str, rows: Sequence[StepRow]) -> None:
        """``rows``, the key's steps in the store now, tell whether the transaction that
        recorded step ``name`` committed (then it replays) or rolled back (then it runs)."""
        assert self.token is not None
        data = self._txn.pop(name)
        fence = self.token.fence
        if any(r.name == name and r.fence == fence and r.result == data for r in rows):
            self._recorded[name] = StepRow(name, fence, data)

    def _txn_took(self, name: str) -> bool:
        """After ``step(name)``'s ``fn`` returned: True if ``fn`` recorded the step in its
        transaction, whose record is then the step's (the step writes nothing more)."""
        assert self.token is not None
        data = self._txn.pop(name, None)
        if data is None:
            return False
        self._recorded[name] = StepRow(name, self.token.fence, data)
        return True

    def _steps_key(self) -> tuple[str, str]:
        """The store's (namespace, key) of this attempt's steps."""
        assert self.token is not None
        return self._steps_port()._token_args(self.token)[:2]

    def __repr__(self) -> str:
        what = "replayed" if self.replayed else f"fence={self.fence}"
        return f"{type(self).__name__}({self.key!r}, {what}, lost={self.lost})"


class IdempotencyBase:
    """What an idempotency port holds for one spec, and the steps its calls share."""

    _kind = "idempotency"
    #: the key and the payload fingerprint as stored (``_records.skey``/``fp``, bound
    #: once: a call costs what a method of the port would)
    _skey: Callable[[str], str]
    _fp: Callable[[Any], str | None]

    def __init__(self, coord: CoordinatorBase, spec: IdempotencySpec) -> None:
        self._coord = coord
        self._spec_name = spec.name
        self._store = coord._store
        self._ns = coord._ns(spec.name)
        self._events = Events(coord, self._kind, spec.name)
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
        return self._coord._renewal_period(
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
            report_loss(self._events, on_lost, token, "claim", "claim")
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

    # ---- the steps of run() ----------------------------------------------------

    def _run_options(
        self,
        wait: timedelta | float | None,
        heartbeat: bool,
        renew_every: timedelta | float | None,
        max_run: timedelta | float | None,
        on_lost: Callable[[ClaimToken], object] | None,
    ) -> tuple[float | None, float | None, float | None]:
        """(renewal interval or None, max_run seconds or None, wait seconds or None)."""
        every, limit = heartbeat_options(self, heartbeat, renew_every, max_run, on_lost)
        return every, limit, None if wait is None else self._wait_for(wait)

    def _begun(self, key: str, claim: Claim) -> Completed | ClaimToken:
        """The replayed attempt of a completed key, or the token of a new claim;
        ``InFlightError`` while another attempt holds the key."""
        if isinstance(claim, Completed):
            return claim
        if not isinstance(claim, Claimed):
            raise InFlightError(key, claim.expires_at)
        return claim.token

    def _not_recorded(self, exc: BaseException, token: ClaimToken, hb: Any) -> BaseException:
        """What leaving a block raises when its completion was refused as stale: the
        claim was lost while the block ran (with a heartbeat), else ``exc`` itself."""
        if hb is None:
            return exc
        lost: BaseException = self._replies.lost_claim(token, hb.reason)
        return lost
