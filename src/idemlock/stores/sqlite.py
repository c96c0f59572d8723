"""The embedded store: one SQLite file, shared by every thread and process on one machine.

URL: ``sqlite:///relative/path.db`` (relative to the working directory) or
``sqlite:////absolute/path.db``; parent directories are created on first use. Options,
as keywords or in the URL (``?timeout=2.5``): ``timeout`` (seconds, default 5), the
bound on one call, and ``busy_timeout`` (default: ``timeout``), how long a call waits
for another writer before raising :class:`~idemlock.StoreUnavailable`.

How it works:

* The file is in WAL mode with ``synchronous=NORMAL`` (a power cut may lose the last
  transactions, never corrupt the file). Put it on a local disk: WAL needs shared
  memory, which network file systems do not provide.
* Every port method is one transaction (``BEGIN IMMEDIATE`` for the writing ones), so
  a call either happens whole or not at all; a failed call is rolled back before
  :class:`~idemlock.StoreUnavailable` is raised.
* Fences and lock tokens count per key: a freed key keeps its row as a tombstone with
  its last fence, and ``purge()`` raises a floor above every fence it deletes before a
  new row starts from it, so they strictly increase per key for the life of the file.
  (Tokens of different keys are not comparable.)
* **Expiry is judged by this machine's wall clock** (``time.time()``), which every
  process using the file shares: keep the file on one machine, and keep the clock from
  stepping back by more than your leases (NTP slewing is fine).
* Waiters in this process are woken at once when a key is freed; a waiter in another
  process re-checks in a short jittered backoff capped at :attr:`SQLiteStore.poll_cap`.
* Connections are pooled (one per concurrent caller), so one store object can be
  used from many threads and from ``asyncio.to_thread``.
* Give idemlock a file of its own: its tables have plain names (``meta`` with the
  schema version and the purge floor, ``claims``, ``locks``, ``fences``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from .._core import transitions as T
from .._core.port import (
    Acquired,
    Channel,
    ClaimReply,
    Granted,
    Held,
    LockRow,
    RecordRow,
)
from .._errors import ConfigurationError, StoreCorrupt, StoreUnavailable
from ._adapt import ThreadedAsyncStore
from ._local import LocalHub, LocalSubscription

__all__ = ["SQLiteAsyncStore", "SQLiteStore", "open_async", "open_sync"]

R = TypeVar("R")

log = logging.getLogger("idemlock")

SCHEMA_VERSION = 1
DEFAULT_BUSY_TIMEOUT = 5.0
#: idle connections kept per store; more concurrent callers get a connection each,
#: closed when they are done
MAX_IDLE = 16

# ---- SQL ------------------------------------------------------------------------
# Module constants: the sqlite3 statement cache keys on the text, so each statement is
# prepared once per connection.

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS meta (
        name TEXT PRIMARY KEY NOT NULL,
        value INTEGER NOT NULL
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS claims (
        ns TEXT NOT NULL,
        key TEXT NOT NULL,
        state TEXT NOT NULL,
        token TEXT NOT NULL,
        fence INTEGER NOT NULL,
        fp TEXT,
        expires_ms INTEGER NOT NULL,
        result BLOB,
        PRIMARY KEY (ns, key)
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS claims_expires ON claims (expires_ms)",
    """CREATE TABLE IF NOT EXISTS locks (
        ns TEXT NOT NULL,
        key TEXT NOT NULL,
        owner TEXT NOT NULL,
        token INTEGER NOT NULL,
        expires_ms INTEGER NOT NULL,
        PRIMARY KEY (ns, key)
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS locks_expires ON locks (expires_ms)",
    """CREATE TABLE IF NOT EXISTS fences (
        ns TEXT NOT NULL,
        resource TEXT NOT NULL,
        highest INTEGER NOT NULL,
        PRIMARY KEY (ns, resource)
    ) WITHOUT ROWID""",
    # 'floor' is at least every fence and token of a row that purge deleted, so a key
    # created again starts above all it ever had; 'schema' is the layout version.
    "INSERT OR IGNORE INTO meta (name, value) VALUES ('schema', 1), ('floor', 0)",
)
_SCHEMA_GET = "SELECT value FROM meta WHERE name = 'schema'"
assert _SCHEMA[0].startswith("CREATE TABLE IF NOT EXISTS meta")

_BEGIN = "BEGIN IMMEDIATE"
_COMMIT = "COMMIT"
_ROLLBACK = "ROLLBACK"

# Absent or expired -> in flight with the next fence, in one statement. Fences are per
# key: a dead row (expired, abandoned, forgotten) stays as a tombstone that keeps its
# fence, so the next claim of the key counts on from it; a brand-new key starts above the
# purge floor. Writing no shared counter row keeps a claim to the pages of its own row.
# Nothing is returned when a live record is in the way; the caller then reads it.
_CLAIM_NEW = """
INSERT INTO claims (ns, key, state, token, fence, fp, expires_ms, result)
VALUES (?1, ?2, 'in_flight', ?3, (SELECT value FROM meta WHERE name = 'floor') + 1, ?4, ?5,
        NULL)
ON CONFLICT (ns, key) DO UPDATE SET
    state = 'in_flight', token = excluded.token, fence = claims.fence + 1, fp = excluded.fp,
    expires_ms = excluded.expires_ms, result = NULL
WHERE claims.expires_ms <= ?6
RETURNING fence
"""
_CLAIM_GET = (
    "SELECT state, token, fence, fp, expires_ms, result FROM claims WHERE ns = ?1 AND key = ?2"
)
# Complete and abandon are accepted after the lease ended while the record still holds
# this token (nobody took the key over) and is no tombstone (expires_ms = 0: abandoned
# or forgotten): refusing would throw finished work away and run it again.
_COMPLETE = """
UPDATE claims SET state = 'completed', result = ?1, expires_ms = ?2
WHERE ns = ?3 AND key = ?4 AND token = ?5 AND state = 'in_flight' AND expires_ms > 0
"""
# Freeing a key leaves a tombstone (expires_ms = 0) that keeps the fence.
_ABANDON = """
UPDATE claims SET expires_ms = 0, result = NULL
WHERE ns = ?1 AND key = ?2 AND token = ?3 AND state = 'in_flight' AND expires_ms > 0
"""
_EXTEND = """
UPDATE claims SET expires_ms = ?1
WHERE ns = ?2 AND key = ?3 AND token = ?4 AND state = 'in_flight' AND expires_ms > ?5
"""
_FORGET = """
UPDATE claims SET expires_ms = 0, result = NULL
WHERE ns = ?1 AND key = ?2 AND expires_ms > ?3
"""
_RECORD_GET = """
SELECT state, fence, expires_ms FROM claims WHERE ns = ?1 AND key = ?2 AND expires_ms > ?3
"""
# substr() rather than LIKE: namespaces contain '%' (the escape of keys.namespace).
_RECORDS = """
SELECT ns, key, state, fence, expires_ms FROM claims
WHERE substr(ns, 1, ?1) = ?2 AND expires_ms > ?3 ORDER BY ns, key
"""

# Free or expired -> next token of the key; held by the same owner -> same token, new
# expiry. Released locks stay as tombstones (expires_ms = 0) that keep their token.
_ACQUIRE = """
INSERT INTO locks (ns, key, owner, token, expires_ms)
VALUES (?1, ?2, ?3, (SELECT value FROM meta WHERE name = 'floor') + 1, ?4)
ON CONFLICT (ns, key) DO UPDATE SET
    token = CASE WHEN locks.expires_ms > ?5 THEN locks.token ELSE locks.token + 1 END,
    owner = excluded.owner, expires_ms = excluded.expires_ms
WHERE locks.expires_ms <= ?5 OR locks.owner = excluded.owner
RETURNING token
"""
_LOCK_GET = "SELECT owner, token, expires_ms FROM locks WHERE ns = ?1 AND key = ?2"
_LOCK_LIVE = (
    "SELECT owner, token, expires_ms FROM locks WHERE ns = ?1 AND key = ?2 AND expires_ms > ?3"
)
_RELEASE = """
UPDATE locks SET expires_ms = 0
WHERE ns = ?1 AND key = ?2 AND owner = ?3 AND token = ?4 AND expires_ms > ?5
"""
_RENEW = """
UPDATE locks SET expires_ms = ?1
WHERE ns = ?2 AND key = ?3 AND owner = ?4 AND token = ?5 AND expires_ms > ?6
"""
# State table row lock.break: held by anyone -> free. The tombstone keeps the token, so
# the next acquire counts on from it and the old holder's (owner, token) matches nothing.
_BREAK = """
UPDATE locks SET expires_ms = 0
WHERE ns = ?1 AND key = ?2 AND expires_ms > ?3
"""
_LOCKS = """
SELECT ns, key, owner, token, expires_ms FROM locks
WHERE substr(ns, 1, ?1) = ?2 AND expires_ms > ?3 ORDER BY ns, key
"""

_FENCE_ADVANCE = """
INSERT INTO fences (ns, resource, highest) VALUES (?1, ?2, ?3)
ON CONFLICT (ns, resource) DO UPDATE SET highest = excluded.highest
WHERE excluded.highest >= fences.highest
RETURNING highest
"""
_FENCE_GET = "SELECT highest FROM fences WHERE ns = ?1 AND resource = ?2"

# Raise the floor over every fence and token about to go, then delete the dead rows.
_PURGE_FLOOR = """
UPDATE meta SET value = max(
    value,
    coalesce((SELECT max(fence) FROM claims WHERE expires_ms <= ?1), 0),
    coalesce((SELECT max(token) FROM locks WHERE expires_ms <= ?1), 0)
) WHERE name = 'floor'
"""
_PURGE_CLAIMS = "DELETE FROM claims WHERE expires_ms <= ?1"
_PURGE_LOCKS = "DELETE FROM locks WHERE expires_ms <= ?1"

_STATES = ("in_flight", "completed")

# SQLite result codes (sqlite3.SQLITE_* exist from Python 3.11 only).
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26

#: every store's in-process waiters, keyed by (file, channel...): two store objects on
#: one file in one process wake each other's waiters
_HUB = LocalHub()

_Pair = tuple[sqlite3.Connection, sqlite3.Cursor]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _no_new_fence() -> int:
    # The conflict path only sees live records; a fresh grant there would mean the
    # upsert and the read disagree inside one transaction.
    raise AssertionError("a live record cannot need a new fence")


class SQLiteStore:
    """The sync SQLite store; see the module docstring."""

    kind = "sqlite"
    issues_fence_tokens = True
    #: other processes cannot notify us: waiters re-check at least this often (seconds)
    poll_cap = 0.05

    def __init__(
        self,
        path: str,
        *,
        busy_timeout: float | None = None,
        timeout: float = DEFAULT_BUSY_TIMEOUT,
    ) -> None:
        self.path = path
        #: the bound on one call in seconds (A1): a call waits for another writer at
        #: most ``busy_timeout``, which defaults to it
        self.timeout = float(timeout)
        self.busy_timeout = self.timeout if busy_timeout is None else float(busy_timeout)
        self._idle: list[_Pair] = []
        self._closed = False
        self._ready = False
        self._init_lock = threading.Lock()
        _STORES.add(self)

    def __repr__(self) -> str:
        return f"SQLiteStore({self.path!r})"

    # ---- connections -------------------------------------------------------------

    def _connect(self) -> _Pair:
        if self._closed:
            raise StoreUnavailable(f"the SQLite store on {self.path} was closed; open a new one")
        try:
            if not self._ready:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
            # isolation_level=None: we issue BEGIN/COMMIT ourselves. A pooled
            # connection is used by one thread at a time, so it may change threads.
            conn = sqlite3.connect(
                self.path,
                timeout=self.busy_timeout,
                isolation_level=None,
                check_same_thread=False,
                cached_statements=64,
            )
        except (sqlite3.Error, OSError) as exc:
            raise self._unavailable(exc) from exc
        try:
            conn.execute("PRAGMA synchronous=NORMAL")
            if not self._ready:
                with self._init_lock:
                    if not self._ready:
                        self._init_schema(conn)
                        self._ready = True
        except BaseException as exc:
            conn.close()
            if isinstance(exc, sqlite3.Error):
                raise self._unavailable(exc) from exc
            raise
        return conn, conn.cursor()

    def _init_schema(self, conn: sqlite3.Connection) -> None:
        # Many processes may open a new file at once: switching to WAL needs the file to
        # itself and does not always wait on the busy handler (it may fail at once, or
        # leave the mode unchanged), so retry it until busy_timeout.
        deadline = time.monotonic() + self.busy_timeout
        delay = 0.001
        while True:
            try:
                mode = str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()
                if mode != "wal":
                    mode = str(conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc) or time.monotonic() >= deadline:
                    raise
                mode = ""
            if mode == "wal":
                break
            if time.monotonic() >= deadline:
                raise StoreUnavailable(
                    f"SQLite store {self.path}: could not switch the file to WAL mode (it "
                    f"stays in {mode!r} mode); the file must be on a local file system"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        # CREATE IF NOT EXISTS inside one write transaction: concurrent first users
        # queue on the write lock, and all but the first find everything in place.
        conn.execute(_BEGIN)
        try:
            conn.execute(_SCHEMA[0])  # meta first: a file of another version is refused
            row = conn.execute(_SCHEMA_GET).fetchone()  # before anything else is touched
            if row is not None and row[0] != SCHEMA_VERSION:
                raise StoreCorrupt(
                    f"SQLite store {self.path}: the file has idemlock schema version "
                    f"{row[0]!r}, this idemlock reads version {SCHEMA_VERSION}; use the "
                    "idemlock version that wrote it, or another file"
                )
            for stmt in _SCHEMA[1:]:
                conn.execute(stmt)
            conn.execute(_COMMIT)
        except BaseException:
            if conn.in_transaction:
                conn.execute(_ROLLBACK)
            raise

    def _checkout(self) -> _Pair:
        try:
            return self._idle.pop()  # list.pop/append are atomic: no lock needed
        except IndexError:
            return self._connect()

    def _checkin(self, pair: _Pair) -> None:
        if len(self._idle) >= MAX_IDLE:
            pair[0].close()
            return
        self._idle.append(pair)
        if self._closed:  # close() ran while this connection was out
            self._drain()

    def _drain(self) -> None:
        while True:
            try:
                conn, _ = self._idle.pop()
            except IndexError:
                return
            conn.close()

    def _write(self, body: Callable[..., R], *args: Any) -> R:
        """Run ``body(cursor, *args)`` in one BEGIN IMMEDIATE transaction."""
        # The hot path: checkout and checkin are inlined.
        _GATE.enter()
        try:
            idle = self._idle
            try:
                pair = idle.pop()
            except IndexError:
                pair = self._connect()
            cur = pair[1]
            try:
                cur.execute(_BEGIN)
                result = body(cur, *args)
                cur.execute(_COMMIT)
            except BaseException as exc:
                err = self._abort(pair, exc)
                if err is None:
                    raise
                raise err from exc
            if len(idle) < MAX_IDLE:
                idle.append(pair)
                if self._closed:
                    self._drain()
            else:
                pair[0].close()
            return result
        finally:
            _GATE.leave()

    def _read(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        """One SELECT (its own read transaction), fetched whole so that no read
        snapshot stays open on an idle connection."""
        _GATE.enter()
        try:
            pair = self._checkout()
            try:
                rows = pair[1].execute(sql, args).fetchall()
            except BaseException as exc:
                err = self._abort(pair, exc)
                if err is None:
                    raise
                raise err from exc
            self._checkin(pair)
            return rows
        finally:
            _GATE.leave()

    def _abort(self, pair: _Pair, exc: BaseException) -> Exception | None:
        """Roll back, give the connection back if it is sound, and return the error
        to raise instead of ``exc`` (None: re-raise ``exc``)."""
        conn = pair[0]
        sound = True
        try:
            if conn.in_transaction:
                conn.execute(_ROLLBACK)
        except sqlite3.Error:
            sound = False
        if sound:
            self._checkin(pair)
        else:
            conn.close()
        if isinstance(exc, sqlite3.Error):
            return self._unavailable(exc)
        if isinstance(exc, OverflowError):
            return ConfigurationError(
                f"a value passed to the SQLite store does not fit a 64-bit integer ({exc}); "
                "fencing tokens, and leases and ttls in milliseconds, must be below 2**63"
            )
        return None

    def _unavailable(self, exc: BaseException) -> StoreUnavailable:
        msg = str(exc)
        code = getattr(exc, "sqlite_errorcode", None)
        if (
            (isinstance(code, int) and (code & 0xFF) in (_SQLITE_CORRUPT, _SQLITE_NOTADB))
            or "not a database" in msg
            or "malformed" in msg
        ):
            return StoreCorrupt(
                f"SQLite store {self.path}: {msg}; the file is not an intact SQLite "
                "database written by idemlock (wrong path, or a damaged file)"
            )
        if _is_busy(exc):
            hint = (
                f" (another connection held the write lock for longer than "
                f"busy_timeout={self.busy_timeout:g}s; nothing was changed)"
            )
        elif "readonly" in msg or "read-only" in msg:
            hint = " (check the permissions of the file, its -wal and -shm files and directory)"
        elif "full" in msg:
            hint = " (free disk space; nothing was changed)"
        elif "unable to open" in msg or isinstance(exc, OSError):
            hint = " (check that the directory exists or can be created, and is writable)"
        else:
            hint = ""
        return StoreUnavailable(f"SQLite store {self.path}: {msg}{hint}")

    def _corrupt(self, table: str, ns: str, key: str, row: Any) -> StoreCorrupt:
        shown = repr(row)
        if len(shown) > 300:  # a row may hold a large result
            shown = shown[:300] + "..."
        return StoreCorrupt(
            f"SQLite store {self.path}: table {table} holds a row idemlock did not write "
            f"for ({ns!r}, {key!r}): {shown}; delete it (or forget the key) to recover"
        )

    def _warn_corrupt(self, table: str, rows: list[Any]) -> None:
        shown = repr(rows[0])
        if len(shown) > 300:
            shown = shown[:300] + "..."
        log.warning(
            "idemlock: SQLite store %s: table %s holds %d row(s) idemlock did not write, "
            "listed as corrupt (first: %s); forget those keys (or delete the rows) to recover",
            self.path,
            table,
            len(rows),
            shown,
        )

    def _claim_rec(self, row: Any, ns: str, key: str) -> T.ClaimRec | None:
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
        return T.ClaimRec(state, token, fence, fp, expires_ms, result)

    def _lock_rec(self, row: Any, ns: str, key: str) -> T.LockRec | None:
        if row is None:
            return None
        owner, token, expires_ms = row
        if type(owner) is not str or type(token) is not int or type(expires_ms) is not int:
            raise self._corrupt("locks", ns, key, row)
        return T.LockRec(owner, token, expires_ms)

    # ---- idempotency -------------------------------------------------------------

    def _claim(
        self, cur: sqlite3.Cursor, ns: str, key: str, fp: str | None, token: str, lease_ms: int
    ) -> ClaimReply:
        now = _now_ms()
        expires = now + lease_ms
        row = cur.execute(_CLAIM_NEW, (ns, key, token, fp, expires, now)).fetchone()
        if row is not None:
            return Granted(token, row[0], expires, lease_ms)
        rec = self._claim_rec(cur.execute(_CLAIM_GET, (ns, key)).fetchone(), ns, key)
        return T.claim(rec, now, fp, token, lease_ms, _no_new_fence)[1]

    def claim(self, ns: str, key: str, fp: str | None, token: str, lease_ms: int) -> ClaimReply:
        return self._write(self._claim, ns, key, fp, token, lease_ms)

    def complete(self, ns: str, key: str, token: str, result: bytes, ttl_ms: int) -> bool:
        data = result if type(result) is bytes else bytes(result)
        if self._write(_complete, data, ns, key, token, ttl_ms):
            _HUB.notify((self.path, "claim", ns, key))
            return True
        return False

    def abandon(self, ns: str, key: str, token: str) -> bool:
        if self._write(_abandon, ns, key, token):
            _HUB.notify((self.path, "claim", ns, key))
            return True
        return False

    def extend(self, ns: str, key: str, token: str, lease_ms: int) -> int | None:
        return self._write(_extend, ns, key, token, lease_ms)

    def record(self, ns: str, key: str) -> RecordRow | None:
        rows = self._read(_RECORD_GET, (ns, key, _now_ms()))
        if not rows:
            return None
        state, fence, expires_ms = rows[0]
        if state not in _STATES or type(fence) is not int or type(expires_ms) is not int:
            raise self._corrupt("claims", ns, key, rows[0])
        return RecordRow(ns, key, state, fence, expires_ms)

    def forget(self, ns: str, key: str) -> bool:
        live = self._write(_forget, ns, key)
        _HUB.notify((self.path, "claim", ns, key))
        return live

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
        self, cur: sqlite3.Cursor, ns: str, key: str, owner: str, ttl_ms: int
    ) -> Acquired | Held:
        now = _now_ms()
        expires = now + ttl_ms
        row = cur.execute(_ACQUIRE, (ns, key, owner, expires, now)).fetchone()
        if row is not None:
            return Acquired(row[0], expires, ttl_ms)
        rec = self._lock_rec(cur.execute(_LOCK_GET, (ns, key)).fetchone(), ns, key)
        return T.acquire(rec, now, owner, ttl_ms, _no_new_fence)[1]

    def acquire(self, ns: str, key: str, owner: str, ttl_ms: int) -> Acquired | Held:
        return self._write(self._acquire, ns, key, owner, ttl_ms)

    def release(self, ns: str, key: str, owner: str, token: int) -> bool:
        if self._write(_release, ns, key, owner, token):
            _HUB.notify((self.path, "lock", ns, key))
            return True
        return False

    def break_lock(self, ns: str, key: str) -> bool:
        """Free the lock whoever holds it (``lock.break``); True if it was held."""
        if self._write(_break, ns, key):
            _HUB.notify((self.path, "lock", ns, key))
            return True
        return False

    def renew(self, ns: str, key: str, owner: str, token: int, ttl_ms: int) -> int | None:
        return self._write(_renew, ns, key, owner, token, ttl_ms)

    def renew_many(self, items: Sequence[tuple[Any, ...]]) -> list[int | None]:
        """Renew many claims (``("claim", ns, key, token, lease_ms)``) and leases
        (``("lock", ns, key, owner, token, ttl_ms)``) in one transaction, for a
        coordinator's renewer: one file lock and one commit for all of them."""
        return self._write(_renew_many, list(items))

    def lock(self, ns: str, key: str) -> LockRow | None:
        rows = self._read(_LOCK_LIVE, (ns, key, _now_ms()))
        if not rows:
            return None
        rec = self._lock_rec(rows[0], ns, key)
        assert rec is not None
        return LockRow(ns, key, rec.owner, rec.token, rec.expires_ms)

    def locks(self, ns_prefix: str) -> list[LockRow]:
        rows = self._read(_LOCKS, (len(ns_prefix), ns_prefix, _now_ms()))
        out = []
        bad: list[Any] = []
        for row in rows:
            ns, key, owner, token, expires_ms = row
            if (
                type(owner) is not str
                or type(token) is not int
                or type(expires_ms) is not int
                or type(key) is not str
            ):
                bad.append(row)
                out.append(LockRow(ns, str(key), "", 0, _int_or_0(expires_ms), corrupt=True))
            else:
                out.append(LockRow(ns, key, owner, token, expires_ms))
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
        return T.fence_advance(row[0], token)

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

    def purge(self) -> int:
        return self._write(_purge)

    # ---- waiting and life cycle --------------------------------------------------

    def subscribe(self, channel: Channel) -> LocalSubscription:
        return _HUB.subscribe((self.path, *channel))

    def close(self) -> None:
        """Close every pooled connection; calls in progress close theirs when done.
        The store cannot be used afterwards."""
        self._closed = True
        self._drain()


# ---- transaction bodies (run inside BEGIN IMMEDIATE by SQLiteStore._write) ----------


def _complete(
    cur: sqlite3.Cursor, result: bytes, ns: str, key: str, token: str, ttl_ms: int
) -> bool:
    now = _now_ms()
    return cur.execute(_COMPLETE, (result, now + ttl_ms, ns, key, token)).rowcount == 1


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
    return removed


def _int_or_0(value: object) -> int:
    return value if type(value) is int else 0


def _is_busy(exc: BaseException) -> bool:
    msg = str(exc)
    return "locked" in msg or "busy" in msg


# ---- fork safety --------------------------------------------------------------------

_STORES: weakref.WeakSet[SQLiteStore] = weakref.WeakSet()
#: connections inherited through fork(): never used nor closed in the child (closing
#: them could disturb the parent's locks), only kept from being garbage collected
_INHERITED: list[_Pair] = []


class _ForkGate:
    """Keeps fork() out of SQLite calls in progress. SQLite tracks the file locks of a
    process in memory shared by all its connections; a child forked while another
    thread was inside a transaction inherits that record of a lock nobody in the child
    will ever release, and every connection it opens then gets "database is locked".
    So fork waits (at most ``FORK_WAIT`` seconds) for calls in progress, and calls wait
    while a fork is under way."""

    __slots__ = ("_active", "_cond", "_forking")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._forking = False

    def enter(self) -> None:
        with self._cond:
            while self._forking:
                self._cond.wait()
            self._active += 1

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            if self._forking and self._active == 0:
                self._cond.notify_all()

    def before_fork(self) -> None:
        self._cond.acquire()
        self._forking = True
        if not self._cond.wait_for(lambda: self._active == 0, FORK_WAIT):
            log.warning(
                "fork() while a SQLite call was still running after %gs: the child may "
                "find the database locked",
                FORK_WAIT,
            )
        # The lock stays held across fork: no call can start until it is released.

    def after_fork_in_parent(self) -> None:
        self._forking = False
        self._cond.notify_all()
        self._cond.release()

    def after_fork_in_child(self) -> None:
        # Calls of the parent's other threads do not exist here.
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._forking = False


#: how long fork() waits for SQLite calls in progress to end
FORK_WAIT = 5.0
_GATE = _ForkGate()


def _after_fork_in_child() -> None:
    _GATE.after_fork_in_child()
    for store in list(_STORES):
        _INHERITED.extend(store._idle)
        store._idle = []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_GATE.before_fork,
        after_in_parent=_GATE.after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


# ---- async face -------------------------------------------------------------------


class SQLiteAsyncStore(ThreadedAsyncStore):
    """The async face: each call runs in a worker thread, since it may wait up to
    ``busy_timeout`` for another writer."""

    poll_cap = SQLiteStore.poll_cap
    sync: SQLiteStore

    def __init__(self, sync: SQLiteStore) -> None:
        super().__init__(sync)
        self.path = sync.path


# ---- URLs ---------------------------------------------------------------------------

_ACCEPTED = (
    "sqlite:///relative/path.db or sqlite:////absolute/path.db, optionally with "
    "?timeout=SECONDS and/or ?busy_timeout=SECONDS"
)
_OPTIONS = ("timeout", "busy_timeout")
_OPTIONS_TEXT = (
    "accepted: timeout (seconds, the bound on one call) and busy_timeout (seconds to "
    "wait for another writer; default: timeout)"
)


def _parse(url: str, options: dict[str, Any]) -> tuple[str, float, float]:
    head, sep, rest = url.partition("://")
    if not sep or head.lower() != "sqlite":
        raise ConfigurationError(f"not an SQLite URL: {url!r}; use {_ACCEPTED}")
    location, _, query = rest.partition("?")
    if not location.startswith("/"):
        where = "no path" if not location else f"a host ({location.split('/', 1)[0]!r})"
        raise ConfigurationError(
            f"SQLite URL {url!r} has {where}; an SQLite file has no host: use {_ACCEPTED}"
        )
    path = location[1:]
    if not path or path.endswith("/"):
        raise ConfigurationError(
            f"SQLite URL {url!r} names no file; use {_ACCEPTED} (for example "
            "sqlite:////var/lib/app/idemlock.db)"
        )
    if path == ":memory:" or path.startswith("file:"):
        raise ConfigurationError(
            f"SQLite URL {url!r}: only a plain file path is accepted (an in-memory SQLite "
            "database is private to one connection); use memory:// for an in-process store"
        )
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"unknown SQLite store option(s) {', '.join(unknown)}; {_OPTIONS_TEXT}"
        )
    given: dict[str, Any] = {k: v for k, v in options.items() if v is not None}
    if query:
        try:
            pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
        except ValueError as exc:
            raise ConfigurationError(
                f"SQLite URL {url!r} has a malformed query ({exc}); use {_ACCEPTED}"
            ) from exc
        for name, value in pairs:
            if name not in _OPTIONS:
                raise ConfigurationError(
                    f"SQLite URL {url!r} has unknown option {name!r}; {_OPTIONS_TEXT}"
                )
            if name in given:
                raise ConfigurationError(
                    f"{name} is given twice (in {url!r} and/or as a keyword); give it once"
                )
            given[name] = value
    timeout = _timeout(given.get("timeout"), "timeout")
    busy = _timeout(given["busy_timeout"], "busy_timeout") if "busy_timeout" in given else timeout
    # realpath: one file reached by two URLs (a symlink) shares its waiters' hub.
    return os.path.realpath(path), busy, timeout


def _timeout(given: Any, name: str) -> float:
    if given is None:
        return DEFAULT_BUSY_TIMEOUT
    value = given
    if isinstance(value, timedelta):
        value = value.total_seconds()
    elif isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigurationError(
            f"the SQLite store option {name} must be a non-negative number of "
            f"seconds (or a timedelta), got {given!r}"
        )
    return float(value)


def open_sync(url: str, **options: Any) -> tuple[SQLiteStore, None]:
    path, busy, timeout = _parse(url, options)
    return SQLiteStore(path, busy_timeout=busy, timeout=timeout), None


def open_async(url: str, **options: Any) -> tuple[SQLiteAsyncStore, None]:
    path, busy, timeout = _parse(url, options)
    return SQLiteAsyncStore(SQLiteStore(path, busy_timeout=busy, timeout=timeout)), None
