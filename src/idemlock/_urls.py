"""From a URL (or an existing client) to a store adapter.

Each scheme maps to a module and a function ``open_sync(url, **options)`` /
``open_async(url, **options)`` in it; the module (and so the store's driver) is
imported only when that scheme is used.
"""

from __future__ import annotations

import importlib
import os
from typing import Any
from urllib.parse import urlsplit

from ._core.clock import Clock
from ._errors import ConfigurationError

#: scheme -> module that implements it
SCHEMES: dict[str, str] = {
    "memory": "idemlock.stores.memory",
    "sqlite": "idemlock.stores.sqlite",
    "redis": "idemlock.stores.redis",
    "rediss": "idemlock.stores.redis",
    "unix": "idemlock.stores.redis",
    "redis+cluster": "idemlock.stores.redis",
    "rediss+cluster": "idemlock.stores.redis",
    "postgresql": "idemlock.stores.postgres",
    "postgres": "idemlock.stores.postgres",
    "etcd": "idemlock.stores.etcd",
    "etcds": "idemlock.stores.etcd",
}

#: client class module prefix -> store module, for passing an existing client
CLIENT_MODULES: dict[str, str] = {
    "redis": "idemlock.stores.redis",
    "psycopg_pool": "idemlock.stores.postgres",
}


def default_url() -> str:
    """``$IDEMLOCK_URL``, else a SQLite file in the user's state directory."""
    env = os.environ.get("IDEMLOCK_URL")
    if env:
        return env
    import platformdirs

    path = platformdirs.user_state_path("idemlock", appauthor=False) / "idemlock.db"
    return f"sqlite:///{path}"


def _accepted() -> str:
    return ", ".join(f"{s}://" for s in SCHEMES)


def open_store(url: Any, *, asynchronous: bool, **options: Any) -> tuple[Any, Clock | None, str]:
    """Return (store, clock the store judges time by or None, URL to show)."""
    if url is not None and not isinstance(url, str):
        modname = CLIENT_MODULES.get(type(url).__module__.split(".")[0])
        if modname is None:
            raise ConfigurationError(
                f"cannot build a store from a {type(url).__module__}.{type(url).__name__}; "
                f"pass a URL ({_accepted()}) or a redis-py client or a psycopg_pool pool"
            )
        mod = importlib.import_module(modname)
        store, clock = mod.from_client(url, asynchronous=asynchronous, **options)
        return store, clock, f"<{type(url).__name__}>"
    if url is None:
        url = default_url()
    if "://" not in url:
        raise ConfigurationError(
            f"store URL {url!r} has no scheme; use one of {_accepted()} "
            "(for example sqlite:///var/lib/app/idemlock.db)"
        )
    scheme = urlsplit(url).scheme.lower() if url.split("://", 1)[0].isascii() else ""
    modname = SCHEMES.get(scheme) or SCHEMES.get(url.split("://", 1)[0].lower())
    if modname is None:
        raise ConfigurationError(
            f"unknown store URL scheme {url.split('://', 1)[0]!r} in {redact(url)!r}; "
            f"accepted schemes: {_accepted()}"
        )
    try:
        mod = importlib.import_module(modname)
    except ImportError as exc:
        extra = modname.rsplit(".", 1)[-1]
        raise ConfigurationError(
            f"the {extra} store needs its driver: pip install 'idemlock[{extra}]' ({exc})"
        ) from exc
    opener = mod.open_async if asynchronous else mod.open_sync
    store, clock = opener(url, **options)
    return store, clock, redact(url)


def redact(url: str) -> str:
    """The URL with any password replaced, for messages and listings."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if parts.password:
        netloc = parts.netloc.replace(":" + parts.password + "@", ":***@")
        return parts._replace(netloc=netloc).geturl()
    return url
