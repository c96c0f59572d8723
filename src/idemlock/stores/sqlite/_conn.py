"""The SQLite store's connections: opening a file (WAL, schema), the idle pool, one
write transaction or one read per call, and the errors a failed call becomes."""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ... import _forks
from ..._errors import ConfigurationError, StoreCorrupt, StoreUnavailable
from ..._logfields import fields as log_fields
from ._fork import GATE as _GATE
from ._sql import (
    _BEGIN,
    _CLAIMS_ADD_STEPS,
    _CLAIMS_COLUMNS,
    _COMMIT,
    _PERMITS_SCHEMA,
    _ROLLBACK,
    _SCHEMA,
    _SCHEMA_GET,
    _SQLITE_CORRUPT,
    _SQLITE_NOTADB,
    _STEPS_SCHEMA,
    _WAITERS_ADD_WAKE,
    _WAITERS_COLUMNS,
    _WAKE_KEY_GET,
    _WAKE_KEY_NEW,
    MAX_IDLE,
    SCHEMA_VERSION,
)

R = TypeVar("R")
_getpid = os.getpid

log = logging.getLogger("idemlock")

_Pair = tuple[sqlite3.Connection, sqlite3.Cursor]

#: the modes of ``Connections._run``
TXN, COUNT, ROWS = 0, 1, 2


class Connections:
    """The connection half of :class:`~._store.SQLiteStore` (which sets these up)."""

    path: str
    timeout: float
    busy_timeout: float
    _idle: list[_Pair]
    _closed: bool
    _ready: bool
    _init_lock: threading.Lock
    _pid: int
    _make_dir: bool
    _wake_key: bytes

    def _connect(self) -> _Pair:
        if self._closed:
            raise StoreUnavailable(f"the SQLite store on {self.path} was closed; open a new one")
        try:
            if not self._ready and self._make_dir:  # the default file's directory only
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
            # A file of the release before permits is upgraded here, in this transaction
            # (IF NOT EXISTS: whoever comes second finds it done). Its locks rows stay
            # what they were: a live one is a lock held, its token the key's counter.
            for stmt in _PERMITS_SCHEMA + _STEPS_SCHEMA:
                conn.execute(stmt)
            if "wake" not in {row[0] for row in conn.execute(_WAITERS_COLUMNS)}:
                conn.execute(_WAITERS_ADD_WAKE)
            # The end of a key's steps, kept in its claims row (in a new file's schema):
            # a file of an earlier release gets the column here (its step rows keep
            # their own ends).
            if "steps_ms" not in {row[0] for row in conn.execute(_CLAIMS_COLUMNS)}:
                conn.execute(_CLAIMS_ADD_STEPS)
            conn.execute(_WAKE_KEY_NEW, (os.urandom(32),))
            key = conn.execute(_WAKE_KEY_GET).fetchone()[0]
            conn.execute(_COMMIT)
        except BaseException:
            if conn.in_transaction:
                conn.execute(_ROLLBACK)
            raise
        # Whatever the row holds (another writer's), every process reads the same.
        self._wake_key = key if type(key) is bytes and key else repr(key).encode()

    def _forked(self) -> None:
        """In a forked child: drop the parent's pooled connections, never used nor
        closed here (closing one could disturb the parent's locks or remove its WAL
        files); the child opens its own."""
        with _forks.LOCK:
            if self._pid != os.getpid():
                _forks.INHERITED.extend(self._idle)
                self._idle = []
                self._init_lock = threading.Lock()  # a parent's thread may have held it
                self._pid = os.getpid()

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
        return self._run(TXN, body, args)  # type: ignore[no-any-return]

    def _read(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        """One SELECT (its own read transaction), fetched whole so that no read
        snapshot stays open on an idle connection."""
        return self._run(ROWS, sql, args)  # type: ignore[no-any-return]

    def _run(self, mode: int, what: Any, args: tuple[Any, ...]) -> Any:
        """One call into the file on a pooled connection. ``mode`` TXN: ``what`` is a
        body run as ``what(cursor, *args)`` inside BEGIN IMMEDIATE; COUNT and ROWS:
        ``what`` is one statement, run as a transaction of its own, answering its
        rowcount or its rows.

        A statement run outside BEGIN is its own transaction (autocommit), and a writing
        one takes the write lock as it starts, waiting on the busy handler exactly as
        BEGIN IMMEDIATE does: the same atomicity in one call into SQLite instead of
        three (BEGIN, the statement, COMMIT). Rows are fetched to the end: a statement
        with RETURNING, and with it its transaction, ends after the last one."""
        # The hot path of every port method: checkout and checkin are inlined.
        _GATE.enter()
        try:
            if self._pid != _getpid():
                self._forked()
            idle = self._idle
            try:
                pair = idle.pop()
            except IndexError:
                pair = self._connect()
            cur = pair[1]
            result: Any
            try:
                if mode == COUNT:
                    result = cur.execute(what, args).rowcount
                elif mode == ROWS:
                    result = cur.execute(what, args).fetchall()
                else:
                    cur.execute(_BEGIN)
                    result = what(cur, *args)
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
            hint = " (check that the directory exists and is writable)"
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
            extra=log_fields(store="sqlite", operation="list", outcome="corrupt"),
        )


def _is_busy(exc: BaseException) -> bool:
    msg = str(exc)
    return "locked" in msg or "busy" in msg
