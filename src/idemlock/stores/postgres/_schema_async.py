"""Creating and upgrading the store's schema, asyncio (see :mod:`._schema`)."""

from __future__ import annotations

from typing import Any

import psycopg
import psycopg_pool
from psycopg.rows import tuple_row

from ._schema import _MISSING, DEFAULT_SCHEMA, _amigrate_refused, _not_migrated, _too_new
from ._shared import check_schema, connect_kwargs, unavailable
from ._sql import (
    MIGRATIONS,
    SCHEMA_VERSION,
    Statements,
    advisory_key,
    bootstrap_statements,
    migration_statements,
    record_version,
)

__all__ = ["aensure", "amigrate", "amigrate_conn"]

# ---- on one connection --------------------------------------------------------------


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
    """Bring ``schema`` to the current version on ``conn``; returns the version."""
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
    """The store's first-use check: read the version; migrate if allowed and needed."""
    current = await _aversion(conn, schema)
    if current == SCHEMA_VERSION:
        return
    if current > SCHEMA_VERSION:
        raise _too_new(schema, current)
    if not migrate:
        raise _not_migrated(schema, current)
    await amigrate_conn(conn, schema)


# ---- public entry points --------------------------------------------------------------


async def amigrate(url_or_pool: Any, schema: str = DEFAULT_SCHEMA) -> int:
    """Create or upgrade the idemlock schema ``schema``; returns the layout version now
    in place.

    ``url_or_pool`` is a ``postgresql://`` URL, a ``psycopg_pool.AsyncConnectionPool`` or
    a ``psycopg.AsyncConnection`` (it must not be inside a transaction). A URL may be the
    one the store is opened with: idemlock's own ``?timeout=`` is taken off it as the
    store takes it off (it bounds connecting here). Safe to run from many processes at
    once, and a no-op when the schema is current. ``idemlock migrate --url ...
    [--schema ...]`` runs it from a shell; the store also runs it on first use unless
    opened with ``auto_migrate=False``.
    """
    check_schema(schema)
    if isinstance(url_or_pool, str):
        # Here, not at the top: the package imports this module.
        from . import _split_url

        url, secs = _split_url(url_or_pool, None)
    try:
        if isinstance(url_or_pool, str):
            kwargs = connect_kwargs(url, None, secs)
            # No prepared statement: the URL may go through a transaction pooler.
            kwargs["prepare_threshold"] = None
            async with await psycopg.AsyncConnection.connect(
                url, autocommit=True, **kwargs
            ) as conn:
                return await amigrate_conn(conn, schema)
        if isinstance(url_or_pool, psycopg_pool.AsyncConnectionPool):
            async with url_or_pool.connection() as conn:
                return await amigrate_conn(conn, schema)
        if isinstance(url_or_pool, psycopg.AsyncConnection):
            return await amigrate_conn(url_or_pool, schema)
    except psycopg.Error as exc:
        raise unavailable(exc, "migrate", schema) from exc
    raise _amigrate_refused(url_or_pool)
