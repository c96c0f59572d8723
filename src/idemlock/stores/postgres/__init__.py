"""The PostgreSQL store: idempotency records and fenced leases in the database that
already holds your data, on psycopg 3 and psycopg_pool.

Open it with ``idemlock.connect("postgresql://user@host/db")`` (or ``postgres://``,
or ``idemlock.aio.connect``), or pass an existing ``psycopg_pool.ConnectionPool`` /
``AsyncConnectionPool``. Options (keywords to ``connect``):

* ``schema`` (default ``"idemlock"``): the PostgreSQL schema holding the tables;
* ``auto_migrate`` (default True): create or upgrade the schema on first use; with
  False, run ``idemlock migrate --url ...`` (:func:`migrate`) first;
* ``prepare`` (default True): use server-side prepared statements (set False behind
  PgBouncer < 1.21 in transaction mode);
* for URLs only: ``min_size`` (1), ``max_size`` (10) and ``timeout`` (5 s, how long a
  call waits for a free connection) of the pool the store makes.

How it works:

* Every transition is ONE SQL statement in autocommit (``INSERT ... ON CONFLICT ...
  DO UPDATE ... WHERE ... RETURNING`` or ``UPDATE ... WHERE token = ...``), so it is
  atomic, and a client killed in the middle leaves no half-made claim.
* Expiry is judged by the database clock (``clock_timestamp()``), never the client's.
* Fences and lock tokens come from one sequence, so they survive restarts and strictly
  increase per key; freeing a key keeps its row (a tombstone) until :meth:`purge`.
* A waiter is woken by LISTEN/NOTIFY on one connection per store, which the store
  opens besides its pool (also when you pass your own pool); freeing statements call
  ``pg_notify`` themselves, so waking is part of the change.
* Statements run with READ COMMITTED semantics (PostgreSQL's default); a driver error,
  a pool timeout or an admin shutdown raises :class:`~idemlock.StoreUnavailable`.
* ``purge()`` (``idemlock purge``) deletes expired records, locks and tombstones, in
  batches, using an index on expiry.

Fenced writes to your own tables and completing a claim in your own transaction:
see :mod:`idemlock.stores.postgres.fenced` (re-exported here).
"""

from __future__ import annotations

from typing import Any

import psycopg_pool

from ..._errors import ConfigurationError
from ._schema import amigrate, migrate
from ._sql import SCHEMA_VERSION
from ._store import DEFAULT_SCHEMA, AsyncPostgresStore, PostgresStore, check_schema
from .fenced import (
    acomplete_in_transaction,
    afenced_update,
    afenced_upsert,
    complete_in_transaction,
    fenced_update,
    fenced_update_stmt,
    fenced_upsert,
    fenced_upsert_stmt,
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
    "sa_afenced_update",
    "sa_afenced_upsert",
    "sa_fenced_update",
    "sa_fenced_upsert",
]

# The store's own pools run in autocommit: one statement per call, no BEGIN/COMMIT.
_POOL_KWARGS = {"autocommit": True}


def _pool_options(min_size: int, max_size: int, timeout: float) -> None:
    if not (isinstance(min_size, int) and isinstance(max_size, int) and min_size >= 0):
        raise ConfigurationError(
            f"min_size and max_size must be ints, got {min_size!r}, {max_size!r}"
        )
    if max_size < max(1, min_size):
        raise ConfigurationError(
            f"max_size must be at least 1 and at least min_size, got {max_size!r}"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigurationError(f"timeout must be a positive number of seconds, got {timeout!r}")


def open_sync(
    url: str,
    *,
    schema: str = DEFAULT_SCHEMA,
    auto_migrate: bool = True,
    prepare: bool = True,
    min_size: int = 1,
    max_size: int = 10,
    timeout: float = 5.0,
) -> tuple[PostgresStore, None]:
    """A sync store on a pool of its own (opened on first use, closed with the store)."""
    check_schema(schema)
    _pool_options(min_size, max_size, timeout)
    pool: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
        url,
        min_size=min_size,
        max_size=max_size,
        timeout=float(timeout),
        kwargs=dict(_POOL_KWARGS),
        open=False,
        name="idemlock",
    )
    store = PostgresStore(
        pool, schema=schema, prepare=prepare, auto_migrate=auto_migrate, owns_pool=True
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
    timeout: float = 5.0,
) -> tuple[AsyncPostgresStore, None]:
    """An async store on a pool of its own (opened on first use, closed with the store)."""
    check_schema(schema)
    _pool_options(min_size, max_size, timeout)
    pool: psycopg_pool.AsyncConnectionPool[Any] = psycopg_pool.AsyncConnectionPool(
        url,
        min_size=min_size,
        max_size=max_size,
        timeout=float(timeout),
        kwargs=dict(_POOL_KWARGS),
        open=False,
        name="idemlock",
    )
    store = AsyncPostgresStore(
        pool, schema=schema, prepare=prepare, auto_migrate=auto_migrate, owns_pool=True
    )
    return store, None


def from_client(
    pool: Any,
    asynchronous: bool,
    *,
    schema: str = DEFAULT_SCHEMA,
    auto_migrate: bool = True,
    prepare: bool = True,
) -> tuple[PostgresStore | AsyncPostgresStore, None]:
    """A store on your open pool: a ``psycopg_pool.ConnectionPool`` for
    ``idemlock.connect``, an ``AsyncConnectionPool`` for ``idemlock.aio.connect``.
    Closing the store does not close your pool. Connections may be in autocommit or
    not; the store switches a borrowed connection to autocommit for its one statement
    and back."""
    if asynchronous:
        if not isinstance(pool, psycopg_pool.AsyncConnectionPool):
            raise ConfigurationError(
                f"idemlock.aio.connect needs a psycopg_pool.AsyncConnectionPool, got "
                f"{type(pool).__name__} (pass a ConnectionPool to idemlock.connect)"
            )
        return AsyncPostgresStore(
            pool, schema=schema, prepare=prepare, auto_migrate=auto_migrate
        ), None
    if not isinstance(pool, psycopg_pool.ConnectionPool):
        raise ConfigurationError(
            f"idemlock.connect needs a psycopg_pool.ConnectionPool, got {type(pool).__name__} "
            "(pass an AsyncConnectionPool to idemlock.aio.connect)"
        )
    return PostgresStore(pool, schema=schema, prepare=prepare, auto_migrate=auto_migrate), None
