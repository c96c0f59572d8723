"""The transaction bodies of the SQLite store: each runs inside one BEGIN IMMEDIATE
(``SQLiteStore._write``). A port method of one statement runs it as a transaction of
its own instead (``_run``, modes COUNT and ROWS)."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from ._sql import (
    _BREAK,
    _BREAK_OLD,
    _DEAD_LOCKS,
    _EXTEND,
    _FLOOR_RAISE,
    _FORGET,
    _PURGE_CLAIMS,
    _PURGE_FLOOR,
    _PURGE_KEY,
    _PURGE_KEY_PERMITS,
    _PURGE_PERMITS,
    _PURGE_STEPS,
    _PURGE_WAITERS,
    _RENEW,
    _RENEW_OLD,
    _STEP_DROP,
    _STEP_PUT,
    _STEP_RENEW,
    _STEPS_DROP_DEAD,
    _STEPS_END_FORGET,
    _STEPS_FORGET,
    _STEPS_START,
)


class _BadRow(Exception):
    """A row idemlock did not write, read inside a transaction (rolled back); the store
    reports it as StoreCorrupt."""

    def __init__(self, table: str, row: Any) -> None:
        super().__init__(table, row)
        self.table, self.row = table, row


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _extend(cur: sqlite3.Cursor, ns: str, key: str, token: str, lease_ms: int) -> int | None:
    now = _now_ms()
    expires = now + lease_ms
    if cur.execute(_EXTEND, (expires, ns, key, token, now)).rowcount == 1:
        return expires
    return None


def _step(
    cur: sqlite3.Cursor,
    ns: str,
    key: str,
    token: str,
    name: str,
    result: bytes | None,
    lease_ms: int,
    ttl_ms: int | None,
) -> int | None:
    """Rows step.record (``ttl_ms`` given) and step.drop (None): the claim's lease
    renewed as extend.ok renews it, then the step written or removed; None, and no
    change, when the claim is not the caller's (step.stale, step.drop.stale).

    The key's steps' end is its claims row's (moved by _STEP_RENEW): a step writes that
    row and its own. Only when that end is behind (the first step of a claim key, or
    steps that are over) are the key's other step rows touched: the ended ones dropped,
    so none is revived, and the end set anew."""
    now = _now_ms()
    expires = now + lease_ms
    until = now if ttl_ms is None else now + ttl_ms
    row = cur.execute(_STEP_RENEW, (expires, ns, key, token, now, until)).fetchone()
    if row is None:
        return None
    fence, end = row
    if type(fence) is not int or type(end) is not int:
        raise _BadRow("claims", row)
    if end <= now:  # no steps, or they are over: a new generation of them
        cur.execute(_STEPS_DROP_DEAD, (ns, key, now))
        if ttl_ms is not None:
            (end,) = cur.execute(_STEPS_START, (ns, key, until)).fetchone()
    if ttl_ms is None:
        cur.execute(_STEP_DROP, (ns, key, name))
    else:
        cur.execute(_STEP_PUT, (ns, key, name, fence, result, end))
    return expires


def _forget(cur: sqlite3.Cursor, ns: str, key: str) -> bool:
    """Rows forget.live (True), forget.dead: the record ends, its steps with it."""
    live: bool = cur.execute(_FORGET, (ns, key, _now_ms())).rowcount == 1
    cur.execute(_STEPS_FORGET, (ns, key))
    cur.execute(_STEPS_END_FORGET, (ns, key))
    return live


def _break(cur: sqlite3.Cursor, ns: str, key: str, token: int | None) -> bool:
    """Row lock.break: free every live permit of the key (``token`` None) or the one with
    ``token``; True if one was held (lock.break.free: nothing changed)."""
    args = (ns, key, _now_ms(), token)
    freed: int = cur.execute(_BREAK, args).rowcount
    if not freed:  # a lock taken before permits
        freed = cur.execute(_BREAK_OLD, args).rowcount
    return freed > 0


def _renew(
    cur: sqlite3.Cursor,
    ns: str,
    key: str,
    owner: str,
    token: int,
    ttl_ms: int,
    value: bytes | None = None,
) -> int | None:
    now = _now_ms()
    expires = now + ttl_ms
    if cur.execute(_RENEW, (expires, ns, key, owner, token, now, value)).rowcount == 1:
        return expires
    if cur.execute(_RENEW_OLD, (expires, ns, key, owner, token, now)).rowcount == 1:
        return expires  # a lock taken before permits
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
    dead = cur.execute(_DEAD_LOCKS, (now, chunk)).fetchall()
    tokens = [t for _, _, t in dead if type(t) is int]
    if tokens:
        cur.execute(_FLOOR_RAISE, (max(tokens),))
    locks = 0
    for ns, key, _ in dead:
        permits: int = cur.execute(_PURGE_KEY_PERMITS, (ns, key, now)).rowcount
        cur.execute(_PURGE_KEY, (ns, key))
        locks += permits or 1  # each expired permit, or the released key once
    expired = 0
    if len(dead) < chunk:  # every dead key is gone: expired permits of held keys next
        expired = cur.execute(_PURGE_PERMITS, (now, chunk)).rowcount
    cur.execute(_PURGE_WAITERS, (now,))  # lapsed registrations: not records, not counted
    steps = cur.execute(_PURGE_STEPS, (now, chunk)).rowcount  # parts of records: not counted
    more = claims == chunk or len(dead) == chunk or expired == chunk or steps == chunk
    return claims + locks + expired, more
