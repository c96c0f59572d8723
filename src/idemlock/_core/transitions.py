"""The former home of the claim and lease state machines, now :mod:`._core.table`.

Kept so imports of these names keep working; each function is one row lookup in the
table (see ``docs/states.md``).
"""

from __future__ import annotations

from collections.abc import Callable

from .port import Acquired, ClaimReply, Held
from .table import ClaimRec, LockRec, apply_claim, apply_fence, apply_lock, claim_state, live

__all__ = [
    "ClaimRec",
    "LockRec",
    "acquire",
    "claim",
    "complete",
    "fence_advance",
    "holds",
    "live",
    "lock_held_by",
    "owns",
]


def claim(
    rec: ClaimRec | None,
    now_ms: int,
    fp: str | None,
    token: str,
    lease_ms: int,
    next_fence: Callable[[], int],
) -> tuple[ClaimRec | None, ClaimReply]:
    """(record to store, reply); the record is ``rec`` itself when nothing changes."""
    _, new, reply = apply_claim(
        "claim", rec, now_ms, {"fp": fp, "token": token, "lease_ms": lease_ms}, next_fence
    )
    return new, reply


def owns(rec: ClaimRec | None, token: str) -> bool:
    """Whether complete and abandon may act (rows complete.ok and complete.late)."""
    return rec is not None and rec.state == "in_flight" and rec.token == token


def holds(rec: ClaimRec | None, token: str, now_ms: int) -> bool:
    """Whether extend may act (row extend.ok)."""
    return owns(rec, token) and claim_state(rec, now_ms) == "in_flight"


def complete(rec: ClaimRec, now_ms: int, result: bytes, ttl_ms: int) -> ClaimRec:
    return ClaimRec("completed", rec.token, rec.fence, rec.fp, now_ms + ttl_ms, result)


def acquire(
    rec: LockRec | None, now_ms: int, owner: str, ttl_ms: int, next_fence: Callable[[], int]
) -> tuple[LockRec, Acquired | Held]:
    _, new, reply = apply_lock(
        "acquire", rec, now_ms, {"owner": owner, "ttl_ms": ttl_ms}, next_fence
    )
    return (new if new is not None else rec), reply  # type: ignore[return-value]


def lock_held_by(rec: LockRec | None, owner: str, token: int, now_ms: int) -> bool:
    return live(rec, now_ms) and rec is not None and (rec.owner, rec.token) == (owner, token)


def fence_advance(current: int | None, token: int) -> tuple[bool, int]:
    return apply_fence(current, token)[1]
