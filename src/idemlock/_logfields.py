"""Structured fields of idemlock's log records.

Every record idemlock logs about an operation carries, as ``extra`` attributes of the
``logging.LogRecord``, the fields below, so a JSON formatter (python-json-logger,
structlog's stdlib bridge, ...) emits them as fields and a filter can route on them::

    idemlock_spec       the spec name ("charge"), or absent when no spec is involved
    idemlock_store      the store kind ("memory", "sqlite", "redis", "postgres", "etcd")
    idemlock_operation  what was being done ("complete", "abandon", "release", ...)
    idemlock_outcome    how it ended ("error", "lost", "stale", ...)
    idemlock_kind       "idempotency" or "lock"

The same rule as for events: never the key, the payload, the owner, a token or a
store URL (keys and payloads may be personal data; URLs may hold passwords), in the
fields or in the message. The names are prefixed so they never collide with
``LogRecord``'s own attributes or an application's ``extra``, and have no dots, so
``%(idemlock_spec)s`` and ``{idemlock_spec}`` format strings work.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FIELDS", "fields", "port_fields"]

#: every field name idemlock may set on a log record
FIELDS = (
    "idemlock_spec",
    "idemlock_store",
    "idemlock_operation",
    "idemlock_outcome",
    "idemlock_kind",
)


def fields(
    *,
    spec: str | None = None,
    store: str | None = None,
    operation: str | None = None,
    outcome: str | None = None,
    kind: str | None = None,
) -> dict[str, str]:
    """The ``extra`` mapping of one record; fields given as None are left out."""
    given = (spec, store, operation, outcome, kind)
    return {name: value for name, value in zip(FIELDS, given, strict=True) if value is not None}


def port_fields(port: Any, operation: str, outcome: str) -> dict[str, str]:
    """The fields of a record about ``port`` (an idempotency or lock port): its spec,
    its coordinator's store kind and its kind."""
    return fields(
        spec=getattr(port, "_spec_name", None),
        store=getattr(getattr(getattr(port, "_coord", None), "_store", None), "kind", None),
        operation=operation,
        outcome=outcome,
        kind=getattr(port, "_kind", None),
    )
