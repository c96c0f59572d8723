"""The PostgreSQL store classes, sync (:class:`PostgresStore`) and async
(:class:`AsyncPostgresStore`), in one place for the package and its fenced helpers.

* :mod:`._async`: the async store's statements and replies, the source of
  :mod:`._sync`, which tools/async_to_sync.py generates (``--check`` runs in CI);
* :mod:`._runner_async` / :mod:`._runner_sync`: what differs, hand-written;
* :mod:`._shared`: settings, messages, pool health, fork safety and :class:`_Base`;
* :mod:`._replies`: reading each statement's rows.
"""

from __future__ import annotations

from ._async import AsyncPostgresStore
from ._shared import (
    DEFAULT_SCHEMA,
    DEFAULT_TIMEOUT,
    Health,
    _Base,
    _secrets_of,
    check_schema,
    recording_class,
    unavailable,
)
from ._sync import PostgresStore

__all__ = [
    "DEFAULT_SCHEMA",
    "DEFAULT_TIMEOUT",
    "AsyncPostgresStore",
    "Health",
    "PostgresStore",
    "_Base",
    "_secrets_of",
    "check_schema",
    "recording_class",
    "unavailable",
]
