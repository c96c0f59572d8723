"""The claim and lease state machines as pure functions.

Stores that run Python inside their atomic section (memory: a lock; SQLite: one
``BEGIN IMMEDIATE`` transaction) apply these functions to the current record;
stores with server-side code (Redis Lua, PostgreSQL SQL) implement the same table.

``complete`` and ``abandon`` act while the record is in flight with the caller's
token (:func:`owns`), also after its lease ended, as long as no other attempt took
the key over. ``extend`` of a claim and ``renew`` of a lock act only while the lease
is live (:func:`holds`, :func:`lock_held_by`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .port import Acquired, Busy, ClaimReply, Done, Granted, Held, Mismatch


@dataclass(slots=True)
class ClaimRec:
    state: Literal["in_flight", "completed"]
    token: str
    fence: int
    fp: str | None
    expires_ms: int
    result: bytes | None = None


@dataclass(slots=True)
class LockRec:
    owner: str
    token: int
    expires_ms: int


def live(rec: ClaimRec | LockRec | None, now_ms: int) -> bool:
    return rec is not None and rec.expires_ms > now_ms


def claim(
    rec: ClaimRec | None,
    now_ms: int,
    fp: str | None,
    token: str,
    lease_ms: int,
    next_fence: Callable[[], int],
) -> tuple[ClaimRec | None, ClaimReply]:
    """Return (record to store, reply). The returned record is ``rec`` itself when
    nothing changes."""
    if rec is not None and rec.expires_ms > now_ms:
        if rec.state == "in_flight" and rec.token == token:
            return rec, Granted(rec.token, rec.fence, rec.expires_ms, rec.expires_ms - now_ms)
        if rec.fp != fp:
            return rec, Mismatch(rec.state)
        if rec.state == "completed":
            return rec, Done(rec.result or b"", rec.expires_ms)
        return rec, Busy(rec.expires_ms, rec.expires_ms - now_ms)
    fence = next_fence()
    new = ClaimRec("in_flight", token, fence, fp, now_ms + lease_ms)
    return new, Granted(token, fence, new.expires_ms, lease_ms)


def owns(rec: ClaimRec | None, token: str) -> bool:
    """Whether ``token`` is the in-flight claim of ``rec``: complete and abandon may act,
    even after the lease ended, as long as no other attempt took the key over (a new
    claim replaces the token). Refusing a late complete would throw the finished work
    away and run it again."""
    return rec is not None and rec.state == "in_flight" and rec.token == token


def holds(rec: ClaimRec | None, token: str, now_ms: int) -> bool:
    """Whether ``token`` is the *live* in-flight claim of ``rec`` (extend may act: an
    expired lease is never revived, its holder must learn its protection lapsed)."""
    return owns(rec, token) and rec is not None and rec.expires_ms > now_ms


def complete(rec: ClaimRec, now_ms: int, result: bytes, ttl_ms: int) -> ClaimRec:
    return ClaimRec("completed", rec.token, rec.fence, rec.fp, now_ms + ttl_ms, result)


def acquire(
    rec: LockRec | None, now_ms: int, owner: str, ttl_ms: int, next_fence: Callable[[], int]
) -> tuple[LockRec, Acquired | Held]:
    if rec is not None and rec.expires_ms > now_ms:
        if rec.owner != owner:
            return rec, Held(rec.expires_ms, rec.expires_ms - now_ms)
        new = LockRec(owner, rec.token, now_ms + ttl_ms)
        return new, Acquired(new.token, new.expires_ms, ttl_ms)
    new = LockRec(owner, next_fence(), now_ms + ttl_ms)
    return new, Acquired(new.token, new.expires_ms, ttl_ms)


def lock_held_by(rec: LockRec | None, owner: str, token: int, now_ms: int) -> bool:
    return rec is not None and rec.owner == owner and rec.token == token and rec.expires_ms > now_ms


def fence_advance(current: int | None, token: int) -> tuple[bool, int]:
    if current is None or token >= current:
        return True, token
    return False, current
