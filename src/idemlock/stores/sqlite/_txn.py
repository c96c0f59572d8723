"""The transaction bodies of the SQLite store: each runs inside one BEGIN IMMEDIATE
(``SQLiteStore._write``). A port method of one statement runs it as a transaction of
its own instead (``_run``, modes COUNT and ROWS)."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from ._sql import (
    _BREAK,
    _EXTEND,
    _PURGE_CLAIMS,
    _PURGE_FLOOR,
    _PURGE_LOCKS,
    _PURGE_WAITERS,
    _RENEW,
)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _extend(cur: sqlite3.Cursor, ns: str, key: str, token: str, lease_ms: int) -> int | None:
    now = _now_ms()
    expires = now + lease_ms
    if cur.execute(_EXTEND, (expires, ns, key, token, now)).rowcount == 1:
        return expires
    return None


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


def _purge(cur: sqlite3.Cursor, chunk: int) -> tuple[int, bool]:
    """One chunk of a purge: (records removed, whether a table may hold more)."""
    now = _now_ms()
    cur.execute(_PURGE_FLOOR, (now, chunk))
    claims: int = cur.execute(_PURGE_CLAIMS, (now, chunk)).rowcount
    locks: int = cur.execute(_PURGE_LOCKS, (now, chunk)).rowcount
    cur.execute(_PURGE_WAITERS, (now,))  # lapsed registrations: not records, not counted
    return claims + locks, claims == chunk or locks == chunk
