"""The SQLite store itself: connections, the port methods and their transactions.

Each port method is one transaction running a statement of :mod:`._sql`; where a
statement leaves the decision to Python (a live record in the way of a claim or an
acquire), the reply is read through the state table (:mod:`idemlock._core.table`).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from time import time_ns
from typing import Any, TypeVar

from ..._core.port import (
    Acquired,
    Capabilities,
    Channel,
    ClaimReply,
    Granted,
    Held,
    LockRow,
    RecordRow,
    StepRow,
)
from ..._core.table import (
    ClaimRec,
    LockRec,
    Permit,
    apply_claim,
    apply_fence,
    apply_lock,
)
from ..._logfields import fields as log_fields
from .._adapt import ThreadedAsyncStore
from .._local import LocalHub, LocalSubscription
from ._conn import COUNT, ROWS, Connections
from ._sql import (
    _ABANDON,
    _ACQUIRE_UNQUEUED,
    _CLAIM_GET,
    _CLAIM_NEW,
    _COMPLETE,
    _EXTEND,
    _FENCE_ADVANCE,
    _FENCE_GET,
    _FLOOR_GET,
    _HOLDERS,
    _LOCK_GET,
    _LOCKS,
    _PERMIT_PUT,
    _PERMITS_GET,
    _PURGE_COUNT,
    _RECORD_GET,
    _RECORDS,
    _RELEASE,
    _RELEASE_OLD,
    _RENEW,
    _RENEW_OLD,
    _STATES,
    _STEPS_GET,
    _WAITER_CHOOSE,
    _WAITER_DROP,
    _WAITER_REGISTER,
    _WAITER_UNREGISTER,
    _WAITERS,
    _WAITERS_UNCHOOSE,
    DEFAULT_BUSY_TIMEOUT,
)
from ._txn import _BadRow, _break, _forget, _now_ms, _purge, _renew_many, _step
from ._url import make_dir
from ._wake import Doorbell, valid_name
from ._wake import tag as _wake_tag

R = TypeVar("R")

log = logging.getLogger("idemlock")

#: rows one purge transaction deletes at most (per table): a purge of a million dead
#: records holds the write lock for a chunk at a time, not for seconds
PURGE_CHUNK = 2000
#: every store's in-process waiters, keyed by (file, channel...): two store objects on
#: one file in one process wake each other's waiters
_HUB = LocalHub()


def _rung(path: str, ns: str, key: str) -> None:
    _HUB.notify((path, "lock", ns, key))


def _freed(path: str, ns: str, key: str) -> None:
    """A permit of (ns, key) was freed: wake this process's waiters and observers."""
    _HUB.notify((path, "lock", ns, key))
    _HUB.notify((path, "leader", ns, key))


def _published(path: str, ns: str, key: str) -> None:
    """A grant or renew published a value: wake this process's observers (the others
    re-read at the poll cap)."""
    if _HUB._subs:
        _HUB.notify((path, "leader", ns, key))


#: wakes this process's waiters when another process reserves a lock for one of them
_DOORBELL = Doorbell(_rung)
#: leases that came through the queue, by (file, ns, key, owner, token): their release
#: reserves the lock for the next waiter and wakes it (bounded: cleared when full)
_QUEUED: dict[tuple[Any, ...], bool] = {}
#: wake-ups (socket name, tag) reserved by transactions not yet rung (sent once they
#: commit)
_RINGS: list[tuple[str, bytes]] = []
#: the owners this process queued per lock (file, ns, key), and the process that did:
#: unregistered when its last waiter on the lock leaves (``_left``)
_MINE: dict[tuple[str, str, str], tuple[int, set[str]]] = {}

_Pair = tuple[sqlite3.Connection, sqlite3.Cursor]

#: ms a free lock stays reserved for the chosen waiter: a waiter in another process is
#: woken (``_wake``), or learns of it at its next poll (``poll_cap``); a waiter that
#: left costs this once
HANDOFF_MS = 200
#: ms a registration outlives its waiter's next poll (a loaded machine's delay)
REGISTER_SLACK_MS = 250


def _no_new_fence() -> int:
    # The conflict path only sees live records; a fresh grant there would mean the
    # upsert and the read disagree inside one transaction.
    raise AssertionError("a live record cannot need a new fence")


class SQLiteStore(Connections):
    """The sync SQLite store; see the module docstring."""

    kind = "sqlite"
    #: no notification crosses processes (the doorbell only rings a chosen waiter)
    capabilities = Capabilities(
        handoff=True, renew_many=True, cross_process_wakeups=False, steps=True
    )
    #: waiters re-check at least this often (seconds): other processes wake a waiter
    #: only when they reserve a lock for it (Linux), so this bounds the rest
    poll_cap = 0.02

    def __init__(
        self,
        path: str,
        *,
        busy_timeout: float | None = None,
        timeout: float = DEFAULT_BUSY_TIMEOUT,
    ) -> None:
        self.path = path
        self._make_dir = make_dir(path)  # or ConfigurationError: a missing directory
        self._wake_key = b""  # the file's (read with its schema)
        #: the bound on one call in seconds (A1): a call waits for another writer at
        #: most ``busy_timeout``, which defaults to it
        self.timeout = float(timeout)
        self.busy_timeout = self.timeout if busy_timeout is None else float(busy_timeout)
        self._idle: list[_Pair] = []
        self._closed = False
        self._ready = False
        self._init_lock = threading.Lock()
        #: the process that made the pooled connections (see ``_forked``)
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"SQLiteStore({self.path!r})"

    def _claim_rec(self, row: Any, ns: str, key: str) -> ClaimRec | None:
        if row is None:
            return None
        state, token, fence, fp, expires_ms, result = row
        if (
            state not in _STATES
            or type(token) is not str
            or type(fence) is not int
            or type(expires_ms) is not int
            or not (fp is None or type(fp) is str)
            or not (result is None or type(result) is bytes)
        ):
            raise self._corrupt("claims", ns, key, row)
        return ClaimRec(state, token, fence, fp, expires_ms, result)

    def _key_rec(self, cur: sqlite3.Cursor, ns: str, key: str, now: int) -> tuple[LockRec, int]:
        """A lock key as read in a transaction: its live holders (a lock taken before
        permits among them) and the next token it would grant."""
        summary = cur.execute(_LOCK_GET, (ns, key)).fetchone()
        holders: dict[str, Permit] = {}
        for row in cur.execute(_PERMITS_GET, (ns, key)).fetchall():
            p = self._permit(row, ns, key)
            if p.expires_ms > now:
                holders[p.owner] = p
        if summary is None:
            floor = cur.execute(_FLOOR_GET).fetchone()[0]
            if type(floor) is not int:
                raise self._corrupt("meta", "floor", "", (floor,))
            return LockRec(holders), floor + 1
        owner, token, expires_ms = summary
        if type(owner) is not str or type(token) is not int or type(expires_ms) is not int:
            raise self._corrupt("locks", ns, key, summary)
        if not holders and expires_ms > now:
            holders[owner] = Permit(owner, token, expires_ms)  # taken before permits
        return LockRec(holders), token + 1

    def _permit(self, row: Any, ns: str, key: str) -> Permit:
        owner, token, expires_ms, value = row
        if (
            type(owner) is not str
            or type(token) is not int
            or type(expires_ms) is not int
            or not (value is None or type(value) is bytes)
        ):
            raise self._corrupt("lock_permits", ns, key, row)
        return Permit(owner, token, expires_ms, value)

    # ---- idempotency -------------------------------------------------------------

    def _claim(
        self, cur: sqlite3.Cursor, ns: str, key: str, fp: str | None, token: str, lease_ms: int
    ) -> ClaimReply:
        now = _now_ms()
        expires = now + lease_ms
        row = cur.execute(_CLAIM_NEW, (ns, key, token, fp, expires, now)).fetchone()
        if row is not None:
            steps = self._steps(cur, ns, key, now) if row[1] else ()
            return Granted(token, row[0], expires, lease_ms, steps)
        rec = self._claim_rec(cur.execute(_CLAIM_GET, (ns, key)).fetchone(), ns, key)
        # A live record is in the way (rows claim.resend, claim.mismatch, claim.busy,
        # claim.replay): the table decides from the record as read.
        args = {"fp": fp, "token": token, "lease_ms": lease_ms}
        reply: ClaimReply = apply_claim("claim", rec, now, args, _no_new_fence)[2]
        if type(reply) is Granted:  # claim.resend: the steps as a grant carries them
            reply = replace(reply, steps=self._steps(cur, ns, key, now))
        return reply

    def _steps(self, cur: sqlite3.Cursor, ns: str, key: str, now: int) -> tuple[StepRow, ...]:
        return self._step_rows(cur.execute(_STEPS_GET, (ns, key, now)).fetchall(), ns, key)

    def _step_rows(self, rows: list[Any], ns: str, key: str) -> tuple[StepRow, ...]:
        out = []
        for row in rows:
            name, fence, result = row
            if (
                type(name) is not str
                or type(fence) is not int
                or not (result is None or type(result) is bytes)
            ):
                raise self._corrupt("claim_steps", ns, key, row)
            out.append(StepRow(name, fence, result))
        return tuple(out)

    def claim(self, ns: str, key: str, fp: str | None, token: str, lease_ms: int) -> ClaimReply:
        now = time_ns() // 1_000_000  # _now_ms(), inlined on the hot path
        expires = now + lease_ms
        rows = self._run(ROWS, _CLAIM_NEW, (ns, key, token, fp, expires, now))
        if rows:  # claim.new, in one statement
            fence, has_steps = rows[0]
            if has_steps:  # recorded by earlier attempts: only this token writes more
                steps = tuple(self.steps(ns, key))
                return Granted(token, fence, expires, lease_ms, steps)
            return Granted(token, fence, expires, lease_ms)
        # A live record was in the way and nothing changed: try again and read the
        # record in one transaction, for the table to decide.
        return self._write(self._claim, ns, key, fp, token, lease_ms)

    def complete(self, ns: str, key: str, token: str, result: bytes, ttl_ms: int) -> bool:
        data = result if type(result) is bytes else bytes(result)
        now = time_ns() // 1_000_000  # _now_ms(), inlined on the hot path
        if self._run(COUNT, _COMPLETE, (data, now + ttl_ms, ns, key, token, now)) == 1:
            if _HUB._subs:  # anyone waiting in this process (one who comes later reads our row)
                _HUB.notify((self.path, "claim", ns, key))
            return True
        return False

    def abandon(self, ns: str, key: str, token: str) -> bool:
        if self._run(COUNT, _ABANDON, (ns, key, token)) == 1:
            _HUB.notify((self.path, "claim", ns, key))
            return True
        return False

    def extend(self, ns: str, key: str, token: str, lease_ms: int) -> int | None:
        now = _now_ms()
        expires = now + lease_ms
        if self._run(COUNT, _EXTEND, (expires, ns, key, token, now)) == 1:
            return expires
        return None

    def record(self, ns: str, key: str) -> RecordRow | None:
        rows = self._read(_RECORD_GET, (ns, key, _now_ms()))
        if not rows:
            return None
        state, fence, expires_ms = rows[0]
        if state not in _STATES or type(fence) is not int or type(expires_ms) is not int:
            raise self._corrupt("claims", ns, key, rows[0])
        return RecordRow(ns, key, state, fence, expires_ms)

    def forget(self, ns: str, key: str) -> bool:
        live: bool = self._write(_forget, ns, key)
        _HUB.notify((self.path, "claim", ns, key))
        return live

    def step(
        self,
        ns: str,
        key: str,
        token: str,
        name: str,
        result: bytes | None,
        lease_ms: int,
        ttl_ms: int,
    ) -> int | None:
        data = None if result is None else bytes(result)
        try:
            r: int | None = self._write(_step, ns, key, token, name, data, lease_ms, ttl_ms)
        except _BadRow as exc:
            raise self._corrupt(exc.table, ns, key, exc.row) from None
        return r

    def drop_step(self, ns: str, key: str, token: str, name: str, lease_ms: int) -> int | None:
        try:
            r: int | None = self._write(_step, ns, key, token, name, None, lease_ms, None)
        except _BadRow as exc:
            raise self._corrupt(exc.table, ns, key, exc.row) from None
        return r

    def steps(self, ns: str, key: str) -> list[StepRow]:
        return list(self._step_rows(self._read(_STEPS_GET, (ns, key, _now_ms())), ns, key))

    def records(self, ns_prefix: str) -> list[RecordRow]:
        rows = self._read(_RECORDS, (len(ns_prefix), ns_prefix, _now_ms()))
        out = []
        bad: list[Any] = []
        for row in rows:
            ns, key, state, fence, expires_ms = row
            if (
                state not in _STATES
                or type(fence) is not int
                or type(expires_ms) is not int
                or type(key) is not str
            ):
                # A listing shows a row it cannot read instead of failing for all (A3).
                bad.append(row)
                out.append(
                    RecordRow(ns, str(key), "corrupt", _int_or_0(fence), _int_or_0(expires_ms))
                )
            else:
                out.append(RecordRow(ns, key, state, fence, expires_ms))
        if bad:
            self._warn_corrupt("claims", bad)
        return out

    # ---- locks -------------------------------------------------------------------

    def _acquire(
        self,
        cur: sqlite3.Cursor,
        ns: str,
        key: str,
        owner: str,
        ttl_ms: int,
        limit: int,
        value: bytes | None,
    ) -> Acquired | Held:
        now = _now_ms()
        expires = now + ttl_ms
        args = (ns, key, owner, expires, now, limit, value)
        row = cur.execute(_ACQUIRE_UNQUEUED, args).fetchone()
        if row is not None:
            return Acquired(row[0], expires, ttl_ms)
        return self._acquire_queued(cur, ns, key, owner, ttl_ms, limit, value, now)

    # The fair queue: a waiter (a caller whose process is subscribed to the key) is
    # queued with every refused attempt; a freed permit is reserved for the oldest
    # waiter that asked twice (a one-shot try never is): the window counts as one
    # holder until that waiter takes it (or it passes, or the waiter stops asking). A
    # process whose waiters on the key all left unqueues them at once (``_left``).

    def _register(
        self, cur: sqlite3.Cursor, ns: str, key: str, owner: str, now: int, wait_ms: int
    ) -> None:
        if (self.path, "lock", ns, key) not in _HUB._subs:
            return  # nobody in this process waits: a one-shot try
        poll_ms = int(self.poll_cap * 1000)
        until = now + min(wait_ms + 1, poll_ms) + REGISTER_SLACK_MS
        # Listening before the ticket exists: a reservation can wake us.
        wake = _DOORBELL.listen()
        if wake:
            _DOORBELL.route(self._wake_key, self.path, ns, key)
        pid = os.getpid()
        mine = _MINE.get((self.path, ns, key))
        if mine is None or mine[0] != pid:
            mine = _MINE[(self.path, ns, key)] = (pid, set())
        mine[1].add(owner)  # a rolled-back registration only costs a no-op delete
        cur.execute(_WAITER_REGISTER, (ns, key, owner, pid, _host(), until, wake))

    def _acquire_queued(
        self,
        cur: sqlite3.Cursor,
        ns: str,
        key: str,
        owner: str,
        ttl_ms: int,
        limit: int,
        value: bytes | None,
        now: int,
    ) -> Acquired | Held:
        """No room under ``limit`` for the caller, waiters queued, or a lock taken
        before permits: the table decides from the key as read."""
        rec, next_token = self._key_rec(cur, ns, key, now)
        if owner not in rec.holders and len(rec.holders) < limit:
            # Room but waiters queued: the window kept for the oldest (lock.handoff*).
            rec.chosen, rec.until = self._choose(cur, ns, key, now)
            if rec.chosen is None:
                rec.until = 0
        args = {"owner": owner, "ttl_ms": ttl_ms, "limit": limit, "value": value}
        row, new, reply = apply_lock("acquire", rec, now, args, lambda: next_token)
        if type(reply) is Held:  # lock.busy, lock.handoff
            self._register(cur, ns, key, owner, now, reply.ttl_ms)
            return reply
        assert new is not None and type(reply) is Acquired
        p = new.holders[owner]
        # lock.acquire, lock.handoff.take, lock.reacquire (of a lock taken before permits)
        cur.execute(_PERMIT_PUT, (ns, key, owner, p.token, p.expires_ms, p.value))
        if row.id != "lock.reacquire":
            cur.execute(_WAITER_DROP, (ns, key, owner))  # its turn is over
            mine = _MINE.get((self.path, ns, key))
            if mine is not None:
                mine[1].discard(owner)  # nothing left to unqueue when it leaves
            if len(_QUEUED) > 4096:
                _QUEUED.clear()  # leases never released (expired): only their wake-up is lost
            _QUEUED[(self.path, ns, key, owner, p.token)] = True
        return reply

    def _choose(self, cur: sqlite3.Cursor, ns: str, key: str, now: int) -> tuple[str | None, int]:
        """The waiter a free lock is reserved for and the window's end, choosing (and
        waking) the oldest live one when no window is open; (None, 0) if none."""
        head = head_wake = None
        for owner, pid, host, until, tries, window, wake in cur.execute(
            _WAITERS, (ns, key)
        ).fetchall():
            if window > now and until > now:
                return owner, window
            if window > 0 or until <= now or self._gone(pid, host, ns, key):
                # its window passed untaken, or it stopped asking: it lost its turn
                cur.execute(_WAITER_DROP, (ns, key, owner))
            elif head is None and tries > 1:
                head, head_wake = owner, wake
        if head is None:
            return None, 0
        window = now + HANDOFF_MS
        cur.execute(_WAITER_CHOOSE, (ns, key, head, window))
        _HUB.notify((self.path, "lock", ns, key))  # the waiter re-checks after our commit
        if head_wake != _DOORBELL.name and valid_name(head_wake):
            # a waiter of another process (with a socket): rung after the commit
            _RINGS.append((head_wake, _wake_tag(self._wake_key, ns, key)))
        return head, window

    def _gone(self, pid: object, host: object, ns: str, key: str) -> bool:
        """Whether a waiter's process has stopped waiting: this process without a
        subscriber to the key, or a process of this machine and PID namespace that has
        exited. A process elsewhere (another container on the file) lapses by time."""
        if type(pid) is not int or type(host) is not str:
            return True
        if host != _host():
            return False
        if pid == os.getpid():
            return (self.path, "lock", ns, key) not in _HUB._subs
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # alive, owned by another user
            return False
        return False

    def acquire(
        self, ns: str, key: str, owner: str, ttl_ms: int, limit: int = 1, value: bytes | None = None
    ) -> Acquired | Held:
        if _HUB._subs and (self.path, "lock", ns, key) in _HUB._subs:
            # Someone here waits for the key: contended, so the one statement would
            # mostly be refused; decide in one transaction at once.
            reply = self._rung_after(
                self._write(self._acquire, ns, key, owner, ttl_ms, limit, value)
            )
        else:
            now = time_ns() // 1_000_000  # _now_ms(), inlined on the hot path
            expires = now + ttl_ms
            rows = self._run(ROWS, _ACQUIRE_UNQUEUED, (ns, key, owner, expires, now, limit, value))
            if rows:  # lock.acquire / lock.reacquire, in one statement
                reply = Acquired(rows[0][0], expires, ttl_ms)
            else:  # no room, or waiters queued, and nothing changed: try again and
                # decide in one transaction
                reply = self._rung_after(
                    self._write(self._acquire, ns, key, owner, ttl_ms, limit, value)
                )
        if value is not None and type(reply) is Acquired:
            _published(self.path, ns, key)
        return reply

    def _rung_after(self, reply: R) -> R:
        """Send the wake-ups the transaction that answered ``reply`` reserved (it has
        committed: the woken waiter finds the file free)."""
        while _RINGS:
            try:
                name, tag = _RINGS.pop()
            except IndexError:
                break
            _DOORBELL.ring(name, tag)
        return reply

    def release(self, ns: str, key: str, owner: str, token: int) -> bool:
        if _QUEUED and _QUEUED.pop((self.path, ns, key, owner, token), False):
            # Others queued with this lease's holder: reserve it for the oldest now.
            if self._rung_after(self._write(_release_and_choose, self, ns, key, owner, token)):
                if _HUB._subs:
                    _freed(self.path, ns, key)
                return True
            return False
        now = time_ns() // 1_000_000
        if self._run(COUNT, _RELEASE, (ns, key, owner, token, now)) == 1 or (
            self._run(COUNT, _RELEASE_OLD, (ns, key, owner, token, now)) == 1
        ):
            if _HUB._subs:  # as in complete()
                _freed(self.path, ns, key)
            return True
        return False

    def break_lock(self, ns: str, key: str, token: int | None = None) -> bool:
        """Free every holder, or the permit with ``token`` (``lock.break``); True if
        something held was freed."""
        if self._write(_break_and_unchoose, ns, key, token):
            _freed(self.path, ns, key)
            return True
        return False

    def renew(
        self, ns: str, key: str, owner: str, token: int, ttl_ms: int, value: bytes | None = None
    ) -> int | None:
        now = _now_ms()
        expires = now + ttl_ms
        if self._run(COUNT, _RENEW, (expires, ns, key, owner, token, now, value)) == 1:
            if value is not None:
                _published(self.path, ns, key)
            return expires
        if self._run(COUNT, _RENEW_OLD, (expires, ns, key, owner, token, now)) == 1:
            return expires  # a lock taken before permits
        return None

    def renew_many(self, items: Sequence[tuple[Any, ...]]) -> list[int | None]:
        """Renew many claims (``("claim", ns, key, token, lease_ms)``) and leases
        (``("lock", ns, key, owner, token, ttl_ms)``) in one transaction, for a
        coordinator's renewer: one file lock and one commit for all of them."""
        return self._write(_renew_many, list(items))

    def holders(self, ns: str, key: str) -> list[LockRow]:
        out = []
        for row in self._read(_HOLDERS, (ns, key, _now_ms())):
            p = self._permit(row, ns, key)
            out.append(LockRow(ns, key, p.owner, p.token, p.expires_ms, value=p.value))
        return out

    def lock(self, ns: str, key: str) -> LockRow | None:
        rows = self.holders(ns, key)
        return rows[0] if rows else None

    def locks(self, ns_prefix: str) -> list[LockRow]:
        rows = self._read(_LOCKS, (len(ns_prefix), ns_prefix, _now_ms()))
        out = []
        bad: list[Any] = []
        for row in rows:
            ns, key, owner, token, expires_ms, value = row
            if (
                type(owner) is not str
                or type(token) is not int
                or type(expires_ms) is not int
                or type(key) is not str
                or not (value is None or type(value) is bytes)
            ):
                bad.append(row)
                out.append(LockRow(ns, str(key), "", 0, _int_or_0(expires_ms), corrupt=True))
            else:
                out.append(LockRow(ns, key, owner, token, expires_ms, value=value))
        if bad:
            self._warn_corrupt("locks", bad)
        return out

    # ---- fences ------------------------------------------------------------------

    def _fence_advance(
        self, cur: sqlite3.Cursor, ns: str, resource: str, token: int
    ) -> tuple[bool, int]:
        if cur.execute(_FENCE_ADVANCE, (ns, resource, token)).fetchone() is not None:
            return True, token
        row = cur.execute(_FENCE_GET, (ns, resource)).fetchone()
        if type(row[0]) is not int:
            raise self._corrupt("fences", ns, resource, row)
        return apply_fence(row[0], token)[1]  # row fence.stale

    def fence_advance(self, ns: str, resource: str, token: int) -> tuple[bool, int]:
        return self._write(self._fence_advance, ns, resource, token)

    def fence_current(self, ns: str, resource: str) -> int | None:
        rows = self._read(_FENCE_GET, (ns, resource))
        if not rows:
            return None
        highest = rows[0][0]
        if type(highest) is not int:
            raise self._corrupt("fences", ns, resource, rows[0])
        return highest

    def purge(self, dry_run: bool = False) -> int:
        if dry_run:
            rows = self._read(_PURGE_COUNT, (_now_ms(),))
            return int(rows[0][0])
        removed, more = 0, True
        while more:  # one transaction per chunk: other callers wait for a chunk at most
            n, more = self._write(_purge, PURGE_CHUNK)
            removed += n
        return removed

    # ---- waiting and life cycle --------------------------------------------------

    def subscribe(self, channel: Channel) -> LocalSubscription:
        sub = _HUB.subscribe((self.path, *channel))
        if channel.kind == "lock":
            sub._on_close = partial(self._left, sub._on_close, channel.ns, channel.key)
        return sub

    def _left(
        self,
        unsubscribe: Callable[[LocalSubscription], None],
        ns: str,
        key: str,
        sub: LocalSubscription,
    ) -> None:
        """A waiter on the lock ``(ns, key)`` left (it got the lock, gave up, timed out
        or was cancelled). Once this process has no waiter left there, the waiters it
        queued leave the queue now, not when their registrations lapse: a freed permit
        is never kept for a waiter that left (other processes cannot tell)."""
        unsubscribe(sub)
        if (self.path, "lock", ns, key) in _HUB._subs:
            return  # another waiter of this process still waits there
        mine = _MINE.pop((self.path, ns, key), None)
        if mine is None or not mine[1] or mine[0] != os.getpid() or self._closed:
            return
        owners = sorted(mine[1])
        if "asyncio" in sys.modules and sys.modules["asyncio"]._get_running_loop() is not None:
            # closed on an event loop (the async face): the write must not block it
            threading.Thread(
                target=self._unregister,
                args=(ns, key, owners),
                name="idemlock-sqlite-unqueue",
                daemon=True,
            ).start()
        else:
            self._unregister(ns, key, owners)

    def _unregister(self, ns: str, key: str, owners: list[str]) -> None:
        try:
            self._write(_unregister, ns, key, owners)
        except Exception as exc:  # never fail a waiter's exit: the registrations lapse
            log.debug(
                "idemlock: SQLite: could not unqueue the waiters that left %s: %s",
                self.path,
                exc,
                extra=log_fields(store="sqlite", operation="unregister", outcome="error"),
            )

    def close(self) -> None:
        """Close every pooled connection; calls in progress close theirs when done.
        The store cannot be used afterwards."""
        self._closed = True
        if self._pid != os.getpid():
            self._forked()  # the parent's connections: never closed here
        self._drain()


_HOST: list[str] = []


def _host() -> str:
    """This machine and PID namespace: where a waiter's pid means a process."""
    if not _HOST:
        try:
            ns = os.readlink("/proc/self/ns/pid")
        except OSError:
            ns = ""
        _HOST.append(f"{os.uname().nodename if hasattr(os, 'uname') else ''}/{ns}")
    return _HOST[0]


def _release_and_choose(
    cur: sqlite3.Cursor, store: SQLiteStore, ns: str, key: str, owner: str, token: int
) -> bool:
    now = _now_ms()
    if cur.execute(_RELEASE, (ns, key, owner, token, now)).rowcount != 1:
        return False
    store._choose(cur, ns, key, now)  # lock.handoff: the oldest waiter's, woken
    return True


def _unregister(cur: sqlite3.Cursor, ns: str, key: str, owners: list[str]) -> None:
    pid, host = os.getpid(), _host()
    cur.executemany(_WAITER_UNREGISTER, [(ns, key, owner, pid, host) for owner in owners])


def _break_and_unchoose(cur: sqlite3.Cursor, ns: str, key: str, token: int | None) -> bool:
    held = _break(cur, ns, key, token)
    if token is None:
        cur.execute(_WAITERS_UNCHOOSE, (ns, key))  # an operator's break closes a window too
    return held


def _int_or_0(value: object) -> int:
    return value if type(value) is int else 0


# ---- async face -------------------------------------------------------------------


class SQLiteAsyncStore(ThreadedAsyncStore):
    """The async face: each call runs in a worker thread, since it may wait up to
    ``busy_timeout`` for another writer."""

    sync: SQLiteStore

    @property
    def poll_cap(self) -> float:
        """The sync store's :attr:`SQLiteStore.poll_cap`."""
        return self.sync.poll_cap

    def __init__(self, sync: SQLiteStore) -> None:
        super().__init__(sync)
        self.path = sync.path
