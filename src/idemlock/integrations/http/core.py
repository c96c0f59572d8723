"""The ``Idempotency-Key`` decision steps every HTTP adapter drives: ASGI
(:mod:`~idemlock.integrations.asgi`), FastAPI, WSGI and Django.

The steps are written once, as coroutines over a :class:`StoreFace`. The ASGI adapters
give them an asyncio port (:class:`AsyncPortFace`); the blocking adapters give them a
blocking port whose coroutines never suspend (:mod:`.blocking`). So the key
check, the identity rule, the fingerprint, the lookup key, the problem documents, the
record format, the replay and the handling of a failing store cannot drift apart.

An adapter:

1. asks :meth:`HttpCore.key_of` for the request's key (an :class:`Answer`, None for a
   request without a key, or the key);
2. computes the caller's identity its own way and asks :meth:`HttpCore.refuse_identity`;
3. reads the body (at most ``max_body``; over it, :meth:`Problems.too_large`);
4. awaits :meth:`HttpCore.claim`, which gives an :class:`Answer` (a replay, 409, 422,
   503, ...) or a :class:`Run`: then it runs its handler, copies the response into the
   run (:meth:`Run.start`, ``run.copy``) and awaits :meth:`HttpCore.settle` before the
   last bytes leave, or :meth:`HttpCore.fail` if the handler raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

from ... import _attempts as attempts
from ..._base.idempotency import Heartbeat, IdempotencyBase
from ..._core.types import Claim, Claimed, ClaimToken, Completed, IdempotencySpec, InFlight
from ..._decorator import heartbeat_options
from ..._errors import (
    ConfigurationError,
    PayloadMismatch,
    ResultDecodeError,
    ResultTooLarge,
    StaleClaim,
    StoreFull,
    StoreUnavailable,
)
from ..._logfields import fields as log_fields
from ..._logfields import port_fields
from ...aio import AsyncIdempotencyPort
from .fingerprint import RequestView, fingerprint_of, older_fingerprints_of
from .key_header import MalformedKey, parse_idempotency_key
from .options import HttpOptions, Scope, route_filter
from .problem_json import Answer, Problems
from .recorded_response import (
    ResponseCopy,
    parse_record,
    record_of,
    replay_answer,
    unreplayable_record,
)

__all__ = ["AsyncPortFace", "HttpCore", "Pass", "Run", "StoreFace", "log"]

#: the one logger of the HTTP adapters (ASGI, FastAPI, WSGI and Django alike)
log = logging.getLogger("idemlock.http")

#: first and longest pause between writes of a record the store refused
_RECORD_RETRY_FIRST = 0.1
_RECORD_RETRY_MAX = 2.0


@dataclass(frozen=True)
class Pass:
    """The request is not covered or carries no key: run the handler untouched."""


@dataclass
class Run:
    """A request holding a fresh claim: its handler runs, its response is copied here."""

    token: ClaimToken
    body: bytes
    copy: ResponseCopy
    beat: Heartbeat | None = None
    status: int | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    settled: bool = False  # completed or abandoned
    #: the adapter marks the handler's start (``expect_handler``/``handler_started``):
    #: a response sent before it (a framework's validation error) is not recorded
    expects_handler: bool = False
    handler_started: bool = False

    def start(self, status: int, headers: Iterable[tuple[bytes, bytes]]) -> None:
        self.status = int(status)
        self.headers = [(bytes(k).lower(), bytes(v)) for k, v in headers]

    def stop_heartbeat(self) -> None:
        if self.beat is not None:
            self.beat.stop()


class StoreFace(ABC):
    """The store calls the steps make; awaited, on an asyncio or a blocking port. The
    calls that reach no store (the port's spec, heartbeat and clock) are alike on both
    faces and written here."""

    port: IdempotencyBase

    @abstractmethod
    async def claim(self, key: str, payload: Any) -> tuple[Claim, float]: ...

    @abstractmethod
    async def complete(self, token: ClaimToken, result: Any) -> None: ...

    @abstractmethod
    async def abandon(self, token: ClaimToken) -> None: ...

    @abstractmethod
    def later(self, job: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``job()`` in the background (a record written again)."""

    @property
    def spec(self) -> IdempotencySpec:
        return self.port.spec

    def heartbeat(
        self,
        token: ClaimToken,
        sent: float,
        every: float,
        limit: float | None,
        on_lost: Callable[[ClaimToken], object],
    ) -> Heartbeat:
        return attempts.keep_alive(self.port, token, sent, every, limit, on_lost)

    def now(self) -> float:
        return attempts.clock(self.port).time()


class AsyncPortFace(StoreFace):
    """An :class:`~idemlock.aio.AsyncIdempotencyPort` as the steps' store."""

    port: AsyncIdempotencyPort

    def __init__(self, port: AsyncIdempotencyPort) -> None:
        self.port = port
        self._background: set[asyncio.Task[None]] = set()

    async def claim(self, key: str, payload: Any) -> tuple[Claim, float]:
        return await attempts.abegin(self.port, key, payload, None)

    async def complete(self, token: ClaimToken, result: Any) -> None:
        await self.port.complete(token, result)

    async def abandon(self, token: ClaimToken) -> None:
        await self.port.abandon(token)

    def later(self, job: Callable[[], Coroutine[Any, Any, None]]) -> None:
        task = asyncio.get_running_loop().create_task(job())
        self._background.add(task)  # a reference, so the task is not collected mid-way
        task.add_done_callback(self._background.discard)


def _lost(token: ClaimToken) -> None:
    log.warning(
        "the idempotency claim of a running request was lost (renewal refused or late); "
        "its response is recorded only if no other attempt took the key over",
        extra=log_fields(
            spec=token.spec, operation="heartbeat", outcome="lost", kind="idempotency"
        ),
    )


class HttpCore:
    """The Idempotency-Key table for one spec and one set of options."""

    def __init__(self, face: StoreFace, options: HttpOptions, *, has_identity: bool) -> None:
        o = options
        self.face = face
        self.options = o
        self.spec = face.spec
        self.every, self.max_run = heartbeat_options(
            face.port, o.heartbeat, o.renew_every, o.max_run, None
        )
        methods = (o.methods,) if isinstance(o.methods, str) else o.methods
        self.methods = frozenset(m.upper() for m in methods)
        self.route = route_filter(o.routes)
        self.allow_anonymous = (
            (not has_identity) if o.allow_anonymous is None else o.allow_anonymous
        )
        # Liberal by default: a bare value (Stripe's SDKs send one) and the draft's
        # sf-string are one key; allow_unquoted_key=False keeps the sf-string only.
        self.allow_unquoted = o.allow_unquoted_key is not False
        mismatch = o.mismatch_status or (400 if o.stripe_compatible else 422)
        self.header = o.header.lower().encode("latin-1")
        self.replay_marker = (
            None
            if o.replay_header is None
            else (o.replay_header.lower().encode("latin-1"), b"true")
        )
        self.fingerprint_headers = frozenset(h.lower() for h in o.fingerprint_headers)
        self.max_body = o.max_body
        self.max_response_body = o.max_response_body
        self.problems = Problems(
            header=o.header,
            docs_url=o.docs_url,
            www_authenticate=o.www_authenticate,
            max_body=o.max_body,
            mismatch_status=mismatch,
        )

    # ---- before the claim ------------------------------------------------------------

    def covers(self, scope: Scope) -> bool:
        """Whether a request (its ``method`` and ``path``) is subject to the header."""
        return str(scope.get("method", "")).upper() in self.methods and self.route(scope)

    def key_of(self, headers: Iterable[tuple[bytes, bytes]]) -> Answer | str | None:
        """The request's key, None when it has none (and needs none), or the 400."""
        values = [v for k, v in headers if bytes(k).lower() == self.header]
        if not values:
            return self.problems.missing() if self.options.require_key else None
        if len(values) > 1:
            return self.problems.malformed("send the header once")
        try:
            return parse_idempotency_key(
                values[0],
                max_length=self.options.max_key_length,
                allow_unquoted=self.allow_unquoted,
            )
        except MalformedKey as exc:
            return self.problems.malformed(str(exc))

    def refuse_identity(self, ident: object) -> Answer | None:
        """The 401 for a request without identity when anonymous calls are refused."""
        if ident is not None and not isinstance(ident, str):
            raise ConfigurationError(
                f"the identity function must return a str or None, got {type(ident).__name__}"
            )
        if ident is None and not self.allow_anonymous:
            return self.problems.unauthenticated()
        return None

    def declared_too_large(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        for k, v in headers:
            if bytes(k).lower() == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = 0  # the server validates framing; count what arrives
                if declared > self.max_body:
                    return True
        return False

    @staticmethod
    def lookup_key(ident: str | None, key: str) -> str:
        # JSON keeps (identity, key) pairs unambiguous: ("a", "b:c") != ("a:b", "c"),
        # and None (anonymous) differs from every string identity.
        joined = json.dumps([ident, key], ensure_ascii=True, separators=(",", ":"))
        return hashlib.sha256(b"idemlock-http/1\0" + joined.encode("ascii")).hexdigest()

    def view(self, scope: Scope, body: bytes) -> RequestView:
        return RequestView(
            method=str(scope["method"]).upper(),
            path=scope.get("path", ""),
            query=bytes(scope.get("query_string", b"")).decode("latin-1"),
            headers=[
                (bytes(k).lower().decode("latin-1"), bytes(v).decode("latin-1"))
                for k, v in scope.get("headers") or ()
            ],
            body=body,
        )

    # ---- the claim -------------------------------------------------------------------

    async def _claim_older(self, lookup: str, forms: list[dict[str, Any]]) -> tuple[Claim, float]:
        """Claim with each older fingerprint form in turn; PayloadMismatch if every one
        mismatches (or there is none)."""
        if not forms:
            raise PayloadMismatch(lookup)
        for form in forms[:-1]:
            with contextlib.suppress(PayloadMismatch):
                return await self.face.claim(lookup, form)
        return await self.face.claim(lookup, forms[-1])

    async def claim(self, scope: Scope, ident: str | None, key: str, body: bytes) -> Answer | Run:
        """Claim the request's key: the replay or a problem, or a :class:`Run`."""
        view = self.view(scope, body)
        payload = fingerprint_of(view, self.fingerprint_headers, self.options.fingerprint)
        lookup = self.lookup_key(ident, key)
        try:
            try:
                claim, sent = await self.face.claim(lookup, payload)
            except PayloadMismatch:
                # A record stored by an earlier version holds an older form: the same
                # request, compared as it was then, still replays (one more round trip
                # per older form, on a mismatch only).
                older = older_fingerprints_of(
                    view, self.fingerprint_headers, self.options.fingerprint
                )
                claim, sent = await self._claim_older(lookup, older)
        except PayloadMismatch:
            return self.problems.mismatch()
        except (StoreUnavailable, StoreFull, OSError, TimeoutError) as exc:
            # Fail closed: the request never runs unprotected.
            log.warning(
                "idempotency store failed; answering 503: %s: %s",
                type(exc).__name__,
                exc,
                extra=self._fields("claim", "error"),
            )
            return self.problems.unavailable()
        except ResultDecodeError:
            log.error(
                "cannot read the recorded response of a request",
                exc_info=True,
                extra=self._fields("claim", "unreadable"),
            )
            return self.problems.unreadable()
        if isinstance(claim, InFlight):
            return self.problems.in_flight()
        if isinstance(claim, Completed):
            return self.replay(claim.result)
        assert isinstance(claim, Claimed)
        run = Run(claim.token, body, ResponseCopy(self.max_response_body))
        if self.every is not None:
            run.beat = self.face.heartbeat(claim.token, sent, self.every, self.max_run, _lost)
        return run

    def _fields(self, operation: str, outcome: str) -> dict[str, str]:
        """Log record fields (spec, store kind, operation, outcome; never the key)."""
        extra = port_fields(getattr(self.face, "port", None), operation, outcome)
        return extra | log_fields(spec=self.spec.name, kind="idempotency")

    def replay(self, rec: Any) -> Answer:
        parsed = parse_record(rec)
        if parsed is None:
            # The record is the response itself (a payload): only its type is logged.
            log.error(
                "stored idempotency record is not a recorded response (a %s)",
                type(rec).__name__,
                extra=self._fields("replay", "unreadable"),
            )
            return self.problems.unreadable()
        status, headers, body = parsed
        if body is None:
            return self.problems.unreplayable(status)
        return replay_answer(status, headers, body, self.replay_marker)

    # ---- after the handler -----------------------------------------------------------

    async def settle(self, run: Run) -> None:
        """Record the run's response (or abandon its claim) before its last bytes leave,
        so a client that has the whole response and retries at once finds the record."""
        if run.settled:
            return
        run.settled = True
        run.stop_heartbeat()
        status = run.status
        if (
            status is None
            or (run.expects_handler and not run.handler_started)
            or not self.options.record(status)
        ):
            await self.abandon(run.token)
            return
        if run.copy.chunks is None:
            log.warning(
                "response of %s bytes is over max_response_body=%s: delivered, recorded as "
                "not replayable",
                run.copy.size,
                self.max_response_body,
                extra=self._fields("complete", "unreplayable"),
            )
        result = record_of(status, run.headers, run.copy.chunks)
        try:
            await self._complete(run.token, status, result)
        except StaleClaim:
            log.warning(
                "the response was not recorded: the claim (lease %s) was lost before the "
                "request finished (%s) and another attempt took the key over, so a retry "
                "may have run again",
                self.spec.lease,
                run.beat.reason if run.beat is not None else "not renewed: heartbeat=False",
                extra=self._fields("complete", "stale"),
            )
        except Exception:
            # The handler ran and its response goes out, but the store did not take the
            # record. Abandoning would let the client's retry run the handler again (a
            # second charge), so keep the claim (retries get 409) and record it later.
            token = run.token
            log.error(
                "idempotency store failed while recording a %s response; it is delivered, "
                "its key stays reserved (retries get 409) and the record is written again "
                "in the background until the claim's lease ends at %s",
                status,
                token.expires_at.isoformat(),
                exc_info=True,
                extra=self._fields("complete", "error"),
            )
            until = token.expires_at.timestamp()
            if run.beat is not None and run.beat.state.expires_ms:
                until = max(until, run.beat.state.expires_ms / 1000)  # renewed since
            self.face.later(lambda: self._record_later(token, status, result, until))

    async def fail(self, run: Run) -> None:
        """The handler raised, or ended without a whole response: abandon the claim."""
        run.stop_heartbeat()
        if not run.settled:
            run.settled = True
            await self.abandon(run.token)

    async def _complete(self, token: ClaimToken, status: int, result: dict[str, Any]) -> None:
        try:
            await self.face.complete(token, result)
        except ResultTooLarge:
            log.warning(
                "response is too large for the store (max_result_bytes): delivered, "
                "recorded as not replayable",
                extra=self._fields("complete", "unreplayable"),
            )
            await self.face.complete(token, unreplayable_record(status))

    async def _record_later(
        self, token: ClaimToken, status: int, result: dict[str, Any], until: float
    ) -> None:
        """Write a response's record again with backoff while its claim's lease lasts
        (the response is out already). A retry in the meantime gets 409, never a run."""
        pause = _RECORD_RETRY_FIRST
        while True:
            await asyncio.sleep(pause)
            try:
                await self._complete(token, status, result)
            except StaleClaim:
                # Our failed attempt reached the store after all, or the lease ran out
                # and another attempt took over: either way nothing is left to write.
                log.warning(
                    "the response's record was written or taken over meanwhile",
                    extra=self._fields("complete", "stale"),
                )
                return
            except Exception as exc:
                if until - self.face.now() <= pause:
                    log.error(
                        "gave up recording a %s response: the store still fails (%s: %s) "
                        "and the claim's lease is over, so a retry runs the handler again",
                        status,
                        type(exc).__name__,
                        exc,
                        extra=self._fields("complete", "error"),
                    )
                    return
                pause = min(pause * 2, _RECORD_RETRY_MAX)
                continue
            log.warning(
                "recorded a %s response on a later attempt; retries replay it",
                status,
                extra=self._fields("complete", "ok"),
            )
            return

    async def abandon(self, token: ClaimToken) -> None:
        try:
            await self.face.abandon(token)
        except StaleClaim:
            # The lease ran out and another attempt may hold the key: nothing to undo.
            log.info(
                "the idempotency claim to abandon had already ended",
                extra=self._fields("abandon", "stale"),
            )
        except Exception:
            # Store down: the claim frees itself when its lease ends; until then retries
            # get 409. Cancellation propagates; the lease covers that case too.
            log.warning(
                "could not abandon an idempotency claim; its key stays reserved until %s",
                token.expires_at.isoformat(),
                exc_info=True,
                extra=self._fields("abandon", "error"),
            )
