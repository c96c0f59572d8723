"""HTTP ``Idempotency-Key`` for Django: a middleware for whole route sets and a view
decorator for single views, configured from ``settings.IDEMLOCK``::

    IDEMLOCK = {
        "url": "postgresql://app@db/app",   # or "sqlite:///...", "redis://..."
        "spec": {"name": "http", "ttl": 86400, "lease": 30},   # seconds; or a name
        "identity": "user",                 # request.user.pk; or "header:X-Api-Key",
                                            # or a function of the request
        "routes": ["/api/payments/*"],      # the middleware's route set (default all)
        # any other option of idemlock.integrations.asgi.IdempotencyMiddleware:
        # methods, require_key, allow_anonymous, fingerprint, mismatch_status, ...
    }
    MIDDLEWARE = [..., "django.contrib.auth.middleware.AuthenticationMiddleware",
                  "idemlock.integrations.django.IdempotencyMiddleware", ...]

    @idempotent_view(spec={"name": "refunds", "ttl": 3600, "lease": 60})
    def refund(request): ...

The table is the ASGI middleware's (same code, see :mod:`idemlock.integrations.http.core`):
400/401/409/413/422/503 as ``application/problem+json``, the replay with
``Idempotent-Replayed: true``, keys per identity (with an ``identity`` configured, a
request without one is 401 unless ``allow_anonymous`` is True), 5xx (Django turns a
view's exception into one) and retryable 4xx not recorded. Put the middleware after
``AuthenticationMiddleware`` when the identity is ``"user"``. A view protected by both
the middleware and the decorator is handled once, by the middleware.

The coordinator is connected once per process and URL (after a fork, the store opens
fresh connections itself).

Add ``"idemlock.integrations.django"`` to ``INSTALLED_APPS`` for the system checks of
``settings.IDEMLOCK`` and of the middleware's place (:mod:`.checks`, run by
``manage.py check``) and for ``manage.py idemlock ...``, the ``idemlock`` command line on
the configured store.
"""

from __future__ import annotations

import functools
import io
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from http.cookies import SimpleCookie
from typing import Any, ClassVar, TypeVar, cast, overload

from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse

from ..._core.types import IdempotencySpec
from ..._errors import ConfigurationError, StaleClaim
from ..._sync import Coordinator
from ..http.blocking import SyncHttp, TransactionFailed
from ..http.core import Pass, Run
from ..http.options import spec_from
from ..http.problem_json import Answer

__all__ = ["IdempotencyMiddleware", "IdempotencyMixin", "idempotent_view"]

log = logging.getLogger("idemlock.django")
View = TypeVar("View", bound=Callable[..., HttpResponseBase])
_HANDLED = "_idemlock_handled"

_coordinators: dict[str, Coordinator] = {}
_lock = threading.RLock()  # a mixin's setup connects its coordinator while holding it


def _coordinator(url: str) -> Coordinator:
    with _lock:
        coord = _coordinators.get(url)
        if coord is None:
            import idemlock

            coord = _coordinators[url] = idemlock.connect(url)
        return coord


def _spec(value: Any) -> IdempotencySpec | str:
    return spec_from(value, "IDEMLOCK['spec']")


def _identity(value: Any) -> Callable[[HttpRequest], str | None] | None:
    if value is None:
        return None
    if callable(value):
        return cast(Callable[[HttpRequest], "str | None"], value)
    if value == "user":

        def user(request: HttpRequest) -> str | None:
            u = getattr(request, "user", None)
            if u is None or not getattr(u, "is_authenticated", False):
                return None
            return str(u.pk)

        return user
    if isinstance(value, str) and value.startswith("header:"):
        name = value[len("header:") :]

        def header(request: HttpRequest) -> str | None:
            return request.headers.get(name) or None

        return header
    raise ConfigurationError(
        f"IDEMLOCK['identity'] must be 'user', 'header:<Name>' or a function of the "
        f"request, got {value!r}"
    )


def _check_atomic(coordinator: Coordinator, alias: str) -> None:
    """Refuse ``atomic`` at setup where recording in the view's transaction cannot work:
    found only in a request, it would answer every request 503 and roll its writes back."""
    from django.db import connections
    from django.db.utils import ConnectionDoesNotExist

    try:
        db = connections[alias]
    except ConnectionDoesNotExist:
        raise ConfigurationError(
            f"'atomic' names the database alias {alias!r}, which is not in DATABASES; give "
            "True (the 'default' database) or an alias of DATABASES"
        ) from None
    store = coordinator.store
    try:
        from ...stores.postgres._shared import _Base
    except ImportError:  # no PostgreSQL driver: the store is not PostgreSQL either
        on_postgres = False
    else:
        on_postgres = isinstance(store, _Base)
    driver = getattr(getattr(type(db), "Database", None), "__name__", None)
    on_psycopg3 = db.vendor == "postgresql" and driver == "psycopg"
    if on_postgres and on_psycopg3:
        return
    found = []
    if not on_postgres:
        found.append(f"the store is {getattr(store, 'kind', type(store).__name__)}")
    if not on_psycopg3:
        engine = db.settings_dict.get("ENGINE")
        # On PostgreSQL only the driver is wrong (psycopg2); elsewhere the engine is.
        on = f" on {driver}" if db.vendor == "postgresql" else ""
        found.append(f"DATABASES[{alias!r}] is {engine}{on}")
    raise ConfigurationError(
        f"IDEMLOCK['atomic'] / atomic=True needs the PostgreSQL store (a postgresql:// url "
        f"on the same database as DATABASES[{alias!r}]) and Django's psycopg 3 backend "
        f"(django.db.backends.postgresql with psycopg installed), but {' and '.join(found)}; "
        "configure both, or drop 'atomic' to record the response after the view, outside "
        "its transaction"
    )


class _Setup:
    """The core and identity built from ``settings.IDEMLOCK`` plus overrides."""

    def __init__(self, overrides: dict[str, Any]) -> None:
        conf = dict(getattr(settings, "IDEMLOCK", None) or {})
        conf.update(overrides)
        url = conf.pop("url", None)
        coordinator = conf.pop("coordinator", None)
        if coordinator is None:
            if not isinstance(url, str):
                raise ConfigurationError(
                    "settings.IDEMLOCK needs 'url' (a store URL such as "
                    "'sqlite:///var/lib/app/idemlock.db') or 'coordinator'"
                )
            coordinator = _coordinator(url)
        self.identity = _identity(conf.pop("identity", None))
        atomic = conf.pop("atomic", None)
        if atomic is True:
            atomic = "default"
        if atomic not in (None, False) and not isinstance(atomic, str):
            raise ConfigurationError(
                f"'atomic' must be True, False or a database alias, got {atomic!r}"
            )
        #: the database alias whose transaction also holds the record, or None
        self.atomic: str | None = atomic or None
        if self.atomic is not None:
            _check_atomic(coordinator, self.atomic)
        if "spec" in conf:
            conf["spec"] = _spec(conf["spec"])
        self.core = SyncHttp(coordinator, has_identity=self.identity is not None, **conf)


def _scope(request: HttpRequest) -> dict[str, Any]:
    return {
        "method": request.method or "GET",
        "path": request.path,
        "query_string": request.META.get("QUERY_STRING", "").encode("latin-1"),
        "headers": [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()
        ],
    }


def _answer(answer: Answer) -> HttpResponse:
    response = HttpResponse(answer.body, status=answer.status)
    del response.headers["Content-Type"]
    for name, value in answer.headers:
        k, v = name.decode("latin-1"), value.decode("latin-1")
        if k.lower() == "set-cookie":
            response.cookies.load(v)
        else:
            response.headers[k] = v
    return response


def _headers(response: HttpResponseBase) -> list[tuple[bytes, bytes]]:
    out = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.items()]
    cookies: SimpleCookie = response.cookies
    for morsel in cookies.values():
        out.append((b"set-cookie", morsel.OutputString().encode("latin-1")))
    return out


def _handle(
    setup: _Setup, request: HttpRequest, call: Callable[[HttpRequest], HttpResponseBase]
) -> HttpResponseBase:
    core = setup.core
    scope = _scope(request)
    if getattr(request, _HANDLED, False) or not core.covers(scope):
        return call(request)
    setattr(request, _HANDLED, True)

    def ident() -> str | None:
        return None if setup.identity is None else setup.identity(request)

    body: bytes | None = None
    pos = [0]

    def read(n: int) -> bytes:
        nonlocal body
        if body is None:
            body = request.body  # Django reads and caches it; the view reads it again
            pos[0] = 0
        chunk = body[pos[0] : pos[0] + n]
        pos[0] += len(chunk)
        return chunk

    decision = core.begin(scope, ident, read)
    if isinstance(decision, Answer):
        return _answer(decision)
    if isinstance(decision, Pass):
        return call(request)
    if setup.atomic is not None:
        return _atomic(setup, setup.atomic, request, call, decision)
    try:
        response = call(request)
    except BaseException:
        core.fail(decision)
        raise
    if isinstance(response, StreamingHttpResponse):
        source = response.streaming_content  # read before it is replaced by our wrapper
        response.streaming_content = _stream(core, decision, response, source)
        # Closed without being iterated (the client left): the generator never starts,
        # so free the claim here (a no-op once the stream settled it).
        response._resource_closers.append(lambda: core.fail(decision))
        return response
    decision.copy.add(cast(HttpResponse, response).content)
    # Recorded before Django sends the response: an immediate retry finds the record.
    core.finish(decision, response.status_code, _headers(response))
    return response


def _atomic(
    setup: _Setup,
    alias: str,
    request: HttpRequest,
    call: Callable[[HttpRequest], HttpResponseBase],
    run: Run,
) -> HttpResponseBase:
    """Run the view in ``transaction.atomic(using=alias)`` and record its response in
    that transaction (``complete_in_transaction``): the view's writes and the record
    commit together or not at all."""
    from django.db import connections, transaction

    core = setup.core
    try:
        with transaction.atomic(using=alias):
            response = call(request)
            if isinstance(response, StreamingHttpResponse):
                raise ConfigurationError(
                    "a view with atomic idempotency must not stream its response"
                )
            run.copy.add(cast(HttpResponse, response).content)
            db = connections[alias]
            db.ensure_connection()
            core.finish(run, response.status_code, _headers(response), db.connection)
    except TransactionFailed as failed:
        # Rolled back: the view's writes and the record alike. Free the key so a retry
        # runs again (refused, and logged, if another attempt took it over).
        core.abandon(run)
        if isinstance(failed.cause, StaleClaim):
            return _answer(core.core.problems.in_flight())
        log.warning(
            "recording in the transaction failed; answering 503: %r",
            failed.cause,
            extra=core.core._fields("complete", "error"),
        )
        return _answer(core.core.problems.unavailable())
    except BaseException:
        if run.settled:
            core.abandon(run)  # the commit failed: the record went with it
        else:
            core.fail(run)
        raise
    return response


def _stream(
    core: SyncHttp, run: Run, response: StreamingHttpResponse, source: Iterable[Any]
) -> Iterator[bytes]:
    return core.relay(
        run, source, lambda: core.finish(run, response.status_code, _headers(response))
    )


class IdempotencyMiddleware:
    """Django middleware applying ``settings.IDEMLOCK`` to its ``routes`` (default all)
    for its ``methods`` (default POST and PATCH)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response
        self._setup = _Setup({})

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        return _handle(self._setup, request, self.get_response)


@overload
def idempotent_view(view: View) -> View: ...
@overload
def idempotent_view(view: None = None, **overrides: Any) -> Callable[[View], View]: ...
def idempotent_view(view: View | None = None, **overrides: Any) -> Any:
    """Protect one view (``@idempotent_view`` or ``@idempotent_view(spec=..., ...)``);
    ``overrides`` replace entries of ``settings.IDEMLOCK`` for this view. The route
    filter does not apply (the view is the route)."""

    def wrap(fn: View) -> View:
        setup: list[_Setup] = []
        init = threading.Lock()

        @functools.wraps(fn)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if not setup:
                with init:
                    if not setup:
                        setup.append(_Setup({"routes": None, **overrides}))
            return _handle(setup[0], request, lambda r: fn(r, *args, **kwargs))

        return cast(View, wrapper)

    return wrap if view is None else wrap(view)


_mixin_setups: dict[type, _Setup] = {}


class _Answered(Exception):
    """Carries the middleware's own response out of DRF's ``initial``."""

    def __init__(self, response: HttpResponse) -> None:
        super().__init__(response.status_code)
        self.response = response


class IdempotencyMixin:
    """For Django REST framework views (put it before ``APIView`` or a generic view):
    ``class Charges(IdempotencyMixin, APIView): idempotency = {"spec": ...}``.

    The decision is taken after DRF's authentication, permission and throttling checks
    (so the identity ``"user"`` is DRF's authenticated ``request.user``, and a 401, 403
    or 429 DRF answers before the handler is never recorded), and the response is
    recorded once DRF rendered it. ``idempotency`` overrides ``settings.IDEMLOCK`` for
    the view; the route filter does not apply."""

    idempotency: ClassVar[dict[str, Any]] = {}
    _idemlock_run: Run | None = None

    @classmethod
    def _idemlock_setup(cls) -> _Setup:
        with _lock:
            setup = _mixin_setups.get(cls)
            if setup is None:
                setup = _mixin_setups[cls] = _Setup({"routes": None, **cls.idempotency})
            return setup

    def initial(self, request: Any, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        setup = self._idemlock_setup()
        raw: HttpRequest = request._request
        scope = _scope(raw)
        if getattr(raw, _HANDLED, False) or not setup.core.covers(scope):
            return
        setattr(raw, _HANDLED, True)

        def ident() -> str | None:
            return None if setup.identity is None else setup.identity(request)

        stream = io.BytesIO(raw.body)
        decision = setup.core.begin(scope, ident, stream.read)
        if isinstance(decision, Answer):
            raise _Answered(_answer(decision))
        if isinstance(decision, Run):
            self._idemlock_run = decision

    def handle_exception(self, exc: Exception) -> Any:
        if isinstance(exc, _Answered):
            return exc.response
        return super().handle_exception(exc)  # type: ignore[misc]

    def finalize_response(self, request: Any, response: Any, *args: Any, **kwargs: Any) -> Any:
        response = super().finalize_response(request, response, *args, **kwargs)  # type: ignore[misc]
        run, self._idemlock_run = self._idemlock_run, None
        if run is not None:
            if callable(getattr(response, "render", None)) and not response.is_rendered:
                response.render()  # the bytes to record are the bytes sent
            run.copy.add(response.content)
            self._idemlock_setup().core.finish(run, response.status_code, _headers(response))
        return response

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().dispatch(request, *args, **kwargs)  # type: ignore[misc]
        except BaseException:
            run, self._idemlock_run = self._idemlock_run, None
            if run is not None:
                self._idemlock_setup().core.fail(run)
            raise
