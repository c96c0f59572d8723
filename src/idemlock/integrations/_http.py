"""The ``Idempotency-Key`` decisions of the ASGI middleware, for blocking servers.

WSGI and Django answer exactly as :class:`idemlock.integrations.asgi.IdempotencyMiddleware`
does (the same key parser, fingerprint, lookup key, problem documents, record format,
replay, and the same handling of a store that fails), because they *run its code*: this
module drives the ASGI middleware's steps as coroutines that never suspend, over a
blocking :class:`idemlock.Coordinator`. Nothing of the table is written twice, so the
servers cannot drift apart.

A framework adapter builds an ASGI-like ``scope`` (``method``, ``path``,
``query_string``, ``headers`` as lowercase byte pairs), calls :meth:`SyncHttp.begin`, and
then either sends the :class:`Answer` it got, lets the request pass untouched, or runs
its handler on the :class:`Run` and hands the response to :meth:`SyncHttp.finish` (or
calls :meth:`SyncHttp.fail` if the handler raised).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from .._core.types import Claim, ClaimToken, IdempotencySpec
from .._errors import ConfigurationError, ResultTooLarge
from .._sync import Coordinator, IdempotencyPort
from ..aio import AsyncIdempotencyPort
from .asgi import (
    IdempotencyMiddleware,
    Message,
    Receive,
    RouteFilter,
    Scope,
    Send,
    _Capture,
    _lost,
)

__all__ = ["Answer", "Pass", "Run", "SyncHttp", "TransactionFailed"]

T = TypeVar("T")

#: bytes read from a request body per step
_CHUNK = 64 * 1024


def _drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (its awaits reach only blocking calls)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return cast(T, stop.value)
    coro.close()
    raise RuntimeError("an idemlock HTTP step suspended on a blocking server")  # pragma: no cover


#: the caller's open transaction (a psycopg connection) in which to record a response
_TX: contextvars.ContextVar[Any] = contextvars.ContextVar("idemlock_http_tx", default=None)


class TransactionFailed(BaseException):
    """Recording in the caller's transaction failed (``cause``): the transaction must
    roll back. A BaseException so the ASGI steps' store-failure handling, which keeps
    the claim and records later outside the transaction, does not apply."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(cause)
        self.cause = cause


class _Blocking:
    """The face of an async port that the ASGI steps await, over a blocking port: each
    coroutine makes its blocking call and returns without suspending."""

    def __init__(self, port: IdempotencyPort) -> None:
        self._sync = port
        self._coord = port._coord
        self.spec = port.spec

    async def _claim_at(self, key: str, payload: Any, wait: float | None) -> tuple[Claim, float]:
        return self._sync._claim_at(key, payload, wait)

    async def complete(self, token: ClaimToken, result: Any) -> None:
        conn = _TX.get()
        if conn is None:
            self._sync.complete(token, result)
            return
        from ..stores.postgres.fenced import complete_in_transaction

        try:
            complete_in_transaction(conn, self._sync, token, result)
        except ResultTooLarge:
            raise  # refused before any SQL: the steps record it as not replayable
        except Exception as exc:
            raise TransactionFailed(exc) from exc

    async def abandon(self, token: ClaimToken) -> None:
        self._sync.abandon(token)


@dataclass(frozen=True)
class Answer:
    """A response the middleware gives itself (a problem or a replay)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(frozen=True)
class Pass:
    """The request is not keyed (or not covered): run the handler untouched."""


@dataclass
class Run:
    """The request holds a fresh claim: run the handler on ``body``, then ``finish``."""

    token: ClaimToken
    body: bytes
    cap: _Capture


class _Steps(IdempotencyMiddleware):
    """The ASGI middleware with its store calls made blocking. Used only by
    :class:`SyncHttp`; never an ASGI application."""

    def __init__(self, port: IdempotencyPort, **options: Any) -> None:
        # Only the policy attributes the steps read are set; the ASGI constructor wants
        # an async coordinator, so it is not called.
        self.app = _mark_pass
        self.port = cast(AsyncIdempotencyPort, _Blocking(port))
        for name, value in options.items():
            setattr(self, name, value)
        self._background: set[asyncio.Task[None]] = set()

    async def _run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        token: ClaimToken,
        body: bytes,
        sent: float,
    ) -> None:
        scope["idemlock.run"] = (token, body, sent)

    def _record_later(
        self, token: ClaimToken, status: int, result: dict[str, Any], until: float
    ) -> None:
        # No event loop on a blocking server: the ASGI retry loop runs in its own thread.
        threading.Thread(
            target=asyncio.run,
            args=(self._retry_record(token, status, result, until),),
            name="idemlock-http-record",
            daemon=True,
        ).start()


async def _mark_pass(scope: Scope, receive: Receive, send: Send) -> None:
    scope["idemlock.pass"] = True


class SyncHttp:
    """The Idempotency-Key table on a blocking :class:`idemlock.Coordinator`; the options
    are those of :class:`~idemlock.integrations.asgi.IdempotencyMiddleware` (``identity``
    is the adapter's: it passes the caller's identity to :meth:`begin`)."""

    def __init__(self, coordinator: Coordinator, **options: Any) -> None:
        known = _asgi_options()
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigurationError(
                f"unknown idempotency option(s) {', '.join(unknown)}; the options are "
                f"those of the ASGI middleware: {', '.join(sorted(known))}"
            )
        # The defaults are the ASGI middleware's own, read from its signature.
        o = {**known, **options}
        spec: IdempotencySpec | str = o["spec"]
        methods: Iterable[str] = o["methods"]
        routes: RouteFilter | None = o["routes"]
        max_body, max_response_body = o["max_body"], o["max_response_body"]
        max_key_length, header, replay_header = o["max_key_length"], o["header"], o["replay_header"]
        record: Callable[[int], bool] = o["record"]
        if not isinstance(coordinator, Coordinator):
            raise ConfigurationError(
                "the WSGI/Django idempotency middleware needs a blocking idemlock.Coordinator "
                f"(idemlock.connect(...)), got {type(coordinator).__name__}"
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
        if not callable(record):
            raise ConfigurationError("record must be a function of the response status")
        from .._base import heartbeat_options
        from .asgi import _route_filter

        self.port = coordinator.idempotency(spec)
        every, limit_run = heartbeat_options(
            self.port, o["heartbeat"], o["renew_every"], o["max_run"], None
        )
        self.methods = frozenset(m.upper() for m in methods)
        self._route = _route_filter(routes)
        self._steps = _Steps(
            self.port,
            _every=every,
            _max_run=limit_run,
            methods=self.methods,
            _route=self._route,
            require_key=o["require_key"],
            identity=_scope_identity,
            allow_anonymous=o["allow_anonymous"],
            fingerprint_headers=tuple(
                h.lower().encode("latin-1") for h in o["fingerprint_headers"]
            ),
            stripe_compatible=o["stripe_compatible"],
            max_body=max_body,
            max_response_body=max_response_body,
            max_key_length=max_key_length,
            header=header,
            _header=header.lower().encode("latin-1"),
            _replay_header=(
                None
                if replay_header is None
                else (replay_header.lower().encode("latin-1"), b"true")
            ),
            record=record,
            docs_url=o["docs_url"],
            www_authenticate=o["www_authenticate"],
        )
        self.max_body = max_body
        self.max_response_body = max_response_body

    def covers(self, method: str, scope: Scope) -> bool:
        """Whether a request of this method and path is subject to the header."""
        return method.upper() in self.methods and self._route(scope)

    def begin(
        self,
        scope: Scope,
        identity: Callable[[], str | None],
        read: Callable[[int], bytes],
    ) -> Answer | Pass | Run:
        """Decide a request. ``scope`` is ASGI-like (``type`` is set here); ``identity``
        is called once the key is valid; ``read(n)`` returns up to n body bytes (b"" at
        the end) and is called only for keyed requests."""
        scope["type"] = "http"
        scope["idemlock.identity"] = identity
        sent: list[Message] = []

        async def receive() -> Message:
            chunk = read(_CHUNK)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunk)}

        async def send(message: Message) -> None:
            sent.append(message)

        _drive(self._steps(scope, receive, send))
        if scope.get("idemlock.pass"):
            return Pass()
        run = scope.get("idemlock.run")
        if run is not None:
            token, body, at = run
            cap = _Capture()
            steps = self._steps
            if steps._every is not None:
                cap.beat = self.port._heartbeat(token, at, steps._every, steps._max_run, _lost)
            return Run(token, body, cap)
        start, end = sent
        return Answer(int(start["status"]), list(start["headers"]), bytes(end["body"]))

    def finish(
        self,
        run: Run,
        status: int,
        headers: Iterable[tuple[bytes, bytes]],
        chunks: list[bytes] | None,
        transaction: Any = None,
    ) -> None:
        """Record (or abandon) the handler's response before its last bytes go out.
        ``chunks`` is None when the body was over ``max_response_body``. With
        ``transaction`` (a psycopg connection inside the caller's open transaction, on
        the PostgreSQL store's database) the record is written in that transaction;
        then :class:`TransactionFailed` means: roll back, then :meth:`abandon`."""
        if run.cap.settled:
            return
        run.cap.status = status
        run.cap.headers = [(k.lower(), v) for k, v in headers]
        run.cap.chunks = chunks
        reset = _TX.set(transaction)
        try:
            _drive(self._steps._settle(run.token, run.cap))
        finally:
            _TX.reset(reset)

    def abandon(self, run: Run) -> None:
        """Abandon the claim even though its response was settled (its record was
        rolled back with the caller's transaction)."""
        run.cap.settled = True
        _drive(self._steps._abandon(run.token))

    def problem(self, kind: str) -> Answer:
        """The middleware's own problem response ``kind``: "in_flight" or "unavailable"."""
        steps = self._steps
        p = steps._in_flight() if kind == "in_flight" else steps._unavailable()
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        _drive(steps._problem(send, p))
        start, end = sent
        return Answer(int(start["status"]), list(start["headers"]), bytes(end["body"]))

    def fail(self, run: Run) -> None:
        """The handler raised or gave up without a whole response: abandon the claim."""
        if run.cap.beat is not None:
            run.cap.beat.stop()
        if not run.cap.settled:
            run.cap.settled = True
            _drive(self._steps._abandon(run.token))


def _asgi_options() -> dict[str, Any]:
    """The ASGI middleware's keyword options and their defaults (not ``coordinator``
    and ``identity``, which each adapter takes its own way)."""
    params = inspect.signature(IdempotencyMiddleware.__init__).parameters
    return {
        name: p.default
        for name, p in params.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("coordinator", "identity")
    }


def _scope_identity(scope: Scope) -> str | None:
    ident: Callable[[], str | None] = scope["idemlock.identity"]
    return ident()
