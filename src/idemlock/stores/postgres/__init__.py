"""The PostgreSQL store: idempotency records and fenced leases in the database that
already holds your data, on psycopg 3 and psycopg_pool.

Open it with ``idemlock.connect("postgresql://user@host/db")`` (or ``postgres://``,
or ``idemlock.aio.connect``), or pass an existing ``psycopg_pool.ConnectionPool`` /
``AsyncConnectionPool``. Options (keywords to ``connect``):

* ``schema`` (default ``"idemlock"``): the PostgreSQL schema holding the tables;
* ``auto_migrate`` (default True): create or upgrade the schema on first use; with
  False, run ``idemlock migrate --url URL [--schema SCHEMA]`` (:func:`migrate`) first,
  on the store's URL (its ``?timeout=`` is taken off as here) and with its ``schema``;
* ``prepare`` (default True): use server-side prepared statements where they are safe:
  the store finds out by itself when its URL goes through a transaction pooler
  (PgBouncer...) and then never prepares (see "PostgreSQL behind a pooler" in
  docs/operations.md);
* ``listen_url`` (also ``?listen_url=`` in the URL, percent-encoded): a
  ``postgresql://`` URL straight to the server for the one connection that takes
  notifications, when the store's URL goes through a transaction pooler, where LISTEN
  does not work (without it, waiters behind such a pooler re-check every 0.1 s, and
  the store says so once in a warning);
* ``timeout`` (default 5 s; also ``?timeout=`` in the URL): the bound on one call,
  the wait for a pooled connection included. It holds when the network goes silent
  (a watchdog shuts down the socket of a call past it, and the connection is
  dropped); the store's own connections also get ``connect_timeout``,
  ``statement_timeout``, TCP keepalives and ``tcp_user_timeout`` from it (unless the
  URL sets them). A call past it raises :class:`~idemlock.StoreUnavailable`;
* for URLs only: ``min_size`` (1) and ``max_size`` (10) of the pool the store makes.

How it works:

* Every transition is ONE SQL statement in autocommit (``INSERT ... ON CONFLICT ...
  DO UPDATE ... WHERE ... RETURNING`` or ``UPDATE ... WHERE token = ...``), so it is
  atomic, and a client killed in the middle leaves no half-made claim.
* Expiry is judged by the database clock (``clock_timestamp()``), never the client's.
* Fences and lock tokens come from one sequence, so they survive restarts and strictly
  increase per key; freeing a key keeps its row (a tombstone) until :meth:`purge`.
* A waiter is woken by LISTEN/NOTIFY on one connection per store, which the store
  opens besides its pool (also when you pass your own pool); freeing statements call
  ``pg_notify`` themselves, so waking is part of the change. An election's observers
  listen on the same channel and are also woken by a grant or renew that publishes a
  value (a new term, ``term.proclaim()``): that statement notifies with payload ``!``,
  which the key's lock waiters sleep through. An acquire or renew without a value (a
  plain lock, a semaphore) runs a statement without it and notifies nobody.
* Locks are handed off in arrival order: a process waiting on a lock is queued in
  ``lock_waiters`` by its refused attempts; a release reserves the free lock for the
  oldest waiting process for ``HANDOFF_MS`` (50) and names it in the notification, so
  only that process wakes at once and only its callers may take the lock meanwhile. A
  process whose waiters all left is unregistered by its listener; a crashed one's
  registration lapses (``REGISTER_MS``) and costs at most one window. The schema is at
  version 2 for this; ``idemlock migrate`` upgrades a version-1 database.
* Statements run with READ COMMITTED semantics (PostgreSQL's default); a driver error,
  a pool timeout or an admin shutdown raises :class:`~idemlock.StoreUnavailable`.
* ``purge()`` (``idemlock purge``) deletes expired records, locks and tombstones, in
  batches, using an index on expiry.

Fenced writes to your own tables and completing a claim in your own transaction:
see :mod:`idemlock.stores.postgres.fenced` (re-exported here).
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import unquote

import psycopg
import psycopg_pool
from psycopg.conninfo import conninfo_to_dict

from ..._core.clock import duration
from ..._errors import ConfigurationError
from ..._urls import redact
from ._pool import CancellableAsyncPool
from ._schema_async import amigrate
from ._schema_sync import migrate
from ._sql import SCHEMA_VERSION
from ._store import (
    DEFAULT_SCHEMA,
    DEFAULT_TIMEOUT,
    AsyncPostgresStore,
    Health,
    PostgresStore,
    _secrets_of,
    check_schema,
    recording_class,
)
from .fenced import (
    acomplete_in_transaction,
    afenced_update,
    afenced_upsert,
    arecord_step_in_transaction,
    complete_in_transaction,
    fenced_update,
    fenced_update_stmt,
    fenced_upsert,
    fenced_upsert_stmt,
    record_step_in_transaction,
    sa_afenced_update,
    sa_afenced_upsert,
    sa_fenced_update,
    sa_fenced_upsert,
)

__all__ = [
    "SCHEMA_VERSION",
    "AsyncPostgresStore",
    "PostgresStore",
    "acomplete_in_transaction",
    "afenced_update",
    "afenced_upsert",
    "arecord_step_in_transaction",
    "amigrate",
    "complete_in_transaction",
    "fenced_update",
    "fenced_update_stmt",
    "fenced_upsert",
    "fenced_upsert_stmt",
    "from_client",
    "migrate",
    "open_async",
    "open_sync",
    "record_step_in_transaction",
    "sa_afenced_update",
    "sa_afenced_upsert",
    "sa_fenced_update",
    "sa_fenced_upsert",
]

#: what a bad timeout is called in the error
_TIMEOUT = "the PostgreSQL store option timeout (the bound on one call)"
# The store's own pools run in autocommit: one statement per call, no BEGIN/COMMIT.
_POOL_KWARGS = {"autocommit": True}


def _pool_options(min_size: int, max_size: int) -> None:
    if not (isinstance(min_size, int) and isinstance(max_size, int) and min_size >= 0):
        raise ConfigurationError(
            f"min_size and max_size must be ints, got {min_size!r}, {max_size!r}"
        )
    if max_size < max(1, min_size):
        raise ConfigurationError(
            f"max_size must be at least 1 and at least min_size, got {max_size!r}"
        )


def _split_url(url: str, timeout: object, listen_url: object = None) -> tuple[str, float]:
    """The URL without idemlock's own ``?timeout=`` and ``?listen_url=`` (libpq would
    refuse them) and the timeout, from the URL or the keyword (not both)."""
    head, secs, _ = _split_url_listen(url, timeout, listen_url)
    return head, secs


def _split_url_listen(
    url: str, timeout: object, listen_url: object = None
) -> tuple[str, float, str | None]:
    """As :func:`_split_url`, and the ``listen_url`` (URL option or keyword, not both)."""
    head, sep, query = url.partition("?")
    given: object = None
    listen: str | None = None
    kept = []
    if sep:
        for part in query.split("&"):
            name, _, value = part.partition("=")
            if unquote(name) == "timeout":
                if given is not None:
                    raise ConfigurationError("timeout is given twice in the URL; give it once")
                given = unquote(value)
            elif unquote(name) == "listen_url":
                if listen is not None:
                    raise ConfigurationError("listen_url is given twice in the URL; give it once")
                listen = unquote(value)
            else:
                kept.append(part)
    if listen is not None and listen_url is not None:
        raise ConfigurationError(
            "listen_url is given twice (in the URL and as a keyword); give it once"
        )
    if listen_url is not None:
        if not isinstance(listen_url, str):
            raise ConfigurationError(
                f"listen_url must be a postgresql:// URL, got {type(listen_url).__name__}"
            )
        listen = listen_url
    if given is not None and timeout is not None:
        raise ConfigurationError(
            "timeout is given twice (in the URL and as a keyword); give it once"
        )
    secs = duration(
        given if given is not None else timeout if timeout is not None else DEFAULT_TIMEOUT,
        _TIMEOUT,
        positive=True,
        text=True,
    )
    if listen is not None and not listen.lower().startswith(("postgresql://", "postgres://")):
        raise ConfigurationError(
            f"listen_url must be a postgresql:// URL straight to the server, got "
            f"{redact(listen)!r} (percent-encode it when it is given inside the store's URL)"
        )
    return head + ("?" + "&".join(kept) if kept else ""), secs, listen


def _listen_settings(listen_url: str | None, timeout: float) -> tuple[str, dict[str, Any]] | None:
    """(conninfo, settings) of the notification connection of ``listen_url``: the
    store's bounds on the wire, no ``options`` (a pooler would refuse them; LISTEN is
    bounded by the watchdog)."""
    if listen_url is None:
        return None
    kw = _server_kwargs(listen_url, timeout)
    for name in ("autocommit", "options"):
        kw.pop(name, None)
    return listen_url, kw


def _server_kwargs(url: str, timeout: float) -> dict[str, Any]:
    """Connection settings that bound each call on the server and on the wire (A1):
    a connect timeout, ``statement_timeout``, TCP keepalives and ``tcp_user_timeout``.
    A setting the URL gives itself is left alone."""
    try:
        given = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        # libpq quotes the part it could not read, which may be a password.
        detail = str(exc)
        for secret in _secrets_of(url):
            detail = detail.replace(secret, "***")
        raise ConfigurationError(
            f"not a valid PostgreSQL URL: {redact(url)!r} ({detail})"
        ) from None
    kw: dict[str, Any] = dict(_POOL_KWARGS)
    secs = max(1, math.ceil(timeout))
    defaults: dict[str, Any] = {
        "connect_timeout": max(2, secs),  # psycopg's floor
        "keepalives": 1,
        "keepalives_idle": secs,
        "keepalives_interval": 1,
        "keepalives_count": 3,
        "tcp_user_timeout": int(timeout * 1000),  # unacknowledged data: ms
    }
    for name, value in defaults.items():
        if name not in given:
            kw[name] = value
    options = str(given.get("options", ""))
    if "statement_timeout" not in options:
        kw["options"] = f"{options} -c statement_timeout={int(timeout * 1000)}".strip()
    return kw


def _make_pool(
    cls: Any, url: str, timeout: float, min_size: int, max_size: int, health: Health
) -> Any:
    base = (
        psycopg.AsyncConnection
        if issubclass(cls, psycopg_pool.AsyncConnectionPool)
        else psycopg.Connection
    )
    return cls(
        url,
        min_size=min_size,
        max_size=max_size,
        timeout=timeout,
        kwargs=_server_kwargs(url, timeout),
        connection_class=recording_class(base, health),
        open=False,
        name="idemlock",
    )


def _open(
    store_cls: Any,
    pool_cls: Any,
    url: str,
    *,
    schema: str,
    auto_migrate: bool,
    prepare: bool,
    min_size: int,
    max_size: int,
    timeout: float | None,
    listen_url: str | None,
) -> Any:
    """A store of ``store_cls`` on a pool of ``pool_cls`` of its own (opened on first
    use, closed with the store); a forked child makes another with ``factory``."""
    check_schema(schema)
    _pool_options(min_size, max_size)
    url, secs, listen = _split_url_listen(url, timeout, listen_url)
    health = Health()

    def factory() -> Any:
        return _make_pool(pool_cls, url, secs, min_size, max_size, health)

    return store_cls(
        factory(),
        schema=schema,
        prepare=prepare,
        auto_migrate=auto_migrate,
        owns_pool=True,
        timeout=secs,
        pool_factory=factory,
        health=health,
        listen=_listen_settings(listen, secs),
    )


def open_sync(
    url: str,
    *,
    schema: str = DEFAULT_SCHEMA,
    auto_migrate: bool = True,
    prepare: bool = True,
    min_size: int = 1,
    max_size: int = 10,
    timeout: float | None = None,
    listen_url: str | None = None,
) -> tuple[PostgresStore, None]:
    """A sync store on a pool of its own (opened on first use, closed with the store)."""
    store: PostgresStore = _open(
        PostgresStore,
        psycopg_pool.ConnectionPool,
        url,
        schema=schema,
        auto_migrate=auto_migrate,
        prepare=prepare,
        min_size=min_size,
        max_size=max_size,
        timeout=timeout,
        listen_url=listen_url,
    )
    return store, None


def open_async(
    url: str,
    *,
    schema: str = DEFAULT_SCHEMA,
    auto_migrate: bool = True,
    prepare: bool = True,
    min_size: int = 1,
    max_size: int = 10,
    timeout: float | None = None,
    listen_url: str | None = None,
) -> tuple[AsyncPostgresStore, None]:
    """An async store on a pool of its own (opened on first use, closed with the store)."""
    store: AsyncPostgresStore = _open(
        AsyncPostgresStore,
        CancellableAsyncPool,
        url,
        schema=schema,
        auto_migrate=auto_migrate,
        prepare=prepare,
        min_size=min_size,
        max_size=max_size,
        timeout=timeout,
        listen_url=listen_url,
    )
    return store, None


def from_client(
    pool: Any,
    asynchronous: bool,
    *,
    schema: str = DEFAULT_SCHEMA,
    auto_migrate: bool = True,
    prepare: bool = True,
    timeout: float | None = None,
    listen_url: str | None = None,
) -> tuple[PostgresStore | AsyncPostgresStore, None]:
    """A store on your open pool: a ``psycopg_pool.ConnectionPool`` for
    ``idemlock.connect``, an ``AsyncConnectionPool`` for ``idemlock.aio.connect``.
    Closing the store does not close your pool. Connections may be in autocommit or
    not; the store switches a borrowed connection to autocommit for its one statement
    and back. ``timeout`` (default 5 s) bounds each call, the wait for a connection of
    your pool included. In a forked child the store uses a pool of its own with your
    pool's settings (your pool's connections belong to the parent)."""
    secs = duration(
        DEFAULT_TIMEOUT if timeout is None else timeout, _TIMEOUT, positive=True, text=True
    )
    listen = None
    if listen_url is not None:
        listen = _listen_settings(_split_url_listen("", None, listen_url)[2], secs)
    if asynchronous:
        if not isinstance(pool, psycopg_pool.AsyncConnectionPool):
            raise ConfigurationError(
                f"idemlock.aio.connect needs a psycopg_pool.AsyncConnectionPool, got "
                f"{type(pool).__name__} (pass a ConnectionPool to idemlock.connect)"
            )
        return AsyncPostgresStore(
            pool,
            schema=schema,
            prepare=prepare,
            auto_migrate=auto_migrate,
            timeout=secs,
            listen=listen,
        ), None
    if not isinstance(pool, psycopg_pool.ConnectionPool):
        raise ConfigurationError(
            f"idemlock.connect needs a psycopg_pool.ConnectionPool, got {type(pool).__name__} "
            "(pass an AsyncConnectionPool to idemlock.aio.connect)"
        )
    return PostgresStore(
        pool,
        schema=schema,
        prepare=prepare,
        auto_migrate=auto_migrate,
        timeout=secs,
        listen=listen,
    ), None
