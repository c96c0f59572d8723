"""HTTP ``Idempotency-Key`` middleware for ASGI applications (Starlette, FastAPI, ...).

It follows the IETF httpapi draft "The Idempotency-Key HTTP Header Field". A client sends
a unique key with a non-idempotent request (``Idempotency-Key: "8e03978e-..."``); the
first request with that key runs and its response (status, headers, body) is recorded;
a retry of the same request gets the recorded response back and the handler does not
run again::

    app.add_middleware(
        IdempotencyMiddleware,
        coordinator=idemlock.aio.connect("sqlite:///var/lib/app/idemlock.db"),
        identity=header_identity("x-api-key"),
    )

The middleware is pure ASGI: it imports no framework, and works with anything that
speaks ASGI 3.

Behaviour, for requests whose method is in ``methods`` (default POST and PATCH) and whose
path matches ``routes`` (default all); every other request, GET included, and every
websocket and lifespan event passes through untouched:

=============================================  =============================================
request                                        response
=============================================  =============================================
no key, ``require_key=False``                  passes through (no idempotency)
no key, ``require_key=True``                   400
malformed key, or more than one key header     400
identity is None, ``allow_anonymous=False``    401
request body over ``max_body``                 413 (the application is not called)
first request with the key                     the application runs; its response is
                                               recorded as described below
retry: same key and fingerprint, first done    the recorded response, plus
                                               ``Idempotent-Replayed: true``
retry while the first still runs               409, ``Retry-After: 1``
same key, different fingerprint                422 (``stripe_compatible=True``: 400)
retry of a request whose response was not      409 with ``code``
replayable (too large)                         ``idempotency_response_unavailable``
the store fails                                503, ``Retry-After: 1`` (fails closed: the
                                               request does not run unprotected), logged
the store fails recording a response           the response is delivered; the key stays
                                               reserved (retries get 409) while the record
                                               is written again in the background until
                                               the claim's lease ends; logged
=============================================  =============================================

Every error the middleware itself produces is ``application/problem+json`` (RFC 9457):
``type``, ``title``, ``status``, ``detail`` and an extension member ``code`` (a stable
machine-readable name such as ``idempotency_key_in_use``). Without ``docs_url`` the type
is ``about:blank`` and the title the status phrase, as RFC 9457 asks; with it the type is
``<docs_url>#<code>`` and a ``Link: <docs_url>; rel="describedby"`` header points to your
documentation, as the draft suggests.

**The key.** The header is a structured-field Item (RFC 8941/9651) whose value must be a
String: ``"..."`` in double quotes, printable ASCII, ``\\"`` and ``\\\\`` the only escapes.
Parameters (``"k";v=1``) are parsed and ignored. An unquoted token, a bad escape, a
non-ASCII or control character, an empty string, more than ``max_key_length`` (default
255) characters, or two ``Idempotency-Key`` fields are 400. ``stripe_compatible=True``
also accepts an unquoted value (printable ASCII without spaces), as Stripe's clients send.

**The fingerprint** is the SHA-256 of the method, the path, the raw query string, the
values of ``fingerprint_headers`` (default ``content-type``) and the body. It is stored
with the claim; a request with the same key and another fingerprint is refused, never
answered with the other request's response.

**Identity.** The record is looked up by SHA-256 of (identity, key), so one caller can
never receive another caller's recorded response, and neither raw keys nor identities
reach the store. ``identity`` is a function of the ASGI scope (sync or async) returning a
string, for example the authenticated principal (``scope_user_identity`` reads Starlette's
``AuthenticationMiddleware``; put that middleware *outside* this one) or an API key header
(``header_identity``). It runs before the application, so FastAPI dependencies cannot
provide it. The default, no identity function, puts every caller in one shared anonymous
space: then anyone who learns or guesses another client's key and sends an identical
request receives that client's response. Use it only for single-tenant services with
random keys, or set ``allow_anonymous=False`` to refuse (401) requests without identity.

**Which responses are recorded.** By default 2xx, 3xx and 4xx, except the statuses that
mean "try again": 401, 403, 408, 409, 423, 425 and 429. Those, every 5xx, an application
that raises, and a request cancelled before its response finished *abandon* the claim,
so a retry runs the handler again (``record=`` takes your own predicate of the status).
The decision is made when the last body chunk is sent, and the record is written *before*
that chunk goes out, so a client that has its response and retries at once gets the
replay, never a 409. Work the application does after its response (Starlette background
tasks) does not affect the record.

**Size limits and streaming.** The request body is read once, at most ``max_body`` bytes
(default 1 MiB; a larger ``Content-Length`` or body is 413 before the application runs),
then handed to the application as one message. The response is forwarded as it is
produced, chunk by chunk, never delayed; a copy is kept while it totals at most
``max_response_body`` bytes (default 512 KiB). A streamed response that ends within the
limit is recorded and replayed whole (same bytes, one chunk). A response that exceeds the
limit, or that the store refuses as too large (the coordinator's ``max_result_bytes``),
is still delivered in full to the first caller, and the claim is *completed as not
replayable*: the side effect is not repeated, and a retry gets 409
``idempotency_response_unavailable`` with the original status in ``original_status``, so
the client fetches the result another way (a GET) instead of running the operation again.
Never-ending streams (server-sent events) do not belong behind this middleware: their
claim stays in flight until its lease ends. The ASGI ``pathsend``, ``zerocopysend`` and
``trailers`` extensions are hidden from the application on keyed requests, so file
responses send their bytes through the middleware.

**Leases and heartbeats.** While the handler runs, its claim is renewed (every
``renew_every``, default a third of the lease) by the coordinator's one renewer, so a
handler may be slower than the lease. The lease (``spec.lease``, default 30 seconds) is how
long after a crash (a killed server process) the key frees itself. ``max_run`` stops
renewing after that long (a handler stuck forever); ``heartbeat=False`` never renews (the
lease must then outlast the slowest handler). A claim that is lost anyway (renewal
refused or late: a stopped process, a silent store) is logged; the handler is not
cancelled (part of its response may be out already); its response is still recorded if
no other attempt took the key over, else its ``complete`` is refused (``ClaimLost``,
logged as a warning). Recorded responses are kept for ``spec.ttl`` (default 24 hours).

**Replays** carry the recorded status, headers (hop-by-hop headers dropped, Content-Length
set to the body) and body, plus ``Idempotent-Replayed: true`` (``replay_header=``). The
server adds its own ``Date`` and ``Server``. ``Set-Cookie`` fields are replayed too, which
is safe because only the same identity can receive a replay. Recorded responses are
stored as JSON data (``{"v": 1, "status": ..., "headers": [[name, value], ...], "body":
base64}``, header bytes as latin-1 strings), never pickled; with a coordinator
``keyring`` and a spec with ``encrypt_result=True`` they are sealed at rest.
"""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import hashlib
import inspect
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from datetime import timedelta
from http import HTTPStatus
from typing import Any, Union

from .._base import Heartbeat, heartbeat_options
from .._core.types import Claimed, ClaimToken, Completed, IdempotencySpec, InFlight
from .._errors import (
    ConfigurationError,
    PayloadMismatch,
    ResultDecodeError,
    ResultTooLarge,
    StaleClaim,
    StoreFull,
    StoreUnavailable,
)
from ..aio import AsyncCoordinator, AsyncIdempotencyPort

__all__ = [
    "DEFAULT_SPEC",
    "IdempotencyMiddleware",
    "MalformedKey",
    "default_record",
    "header_identity",
    "parse_idempotency_key",
    "scope_user_identity",
]

log = logging.getLogger("idemlock.asgi")

# ASGI 3 types, spelled out so no framework is imported.
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Identity = Callable[[Scope], "str | Awaitable[str | None] | None"]
RouteFilter = Union[
    Callable[[Scope], bool], str, "re.Pattern[str]", Iterable["str | re.Pattern[str]"]
]

DEFAULT_SPEC = IdempotencySpec("http", ttl=timedelta(hours=24), lease=timedelta(seconds=30))

#: statuses that mean "try again later or differently": never recorded by default
_RETRYABLE_4XX = frozenset({401, 403, 408, 409, 423, 425, 429})
#: connection-level headers that must not be replayed on another connection
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
#: ASGI extensions that would let the app send bytes around us
_HIDDEN_EXTENSIONS = ("http.response.pathsend", "http.response.zerocopysend")
_TRAILERS = "http.response.trailers"
_RECORD_VERSION = 1
#: first and longest pause between writes of a record the store refused
_RECORD_RETRY_FIRST = 0.1
_RECORD_RETRY_MAX = 2.0


def default_record(status: int) -> bool:
    """Record 2xx, 3xx and 4xx except 401, 403, 408, 409, 423, 425 and 429."""
    return 200 <= status < 500 and status not in _RETRYABLE_4XX


def header_identity(name: str) -> Callable[[Scope], str | None]:
    """An identity function returning the value of request header ``name`` (e.g. an API
    key), or None when the request has none. The value is hashed into the lookup key,
    never stored."""
    wanted = name.lower().encode("latin-1")

    def identity(scope: Scope) -> str | None:
        for key, value in scope.get("headers") or ():
            if key == wanted and value:
                return bytes(value).decode("latin-1")
        return None

    return identity


def scope_user_identity(scope: Scope) -> str | None:
    """The identity of ``scope["user"]`` as set by Starlette's ``AuthenticationMiddleware``
    (which must wrap this middleware), or None for an unauthenticated user."""
    user = scope.get("user")
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    ident = getattr(user, "identity", None)
    return None if ident is None else str(ident)


# ---- the header: an RFC 8941 / 9651 Item whose bare item is a String ------------------


class MalformedKey(ValueError):
    """The Idempotency-Key header is not a usable structured-field String."""


_PARAM_KEY = re.compile(r"[a-z*][a-z0-9_\-.*]*")
_NUMBER = re.compile(r"-?(?:[0-9]{1,12}\.[0-9]{1,3}|[0-9]{1,15})(?![0-9.])")
_INTEGER = re.compile(r"-?[0-9]{1,15}(?![0-9.])")
_TOKEN = re.compile(r"[A-Za-z*][!#$%&'*+\-.^_`|~0-9A-Za-z:/]*")
_BINARY = re.compile(r":[A-Za-z0-9+/=]*:")
_BOOLEAN = re.compile(r"\?[01]")
_LOWER_HEX = frozenset("0123456789abcdef")


def _parse_string(text: str, pos: int) -> tuple[str, int]:
    """An sf-string starting at ``text[pos] == '"'``: (value, position after it)."""
    out: list[str] = []
    i = pos + 1
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            if i + 1 >= n or text[i + 1] not in '"\\':
                raise MalformedKey("a backslash may only escape '\"' or '\\'")
            out.append(text[i + 1])
            i += 2
        elif ch == '"':
            return "".join(out), i + 1
        elif not " " <= ch <= "~":
            raise MalformedKey("only printable ASCII is allowed inside the quotes")
        else:
            out.append(ch)
            i += 1
    raise MalformedKey("the string has no closing double quote")


def _skip_display_string(text: str, pos: int) -> int:
    """An RFC 9651 display string (``%"..."``) starting at ``pos``; its end."""
    raw = bytearray()
    i = pos + 2
    n = len(text)
    while i < n:
        ch = text[i]
        if not " " <= ch <= "~":
            raise MalformedKey("a display string allows only printable ASCII")
        if ch == "%":
            hexdigits = text[i + 1 : i + 3]
            if len(hexdigits) != 2 or not set(hexdigits) <= _LOWER_HEX:
                raise MalformedKey("a display string needs %xx with lowercase hex digits")
            raw.append(int(hexdigits, 16))
            i += 3
        elif ch == '"':
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                raise MalformedKey("a display string is not valid UTF-8") from None
            return i + 1
        else:
            raw.append(ord(ch))
            i += 1
    raise MalformedKey("the display string has no closing double quote")


def _skip_bare_item(text: str, pos: int) -> int:
    """Validate any bare item (a parameter value) at ``pos``; return its end."""
    ch = text[pos : pos + 1]
    if ch == '"':
        return _parse_string(text, pos)[1]
    if ch == "%" and text[pos + 1 : pos + 2] == '"':
        return _skip_display_string(text, pos)
    if ch == "@":
        m = _INTEGER.match(text, pos + 1)
    else:
        m = next(
            (m for rx in (_NUMBER, _TOKEN, _BINARY, _BOOLEAN) if (m := rx.match(text, pos))),
            None,
        )
    if m is None:
        raise MalformedKey(f"a parameter value is malformed at {text[pos : pos + 10]!r}")
    return m.end()


def parse_idempotency_key(
    value: bytes | str, *, max_length: int = 255, allow_unquoted: bool = False
) -> str:
    """The key carried by an ``Idempotency-Key`` field value, or raise
    :class:`MalformedKey`.

    The value must be a structured-field Item whose bare item is a String (RFC 8941
    section 3.3.3): ``"abc"``, with ``\\"`` and ``\\\\`` as the only escapes; parameters
    are checked and ignored. The decoded key must have 1 to ``max_length`` characters.
    ``allow_unquoted`` also accepts a bare value of printable ASCII without spaces (what
    Stripe's clients send)."""
    text = value.decode("latin-1") if isinstance(value, (bytes, bytearray)) else value
    text = text.strip(" \t")
    if not text.startswith('"'):
        if allow_unquoted and text and all("!" <= ch <= "~" for ch in text):
            key = text
        else:
            raise MalformedKey(
                'the value must be a quoted string, for example Idempotency-Key: "8e03978e-..."'
            )
    else:
        key, pos = _parse_string(text, 0)
        while text[pos : pos + 1] == ";":
            pos += 1
            while text[pos : pos + 1] == " ":
                pos += 1
            m = _PARAM_KEY.match(text, pos)
            if m is None:
                raise MalformedKey("a parameter name must start with a-z or '*'")
            pos = m.end()
            if text[pos : pos + 1] == "=":
                pos = _skip_bare_item(text, pos + 1)
        if text[pos:].strip(" "):
            raise MalformedKey(f"unexpected characters after the string: {text[pos:][:20]!r}")
    if not key:
        raise MalformedKey("the key must not be empty")
    if len(key) > max_length:
        raise MalformedKey(f"the key has {len(key)} characters, more than {max_length}")
    return key


# ---- responses the middleware produces ------------------------------------------------


@dataclass(frozen=True)
class _Problem:
    status: int
    code: str
    title: str
    detail: str
    headers: tuple[tuple[bytes, bytes], ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


class _BodyTooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


@dataclass
class _Capture:
    """What the application has sent so far on a claimed request."""

    status: int | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    chunks: list[bytes] | None = field(default_factory=list)  # None: over the limit
    size: int = 0
    settled: bool = False  # completed or abandoned
    beat: Heartbeat | None = None  # the claim's heartbeat while the handler runs


def _stop(cap: _Capture) -> None:
    if cap.beat is not None:
        cap.beat.stop()


def _lost(token: ClaimToken) -> None:
    log.warning(
        "the idempotency claim of a running request was lost (renewal refused or late); "
        "its response is recorded only if no other attempt took the key over"
    )


async def _send_plain(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _has_body(status: int) -> bool:
    return status >= 200 and status not in (204, 304)


class IdempotencyMiddleware:
    """ASGI middleware implementing the ``Idempotency-Key`` request header.

    :param app: the ASGI application to wrap (given by ``app.add_middleware``).
    :param coordinator: an :class:`idemlock.aio.AsyncCoordinator` (``idemlock.aio.connect``).
    :param spec: the :class:`~idemlock.IdempotencySpec` (or its name) of the records:
        ``ttl`` is how long responses are replayed, ``lease`` how long after a crash a
        running request's key frees itself (renewed while the handler runs). Default
        ``DEFAULT_SPEC`` (``"http"``, 24 hours, 30 seconds).
    :param methods: the methods that honour the header (default POST and PATCH).
    :param routes: None (every path), a glob (``"/payments/*"``), a compiled regex
        (full match), a list of those, or a predicate of the scope.
    :param require_key: answer 400 to a configured request without the header.
    :param identity: function of the scope (sync or async) naming the caller; see the
        module documentation. Default: everyone is anonymous.
    :param allow_anonymous: when False, a request whose identity is None gets 401.
    :param fingerprint_headers: request headers that are part of the fingerprint.
    :param stripe_compatible: 400 instead of 422 on a key reused with another request,
        and unquoted key values accepted.
    :param max_body: largest request body read (413 above it).
    :param max_response_body: largest response body recorded; larger responses are
        delivered but not replayable.
    :param max_key_length: longest key accepted, in characters.
    :param header: the request header carrying the key.
    :param replay_header: response header marking a replay (None: none).
    :param record: predicate of the status deciding which responses are recorded
        (default :func:`default_record`).
    :param docs_url: documentation of your idempotency policy, used as the problem type
        base and in a ``Link`` header.
    :param www_authenticate: the ``WWW-Authenticate`` value sent with the 401.
    :param heartbeat: renew a running request's claim (default True).
    :param renew_every: seconds between renewals (default: a third of the lease).
    :param max_run: stop renewing a request's claim after this many seconds (None: never).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        coordinator: AsyncCoordinator,
        spec: IdempotencySpec | str = DEFAULT_SPEC,
        methods: Iterable[str] = ("POST", "PATCH"),
        routes: RouteFilter | None = None,
        require_key: bool = False,
        identity: Identity | None = None,
        allow_anonymous: bool = True,
        fingerprint_headers: Iterable[str] = ("content-type",),
        stripe_compatible: bool = False,
        max_body: int = 1 << 20,
        max_response_body: int = 512 * 1024,
        max_key_length: int = 255,
        header: str = "Idempotency-Key",
        replay_header: str | None = "Idempotent-Replayed",
        record: Callable[[int], bool] = default_record,
        docs_url: str | None = None,
        www_authenticate: str = "Bearer",
        heartbeat: bool = True,
        renew_every: timedelta | float | None = None,
        max_run: timedelta | float | None = None,
    ) -> None:
        if not isinstance(coordinator, AsyncCoordinator):
            raise ConfigurationError(
                "IdempotencyMiddleware needs an idemlock.aio.AsyncCoordinator "
                f"(idemlock.aio.connect(...)), got {type(coordinator).__name__}"
            )
        for name, limit in (
            ("max_body", max_body),
            ("max_response_body", max_response_body),
            ("max_key_length", max_key_length),
        ):
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise ConfigurationError(f"{name} must be a positive int, got {limit!r}")
        if isinstance(methods, str):
            methods = (methods,)
        if identity is not None and not callable(identity):
            raise ConfigurationError("identity must be a function of the ASGI scope")
        if not callable(record):
            raise ConfigurationError("record must be a function of the response status")
        self.app = app
        self.port: AsyncIdempotencyPort = coordinator.idempotency(spec)
        self._every, self._max_run = heartbeat_options(
            self.port, heartbeat, renew_every, max_run, None
        )
        self.methods = frozenset(m.upper() for m in methods)
        self._route = _route_filter(routes)
        self.require_key = require_key
        self.identity = identity
        self.allow_anonymous = allow_anonymous
        self.fingerprint_headers = tuple(h.lower().encode("latin-1") for h in fingerprint_headers)
        self.stripe_compatible = stripe_compatible
        self.max_body = max_body
        self.max_response_body = max_response_body
        self.max_key_length = max_key_length
        self.header = header
        self._header = header.lower().encode("latin-1")
        self._replay_header = (
            None if replay_header is None else (replay_header.lower().encode("latin-1"), b"true")
        )
        self.record = record
        self.docs_url = docs_url
        self.www_authenticate = www_authenticate
        #: records being written again after a store failure
        self._background: set[asyncio.Task[None]] = set()

    # ---- the request -------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method", "").upper() not in self.methods
            or not self._route(scope)
        ):
            await self.app(scope, receive, send)
            return
        values = [v for k, v in scope.get("headers") or () if bytes(k).lower() == self._header]
        if not values:
            if self.require_key:
                await self._problem(send, self._missing())
            else:
                await self.app(scope, receive, send)
            return
        problem, key = self._key_of(values)
        if problem is not None:
            await self._problem(send, problem)
            return
        assert key is not None
        ident = await self._identity_of(scope)
        if ident is None and not self.allow_anonymous:
            await self._problem(send, self._unauthenticated())
            return
        try:
            body = await self._read_body(scope, receive)
        except _BodyTooLarge:
            await self._problem(send, self._too_large())
            return
        except _Disconnected:
            return  # nobody to answer, nothing claimed
        await self._keyed(scope, receive, send, self._lookup_key(ident, key), body)

    def _key_of(self, values: list[bytes]) -> tuple[_Problem | None, str | None]:
        if len(values) > 1:
            return self._malformed("send the header once"), None
        try:
            key = parse_idempotency_key(
                values[0],
                max_length=self.max_key_length,
                allow_unquoted=self.stripe_compatible,
            )
        except MalformedKey as exc:
            return self._malformed(str(exc)), None
        return None, key

    async def _identity_of(self, scope: Scope) -> str | None:
        if self.identity is None:
            return None
        ident = self.identity(scope)
        if inspect.isawaitable(ident):
            ident = await ident
        if ident is not None and not isinstance(ident, str):
            raise ConfigurationError(
                f"the identity function must return a str or None, got {type(ident).__name__}"
            )
        return ident

    def _lookup_key(self, ident: str | None, key: str) -> str:
        # JSON keeps (identity, key) pairs unambiguous: ("a", "b:c") != ("a:b", "c"),
        # and None (anonymous) differs from every string identity.
        joined = json.dumps([ident, key], ensure_ascii=True, separators=(",", ":"))
        return hashlib.sha256(b"idemlock-http/1\0" + joined.encode("ascii")).hexdigest()

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        for k, v in scope.get("headers") or ():
            if bytes(k).lower() == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = 0  # the server validates framing; count what arrives
                if declared > self.max_body:
                    raise _BodyTooLarge
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            if message["type"] != "http.request":
                continue
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _fingerprint(self, scope: Scope, body: bytes) -> dict[str, Any]:
        headers = [
            [bytes(k).lower().decode("latin-1"), bytes(v).decode("latin-1")]
            for k, v in scope.get("headers") or ()
            if bytes(k).lower() in self.fingerprint_headers
        ]
        headers.sort(key=lambda kv: kv[0])  # stable: keeps repeated headers in order
        return {
            "method": scope["method"].upper(),
            "path": scope.get("path", ""),
            "query": bytes(scope.get("query_string", b"")).decode("latin-1"),
            "headers": headers,
            "body": hashlib.sha256(body).hexdigest(),
        }

    async def _keyed(
        self, scope: Scope, receive: Receive, send: Send, lookup: str, body: bytes
    ) -> None:
        try:
            claim, sent = await self.port._claim_at(lookup, self._fingerprint(scope, body), None)
        except PayloadMismatch:
            await self._problem(send, self._mismatch())
            return
        except (StoreUnavailable, StoreFull, OSError, TimeoutError) as exc:
            # Fail closed: the request never runs unprotected.
            log.warning("idempotency store failed; answering 503: %s: %s", type(exc).__name__, exc)
            await self._problem(send, self._unavailable())
            return
        except ResultDecodeError:
            log.error("cannot read the recorded response of a request", exc_info=True)
            await self._problem(send, self._unreadable())
            return
        if isinstance(claim, InFlight):
            await self._problem(send, self._in_flight())
            return
        if isinstance(claim, Completed):
            await self._replay(send, claim)
            return
        assert isinstance(claim, Claimed)
        await self._run(scope, receive, send, claim.token, body, sent)

    # ---- running the application on a claim ----------------------------------------------

    async def _run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        token: ClaimToken,
        body: bytes,
        sent: float,
    ) -> None:
        scope = dict(scope)
        extensions = dict(scope.get("extensions") or {})
        for name in (*_HIDDEN_EXTENSIONS, _TRAILERS):
            extensions.pop(name, None)
        scope["extensions"] = extensions
        pending = [body]
        cap = _Capture()
        if self._every is not None:
            cap.beat = self.port._heartbeat(token, sent, self._every, self._max_run, _lost)

        async def replay_receive() -> Message:
            if pending:
                return {"type": "http.request", "body": pending.pop(), "more_body": False}
            return await receive()

        async def capture_send(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                cap.status = int(message["status"])
                cap.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers") or ()]
            elif kind == "http.response.body" and not cap.settled:
                chunk = bytes(message.get("body", b""))
                cap.size += len(chunk)
                if cap.chunks is not None:
                    if cap.size > self.max_response_body:
                        cap.chunks = None  # stop copying; keep forwarding
                    else:
                        cap.chunks.append(chunk)
                if not message.get("more_body", False):
                    # Settle before the last chunk leaves, so a client that has the whole
                    # response and retries at once finds the record.
                    await self._settle(token, cap)
            await send(message)

        try:
            await self.app(scope, replay_receive, capture_send)
        except BaseException:
            _stop(cap)
            if not cap.settled:
                cap.settled = True
                await self._abandon(token)
            raise
        _stop(cap)
        if not cap.settled:
            # The application returned without finishing a response.
            cap.settled = True
            await self._abandon(token)

    async def _settle(self, token: ClaimToken, cap: _Capture) -> None:
        cap.settled = True
        _stop(cap)
        status = cap.status
        if status is None or not self.record(status):
            await self._abandon(token)
            return
        result: dict[str, Any] = {"v": _RECORD_VERSION, "status": status}
        if cap.chunks is None:
            log.warning(
                "response of %s bytes is over max_response_body=%s: delivered, recorded as "
                "not replayable",
                cap.size,
                self.max_response_body,
            )
            result["replayable"] = False
        else:
            result["headers"] = [
                [k.decode("latin-1"), v.decode("latin-1")]
                for k, v in cap.headers
                if k.lower() not in _HOP_BY_HOP
            ]
            result["body"] = base64.b64encode(b"".join(cap.chunks)).decode("ascii")
        try:
            await self._complete(token, status, result)
        except StaleClaim:
            log.warning(
                "the response was not recorded: the claim (lease %s) was lost before the "
                "request finished (%s) and another attempt took the key over, so a retry "
                "may have run again",
                self.port.spec.lease,
                cap.beat.reason if cap.beat is not None else "not renewed: heartbeat=False",
            )
        except Exception:
            # The handler ran and its response goes out, but the store did not take the
            # record. Abandoning would let the client's retry run the handler again (a
            # second charge), so keep the claim (retries get 409) and record it later.
            log.error(
                "idempotency store failed while recording a %s response; it is delivered, "
                "its key stays reserved (retries get 409) and the record is written again "
                "in the background until the claim's lease ends at %s",
                status,
                token.expires_at.isoformat(),
                exc_info=True,
            )
            until = token.expires_at.timestamp()
            if cap.beat is not None and cap.beat.state.expires_ms:
                until = max(until, cap.beat.state.expires_ms / 1000)  # renewed since
            self._record_later(token, status, result, until)

    async def _complete(self, token: ClaimToken, status: int, result: dict[str, Any]) -> None:
        try:
            await self.port.complete(token, result)
        except ResultTooLarge:
            log.warning(
                "response is too large for the store (max_result_bytes): delivered, "
                "recorded as not replayable"
            )
            await self.port.complete(
                token, {"v": _RECORD_VERSION, "status": status, "replayable": False}
            )

    def _record_later(
        self, token: ClaimToken, status: int, result: dict[str, Any], until: float
    ) -> None:
        task = asyncio.get_running_loop().create_task(
            self._retry_record(token, status, result, until)
        )
        self._background.add(task)  # a reference, so the task is not collected mid-way
        task.add_done_callback(self._background.discard)

    async def _retry_record(
        self, token: ClaimToken, status: int, result: dict[str, Any], until: float
    ) -> None:
        """Write a response's record again with backoff while its claim's lease lasts
        (the response is out already). A retry in the meantime gets 409, never a run."""
        clock = self.port._coord.clock
        pause = _RECORD_RETRY_FIRST
        while True:
            await asyncio.sleep(pause)
            try:
                await self._complete(token, status, result)
            except StaleClaim:
                # Our failed attempt reached the store after all, or the lease ran out
                # and another attempt took over: either way nothing is left to write.
                log.warning("the response's record was written or taken over meanwhile")
                return
            except Exception as exc:
                left = until - clock.time()
                if left <= pause:
                    log.error(
                        "gave up recording a %s response: the store still fails (%s: %s) "
                        "and the claim's lease is over, so a retry runs the handler again",
                        status,
                        type(exc).__name__,
                        exc,
                    )
                    return
                pause = min(pause * 2, _RECORD_RETRY_MAX)
                continue
            log.warning("recorded a %s response on a later attempt; retries replay it", status)
            return

    async def _abandon(self, token: ClaimToken) -> None:
        try:
            await self.port.abandon(token)
        except StaleClaim:
            # The lease ran out and another attempt may hold the key: nothing to undo.
            log.info("the idempotency claim to abandon had already ended")
        except Exception:
            # Store down: the claim frees itself when its lease ends; until then retries
            # get 409. Cancellation propagates; the lease covers that case too.
            log.warning(
                "could not abandon an idempotency claim; its key stays reserved until %s",
                token.expires_at.isoformat(),
                exc_info=True,
            )

    # ---- replays ----------------------------------------------------------------------

    async def _replay(self, send: Send, claim: Completed) -> None:
        rec = claim.result
        parsed = _parse_record(rec)
        if parsed is None:
            log.error("stored idempotency record is not a recorded response: %.200r", rec)
            await self._problem(send, self._unreadable())
            return
        status, headers, body = parsed
        if body is None:
            await self._problem(send, self._unreplayable(status))
            return
        out: list[tuple[bytes, bytes]] = []
        length = str(len(body)).encode("ascii")
        has_length = False
        for name, value in headers:
            if name.lower() == b"content-length":
                if has_length or not _has_body(status):
                    continue
                value, has_length = length, True
            out.append((name, value))
        if not has_length and _has_body(status):
            out.append((b"content-length", length))
        if self._replay_header is not None:
            out.append(self._replay_header)
        await _send_plain(send, status, out, body)

    # ---- problems ---------------------------------------------------------------------

    async def _problem(self, send: Send, p: _Problem) -> None:
        if self.docs_url is None:
            ptype, title = "about:blank", HTTPStatus(p.status).phrase
        else:
            ptype, title = f"{self.docs_url}#{p.code}", p.title
        doc = {
            "type": ptype,
            "title": title,
            "status": p.status,
            "detail": p.detail,
            "code": p.code,
            **p.extra,
        }
        body = json.dumps(doc, ensure_ascii=True).encode("ascii")
        headers = [
            (b"content-type", b"application/problem+json"),
            (b"content-length", str(len(body)).encode("ascii")),
            (b"content-language", b"en"),
            *p.headers,
        ]
        if self.docs_url is not None:
            link = f'<{self.docs_url}>; rel="describedby"'.encode("latin-1")
            headers.append((b"link", link))
        await _send_plain(send, p.status, headers, body)

    def _missing(self) -> _Problem:
        return _Problem(
            400,
            "idempotency_key_missing",
            "Idempotency-Key is missing",
            f"This operation requires an {self.header} header with a unique quoted value, "
            f'for example {self.header}: "8e03978e-40d5-43e8-bc93-6894a57f9324".',
        )

    def _malformed(self, why: str) -> _Problem:
        return _Problem(
            400,
            "idempotency_key_malformed",
            "Idempotency-Key is malformed",
            f"The {self.header} header is not a valid key: {why}.",
        )

    def _unauthenticated(self) -> _Problem:
        return _Problem(
            401,
            "idempotency_identity_missing",
            "Authentication required",
            f"Requests with an {self.header} must identify their caller.",
            headers=((b"www-authenticate", self.www_authenticate.encode("latin-1")),),
        )

    def _too_large(self) -> _Problem:
        return _Problem(
            413,
            "idempotency_body_too_large",
            "Request body too large",
            f"Requests with an {self.header} may have at most {self.max_body} bytes of body.",
        )

    def _mismatch(self) -> _Problem:
        return _Problem(
            400 if self.stripe_compatible else 422,
            "idempotency_key_reused",
            "Idempotency-Key is already used",
            f"This {self.header} was already used with a different request (method, path, "
            "query, body or headers). A retry must repeat the request exactly; a new "
            "request needs a new key.",
        )

    def _in_flight(self) -> _Problem:
        return _Problem(
            409,
            "idempotency_key_in_use",
            "A request is outstanding for this Idempotency-Key",
            f"A request with the same {self.header} is still being processed; retry later "
            "to receive its response.",
            headers=((b"retry-after", b"1"),),
        )

    def _unreplayable(self, status: int) -> _Problem:
        return _Problem(
            409,
            "idempotency_response_unavailable",
            "The response cannot be replayed",
            f"The request with this {self.header} already completed with status {status}, "
            "but its response was too large to record. It will not run again; fetch the "
            "result another way.",
            extra={"original_status": status},
        )

    def _unreadable(self) -> _Problem:
        return _Problem(
            500,
            "idempotency_record_invalid",
            "Recorded response cannot be read",
            f"The response recorded for this {self.header} cannot be read (another "
            "program wrote it, or it was sealed with another key).",
        )

    def _unavailable(self) -> _Problem:
        return _Problem(
            503,
            "idempotency_store_unavailable",
            "Idempotency store unavailable",
            "The request was not processed because its idempotency could not be checked; "
            "retry with the same key.",
            headers=((b"retry-after", b"1"),),
        )


def _parse_record(
    rec: Any,
) -> tuple[int, list[tuple[bytes, bytes]], bytes | None] | None:
    """(status, headers, body or None when not replayable), or None if ``rec`` is not a
    response this middleware recorded."""
    if not isinstance(rec, dict) or rec.get("v") != _RECORD_VERSION:
        return None
    status = rec.get("status")
    if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
        return None
    if rec.get("replayable") is False:
        return status, [], None
    raw_headers, raw_body = rec.get("headers"), rec.get("body")
    if not isinstance(raw_headers, list) or not isinstance(raw_body, str):
        return None
    headers: list[tuple[bytes, bytes]] = []
    try:
        for pair in raw_headers:
            name, value = pair
            headers.append((name.encode("latin-1"), value.encode("latin-1")))
        body = base64.b64decode(raw_body, validate=True)
    except (TypeError, ValueError, AttributeError):
        return None
    return status, headers, body


def _route_filter(routes: RouteFilter | None) -> Callable[[Scope], bool]:
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
