"""The meaning of store replies for claims: a claim reply becomes a public outcome
(and its event), a refused complete/abandon/extend becomes ``StaleClaim``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._core import table
from ._core.events import answered
from ._core.port import Busy, ClaimReply, Done, Granted, Mismatch, RecordRow
from ._core.types import (
    Claim,
    Claimed,
    ClaimToken,
    Completed,
    InFlight,
    RecordStatus,
    from_ms,
)
from ._errors import InFlightError, PayloadMismatch, ResultDecodeError

if TYPE_CHECKING:
    from ._coordinator import CoordinatorBase
    from ._events import Events
    from ._sealing import Records

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
        from ._errors import ClaimLost

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
        from ._errors import StaleClaim

        return StaleClaim(
            f"cannot {what} key {token.key!r} (fence {token.fence}): this claim no longer "
            "holds the key (its lease ran out and another attempt took over, it was "
            "completed or abandoned already, or the record was forgotten); nothing changed"
        )

    def status(self, key: str, row: RecordRow | None) -> RecordStatus | None:
        if row is None:
            return None
        status = self._coord._record_status(row)
        return RecordStatus(
            key, status.state, status.fence, status.expires_at, status.spec, status.tenant
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
