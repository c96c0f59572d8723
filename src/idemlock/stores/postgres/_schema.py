"""Creating and upgrading the store's schema.

The schema's layout version lives in ``<schema>.schema_version`` (one row per applied
migration). Migrating runs in one transaction under ``pg_advisory_xact_lock`` on a key
derived from the schema name, so any number of processes may migrate at once: one
does the work, the others wait for it and find nothing left to do. The lock is
transaction-level, never session-level (session locks leak behind transaction poolers
such as PgBouncer). A store whose schema is already current only reads the version.

This module holds what both sides share; :mod:`._schema_async` is the source of
:mod:`._schema_sync`, which tools/async_to_sync.py generates.
"""

from __future__ import annotations

import psycopg

from ..._errors import ConfigurationError
from ._sql import (
    SCHEMA_VERSION,
)

_MISSING = (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName)

#: the schema of a store opened without ``schema=`` (and of ``idemlock migrate``)
DEFAULT_SCHEMA = "idemlock"


def migrate_command(schema: str) -> str:
    """The shell command that migrates ``schema``: ``--schema`` only when it is not the
    default, which is what the command migrates without it."""
    extra = "" if schema == DEFAULT_SCHEMA else f" --schema {schema}"
    return f"`idemlock migrate --url ...{extra}`"


def _too_new(schema: str, version: int) -> ConfigurationError:
    return ConfigurationError(
        f"the PostgreSQL schema {schema!r} is at layout version {version}, newer than this "
        f"idemlock understands ({SCHEMA_VERSION}); upgrade idemlock"
    )


def _not_migrated(schema: str, version: int) -> ConfigurationError:
    return ConfigurationError(
        f"the PostgreSQL schema {schema!r} is at layout version {version}, this idemlock "
        f"needs {SCHEMA_VERSION}; run {migrate_command(schema)} (or open the store with "
        "auto_migrate=True)"
    )


def _migrate_refused(got: object) -> ConfigurationError:
    return ConfigurationError(
        "migrate() takes a postgresql:// URL, a psycopg_pool.ConnectionPool or a "
        f"psycopg.Connection, got {type(got).__name__} (use amigrate() for async pools)"
    )


def _amigrate_refused(got: object) -> ConfigurationError:
    return ConfigurationError(
        "amigrate() takes a postgresql:// URL, a psycopg_pool.AsyncConnectionPool or a "
        f"psycopg.AsyncConnection, got {type(got).__name__}"
    )
