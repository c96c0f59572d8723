"""Creating and upgrading the store's schema.

The schema's layout version lives in ``<schema>.schema_version`` (one row per applied
migration). Migrating runs in one transaction under ``pg_advisory_xact_lock`` on a key
derived from the schema name, so any number of processes may migrate at once: one
does the work, the others wait for it and find nothing left to do. The lock is
transaction-level, never session-level (session locks leak behind transaction poolers
such as PgBouncer). A store whose schema is already current only reads the version.
"""

from __future__ import annotations

from typing import Any

import psycopg
import psycopg_pool
from psycopg.rows import tuple_row

from ..._errors import ConfigurationError
from ._sql import (
    MIGRATIONS,
    SCHEMA_VERSION,
    Statements,
    advisory_key,
    bootstrap_statements,
    migration_statements,
    record_version,
)

__all__ = ["aensure", "amigrate", "ensure", "migrate"]

_MISSING = (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName)


def _too_new(schema: str, version: int) -> ConfigurationError:
    return ConfigurationError(
        f"the PostgreSQL schema {schema!r} is at layout version {version}, newer than this "
        f"idemlock understands ({SCHEMA_VERSION}); upgrade idemlock"
    )


def _not_migrated(schema: str, version: int) -> ConfigurationError:
    return ConfigurationError(
        f"the PostgreSQL schema {schema!r} is at layout version {version}, this idemlock "
        f"needs {SCHEMA_VERSION}; run `idemlock migrate --url ...` (or open the store with "
        "auto_migrate=True)"
    )


# ---- on one connection --------------------------------------------------------------


def _version(conn: psycopg.Connection[Any], schema: str) -> int:
    try:
        with conn.transaction():
            row = (
                conn.cursor(row_factory=tuple_row)
                .execute(Statements.for_schema(schema).version)
                .fetchone()
            )
    except _MISSING:
        return 0
    return int(row[0]) if row else 0


def migrate_conn(conn: psycopg.Connection[Any], schema: str) -> int:
    """Bring ``schema`` to the current version on ``conn``; returns the version."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (advisory_key(schema),))
        for stmt in bootstrap_statements(schema):
            conn.execute(stmt)
        row = (
            conn.cursor(row_factory=tuple_row)
            .execute(Statements.for_schema(schema).version)
            .fetchone()
        )
        current = int(row[0]) if row else 0
        if current > SCHEMA_VERSION:
            raise _too_new(schema, current)
        for version in sorted(v for v in MIGRATIONS if v > current):
            for stmt in migration_statements(schema, version):
                conn.execute(stmt)
            conn.execute(record_version(schema), {"v": version})
    return SCHEMA_VERSION


def ensure(conn: psycopg.Connection[Any], schema: str, *, migrate: bool) -> None:
    """The store's first-use check: read the version; migrate if allowed and needed."""
    current = _version(conn, schema)
    if current == SCHEMA_VERSION:
        return
    if current > SCHEMA_VERSION:
        raise _too_new(schema, current)
    if not migrate:
        raise _not_migrated(schema, current)
    migrate_conn(conn, schema)


async def _aversion(conn: psycopg.AsyncConnection[Any], schema: str) -> int:
    try:
        async with conn.transaction():
            cur = conn.cursor(row_factory=tuple_row)
            await cur.execute(Statements.for_schema(schema).version)
            row = await cur.fetchone()
    except _MISSING:
        return 0
    return int(row[0]) if row else 0


async def amigrate_conn(conn: psycopg.AsyncConnection[Any], schema: str) -> int:
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (advisory_key(schema),))
        for stmt in bootstrap_statements(schema):
            await conn.execute(stmt)
        cur = conn.cursor(row_factory=tuple_row)
        await cur.execute(Statements.for_schema(schema).version)
        row = await cur.fetchone()
        current = int(row[0]) if row else 0
        if current > SCHEMA_VERSION:
            raise _too_new(schema, current)
        for version in sorted(v for v in MIGRATIONS if v > current):
            for stmt in migration_statements(schema, version):
                await conn.execute(stmt)
            await conn.execute(record_version(schema), {"v": version})
    return SCHEMA_VERSION


async def aensure(conn: psycopg.AsyncConnection[Any], schema: str, *, migrate: bool) -> None:
    current = await _aversion(conn, schema)
    if current == SCHEMA_VERSION:
        return
    if current > SCHEMA_VERSION:
        raise _too_new(schema, current)
    if not migrate:
        raise _not_migrated(schema, current)
    await amigrate_conn(conn, schema)


# ---- public entry points --------------------------------------------------------------


def migrate(url_or_pool: Any, schema: str = "idemlock") -> int:
    """Create or upgrade the idemlock schema; returns the layout version now in place.

    ``url_or_pool`` is a ``postgresql://`` URL, a ``psycopg_pool.ConnectionPool`` or a
    ``psycopg.Connection`` (it must not be inside a transaction). Safe to run from many
    processes at once, and a no-op when the schema is current. Used by
    ``idemlock migrate --url ...``; the store also runs it on first use unless opened
    with ``auto_migrate=False``.
    """
    from ._store import check_schema, unavailable

    check_schema(schema)
    try:
        if isinstance(url_or_pool, str):
            with psycopg.connect(url_or_pool, autocommit=True) as conn:
                return migrate_conn(conn, schema)
        if isinstance(url_or_pool, psycopg_pool.ConnectionPool):
            with url_or_pool.connection() as conn:
                return migrate_conn(conn, schema)
        if isinstance(url_or_pool, psycopg.Connection):
            return migrate_conn(url_or_pool, schema)
    except psycopg.Error as exc:
        raise unavailable(exc, "migrate") from exc
    raise ConfigurationError(
        "migrate() takes a postgresql:// URL, a psycopg_pool.ConnectionPool or a "
        f"psycopg.Connection, got {type(url_or_pool).__name__} (use amigrate() for async pools)"
    )


async def amigrate(url_or_pool: Any, schema: str = "idemlock") -> int:
    """:func:`migrate` for asyncio: a URL, an ``AsyncConnectionPool`` or an
    ``AsyncConnection``."""
    from ._store import check_schema, unavailable

    check_schema(schema)
    try:
        if isinstance(url_or_pool, str):
            async with await psycopg.AsyncConnection.connect(url_or_pool, autocommit=True) as conn:
                return await amigrate_conn(conn, schema)
        if isinstance(url_or_pool, psycopg_pool.AsyncConnectionPool):
            async with url_or_pool.connection() as conn:
                return await amigrate_conn(conn, schema)
        if isinstance(url_or_pool, psycopg.AsyncConnection):
            return await amigrate_conn(url_or_pool, schema)
    except psycopg.Error as exc:
        raise unavailable(exc, "migrate") from exc
    raise ConfigurationError(
        "amigrate() takes a postgresql:// URL, a psycopg_pool.AsyncConnectionPool or a "
        f"psycopg.AsyncConnection, got {type(url_or_pool).__name__}"
    )
