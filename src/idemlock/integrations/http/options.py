"""The options of the HTTP adapters, checked once for all of them: the typed keyword
dicts users' type checkers see (:class:`RouteOptions`, :class:`IdempotencyOptions`),
the frozen :class:`HttpOptions` the decision core reads, the route filter and the spec
read from configuration (Django's and Flask's settings)."""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, TypedDict, Union

from ..._core.types import IdempotencySpec
from ..._errors import ConfigurationError
from .fingerprint import Fingerprint
from .recorded_response import default_record

Scope = MutableMapping[str, Any]
RouteFilter = Union[
    Callable[[Scope], bool], str, "re.Pattern[str]", Iterable["str | re.Pattern[str]"]
]

DEFAULT_SPEC = IdempotencySpec("http", ttl=timedelta(hours=24), lease=timedelta(seconds=30))


class ViewOptions(TypedDict, total=False):
    """The keyword options of one protected endpoint or view (FastAPI's and Flask's
    ``protect``) besides its spec and identity; every adapter takes them. For type
    checkers only: at run time they are plain keyword arguments."""

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


class RouteOptions(ViewOptions, total=False):
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
