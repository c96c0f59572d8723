"""Reading the PostgreSQL store's replies, and the parameters of the batched renewal.

One function per statement turns its rows into the store port's reply; the sync and
async stores share them, so they answer alike by construction.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal, cast

from psycopg.types.numeric import Int8

from ..._core import table as T
from ..._core.port import (
    Acquired,
    Busy,
    ClaimReply,
    Done,
    Granted,
    Held,
    LockRow,
    Mismatch,
    RecordRow,
    StepRow,
)
from ..._errors import ConfigurationError, StoreCorrupt
from ..._logfields import fields as log_fields
from ._sql import RENEW_MANY, Stmt

Row = tuple[Any, ...]

log = logging.getLogger("idemlock")

_STATES = ("in_flight", "completed")


class _Retry:
    """Marker: the statement's snapshot and the row version its upsert conflicted with
    disagree (a concurrent commit in between); it changed nothing, and running it
    again gives a consistent answer."""


_RETRY = _Retry()


_I8_MAX = 2**63 - 1


def _renew_many(
    store: Any, items: Sequence[tuple[Any, ...]]
) -> tuple[Stmt, dict[str, Any], dict[tuple[str, int], int]]:
    """The batched renewal statement (rendered once per store), its array parameters,
    and where each reply row (kind, position) goes in the answer."""
    stmt = store._renew_many_stmt
    if stmt is None:
        stmt = store._renew_many_stmt = Stmt.render(RENEW_MANY, store.statements.schema)
    names = ("cns", "ckey", "ctoken", "clease", "lns", "lkey", "lowner", "ltoken", "lttl")
    cols: dict[str, list[Any]] = {k: [] for k in names}
    where: dict[tuple[str, int], int] = {}
    for i, item in enumerate(items):
        if item[0] == "claim":
            _, ns, key, token, lease_ms = item
            for name, value in zip(("cns", "ckey", "ctoken"), (ns, key, token), strict=True):
                cols[name].append(value)
            cols["clease"].append(int(_i8(lease_ms)))
            where[("c", len(cols["cns"]))] = i
        else:
            _, ns, key, owner, token, ttl_ms = item
            for name, value in zip(("lns", "lkey", "lowner"), (ns, key, owner), strict=True):
                cols[name].append(value)
            cols["ltoken"].append(int(_i8(token)))
            cols["lttl"].append(int(_i8(ttl_ms)))
            where[("l", len(cols["lns"]))] = i
    return stmt, cols, where


def _renewed_many(
    rows: Sequence[Any], where: dict[tuple[str, int], int], count: int
) -> list[int | None]:
    out: list[int | None] = [None] * count
    for kind, pos, expires in rows:
        out[where[(str(kind), int(pos))]] = int(expires)
    return out


def _i8(value: int) -> Int8:
    """An int sent as bigint; out of range is the caller's error, not a bare
    OverflowError from inside psycopg."""
    if not -_I8_MAX - 1 <= value <= _I8_MAX:
        raise ConfigurationError(
            f"a value passed to the PostgreSQL store does not fit a 64-bit integer "
            f"({value!r}); fencing tokens, and leases and ttls in milliseconds, must be "
            "below 2**63"
        )
    return Int8(value)


def _state(value: object, ns: str, key: str) -> Literal["in_flight", "completed"]:
    if value not in _STATES:
        raise StoreCorrupt(
            f"the claim record {key!r} in {ns!r} has state {value!r}, which idemlock never "
            "writes; the row was changed by something else: forget the key"
        )
    return cast('Literal["in_flight", "completed"]', value)


def _claim_reply(rows: list[Row], ns: str, key: str, token: str) -> ClaimReply | _Retry:
    if not rows:
        return _RETRY
    # CLAIM's rows carry the key's steps; CLAIM_FAST's do not (its grant is of a new
    # key, which has none).
    granted, fence, exp, now, state, result, same_token, same_fp, *steps = rows[0]
    if granted:
        return Granted(token, fence, exp, exp - now, _steps(steps, ns, key) if steps else ())
    if exp <= now:
        return _RETRY
    st = _state(state, ns, key)
    # A live record in the way: the state table picks the row (claim.resend,
    # claim.mismatch, claim.replay or claim.busy) from what the statement compared.
    reply = T.claim_row(st, bool(same_token), bool(same_fp)).reply
    if reply is T.GRANTED:  # claim.resend: the steps as a grant carries them
        if not steps:
            return _RETRY  # CLAIM_FAST's: CLAIM reads the steps with it
        return Granted(token, fence, exp, exp - now, _steps(steps, ns, key))
    if reply is T.MISMATCH:
        return Mismatch(st)
    if reply is T.DONE:
        if result is None:
            raise StoreCorrupt(f"the completed record {key!r} in {ns!r} has no result")
        return Done(bytes(result), exp)
    return Busy(exp, exp - now)


def _steps(cols: list[Any], ns: str, key: str) -> tuple[StepRow, ...]:
    """A grant's steps: the three arrays (names, fences, results) the claim statement
    aggregates, all None when the key has none."""
    names, fences, results = cols
    if names is None:
        return ()
    return _step_rows(list(zip(names, fences, results, strict=True)), ns, key)


def _step_rows(rows: Sequence[Row], ns: str, key: str) -> tuple[StepRow, ...]:
    out: list[StepRow] = []
    for row in rows:
        name, fence, result = row
        # Every column is typed; a fence is a value of the fence sequence, which starts
        # at 1: anything else was written by something other than idemlock.
        if name is None or fence is None or fence < 1:
            raise StoreCorrupt(
                f"the step {name!r} of claim key {key!r} in {ns!r} has fence {fence!r}, "
                "which idemlock never writes; the row was changed by something else: "
                "forget the key"
            )
        out.append(StepRow(name, int(fence), None if result is None else bytes(result)))
    return tuple(out)


def _acquire_reply(rows: list[Row]) -> Acquired | Held | _Retry:
    if not rows:
        return _RETRY
    acquired, token, exp, now, busy = rows[0]
    if acquired:
        return Acquired(token, exp, exp - now)
    if busy:
        # lock.busy, lock.handoff: until the earliest end of a live permit or of a
        # window kept for another process
        return Held(exp, max(0, exp - now))
    # The snapshot shows room (or the caller's own permit) that the row version the
    # upsert judged did not: a concurrent commit in between.
    return _RETRY


def _fence_reply(rows: list[Row], token: int) -> tuple[bool, int] | _Retry:
    if not rows:
        return _RETRY
    accepted, highest = rows[0]
    if accepted:
        return True, int(highest)
    if highest <= token:
        return _RETRY
    return False, int(highest)


def _record_rows(rows: list[Row], schema: str) -> list[RecordRow]:
    out: list[RecordRow] = []
    bad: list[Row] = []
    for row in rows:
        ns, key, st, fence, exp = row
        if st in _STATES:
            out.append(RecordRow(ns, key, st, fence, exp))
        else:
            # A listing shows a row it cannot read instead of failing for all (A3).
            bad.append(row)
            out.append(RecordRow(ns, key, "corrupt", fence, exp))
    if bad:
        shown = repr(bad[0])[:300]
        log.warning(
            "idemlock: PostgreSQL table %s.claims holds %d row(s) with a state idemlock "
            "never writes, listed as corrupt (first: %s); forget those keys to recover",
            schema,
            len(bad),
            shown,
            extra=log_fields(store="postgres", operation="list", outcome="corrupt"),
        )
    return out


def _lock_rows(rows: list[Row]) -> list[LockRow]:
    # Every column but value is typed and NOT NULL: a permit is always readable.
    return [
        LockRow(ns, key, owner, token, exp, value=None if value is None else bytes(value))
        for ns, key, owner, token, exp, value in rows
    ]


def _holder_rows(rows: list[Row], ns: str, key: str) -> list[LockRow]:
    return _lock_rows([(ns, key, *row) for row in rows])


def _nothing(reply: Any) -> None:
    """No undo: a settling call (complete, abandon, release) may take effect."""
    return None
