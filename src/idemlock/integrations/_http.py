"""The ``Idempotency-Key`` decision steps every HTTP adapter drives: ASGI
(:mod:`~idemlock.integrations.asgi`), FastAPI, WSGI and Django.

The steps are written once, as coroutines over a :class:`StoreFace`. The ASGI adapters
give them an asyncio port (:class:`AsyncPortFace`); the blocking adapters give them a
blocking port whose coroutines never suspend (:mod:`._http_blocking`). So the key
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
import difflib
import fnmatch
import hashlib
import json
import logging
import re
from collections.abc import Callable, Coroutine, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Protocol, TypedDict, Union

from .. import _attempts as attempts
from .._core.types import Claim, Claimed, ClaimToken, Completed, IdempotencySpec, InFlight
from .._decorator import heartbeat_options
from .._errors import (
    ConfigurationError,
    PayloadMismatch,
    ResultDecodeError,
    ResultTooLarge,
    StaleClaim,
    StoreFull,
    StoreUnavailable,
)
from .._logfields import fields as log_fields
from .._logfields import port_fields
from .._ports import Heartbeat, IdempotencyBase
from ..aio import AsyncIdempotencyPort
from ._fingerprint import Fingerprint, RequestView, fingerprint_of, legacy_fingerprint_of
from ._key_header import MalformedKey, parse_idempotency_key
from ._problem_json import Answer, Problems
from ._recorded_response import (
    ResponseCopy,
    default_record,
    parse_record,
    record_of,
    replay_answer,
    unreplayable_record,
)

__all__ = [
    "DEFAULT_SPEC",
    "AsyncPortFace",
    "HttpCore",
    "HttpOptions",
    "Pass",
    "Run",
    "Scope",
    "StoreFace",
    "log",
    "did_you_mean",
    "route_filter",
    "spec_from",
]

#: the one logger of the HTTP adapters (ASGI, FastAPI, WSGI and Django alike)
log = logging.getLogger("idemlock.http")

Scope = MutableMapping[str, Any]
RouteFilter = Union[
    Callable[[Scope], bool], str, "re.Pattern[str]", Iterable["str | re.Pattern[str]"]
]

DEFAULT_SPEC = IdempotencySpec("http", ttl=timedelta(hours=24), lease=timedelta(seconds=30))

#: first and longest pause between writes of a record the store refused
_RECORD_RETRY_FIRST = 0.1
_RECORD_RETRY_MAX = 2.0


class _SharedOptions(TypedDict, total=False):
    require_key: bool
    allow_anonymous: bool | None
    fingerprint_headers: Iterable[str]
    fingerprint: Fingerprint | None
    stripe_compatible: bool
    allow_unquoted_key: bool | None
    mismatch_status: int | None
    max_body: int
    max_response_body: int
    max_key_length: int
    header: str
    replay_header: str | None
    record: Callable[[int], bool]
    docs_url: str | None
    www_authenticate: str
    heartbeat: bool
    renew_every: timedelta | float | None
    max_run: timedelta | float | None


class RouteOptions(_SharedOptions, total=False):
    """The keyword options of one protected route (FastAPI's ``Idempotency``): those of
    :class:`IdempotencyOptions` but ``methods`` and ``routes`` (the route is the
    endpoint). For type checkers only: at run time they are plain keyword arguments."""

    spec: IdempotencySpec | str


class IdempotencyOptions(RouteOptions, total=False):
    """The keyword options of the HTTP middlewares (``**options`` of ASGI's and WSGI's
    ``IdempotencyMiddleware``), each described there; a misspelt name or a value of
    the wrong type is refused by a type checker as it is (``ConfigurationError``) at
    run time."""

    methods: Iterable[str]
    routes: RouteFilter | None


@dataclass(frozen=True)
class HttpOptions:
    """The options every HTTP adapter takes (``identity`` and the coordinator are the
    adapter's own). See :class:`idemlock.integrations.asgi.IdempotencyMiddleware`."""

    spec: IdempotencySpec | str = DEFAULT_SPEC
    methods: Iterable[str] = ("POST", "PATCH")
    routes: RouteFilter | None = None
    require_key: bool = False
    #: None: True without an identity function, False (401) with one
    allow_anonymous: bool | None = None
    fingerprint_headers: Iterable[str] = ("content-type",)
    fingerprint: Fingerprint | None = None
    #: shorthand for mismatch_status=400 (and unquoted keys, accepted by default anyway)
    stripe_compatible: bool = False
    #: None or True: a bare key (``order-A18``) and a quoted one (``"order-A18"``) alike;
    #: False: the draft's sf-string only (an unquoted key is 400)
    allow_unquoted_key: bool | None = None
    mismatch_status: int | None = None
    max_body: int = 1 << 20
    max_response_body: int = 512 * 1024
    max_key_length: int = 255
    header: str = "Idempotency-Key"
    replay_header: str | None = "Idempotent-Replayed"
    record: Callable[[int], bool] = default_record
    docs_url: str | None = None
    www_authenticate: str = "Bearer"
    heartbeat: bool = True
    renew_every: timedelta | float | None = None
    max_run: timedelta | float | None = None

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> HttpOptions:
        """The options from keyword arguments; an unknown name is a ConfigurationError
        naming the known ones."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigurationError(
                f"unknown idempotency option(s) {', '.join(unknown)}; the options are: "
                f"{', '.join(known)}"
            )
        return cls(**options)

    def __post_init__(self) -> None:
        for name in ("max_body", "max_response_body", "max_key_length"):
            limit = getattr(self, name)
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise ConfigurationError(f"{name} must be a positive int, got {limit!r}")
        for name in ("require_key", "stripe_compatible", "heartbeat"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"{name} must be True or False")
        for name in ("allow_anonymous", "allow_unquoted_key"):
            if getattr(self, name) not in (None, True, False):
                raise ConfigurationError(f"{name} must be True, False or None")
        if self.mismatch_status not in (None, 400, 409, 422):
            raise ConfigurationError(
                f"mismatch_status must be 400, 409 or 422, got {self.mismatch_status!r}"
            )
        if not callable(self.record):
            raise ConfigurationError("record must be a function of the response status")
        if self.fingerprint is not None and not callable(self.fingerprint):
            raise ConfigurationError(
                "fingerprint must be a function of a RequestView (see json_fields)"
            )

    def with_changes(self, **changes: Any) -> HttpOptions:
        return HttpOptions.of({**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the known name closest to a misspelt one, or ``""``."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def spec_from(value: Any, where: str) -> IdempotencySpec | str:
    """A spec from configuration: a name, an :class:`IdempotencySpec`, or a dict of
    ``name`` (default ``"http"``), ``ttl`` and ``lease`` (seconds or timedeltas) and the
    spec's other fields. ``where`` names the setting in the error."""
    if isinstance(value, (IdempotencySpec, str)):
        return value
    if isinstance(value, dict):
        opts = dict(value)
        name = opts.pop("name", "http")
        for k in ("ttl", "lease"):
            if isinstance(opts.get(k), (int, float)) and not isinstance(opts.get(k), bool):
                opts[k] = timedelta(seconds=opts[k])
        try:
            return IdempotencySpec(name, **opts)
        except TypeError as exc:
            raise ConfigurationError(f"{where}: {exc}") from None
    raise ConfigurationError(
        f"{where} must be a spec name, an IdempotencySpec or a dict of name/ttl/lease, "
        f"got {value!r}"
    )


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


class StoreFace(Protocol):
    """The store calls the steps make; awaited, on an asyncio or a blocking port."""

    @property
    def port(self) -> IdempotencyBase: ...

    @property
    def spec(self) -> IdempotencySpec: ...

    async def claim(self, key: str, payload: Any) -> tuple[Claim, float]: ...

    async def complete(self, token: ClaimToken, result: Any) -> None: ...

    async def abandon(self, token: ClaimToken) -> None: ...

    def heartbeat(
        self,
        token: ClaimToken,
        sent: float,
        every: float,
        limit: float | None,
        on_lost: Callable[[ClaimToken], object],
    ) -> Heartbeat: ...

    def now(self) -> float: ...

    def later(self, job: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``job()`` in the background (a record written again)."""


class PortFaceBase:
    """What both faces do alike: no store call, only the port's spec, heartbeat and clock."""

    port: IdempotencyBase

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


class AsyncPortFace(PortFaceBase):
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


def route_filter(routes: RouteFilter | None) -> Callable[[Scope], bool]:
    """A predicate of the scope from ``routes``: None (all), globs, regexes, or a
    predicate."""
    if routes is None:
        return lambda scope: True
    if callable(routes):
        return routes
    items: Iterable[str | re.Pattern[str]] = (
        [routes] if isinstance(routes, (str, re.Pattern)) else routes
    )
    patterns: list[re.Pattern[str]] = []
    for r in items:
        if isinstance(r, str):
            patterns.append(re.compile(fnmatch.translate(r)))
        elif isinstance(r, re.Pattern):
            patterns.append(r)
        else:
            raise ConfigurationError(
                f"routes must be globs, compiled regexes or a predicate, got {r!r}"
            )

    def matches(scope: Scope) -> bool:
        path = scope.get("path", "")
        return any(p.fullmatch(path) for p in patterns)

    return matches


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

    async def claim(self, scope: Scope, ident: str | None, key: str, body: bytes) -> Answer | Run:
        """Claim the request's key: the replay or a problem, or a :class:`Run`."""
        view = self.view(scope, body)
        payload = fingerprint_of(view, self.fingerprint_headers, self.options.fingerprint)
        lookup = self.lookup_key(ident, key)
        try:
            try:
                claim, sent = await self.face.claim(lookup, payload)
            except PayloadMismatch:
                # A record stored before fingerprints were JCS holds the older form:
                # the same request, compared as it was then, still replays.
                legacy = legacy_fingerprint_of(
                    view, self.fingerprint_headers, self.options.fingerprint
                )
                if legacy == payload:
                    raise
                claim, sent = await self.face.claim(lookup, legacy)
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
