"""The transaction bodies of the SQLite store: each answers what the port method
returns. The single-statement ones run as a transaction of their own
(``SQLiteStore._write1``), the others inside one BEGIN IMMEDIATE (``_write``)."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from ._sql import (
    _ABANDON,
    _BREAK,
    _COMPLETE,
    _EXTEND,
    _FORGET,
    _PURGE_CLAIMS,
    _PURGE_FLOOR,
    _PURGE_LOCKS,
    _PURGE_WAITERS,
    _RELEASE,
    _RENEW,
)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _rows(cur: sqlite3.Cursor, sql: str, args: tuple[Any, ...]) -> list[Any]:
    # Fetched to the end: a statement with RETURNING ends (and commits) after its last row.
    return cur.execute(sql, args).fetchall()


def _complete(
    cur: sqlite3.Cursor, result: bytes, ns: str, key: str, token: str, ttl_ms: int
) -> bool:
    now = _now_ms()
    return cur.execute(_COMPLETE, (result, now + ttl_ms, ns, key, token, now)).rowcount == 1


def _abandon(cur: sqlite3.Cursor, ns: str, key: str, token: str) -> bool:
    return cur.execute(_ABANDON, (ns, key, token)).rowcount == 1


def _extend(cur: sqlite3.Cursor, ns: str, key: str, token: str, lease_ms: int) -> int | None:
    now = _now_ms()
    expires = now + lease_ms
    if cur.execute(_EXTEND, (expires, ns, key, token, now)).rowcount == 1:
        return expires
    return None


def _forget(cur: sqlite3.Cursor, ns: str, key: str) -> bool:
    return cur.execute(_FORGET, (ns, key, _now_ms())).rowcount == 1


def _release(cur: sqlite3.Cursor, ns: str, key: str, owner: str, token: int) -> bool:
    return cur.execute(_RELEASE, (ns, key, owner, token, _now_ms())).rowcount == 1


def _break(cur: sqlite3.Cursor, ns: str, key: str) -> bool:
    return cur.execute(_BREAK, (ns, key, _now_ms())).rowcount == 1


def _renew(
    cur: sqlite3.Cursor, ns: str, key: str, owner: str, token: int, ttl_ms: int
) -> int | None:
    now = _now_ms()
    expires = now + ttl_ms
    if cur.execute(_RENEW, (expires, ns, key, owner, token, now)).rowcount == 1:
        return expires
    return None


def _renew_many(cur: sqlite3.Cursor, items: list[tuple[Any, ...]]) -> list[int | None]:
    out: list[int | None] = []
    for item in items:
        if item[0] == "claim":
            out.append(_extend(cur, *item[1:]))
        else:
            out.append(_renew(cur, *item[1:]))
    return out


def _purge(cur: sqlite3.Cursor) -> int:
    now = _now_ms()
    cur.execute(_PURGE_FLOOR, (now,))
    removed: int = cur.execute(_PURGE_CLAIMS, (now,)).rowcount
    removed += cur.execute(_PURGE_LOCKS, (now,)).rowcount
    cur.execute(_PURGE_WAITERS, (now,))  # lapsed registrations: not records, not counted
    return removed
