"""HTTP ``Idempotency-Key`` for Flask, as a Flask extension::

    from idemlock.integrations.flask import Idempotency

    idem = Idempotency()                    # or Idempotency(app)

    def create_app() -> Flask:
        app = Flask(__name__)
        app.config["IDEMLOCK_URL"] = "sqlite:///var/lib/app/idemlock.db"
        app.config["IDEMLOCK_IDENTITY"] = "header:X-Api-Key"   # or a function of nothing
        idem.init_app(app)
        return app

    @bp.post("/charges")
    @idem.protect                           # or @idem.protect(ttl=3600, require_key=True)
    def charge(): ...

Configuration comes from ``app.config``: ``IDEMLOCK_URL`` (a store URL; or
``IDEMLOCK_COORDINATOR``, an open :class:`idemlock.Coordinator`), ``IDEMLOCK_IDENTITY``
(``"header:<Name>"`` or a function of no arguments reading ``flask.request`` / ``g``,
returning the caller as a str or None), ``IDEMLOCK_SPEC`` (a name, an
:class:`~idemlock.IdempotencySpec` or a dict of ``name``/``ttl``/``lease``) and
``IDEMLOCK_<OPTION>`` for every option of the ASGI middleware (``IDEMLOCK_REQUIRE_KEY``,
``IDEMLOCK_ALLOW_UNQUOTED_KEY``, ``IDEMLOCK_MAX_BODY``, ...). Keyword arguments of
:class:`Idempotency` are the defaults the configuration overrides, and
:meth:`Idempotency.protect`'s override both for one view. A misspelt ``IDEMLOCK_`` key is
a :class:`~idemlock.ConfigurationError` at ``init_app`` saying which key was meant.

The state of each application is ``app.extensions["idemlock"]`` (an
:class:`IdempotencyState`), so one ``Idempotency`` serves several applications (an app
factory). A coordinator opened from ``IDEMLOCK_URL`` belongs to the extension: it is
closed when its application is collected, by :meth:`Idempotency.close`, or at
interpreter exit, never per request (it holds the store's connection pool; after a fork
the store opens fresh connections itself).
A request whose claim is still open when its application context tears down (the view
never produced a response) has the claim abandoned there, so a retry runs at once.

The answers are the WSGI middleware's (:mod:`idemlock.integrations.wsgi`; the same
decision core, :mod:`idemlock.integrations.http.core`): 400/401/409/413/422/503 as
``application/problem+json``, the replay with ``Idempotent-Replayed: true``, 5xx and the
retryable 4xx not recorded. An ``abort(404)`` in the view is recorded as the 404 it
answers. The response is recorded before it leaves the view, so ``after_request``
functions run on first responses and replays alike. Use the WSGI middleware instead for
a whole route set.
"""

from __future__ import annotations

import atexit
import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

from flask import Flask, current_app, g, request
from flask.wrappers import Response
from werkzeug.exceptions import HTTPException

from .._core.clock import duration
from .._core.types import IdempotencySpec
from .._errors import ConfigurationError
from .._sync import Coordinator
from .http.blocking import SyncHttp
from .http.core import Pass, Run
from .http.options import HttpOptions, ViewOptions, did_you_mean, spec_from
from .http.problem_json import Answer
from .wsgi import _scope

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["ExtensionOptions", "Idempotency", "IdempotencyState"]

F = TypeVar("F", bound=Callable[..., Any])
Identity = Callable[[], "str | None"]


class ExtensionOptions(ViewOptions, total=False):
    """The keyword options of :class:`Idempotency`: those of
    :class:`idemlock.integrations.asgi.IdempotencyOptions` but ``routes`` (each protected
    view is its route), with ``spec`` also a dict of the spec's fields (as in
    ``IDEMLOCK_SPEC``). For type checkers only: at run time they are keyword arguments."""

    spec: IdempotencySpec | str | dict[str, Any]
    methods: Iterable[str]


class _ProtectOptions(ViewOptions, total=False):
    methods: Iterable[str]


#: the extension's own settings (besides one per option of HttpOptions)
_OWN_SETTINGS = ("url", "coordinator", "identity")
#: options that do not apply to a decorated view (the view is the route)
_NOT_FOR_VIEWS = ("routes",)
_OPTIONS = tuple(f.name for f in fields(HttpOptions) if f.name not in _NOT_FOR_VIEWS)
_SETTINGS = tuple(f"IDEMLOCK_{name.upper()}" for name in (*_OWN_SETTINGS, *_OPTIONS))
_RUNS = "_idemlock_runs"
_UNSET: Any = object()


def _identity(value: Any, where: str) -> Identity | None:
    if value is None:
        return None
    if isinstance(value, str) and value.startswith("header:") and len(value) > 7:
        name = value[len("header:") :]

        def header() -> str | None:
            return request.headers.get(name) or None

        return header
    if callable(value):
        return cast(Identity, value)
    raise ConfigurationError(
        f"{where} must be 'header:<Name>' or a function of no arguments (reading "
        f"flask.request or g) returning a str or None, got {value!r}"
    )


def _seconds(value: timedelta | float | None, what: str) -> timedelta | None:
    return None if value is None else timedelta(seconds=duration(value, what, positive=True))


@dataclass
class IdempotencyState:
    """One application's idempotency state: ``app.extensions["idemlock"]``."""

    coordinator: Coordinator
    identity: Identity | None
    options: dict[str, Any]
    #: whether the extension opened the coordinator (and so closes it)
    owned: bool
    _cores: dict[int, tuple[SyncHttp, Identity | None]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def core(self, view: _View) -> tuple[SyncHttp, Identity | None]:
        """The decision core of one protected view on this application (made once)."""
        made = self._cores.get(id(view))
        if made is None:
            with self._lock:
                made = self._cores.get(id(view))
                if made is None:
                    ident = self.identity if view.identity is _UNSET else view.identity
                    opts = {**self.options, **view.options}
                    spec = spec_from(opts.get("spec", "http"), "IDEMLOCK_SPEC")
                    if view.ttl is not None or view.lease is not None:
                        if not isinstance(spec, IdempotencySpec):
                            spec = IdempotencySpec(spec)
                        spec = IdempotencySpec(
                            spec.name,
                            ttl=view.ttl or spec.ttl,
                            lease=view.lease or spec.lease,
                            encrypt_result=spec.encrypt_result,
                        )
                    if "spec" in opts or view.ttl is not None or view.lease is not None:
                        opts["spec"] = spec
                    core = SyncHttp(self.coordinator, has_identity=ident is not None, **opts)
                    made = self._cores[id(view)] = (core, ident)
        return made


@dataclass
class _View:
    """What ``@idem.protect(...)`` said for one view."""

    fn: Callable[..., Any]
    options: dict[str, Any]
    identity: Any
    ttl: timedelta | None
    lease: timedelta | None


class Idempotency:
    """The Flask extension: ``Idempotency(app)``, or ``idem = Idempotency()`` and
    ``idem.init_app(app)`` in an application factory.

    :param app: the application to set up now (else call :meth:`init_app`).
    :param url: default store URL (``IDEMLOCK_URL`` wins).
    :param coordinator: an open blocking :class:`idemlock.Coordinator` instead of a URL
        (yours to close).
    :param identity: default identity: ``"header:<Name>"`` or a function of no arguments.
    :param options: defaults of the options of
        :class:`idemlock.integrations.asgi.IdempotencyMiddleware` (``spec``,
        ``require_key``, ``allow_unquoted_key``, ``methods``, ...); ``IDEMLOCK_<NAME>``
        settings override them.
    """

    def __init__(
        self,
        app: Flask | None = None,
        *,
        url: str | None = None,
        coordinator: Coordinator | None = None,
        identity: str | Identity | None = None,
        **options: Unpack[ExtensionOptions],
    ) -> None:
        for name in options:
            if name not in _OPTIONS:
                raise ConfigurationError(
                    f"unknown idempotency option {name!r}{did_you_mean(name, _OPTIONS)}; the "
                    f"options are: {', '.join(_OPTIONS)}"
                )
        HttpOptions.of({k: v for k, v in options.items() if k != "spec"})  # checked now
        self._defaults: dict[str, Any] = {"url": url, "coordinator": coordinator}
        self._identity = identity
        self._options = options
        self._owned: list[Coordinator] = []
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Read ``app.config``'s ``IDEMLOCK_*`` settings, open the store and register
        the extension as ``app.extensions["idemlock"]``."""
        conf: dict[str, Any] = {}
        for key, value in app.config.items():
            if not key.startswith("IDEMLOCK_"):
                continue
            if key not in _SETTINGS:
                raise ConfigurationError(
                    f"unknown Flask setting {key}{did_you_mean(key, _SETTINGS)}; the "
                    f"IDEMLOCK_ settings are: {', '.join(_SETTINGS)}"
                )
            conf[key[len("IDEMLOCK_") :].lower()] = value
        url = conf.pop("url", self._defaults["url"])
        coordinator = conf.pop("coordinator", self._defaults["coordinator"])
        identity = _identity(conf.pop("identity", self._identity), "IDEMLOCK_IDENTITY")
        options = {**self._options, **conf}
        if "spec" in options:
            options["spec"] = spec_from(options["spec"], "IDEMLOCK_SPEC")
        HttpOptions.of(options)  # a bad value fails here, not at the first request
        owned = False
        if coordinator is None:
            if not isinstance(url, str):
                raise ConfigurationError(
                    "the idemlock Flask extension needs app.config['IDEMLOCK_URL'] (a store "
                    "URL such as 'sqlite:///var/lib/app/idemlock.db') or IDEMLOCK_COORDINATOR"
                )
            import idemlock

            coordinator = idemlock.connect(url)
            owned = True
            if not self._owned:
                atexit.register(self.close)
            self._owned.append(coordinator)
            # The application's teardown: its coordinator closes when the application
            # goes away (an app factory's apps in a test suite), else at exit.
            weakref.finalize(app, coordinator.close)
        elif not isinstance(coordinator, Coordinator):
            raise ConfigurationError(
                "IDEMLOCK_COORDINATOR must be a blocking idemlock.Coordinator "
                f"(idemlock.connect(...)), got {type(coordinator).__name__}"
            )
        app.extensions["idemlock"] = IdempotencyState(coordinator, identity, options, owned)
        app.teardown_appcontext(_teardown)

    def close(self) -> None:
        """Close the coordinators this extension opened from ``IDEMLOCK_URL``."""
        while self._owned:
            self._owned.pop().close()

    @overload
    def protect(
        self,
        view: F,
        /,
        *,
        spec: IdempotencySpec | str | dict[str, Any] | None = None,
        ttl: timedelta | float | None = None,
        lease: timedelta | float | None = None,
        identity: str | Identity | None = ...,
        **options: Unpack[_ProtectOptions],
    ) -> F: ...

    @overload
    def protect(
        self,
        view: None = None,
        /,
        *,
        spec: IdempotencySpec | str | dict[str, Any] | None = None,
        ttl: timedelta | float | None = None,
        lease: timedelta | float | None = None,
        identity: str | Identity | None = ...,
        **options: Unpack[_ProtectOptions],
    ) -> Callable[[F], F]: ...

    def protect(
        self,
        view: F | None = None,
        /,
        *,
        spec: IdempotencySpec | str | dict[str, Any] | None = None,
        ttl: timedelta | float | None = None,
        lease: timedelta | float | None = None,
        identity: str | Identity | None = _UNSET,
        **options: Any,
    ) -> F | Callable[[F], F]:
        """Protect one view: ``@idem.protect`` or ``@idem.protect(ttl=..., ...)``, under
        its route decorator. ``spec``, or ``ttl`` and ``lease`` over the application's
        spec, say how long this view's responses are replayed and how long a crashed
        request holds its key; ``identity`` and the other options replace the
        application's for this view. The decorated view keeps its type."""
        for name in options:
            if name not in _OPTIONS:
                raise ConfigurationError(
                    f"unknown idempotency option {name!r}{did_you_mean(name, _OPTIONS)}; the "
                    f"options are: {', '.join(_OPTIONS)}"
                )
        HttpOptions.of(options)  # a bad value fails at import, not at the first request
        if spec is not None:
            options["spec"] = spec_from(spec, "spec")
        ident = _UNSET if identity is _UNSET else _identity(identity, "identity")
        ttl_td, lease_td = _seconds(ttl, "ttl"), _seconds(lease, "lease")

        def wrap(fn: F) -> F:
            if not callable(fn):
                raise ConfigurationError(f"@idem.protect decorates a view, got {fn!r}")
            said = _View(fn, options, ident, ttl_td, lease_td)

            @functools.wraps(fn)
            def protected(*args: Any, **kwargs: Any) -> Any:
                state = current_app.extensions.get("idemlock")
                if not isinstance(state, IdempotencyState):
                    raise ConfigurationError(
                        f"{fn.__qualname__} is protected with @idem.protect, but the "
                        "application has no idemlock extension: call idem.init_app(app) "
                        "(or Idempotency(app)) when creating it"
                    )
                core, who = state.core(said)
                return _handle(core, who, lambda: fn(*args, **kwargs))

            protected.__idemlock_view__ = said  # type: ignore[attr-defined]  # keeps it alive
            return cast(F, protected)

        return wrap if view is None else wrap(view)


def _answer(answer: Answer) -> Response:
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in answer.headers]
    response = Response(answer.body, status=answer.status, headers=headers)
    if not any(k.lower() == "content-type" for k, _ in headers):
        del response.headers["Content-Type"]
    return response


def _headers(response: Response) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.headers]


def _handle(core: SyncHttp, identity: Identity | None, call: Callable[[], Any]) -> Any:
    scope = _scope(request.environ)
    if not core.covers(scope):
        return call()
    body: bytes | None = None
    pos = 0

    def read(n: int) -> bytes:
        nonlocal body, pos
        if body is None:
            body = request.get_data(cache=True)  # kept: the view reads it again
        chunk = body[pos : pos + n]
        pos += len(chunk)
        return chunk

    decision = core.begin(scope, lambda: None if identity is None else identity(), read)
    if isinstance(decision, Answer):
        return _answer(decision)
    if isinstance(decision, Pass):
        return call()
    run = decision
    runs: list[tuple[SyncHttp, Run]] = g.setdefault(_RUNS, [])
    runs.append((core, run))  # until the view gave its response (see _teardown)
    try:
        try:
            rv = call()
        except HTTPException as exc:
            rv = current_app.handle_user_exception(exc)  # abort(404): its response
        response = current_app.make_response(rv)
    except BaseException:
        core.fail(run)
        raise
    finally:
        runs.remove((core, run))
    if response.is_streamed:
        # Encoded (str chunks to bytes) before our wrapper replaces the iterable.
        response.response = _stream(core, run, response, response.iter_encoded())
        # Closed without being iterated (the client left): free the claim (a no-op once
        # the stream settled it).
        response.call_on_close(lambda: core.fail(run))
        return response
    run.copy.add(response.get_data())
    # Recorded before the response leaves the view: an immediate retry finds the record.
    core.finish(run, response.status_code, _headers(response))
    return response


def _stream(core: SyncHttp, run: Run, response: Response, source: Iterable[Any]) -> Iterator[bytes]:
    return core.relay(
        run, source, lambda: core.finish(run, response.status_code, _headers(response))
    )


def _teardown(exc: BaseException | None) -> None:
    """Abandon the claim of a protected view that never gave a response (its request
    ended some other way): a retry then runs at once instead of waiting a lease."""
    for core, run in g.pop(_RUNS, ()):
        core.fail(run)
