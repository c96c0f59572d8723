"""``Idempotency-Key`` for FastAPI, natively: per-route specs, the identity from a
FastAPI dependency, the header and the problem responses in the OpenAPI document, and a
lifespan that opens and closes the coordinator::

    from idemlock.integrations.fastapi import Idempotency

    async def caller(user: User = Depends(current_user)) -> str:
        return str(user.id)

    idem = Idempotency("postgresql://app@db/app", identity=caller)
    app = FastAPI(lifespan=idem.lifespan)
    idem.install(app)

    @app.post("/charges", status_code=201)
    @idem.protect(ttl=3600, lease=60)          # under the route decorator
    async def charge(order: Order) -> Receipt: ...

The decision is taken *inside* the endpoint, after FastAPI resolved its dependencies and
validated the request: so the identity is whatever your dependency returns (with an
``identity`` configured, None is 401 unless ``allow_anonymous=True``), and FastAPI's
request-validation 422s, like the 401/403 your own dependencies raise, are never
recorded: a client that fixes its body can reuse its key. The table is the ASGI
middleware's (:mod:`idemlock.integrations.asgi`): replay with ``Idempotent-Replayed:
true``, 409 while the first request runs, 422 for a key reused on another request, 503
when the store fails, every refusal ``application/problem+json``. What the endpoint
returns is recorded as FastAPI sends it (status, headers, serialised body).

``install(app)`` adds the small ASGI layer that copies a protected endpoint's response
(it touches nothing else) and documents each protected route in ``app.openapi()``: the
``Idempotency-Key`` header parameter and the 400, 409, 422 and 503 (with an identity, 401)
problem responses. ``lifespan`` opens the coordinator from the URL at startup and closes
it at shutdown; use it as ``FastAPI(lifespan=idem.lifespan)`` or inside your own
lifespan (``async with idem.lifespan(app): yield``). A coordinator you pass yourself
(``coordinator=``) is yours to close. At startup the lifespan refuses (a
``ConfigurationError`` naming the function) an endpoint this instance protected that no
route of the app calls, or an app without ``install(app)``.

``@idem.protect`` above the route decorator works too: the route FastAPI registered with
the bare function is rebuilt on the protected wrapper (found by ``install``, the
lifespan, ``app.openapi()`` and the capture layer before a request after the routes
changed). The wrapper adds one parameter, a dependency of its own giving it the request,
the key header and the identity, named apart from the endpoint's: so the endpoint keeps
every parameter FastAPI allows (its own ``Request``, ``Response``, ``BackgroundTasks``,
``Depends``, ``Annotated``, path, query and body parameters), and its type.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast, overload

from fastapi import Depends, FastAPI, Header, Request
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.routing import Host, Mount

from .._core.clock import duration
from .._core.types import IdempotencySpec
from .._errors import ConfigurationError
from ..aio import AsyncCoordinator
from .asgi import ASGIApp, Message, Receive, Scope, Send, send_captured
from .http.core import AsyncPortFace, HttpCore, Run
from .http.options import HttpOptions, RouteOptions, ViewOptions, did_you_mean
from .http.problem_json import PROBLEM_CODES, Answer

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Idempotency", "IdempotencyCapture", "Identity"]

F = TypeVar("F", bound=Callable[..., Any])

Identity: TypeAlias = Callable[..., "str | Awaitable[str | None] | None"]
"""An identity dependency: a function (plain or ``async def``) FastAPI calls with its own
parameters and ``Depends``, returning the caller's identity as a str, or None."""

#: the scope key of a request's :class:`_Slot`
_SLOT = "idemlock.fastapi"
#: the marker a protected endpoint's key parameter carries into the OpenAPI document
#: (removed there once read), and the protected endpoints by marker
_OPENAPI_MARK = "x-idemlock-route"
_PROTECTED: weakref.WeakValueDictionary[str, _ProtectedEndpoint] = weakref.WeakValueDictionary()
#: the name of the one parameter a protected endpoint's wrapper adds (a dependency giving
#: the request, the key header and the identity), made unique against the endpoint's own
_INJECTED = "idemlock__"
#: the attribute of a function ``protect`` wrapped that names its protection: a route
#: registered with the function itself (``@idem.protect`` above ``@app.post``) is found by
#: it and rebuilt on the wrapper
_PROTECTED_BY = "__idemlock_protected_by__"
_UNSET: Any = object()

_PROBLEM_SCHEMA: dict[str, Any] = {
    "title": "IdempotencyProblem",
    "type": "object",
    "description": "An RFC 9457 problem document; `code` is a stable machine-readable name.",
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "code": {"type": "string"},
        "original_status": {"type": "integer"},
    },
    "required": ["type", "title", "status", "detail", "code"],
}
_DESCRIPTIONS = {
    400: "Idempotency-Key missing or malformed",
    401: "The request has no identity (Idempotency-Key requires one)",
    409: "A request with this Idempotency-Key is still running, or its response cannot be replayed",
    413: "Request body too large for an idempotent request",
    422: "This Idempotency-Key was used with a different request",
    503: "The idempotency store is unavailable; retry with the same key",
}


class _Slot:
    """One request's state between the capture layer and a protected endpoint: a copy
    of the request body as it is read (at most ``limit`` bytes), then the claim."""

    __slots__ = ("chunks", "complete", "core", "limit", "over", "run", "size")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.chunks: list[bytes] = []
        self.size = 0
        self.over = False
        self.complete = False
        self.core: HttpCore | None = None
        self.run: Run | None = None

    def add(self, message: Message) -> None:
        chunk = bytes(message.get("body", b""))
        self.size += len(chunk)
        if self.size > self.limit:
            self.over, self.chunks = True, []
        elif not self.over:
            self.chunks.append(chunk)
        if not message.get("more_body", False):
            self.complete = True


class IdempotencyCapture:
    """The ASGI layer :meth:`Idempotency.install` adds: it keeps a bounded copy of each
    request body and copies the response of a request a protected endpoint claimed.
    Other requests pass through unchanged. Before the first request, and whenever the
    application's routes changed, it puts the routes of endpoints protected from above
    their route decorator on their protected wrapper (see :meth:`Idempotency.protect`)."""

    def __init__(self, app: ASGIApp, *, max_body: int) -> None:
        self.app = app
        self.max_body = max_body
        self._routes_seen: object = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        application = scope.get("app")
        if application is not None:
            version = _routes_version(application)
            if version != self._routes_seen:
                _protect_routes(application)
                self._routes_seen = _routes_version(application)
        slot = _Slot(self.max_body)
        scope[_SLOT] = slot

        async def tee_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                slot.add(message)
            return message

        async def capture_send(message: Message) -> None:
            if slot.run is None or slot.core is None:
                await send(message)
            else:
                await send_captured(slot.core, slot.run, message, send)

        try:
            await self.app(scope, tee_receive, capture_send)
        finally:
            if slot.run is not None and slot.core is not None:
                # A no-op once settled; else the endpoint raised or no whole response
                # was sent: abandon, so a retry runs again.
                await slot.core.fail(slot.run)


def _seconds(value: timedelta | float | None, what: str) -> timedelta | None:
    return None if value is None else timedelta(seconds=duration(value, what, positive=True))


class Idempotency:
    """The Idempotency-Key table for a FastAPI application.

    :param url: the store URL the lifespan connects (``idemlock.aio.connect``).
    :param coordinator: an open :class:`idemlock.aio.AsyncCoordinator` instead of ``url``.
    :param identity: a FastAPI dependency (a function FastAPI can call with its own
        parameters and ``Depends``) returning the caller's identity as a str, or None.
    :param options: the options of :class:`idemlock.integrations.asgi.IdempotencyMiddleware`
        (``spec``, ``require_key``, ``allow_anonymous``, ``fingerprint``,
        ``mismatch_status``, ``max_body``, ``record``, ...), the defaults of every
        protected route. ``methods`` and ``routes`` do not apply: the decorated endpoint
        is the route.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        coordinator: AsyncCoordinator | None = None,
        identity: Identity | None = None,
        **options: Unpack[RouteOptions],
    ) -> None:
        if (url is None) == (coordinator is None):
            raise ConfigurationError("Idempotency needs a store url or a coordinator (one)")
        if coordinator is not None and not isinstance(coordinator, AsyncCoordinator):
            raise ConfigurationError(
                "Idempotency needs an idemlock.aio.AsyncCoordinator (idemlock.aio.connect), "
                f"got {type(coordinator).__name__}"
            )
        if identity is not None and not callable(identity):
            raise ConfigurationError("identity must be a FastAPI dependency (a callable)")
        for name in ("methods", "routes"):
            if name in options:
                raise ConfigurationError(
                    f"{name!r} does not apply to FastAPI: protect each endpoint with "
                    "@idem.protect(...)"
                )
        self.url = url
        self.identity = identity
        self.options = HttpOptions.of(options)
        self._coordinator = coordinator
        #: the endpoints this instance protected (while their functions live)
        self._protected: weakref.WeakSet[_ProtectedEndpoint] = weakref.WeakSet()

    @property
    def coordinator(self) -> AsyncCoordinator:
        if self._coordinator is None:
            raise ConfigurationError(
                "the idempotency coordinator is not open: give FastAPI the lifespan "
                "(FastAPI(lifespan=idem.lifespan), or async with idem.lifespan(app) in yours)"
            )
        return self._coordinator

    @asynccontextmanager
    async def lifespan(self, app: Any = None) -> AsyncIterator[None]:
        """Open the coordinator from ``url`` for the application's life, then close it.

        At startup it also checks the application (``app``, which FastAPI passes): every
        endpoint this instance protected must be one of its routes, served through the
        layer :meth:`install` adds; else a :class:`~idemlock.ConfigurationError` names
        the endpoint and the application does not start."""
        if app is not None:
            self._check(app)
        if self.url is None:
            yield  # a coordinator given by the caller: theirs to open and close
            return
        import idemlock.aio

        self._coordinator = idemlock.aio.connect(self.url)
        try:
            yield
        finally:
            coord, self._coordinator = self._coordinator, None
            await coord.close()

    def install(self, app: FastAPI) -> None:
        """Add the response-copying layer and document the protected routes in
        ``app.openapi()``. Call it once, before the application serves."""
        app.add_middleware(IdempotencyCapture, max_body=self.options.max_body)
        generate = app.openapi

        def openapi() -> dict[str, Any]:
            if app.openapi_schema is None:
                _protect_routes(app)
                _document(generate())
            return cast(dict[str, Any], app.openapi_schema)

        app.openapi = openapi  # type: ignore[method-assign]
        _protect_routes(app)

    def _check(self, app: Any) -> None:
        """Protect the routes registered with an endpoint's own function (``@idem.protect``
        above ``@app.post``), then check that every endpoint this instance protected is
        a route of ``app`` (or of an application it mounts) served through
        :meth:`install`'s layer; else raise :class:`~idemlock.ConfigurationError` naming
        the endpoint. The lifespan calls it at startup."""
        served = _protect_routes(app)
        bare = sorted(
            {_describe(p.fn) for p, host in served if p.owner is self and not _installed(host)}
        )
        if bare:
            raise ConfigurationError(
                f"{', '.join(bare)} {'is' if len(bare) == 1 else 'are'} protected with "
                "@idem.protect, but idem.install(app) was not called on the application "
                "serving it: call it once after creating the FastAPI app"
            )
        missing = self._unserved()
        if missing:
            gc.collect()  # the endpoints of applications already dropped (an app factory)
            missing = self._unserved()
        if missing:
            raise ConfigurationError(
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} protected with "
                "@idem.protect but no route of this application calls "
                f"{'it' if len(missing) == 1 else 'them'}: register each with "
                "@app.post(...) (or @router.post(...), and app.include_router(router) "
                "before the application starts), and put @idem.protect below the route "
                "decorator"
            )

    def _unserved(self) -> list[str]:
        return sorted(_describe(p.fn) for p in list(self._protected) if not p.served)

    @overload
    def protect(
        self,
        endpoint: F,
        /,
        *,
        spec: IdempotencySpec | str | None = None,
        ttl: timedelta | float | None = None,
        lease: timedelta | float | None = None,
        identity: Identity | None = ...,
        **options: Unpack[ViewOptions],
    ) -> F: ...

    @overload
    def protect(
        self,
        endpoint: None = None,
        /,
        *,
        spec: IdempotencySpec | str | None = None,
        ttl: timedelta | float | None = None,
        lease: timedelta | float | None = None,
        identity: Identity | None = ...,
        **options: Unpack[ViewOptions],
    ) -> Callable[[F], F]: ...

    def protect(
        self,
        endpoint: F | None = None,
        /,
        *,
        spec: IdempotencySpec | str | None = None,
        ttl: timedelta | float | None = None,
        lease: timedelta | float | None = None,
        identity: Identity | None = _UNSET,
        **options: Any,
    ) -> F | Callable[[F], F]:
        """Protect one endpoint: ``@idem.protect`` or ``@idem.protect(ttl=..., ...)``,
        best put *under* ``@app.post(...)``. Above it works too: the route FastAPI
        registered with the function itself is rebuilt on the protected wrapper (by
        :meth:`install`, the lifespan and the layer ``install`` adds, before the first
        request). ``spec``, or ``ttl`` and ``lease`` over the default spec, say how long
        this route's responses are replayed and how long a crashed request holds its
        key; ``identity`` and the other options (those of :class:`Idempotency`) replace
        its defaults for this route. The decorated endpoint keeps its type."""
        for name in options:
            if name not in ViewOptions.__optional_keys__:
                # What Python says of an unknown keyword (a type checker says it too).
                raise TypeError(
                    f"Idempotency.protect() got an unexpected keyword argument {name!r}"
                    f"{did_you_mean(name, ViewOptions.__optional_keys__)}"
                )
        ident = self.identity if identity is _UNSET else identity
        if ident is not None and not callable(ident):
            raise ConfigurationError("identity must be a FastAPI dependency (a callable)")
        opts = self.options.with_changes(**options) if options else self.options
        base = opts.spec if spec is None else spec
        ttl_td, lease_td = _seconds(ttl, "ttl"), _seconds(lease, "lease")
        if ttl_td is not None or lease_td is not None:
            if not isinstance(base, IdempotencySpec):
                base = IdempotencySpec(base)
            base = dataclasses.replace(base, ttl=ttl_td or base.ttl, lease=lease_td or base.lease)
        opts = opts.with_changes(spec=base)

        def wrap(fn: F) -> F:
            if not callable(fn):
                raise ConfigurationError(f"@idem.protect decorates an endpoint, got {fn!r}")
            protected = _ProtectedEndpoint(self, fn, opts, ident)
            self._protected.add(protected)
            return cast(F, protected.endpoint)

        return wrap if endpoint is None else wrap(endpoint)


class _ProtectedEndpoint:
    """One protected endpoint: the wrapper FastAPI calls, and its core (made at the
    first request, on the coordinator the lifespan opened)."""

    def __init__(
        self,
        owner: Idempotency,
        fn: Callable[..., Any],
        options: HttpOptions,
        identity: Identity | None,
    ) -> None:
        self.owner, self.fn, self.options, self.identity = owner, fn, options, identity
        self._made: tuple[AsyncCoordinator, HttpCore] | None = None
        self._is_async = _is_async(fn)
        self.mark = uuid.uuid4().hex
        #: found as the endpoint of a route (set by _protect_routes)
        self.served = False
        _PROTECTED[self.mark] = self
        self.endpoint = self._wrapper()
        # After the wrapper copied the function's attributes. A callable that takes no
        # attributes is only found when protected from below its route decorator.
        with contextlib.suppress(AttributeError, TypeError):
            setattr(fn, _PROTECTED_BY, self)

    def core(self) -> HttpCore:
        coord = self.owner.coordinator
        made = self._made
        if made is None or made[0] is not coord:
            # First request, or a new coordinator (a new lifespan): a core on it.
            port = coord.idempotency(self.options.spec)
            core = HttpCore(
                AsyncPortFace(port), self.options, has_identity=self.identity is not None
            )
            made = self._made = (coord, core)
        return made[1]

    def _context(self) -> Callable[..., Any]:
        """The dependency the wrapper adds: the request, the key header (for the OpenAPI
        document; the key is read from the raw headers) and the identity. A dependency
        of its own, so no name or type of the endpoint's parameters can collide with
        them (FastAPI gives one endpoint's ``Request`` to one parameter only)."""
        options = self.options
        form = (
            'as a quoted string (`"order-A18"`)'
            if options.allow_unquoted_key is False
            else '(`order-A18`, or quoted: `"order-A18"`)'
        )
        params = [
            inspect.Parameter("request", inspect.Parameter.KEYWORD_ONLY, annotation=Request),
            inspect.Parameter(
                "key",
                inspect.Parameter.KEYWORD_ONLY,
                annotation=str | None,
                default=Header(
                    None,
                    alias=options.header,
                    description=(
                        f"A unique key for this operation {form}. A retry with the same "
                        "key and request gets the first response back (marked "
                        f"`{options.replay_header}: true`) and the operation does not run "
                        "again." + (" Required." if options.require_key else "")
                    ),
                    json_schema_extra={_OPENAPI_MARK: self.mark},
                ),
            ),
        ]
        if self.identity is not None:
            params.append(
                inspect.Parameter(
                    "identity",
                    inspect.Parameter.KEYWORD_ONLY,
                    annotation=Any,
                    default=Depends(self.identity),
                )
            )

        async def context(
            *, request: Request, key: str | None = None, identity: Any = None
        ) -> tuple[Request, Any]:
            return request, identity

        context.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        return context

    def _wrapper(self) -> Callable[..., Any]:
        fn = self.fn
        try:  # as FastAPI reads it: strings it cannot resolve are left to it
            sig = inspect.signature(fn, eval_str=True)
        except NameError:
            sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        injected = _INJECTED
        while injected in sig.parameters:
            injected += "_"
        at = next(
            (i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD),
            len(params),
        )
        params.insert(
            at,
            inspect.Parameter(
                injected,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=Any,
                default=Depends(self._context()),
            ),
        )

        @functools.wraps(fn)
        async def endpoint(*args: Any, **kwargs: Any) -> Any:
            request, ident = kwargs.pop(injected)
            decided = await self._decide(request, ident)
            if isinstance(decided, Answer):
                return _response(decided)
            if self._is_async:
                return await fn(*args, **kwargs)
            return await run_in_threadpool(fn, *args, **kwargs)

        endpoint.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        endpoint.__idemlock_route__ = self  # type: ignore[attr-defined]  # keeps it alive
        return endpoint

    async def _decide(self, request: Request, ident: Any) -> Answer | None:
        slot = request.scope.get(_SLOT)
        if not isinstance(slot, _Slot):
            raise ConfigurationError(
                "this endpoint is protected with @idem.protect, but idem.install(app) was "
                "not called: call it once after creating the FastAPI app"
            )
        core = self.core()
        key = core.key_of(request.scope.get("headers") or ())
        if key is None or isinstance(key, Answer):
            return key
        refused = core.refuse_identity(ident)
        if refused is not None:
            return refused
        if core.declared_too_large(request.scope.get("headers") or ()):
            return core.problems.too_large()
        try:
            body = await request.body()  # FastAPI's copy, or read now
        except RuntimeError:
            # A form endpoint: FastAPI parsed the stream without keeping its bytes,
            # which the capture layer copied on the way.
            body = b"" if slot.over else b"".join(slot.chunks)
        if slot.over or len(body) > core.max_body:
            return core.problems.too_large()
        decided = await core.claim(request.scope, ident, key, body)
        if isinstance(decided, Run):
            slot.core, slot.run = core, decided
            return None
        return decided


def _is_async(fn: Callable[..., Any]) -> bool:
    """As FastAPI decides to await an endpoint (a coroutine function, or a callable
    whose ``__call__`` is one) rather than run it in the threadpool."""
    if inspect.isroutine(fn) or isinstance(fn, functools.partial):
        return inspect.iscoroutinefunction(fn)
    return inspect.iscoroutinefunction(type(fn).__call__)


def _describe(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or repr(fn)
    code = getattr(fn, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"{name}(){where}"


def _routers(app: Any) -> Iterator[tuple[Any, Any]]:
    """Every router of an application, with the application serving it: its own, the
    routers it includes (FastAPI >= 0.16x keeps them by reference) and those of the
    applications it mounts."""
    seen: set[int] = set()
    stack: list[tuple[Any, Any]] = [(getattr(app, "router", app), app)]
    while stack:
        router, host = stack.pop()
        if id(router) in seen:
            continue
        seen.add(id(router))
        yield router, host
        for route in list(getattr(router, "routes", None) or ()):
            included = getattr(route, "original_router", None)
            if included is not None:
                stack.append((included, host))
            elif isinstance(route, (Mount, Host)):
                mounted = getattr(route, "_base_app", route.app)
                if hasattr(mounted, "user_middleware"):  # an application of its own
                    stack.append((getattr(mounted, "router", mounted), mounted))
                else:
                    stack.append((mounted, host))


def _routes_version(app: Any) -> object:
    router = getattr(app, "router", app)
    version = getattr(router, "_get_routes_version", None)
    count = len(getattr(router, "routes", None) or ())
    return (count, version() if callable(version) else None)


def _protect_routes(app: Any) -> list[tuple[_ProtectedEndpoint, Any]]:
    """Put each route registered with a function ``protect`` wrapped (``@idem.protect``
    above ``@app.post``) on the protected wrapper instead, then return the protected
    endpoints the application's routes serve, each with the application serving it."""
    served: list[tuple[_ProtectedEndpoint, Any]] = []
    for router, host in _routers(app):
        routes = getattr(router, "routes", None)
        if not isinstance(routes, list):
            continue
        changed = False
        for i, route in enumerate(routes):
            if not isinstance(route, APIRoute):
                continue
            endpoint = route.endpoint
            protected = getattr(endpoint, "__idemlock_route__", None)
            if isinstance(protected, _ProtectedEndpoint):
                served.append((protected, host))
                continue
            protected = getattr(endpoint, _PROTECTED_BY, None)
            if isinstance(protected, _ProtectedEndpoint) and protected.fn is endpoint:
                routes[i] = _rebuilt(route, protected)
                changed = True
                served.append((protected, host))
        if changed:
            mark = getattr(router, "_mark_routes_changed", None)
            if callable(mark):
                mark()  # FastAPI's caches of included routes
    for protected, _ in served:
        protected.served = True
    return served


def _rebuilt(route: APIRoute, protected: _ProtectedEndpoint) -> APIRoute:
    """The same route (its path, methods, status, response model, dependencies, ...)
    calling the protected wrapper: every option of the route class's constructor is
    read back from the attribute of that name."""
    cls = type(route)
    options = {
        name: getattr(route, name)
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and hasattr(route, name)
    }
    try:
        return cls(route.path, protected.endpoint, **options)
    except Exception as e:
        raise ConfigurationError(
            f"{_describe(protected.fn)} is protected with @idem.protect above its route "
            f"decorator, and its route {route.path!r} could not be rebuilt on the protected "
            f"endpoint ({type(e).__name__}: {e}): put @idem.protect below @app.post(...)"
        ) from e


def _installed(app: Any) -> bool:
    middleware = getattr(app, "user_middleware", None)
    if middleware is None:
        return True  # not an application we can inspect: the request-time check stays
    return any(getattr(m, "cls", None) is IdempotencyCapture for m in middleware)


def _response(answer: Answer) -> Response:
    response = Response(answer.body, status_code=answer.status)
    response.raw_headers = list(answer.headers)  # repeated fields (Set-Cookie) kept
    return response


def _document(schema: dict[str, Any]) -> None:
    """Add the Idempotency-Key problem responses to each protected operation, found by
    the marker its key parameter carries (whatever way FastAPI nests its routers)."""
    used = False
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            if not isinstance(operation, dict):
                continue
            marked = [
                (p, p["schema"].pop(_OPENAPI_MARK))
                for p in operation.get("parameters", ())
                if isinstance(p.get("schema"), dict) and _OPENAPI_MARK in p["schema"]
            ]
            found = next(((p, _PROTECTED[m]) for p, m in marked if m in _PROTECTED), None)
            if found is None:
                continue
            param, protected = found
            used = True
            if protected.options.require_key:
                # The header is Optional in the dependency (its absence is our 400
                # problem, not FastAPI's validation error), but the operation needs it.
                param["required"] = True
            _add_problems(operation, protected)
            _add_replay_header(operation, protected.options.replay_header)
    if used:
        schema.setdefault("components", {}).setdefault("schemas", {})["IdempotencyProblem"] = (
            _PROBLEM_SCHEMA
        )


def _add_replay_header(operation: dict[str, Any], name: str | None) -> None:
    """Document the replay marker on the operation's success responses (a retry gets
    the recorded response back with it)."""
    if name is None:
        return
    for status, entry in operation.get("responses", {}).items():
        if isinstance(entry, dict) and str(status).startswith("2"):
            entry.setdefault("headers", {})[name] = {
                "description": (
                    "`true` when this is the recorded response of an earlier request with "
                    "the same Idempotency-Key, replayed (the operation did not run again); "
                    "absent on a first run."
                ),
                "schema": {"type": "string", "enum": ["true"]},
            }


def _add_problems(operation: dict[str, Any], protected: _ProtectedEndpoint) -> None:
    statuses = {400, 409, 413, 503, protected.options.mismatch_status or 422}
    if protected.identity is not None or protected.options.allow_anonymous is False:
        statuses.add(401)
    responses = operation.setdefault("responses", {})
    for status in sorted(statuses):
        entry = responses.setdefault(str(status), {})
        codes = ", ".join(f"`{c}`" for c in PROBLEM_CODES.get(status, ()))
        described = _DESCRIPTIONS[status] + (f" (code {codes})" if codes else "")
        old = entry.get("description")
        entry["description"] = described if not old else f"{old}; or: {described}"
        entry.setdefault("content", {})["application/problem+json"] = {
            "schema": {"$ref": "#/components/schemas/IdempotencyProblem"}
        }
