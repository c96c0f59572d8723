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
identity function configured, it gives None    401 (``allow_anonymous=True``: runs in the
                                               shared anonymous key space)
request body over ``max_body``                 413 (the application is not called)
first request with the key                     the application runs; its response is
                                               recorded as described below
retry: same key and fingerprint, first done    the recorded response, plus
                                               ``Idempotent-Replayed: true``
retry while the first still runs               409, ``Retry-After: 1``
same key, different fingerprint                422 (``mismatch_status=400``: 400)
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

**The key.** The draft makes the header a structured-field Item (RFC 8941/9651) whose
value is a String: ``"..."`` in double quotes, printable ASCII, ``\\"`` and ``\\\\`` the only
escapes; parameters (``"k";v=1``) are parsed and ignored. Most clients (Stripe's SDKs
among them) send the key unquoted (``Idempotency-Key: order-A18``), so by default an
unquoted value of printable ASCII without spaces is accepted too, as the same key as its
quoted form. ``allow_unquoted_key=False`` accepts the sf-string only. A bad escape, a
non-ASCII or control character, an empty string, more than ``max_key_length`` (default
255) characters, or two ``Idempotency-Key`` fields are 400. ``stripe_compatible=True`` is
shorthand for ``mismatch_status=400`` (Stripe answers a reused key with 400).

**The fingerprint** is the SHA-256 of the method, the path, the raw query string, the
values of ``fingerprint_headers`` (default ``content-type``) and the body. A JSON body
(``application/json`` or ``+json``) counts in its RFC 8785 (JCS) form, so the same
document sent with other spacing, member order or number spelling (``1200.0`` for
``1200``) is the same request; any other body counts by its bytes. ``fingerprint=``
takes your own function of a :class:`RequestView` (``json_fields("amount",
"currency")`` keeps chosen fields); the method and path always count. It is stored with
the claim; a request with the same key and another fingerprint is refused, never
answered with the other request's response.

**Identity.** The record is looked up by SHA-256 of (identity, key), so one caller can
never receive another caller's recorded response, and neither raw keys nor identities
reach the store. ``identity`` is a function of the ASGI scope (sync or async) returning a
string, for example the authenticated principal (``scope_user_identity`` reads Starlette's
``AuthenticationMiddleware``; put that middleware *outside* this one) or an API key header
(``header_identity``). It runs before the application; to take the identity from a
FastAPI dependency use :mod:`idemlock.integrations.fastapi`. With an identity function, a
request for which it returns None gets 401 (``allow_anonymous=True`` runs it in a shared
anonymous key space instead). Without one, every caller shares one anonymous space: then
anyone who learns or guesses another client's key and sends an identical request
receives that client's response. Use that only for single-tenant services with random
keys, or set ``allow_anonymous=False`` to refuse (401) every request without identity.

**Which responses are recorded.** By default 2xx, 3xx and 4xx, except the statuses that
mean "try again": 401, 403, 408, 409, 423, 425 and 429. Those, every 5xx, an application
that raises, and a request cancelled before its response finished *abandon* the claim,
so a retry runs the handler again (``record=`` takes your own predicate of the status).
The decision is made when the last body chunk is sent, and the record is written *before*
that chunk goes out, so a client that has its response and retries at once gets the
replay, never a 409. Work the application does after its response (Starlette background
tasks) does not affect the record.

**Responses the framework produced before the handler ran** (routing errors, request
validation) should not be recorded: a client that fixes its body can then reuse its key.
A plain ASGI middleware cannot see where the framework ends and the handler begins, so
the rule is: every response is recorded as above, unless the application calls
:func:`expect_handler` on the request's scope; then a response sent before it calls
:func:`handler_started` abandons the claim. The FastAPI integration
(:mod:`idemlock.integrations.fastapi`) decides inside the endpoint, after FastAPI's
validation and dependencies, so its 422s are never recorded without any of this.

**Logging.** Everything is logged on ``idemlock.http`` (a store failure answered 503, a
lost claim, a record written late). When the application configures no logging at all
(uvicorn's default setup configures only its own loggers), idemlock's warnings and errors
are written to stderr; configure a handler for ``idemlock`` (or the root logger) to send
them elsewhere.

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

import inspect
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from .._errors import ConfigurationError
from ..aio import AsyncCoordinator
from .http.core import AsyncPortFace, HttpCore, Run
from .http.fingerprint import RequestView, json_fields
from .http.key_header import MalformedKey, parse_idempotency_key
from .http.options import DEFAULT_SPEC, HttpOptions, IdempotencyOptions, RouteOptions
from .http.problem_json import Answer
from .http.recorded_response import default_record

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "DEFAULT_SPEC",
    "HANDLER_GATE",
    "IdempotencyMiddleware",
    "IdempotencyOptions",
    "MalformedKey",
    "RequestView",
    "RouteOptions",
    "default_record",
    "expect_handler",
    "handler_started",
    "header_identity",
    "json_fields",
    "parse_idempotency_key",
    "scope_user_identity",
]

# ASGI 3 types, spelled out so no framework is imported.
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Identity = Callable[[Scope], "str | Awaitable[str | None] | None"]

#: the scope key of a keyed request's :class:`Run`, for :func:`expect_handler` and
#: :func:`handler_started`
HANDLER_GATE = "idemlock.run"
#: ASGI extensions that would let the app send bytes around us
_HIDDEN_EXTENSIONS = (
    "http.response.pathsend",
    "http.response.zerocopysend",
    "http.response.trailers",
)


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


def expect_handler(scope: Scope) -> None:
    """Say that this keyed request's handler will call :func:`handler_started`: until it
    does, the response is the framework's own (routing, validation) and is not
    recorded. A no-op on a request the middleware does not hold a claim for."""
    run = scope.get(HANDLER_GATE)
    if isinstance(run, Run):
        run.expects_handler = True


def handler_started(scope: Scope) -> None:
    """Mark that the request's handler started: its response is recorded."""
    run = scope.get(HANDLER_GATE)
    if isinstance(run, Run):
        run.handler_started = True


async def send_answer(send: Send, answer: Answer) -> None:
    await send({"type": "http.response.start", "status": answer.status, "headers": answer.headers})
    await send({"type": "http.response.body", "body": answer.body, "more_body": False})


class _BodyTooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body, at most ``limit`` bytes."""
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
        if size > limit:
            raise _BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_captured(core: HttpCore, run: Run, message: Message, send: Send) -> None:
    """Forward one response message of a claimed request, copying it into ``run``; the
    claim is settled before the last body chunk leaves."""
    kind = message["type"]
    if kind == "http.response.start":
        run.start(message["status"], message.get("headers") or ())
    elif kind == "http.response.body" and not run.settled:
        run.copy.add(bytes(message.get("body", b"")))
        if not message.get("more_body", False):
            # Settle before the last chunk leaves, so a client that has the whole
            # response and retries at once finds the record.
            await core.settle(run)
    await send(message)


async def run_claimed(
    app: ASGIApp, core: HttpCore, run: Run, scope: Scope, receive: Receive, send: Send
) -> None:
    """Run ``app`` on a claimed request: its response is forwarded as it is produced
    and copied into ``run``; the claim is settled before the last chunk leaves, and
    abandoned if the application raises or ends without a whole response."""
    scope = dict(scope)
    extensions = dict(scope.get("extensions") or {})
    for name in _HIDDEN_EXTENSIONS:
        extensions.pop(name, None)
    scope["extensions"] = extensions
    scope[HANDLER_GATE] = run
    pending = [run.body]

    async def replay_receive() -> Message:
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        return await receive()

    async def capture_send(message: Message) -> None:
        await send_captured(core, run, message, send)

    try:
        await app(scope, replay_receive, capture_send)
    except BaseException:
        await core.fail(run)
        raise
    await core.fail(run)  # a no-op once settled; else no whole response was sent


class IdempotencyMiddleware:
    """ASGI middleware implementing the ``Idempotency-Key`` request header.

    :param app: the ASGI application to wrap (given by ``app.add_middleware``).
    :param coordinator: an :class:`idemlock.aio.AsyncCoordinator` (``idemlock.aio.connect``).
    :param identity: function of the scope (sync or async) naming the caller; see the
        module documentation. Default: everyone is anonymous.
    :param spec: the :class:`~idemlock.IdempotencySpec` (or its name) of the records:
        ``ttl`` is how long responses are replayed, ``lease`` how long after a crash a
        running request's key frees itself (renewed while the handler runs). Default
        ``DEFAULT_SPEC`` (``"http"``, 24 hours, 30 seconds).
    :param methods: the methods that honour the header (default POST and PATCH).
    :param routes: None (every path), a glob (``"/payments/*"``), a compiled regex
        (full match), a list of those, or a predicate of the scope.
    :param require_key: answer 400 to a configured request without the header.
    :param allow_anonymous: whether a request whose identity is None runs (in one
        shared anonymous key space) or gets 401. Default: True without an ``identity``
        function, False (401) with one.
    :param fingerprint_headers: request headers that are part of the fingerprint.
    :param fingerprint: your own fingerprint function of a :class:`RequestView` (for
        example :func:`json_fields`); default: query, ``fingerprint_headers`` and the
        body (a JSON body canonically).
    :param allow_unquoted_key: accept an unquoted key (what Stripe's clients send) as well
        as the draft's sf-string (default); False: the sf-string only.
    :param mismatch_status: the status for a key reused with another request (default
        422; 400 as Stripe answers).
    :param stripe_compatible: shorthand for ``mismatch_status=400`` (an explicit
        ``mismatch_status`` wins).
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
        identity: Identity | None = None,
        **options: Unpack[IdempotencyOptions],
    ) -> None:
        if not isinstance(coordinator, AsyncCoordinator):
            raise ConfigurationError(
                "IdempotencyMiddleware needs an idemlock.aio.AsyncCoordinator "
                f"(idemlock.aio.connect(...)), got {type(coordinator).__name__}"
            )
        if identity is not None and not callable(identity):
            raise ConfigurationError("identity must be a function of the ASGI scope")
        opts = HttpOptions.of(options)
        self.app = app
        self.identity = identity
        self.port = coordinator.idempotency(opts.spec)
        self.core = HttpCore(AsyncPortFace(self.port), opts, has_identity=identity is not None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        core = self.core
        if scope["type"] != "http" or not core.covers(scope):
            await self.app(scope, receive, send)
            return
        headers = list(scope.get("headers") or ())
        key = core.key_of(headers)
        if key is None:
            await self.app(scope, receive, send)
            return
        if isinstance(key, Answer):
            await send_answer(send, key)
            return
        ident = await self._identity_of(scope)
        refused = core.refuse_identity(ident)
        if refused is not None:
            await send_answer(send, refused)
            return
        try:
            if core.declared_too_large(headers):
                raise _BodyTooLarge
            body = await read_body(receive, core.max_body)
        except _BodyTooLarge:
            await send_answer(send, core.problems.too_large())
            return
        except _Disconnected:
            return  # nobody to answer, nothing claimed
        decided = await core.claim(scope, ident, key, body)
        if isinstance(decided, Answer):
            await send_answer(send, decided)
            return
        await run_claimed(self.app, core, decided, scope, receive, send)

    async def _identity_of(self, scope: Scope) -> Any:
        if self.identity is None:
            return None
        ident = self.identity(scope)
        if inspect.isawaitable(ident):
            ident = await ident
        return ident
