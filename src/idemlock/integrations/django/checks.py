"""System checks of ``settings.IDEMLOCK`` and of the middleware's place, run by
``manage.py check`` (and before ``runserver``, ``migrate``, the test runner) once
``"idemlock.integrations.django"`` is in ``INSTALLED_APPS``.

=================  ==========================================================================
idemlock.E001      ``IDEMLOCK`` is missing while the middleware is installed
idemlock.E002      ``IDEMLOCK`` is not a dict
idemlock.E003      an unknown key in ``IDEMLOCK`` (the message says which one was meant)
idemlock.E004      neither ``url`` nor ``coordinator`` is set
idemlock.E005      a value ``IdempotencyMiddleware`` would refuse (a bad spec, identity, option)
idemlock.E006      ``atomic`` with a store or database on which it cannot work
idemlock.E007      the middleware runs before ``AuthenticationMiddleware`` while the identity
                   is ``"user"`` (or that middleware is missing): every keyed request would
                   be 401
idemlock.W001      the store does not answer (checked with one read of a key that never exists)
=================  ==========================================================================
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning, register
from django.utils.module_loading import import_string

from ..._errors import ConfigurationError, IdemlockError
from ..http.options import HttpOptions, did_you_mean

__all__ = ["check_middleware_order", "check_settings", "check_store"]

#: the keys of settings.IDEMLOCK: Django's own, then the HTTP options
DJANGO_KEYS = ("url", "coordinator", "identity", "atomic")
KNOWN_KEYS = (*DJANGO_KEYS, *(f.name for f in fields(HttpOptions)))
_MIDDLEWARE = "idemlock.integrations.django.IdempotencyMiddleware"
_AUTH = "django.contrib.auth.middleware.AuthenticationMiddleware"


def _conf() -> Any:
    return getattr(settings, "IDEMLOCK", None)


def _middleware_index(path: str) -> int | None:
    """Where ``MIDDLEWARE`` lists ``path`` or a subclass of it, or None."""
    try:
        wanted = import_string(path)
    except ImportError:
        return None
    for i, entry in enumerate(getattr(settings, "MIDDLEWARE", None) or ()):
        if entry == path:
            return i
        try:
            cls = import_string(entry)
        except ImportError:
            continue  # Django's own check reports a middleware that does not import
        if isinstance(cls, type) and issubclass(cls, wanted):
            return i
    return None


def _problems() -> list[CheckMessage]:
    """E001-E005: the setting itself, without touching the store."""
    conf = _conf()
    if conf is None:
        if _middleware_index(_MIDDLEWARE) is not None:
            return [
                Error(
                    "settings.IDEMLOCK is missing, and MIDDLEWARE lists idemlock's "
                    "IdempotencyMiddleware",
                    hint="set IDEMLOCK = {'url': 'sqlite:///var/lib/app/idemlock.db', ...}",
                    id="idemlock.E001",
                )
            ]
        return []
    if not isinstance(conf, dict):
        return [
            Error(
                f"settings.IDEMLOCK must be a dict, got {type(conf).__name__}",
                hint="IDEMLOCK = {'url': 'sqlite:///var/lib/app/idemlock.db', ...}",
                id="idemlock.E002",
            )
        ]
    found: list[CheckMessage] = []
    for key in conf:
        if key not in KNOWN_KEYS:
            found.append(
                Error(
                    f"settings.IDEMLOCK has an unknown key {key!r}"
                    f"{did_you_mean(str(key), KNOWN_KEYS)}",
                    hint=f"the keys are: {', '.join(KNOWN_KEYS)}",
                    obj="settings.IDEMLOCK",
                    id="idemlock.E003",
                )
            )
    if conf.get("url") is None and conf.get("coordinator") is None:
        found.append(
            Error(
                "settings.IDEMLOCK needs 'url' (a store URL) or 'coordinator'",
                hint="for example 'url': 'postgresql://app@db/app' or 'sqlite:///var/lib/...'",
                obj="settings.IDEMLOCK",
                id="idemlock.E004",
            )
        )
    elif conf.get("coordinator") is None and not isinstance(conf.get("url"), str):
        found.append(_invalid(f"'url' must be a str, got {conf.get('url')!r}"))
    if found:
        return found
    from . import _identity, _spec

    options = {k: v for k, v in conf.items() if k not in DJANGO_KEYS}
    try:
        _identity(conf.get("identity"))
        if "spec" in options:
            options["spec"] = _spec(options["spec"])
        HttpOptions.of(options)
        atomic = conf.get("atomic")
        if atomic not in (None, True, False) and not isinstance(atomic, str):
            raise ConfigurationError(
                f"'atomic' must be True, False or a database alias, got {atomic!r}"
            )
    except (ConfigurationError, TypeError, ValueError) as exc:
        return [_invalid(str(exc))]
    return []


def _invalid(message: str) -> Error:
    return Error(
        f"settings.IDEMLOCK: {message}",
        obj="settings.IDEMLOCK",
        id="idemlock.E005",
    )


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E001-E005: ``settings.IDEMLOCK`` is what the middleware and decorators accept."""
    return _problems()


def check_middleware_order(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E007: with the identity ``"user"`` the middleware must run after Django's
    authentication, which sets ``request.user``."""
    conf = _conf()
    at = _middleware_index(_MIDDLEWARE)
    if at is None or not isinstance(conf, dict) or conf.get("identity") != "user":
        return []
    auth = _middleware_index(_AUTH)
    if auth is not None and auth < at:
        return []
    where = (
        "is not in MIDDLEWARE"
        if auth is None
        else f"comes after it (MIDDLEWARE[{auth}] after MIDDLEWARE[{at}])"
    )
    return [
        Error(
            "idemlock's IdempotencyMiddleware takes the caller from request.user "
            f"(IDEMLOCK['identity'] == 'user'), but {_AUTH} {where}: request.user is not "
            "set when it runs, so every request with an Idempotency-Key would be 401",
            hint=(
                f"put {_MIDDLEWARE!r} after {_AUTH!r} (and SessionMiddleware) in MIDDLEWARE, "
                "or use another identity ('header:<Name>' or a function of the request)"
            ),
            obj=_MIDDLEWARE,
            id="idemlock.E007",
        )
    ]


def _unreachable(shown: str, exc: BaseException) -> Warning:
    return Warning(
        f"the idempotency store {shown} does not answer: {type(exc).__name__}: {exc}",
        hint=(
            "requests with an Idempotency-Key get 503 until it does; check "
            "settings.IDEMLOCK['url'] and that the store is running"
        ),
        obj="settings.IDEMLOCK",
        id="idemlock.W001",
    )


def check_store(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W001 (the store does not answer) and E006 (``atomic`` cannot work), once the
    setting itself is valid. The store is read once, for a key that never exists."""
    conf = _conf()
    if not isinstance(conf, dict) or _problems():
        return []
    import idemlock

    from ...cli._common import _shown_url
    from . import _check_atomic

    given = conf.get("coordinator")
    url = conf.get("url")
    shown = _shown_url(getattr(given, "url", None) or url)  # never a password
    try:
        coordinator = given if given is not None else idemlock.connect(url)
    except ConfigurationError as exc:  # a bad URL, a driver not installed
        return [_invalid(str(exc))]
    except (IdemlockError, OSError, TimeoutError) as exc:
        return [_unreachable(shown, exc)]
    try:
        try:
            coordinator.idempotency("idemlock-check").status("idemlock-system-check")
        except ConfigurationError as exc:
            return [_invalid(str(exc))]
        except (IdemlockError, OSError, TimeoutError) as exc:
            return [_unreachable(shown, exc)]
        atomic = conf.get("atomic")
        if atomic:
            try:
                _check_atomic(coordinator, "default" if atomic is True else atomic)
            except ConfigurationError as exc:
                return [Error(str(exc), obj="settings.IDEMLOCK", id="idemlock.E006")]
        return []
    finally:
        if given is None:
            coordinator.close()


for _check in (check_settings, check_middleware_order, check_store):
    register(_check, "idemlock")
