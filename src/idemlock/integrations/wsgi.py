"""HTTP ``Idempotency-Key`` middleware for WSGI applications (Flask, Django's WSGI
handler, Pyramid, Bottle, ...), on a blocking :class:`idemlock.Coordinator`::

    app.wsgi_app = IdempotencyMiddleware(
        app.wsgi_app,
        coordinator=idemlock.connect("sqlite:///var/lib/app/idemlock.db"),
        identity=header_identity("x-api-key"),
    )

It answers exactly as the ASGI middleware (:mod:`idemlock.integrations.asgi`, whose
documentation has the whole table): 400 for a missing (``require_key``) or malformed
key, 401 when the identity function gives None (unless ``allow_anonymous=True``), 413
over ``max_body``, 409 while
the first request runs, 422 for the key reused on another request, the recorded response
plus ``Idempotent-Replayed: true`` for a retry, 503 when the store fails (the request does
not run), every error ``application/problem+json``. 5xx, the retryable 4xx and a handler
that raises are not recorded. A response the store fails to record is delivered and its
key stays reserved (retries get 409) while the record is written again in the background.

``identity`` is a function of the WSGI ``environ``. The record is written before the
response's last chunk leaves, so a client that has its response and retries at once gets
the replay. The application's ``wsgi.file_wrapper`` is hidden on keyed requests so file
responses pass through the middleware. Works under any WSGI server, across processes
(gunicorn workers) when the store is shared (SQLite file, Redis, PostgreSQL).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Generator, Iterable, Iterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from .._errors import ConfigurationError
from .._sync import Coordinator
from .http.blocking import SyncHttp
from .http.core import Pass, Run
from .http.options import IdempotencyOptions
from .http.problem_json import Answer

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["IdempotencyMiddleware", "environ_header_identity"]

Environ = dict[str, Any]
StartResponse = Callable[..., Any]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]


def environ_header_identity(name: str) -> Callable[[Environ], str | None]:
    """An identity function returning request header ``name`` (e.g. an API key) from the
    environ, or None; hashed into the lookup key, never stored."""
    cgi = "HTTP_" + name.upper().replace("-", "_")

    def identity(environ: Environ) -> str | None:
        return environ.get(cgi) or None

    return identity


def _scope(environ: Environ) -> dict[str, Any]:
    headers: list[tuple[bytes, bytes]] = []
    for name, value in environ.items():
        if name.startswith("HTTP_"):
            headers.append(
                (name[5:].replace("_", "-").lower().encode("latin-1"), value.encode("latin-1"))
            )
        elif name in ("CONTENT_TYPE", "CONTENT_LENGTH") and value:
            headers.append(
                (name.replace("_", "-").lower().encode("latin-1"), value.encode("latin-1"))
            )
    return {
        "method": environ.get("REQUEST_METHOD", "GET"),
        "path": environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", ""),
        "query_string": environ.get("QUERY_STRING", "").encode("latin-1"),
        "headers": headers,
    }


def _reader(environ: Environ) -> Callable[[int], bytes]:
    stream = environ["wsgi.input"]
    try:
        left: int | None = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        left = 0
    if not left and (
        environ.get("wsgi.input_terminated")
        or environ.get("HTTP_TRANSFER_ENCODING", "").lower() == "chunked"
    ):
        left = None  # the server ends the stream for us

    def read(n: int) -> bytes:
        nonlocal left
        if left is None:
            return bytes(stream.read(n))
        if left <= 0:
            return b""
        chunk = bytes(stream.read(min(n, left)))
        left = left - len(chunk) if chunk else 0
        return chunk

    return read


def _answer(start_response: StartResponse, answer: Answer) -> list[bytes]:
    status = f"{answer.status} {HTTPStatus(answer.status).phrase}"
    start_response(status, [(k.decode("latin-1"), v.decode("latin-1")) for k, v in answer.headers])
    return [answer.body]


class _Closing:
    """The keyed response iterable. A server that closes it without iterating (the
    client left first) never starts the generator, so its cleanup would not run: close
    abandons the claim (and stops its heartbeat) unless the response was settled."""

    def __init__(self, body: Generator[bytes, None, None], core: SyncHttp, run: Run) -> None:
        self._body, self._core, self._run = body, core, run

    def __iter__(self) -> Iterator[bytes]:
        return self._body

    def close(self) -> None:
        try:
            self._body.close()
        finally:
            self._core.fail(self._run)


class IdempotencyMiddleware:
    """WSGI middleware implementing the ``Idempotency-Key`` request header.

    :param app: the WSGI application to wrap.
    :param coordinator: a blocking :class:`idemlock.Coordinator` (``idemlock.connect``).
    :param identity: function of the WSGI environ naming the caller (a str) or None.
    :param options: the options of :class:`idemlock.integrations.asgi.IdempotencyMiddleware`
        (``spec``, ``methods``, ``routes``, ``require_key``, ``allow_anonymous``,
        ``fingerprint``, ``mismatch_status``, ``max_body``, ``record``, ``heartbeat``,
        ...); a ``routes`` predicate receives an ASGI-like scope with ``path`` and
        ``method``.
    """

    def __init__(
        self,
        app: WSGIApp,
        *,
        coordinator: Coordinator,
        identity: Callable[[Environ], str | None] | None = None,
        **options: Unpack[IdempotencyOptions],
    ) -> None:
        if identity is not None and not callable(identity):
            raise ConfigurationError("identity must be a function of the WSGI environ")
        self.app = app
        self.identity = identity
        self.core = SyncHttp(coordinator, has_identity=identity is not None, **options)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        scope = _scope(environ)
        if not self.core.covers(scope):
            return self.app(environ, start_response)

        def ident() -> str | None:
            return None if self.identity is None else self.identity(environ)

        decision = self.core.begin(scope, ident, _reader(environ))
        if isinstance(decision, Answer):
            return _answer(start_response, decision)
        if isinstance(decision, Pass):
            return self.app(environ, start_response)
        environ = dict(environ)
        environ["wsgi.input"] = io.BytesIO(decision.body)
        environ["CONTENT_LENGTH"] = str(len(decision.body))
        environ.pop("HTTP_TRANSFER_ENCODING", None)
        environ.pop("wsgi.file_wrapper", None)
        return _Closing(self._run(environ, start_response, decision), self.core, decision)

    def _run(
        self, environ: Environ, start_response: StartResponse, run: Run
    ) -> Generator[bytes, None, None]:
        core = self.core
        head: list[Any] = []

        written: list[bytes] = []

        def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            head[:] = [status, headers]
            server_write = (
                start_response(status, headers, exc_info)
                if exc_info
                else start_response(status, headers)
            )

            def write(data: bytes) -> None:
                # PEP 3333's legacy write(): these bytes precede the iterable's.
                written.append(bytes(data))
                server_write(data)

            return write

        def record() -> None:
            if not head:
                raise RuntimeError("the WSGI application did not call start_response")
            run.copy.prepend(written)
            status = int(str(head[0]).split(" ", 1)[0])
            headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in head[1]]
            core.finish(run, status, headers)

        try:
            body = self.app(environ, capture)
        except BaseException:
            core.fail(run)
            raise
        try:
            yield from core.relay(run, body, record)  # fails the run if the stream breaks
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
