"""The SQLite store's adapter; its baseline is raw sqlite3, the same transactions."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Any
from unittest import mock

from common import LEASE_MS, LOCK, LOCK_OP, SCALE, _fail

import idemlock
from idemlock import FencedOut
from idemlock.stores.sqlite import _SCHEMA
from idemlock.stores.sqlite import _sql as S
from idemlock.stores.sqlite._sql import _PERMITS_SCHEMA, _STEPS_SCHEMA
from subjects.base import Adapter, Ctx, Raw

SQ_NS = "bench:job"
SQ_RESULT = b'{"ok":true,"id":12345}'
SQ_TTL_MS = 86_400_000
SQ_INSERT_CLAIM = (
    "INSERT INTO claims (ns, key, state, token, fence, fp, expires_ms, result) "
    "VALUES (?, ?, 'in_flight', ?, ?, NULL, ?, NULL)"
)
SQ_COMPLETE = (
    "UPDATE claims SET state = 'completed', result = ?, expires_ms = ? WHERE ns = ? AND key = ?"
)
SQ_INSERT_LOCK = "INSERT INTO locks (ns, key, owner, token, expires_ms) VALUES (?, ?, ?, ?, ?)"
SQ_DELETE_LOCK = "DELETE FROM locks WHERE ns = ? AND key = ?"
SQLITE_EFFECTS = (
    "CREATE TABLE IF NOT EXISTS effects "
    "(key TEXT PRIMARY KEY, value TEXT NOT NULL, fence_token INTEGER NOT NULL)"
)
SQLITE_FENCED_UPSERT = (
    "INSERT INTO effects (key, value, fence_token) VALUES (?, ?, ?) ON CONFLICT (key) DO "
    "UPDATE SET value = excluded.value, fence_token = excluded.fence_token "
    "WHERE effects.fence_token <= excluded.fence_token"
)
ENDS = ("COMMIT", "END", "ROLLBACK")


@contextlib.contextmanager
def count_sqlite_transactions() -> Iterator[Callable[[], int]]:
    """Transactions run on SQLite connections opened meanwhile (every BEGIN, and every
    statement run outside one, which SQLite runs as a transaction of its own)."""
    real, box = sqlite3.connect, [0]

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn, inside = real(*args, **kwargs), [False]

        def trace(sql: str) -> None:
            head = sql.lstrip()[:8].upper()
            box[0] += head.startswith("BEGIN") or not (inside[0] or head.startswith(ENDS))
            if head.startswith(("BEGIN", *ENDS)):
                inside[0] = head.startswith("BEGIN")

        conn.set_trace_callback(trace)
        return conn

    with mock.patch.object(sqlite3, "connect", connect):
        yield lambda: box[0]


def sq_open_raw(path: str) -> sqlite3.Cursor:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    for stmt in (*_SCHEMA, *_PERMITS_SCHEMA, *_STEPS_SCHEMA):  # the store's own schema
        conn.execute(stmt)
    return conn.cursor()


def sqlite_effects(path: str, stack: contextlib.ExitStack) -> sqlite3.Cursor:
    """Your own table in the same file, written with a fenced upsert."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    stack.callback(conn.close)
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(SQLITE_EFFECTS)
    return conn.cursor()


def sqlite_fenced_write(cur: sqlite3.Cursor, key: str, fence: int) -> None:
    if cur.execute(SQLITE_FENCED_UPSERT, (key, "done", fence)).rowcount != 1:
        raise FencedOut(key, fence, None)


class SqliteRaw(Raw):
    """Each request one transaction (BEGIN IMMEDIATE, the statement, COMMIT) on this
    thread's connection; asyncio: in asyncio.to_thread, as the store's async face runs
    its calls, one connection per worker thread."""

    def __init__(self, path: str, stack: Any) -> None:
        self.path, self.local, self.fences = path, threading.local(), itertools.count(1)
        self.effects = sqlite_effects(path, stack)

    def steps(self, op: str, key: str) -> tuple[Any, Callable[[Any], Any]]:
        # the claim's fence, for the job's write: the INSERT returns nothing
        self.fence, now = next(self.fences), time.time_ns() // 1_000_000
        if op == LOCK_OP:
            first = (SQ_INSERT_LOCK, (SQ_NS, key, "owner", self.fence, now + 30_000))
            return first, lambda _: (SQ_DELETE_LOCK, (SQ_NS, key))
        first = (SQ_INSERT_CLAIM, (SQ_NS, key, "token", self.fence, now + LEASE_MS))
        return first, lambda _: (SQ_COMPLETE, (SQ_RESULT, now + SQ_TTL_MS, SQ_NS, key))

    def send(self, request: tuple[str, tuple[Any, ...]]) -> Any:
        """The statement in its transaction; its first row (None if it returns none)."""
        if getattr(self.local, "cur", None) is None:
            self.local.cur = sq_open_raw(self.path)
        cur = self.local.cur
        cur.execute("BEGIN IMMEDIATE")
        row = cur.execute(*request).fetchone()
        cur.execute("COMMIT")
        return row

    def asend(self, request: tuple[str, tuple[Any, ...]]) -> Awaitable[None]:
        return asyncio.to_thread(self.send, request)

    def write(self, key: str, reply: Any) -> None:
        sqlite_fenced_write(self.effects, key, self.fence)


class SqliteOwnSql(SqliteRaw):
    """The store's own statements (imported from it, so they stay the same) with its
    arguments, each in the baseline's transaction (the store runs it as one autocommit
    statement): what its SQL costs next to the baseline's, without the Python layer."""

    def steps(self, op: str, key: str) -> tuple[Any, Callable[[Any], Any]]:
        now, token = time.time_ns() // 1_000_000, uuid.uuid4().hex
        if op == LOCK_OP:
            first = (S._ACQUIRE_UNQUEUED, (SQ_NS, key, "owner", now + 30_000, now, 1, None))
            return first, lambda row: (S._RELEASE, (SQ_NS, key, "owner", row[0], now))
        first = (S._CLAIM_NEW, (SQ_NS, key, token, None, now + LEASE_MS, now))
        return first, lambda _: (S._COMPLETE, (SQ_RESULT, now + SQ_TTL_MS, SQ_NS, key, token, now))


class SqliteBench(Adapter):
    name = "sqlite"
    scale = SCALE["sqlite"]

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp

    def target(self) -> dict[str, Any]:
        path = os.path.join(self.tmp, f"{uuid.uuid4().hex[:10]}.db")
        return {"path": path, "url": f"sqlite:///{path}"}

    def url(self, t: dict[str, Any]) -> str:
        return str(self.target()["url"])  # every subject on a file of its own

    @contextlib.contextmanager
    def counting(self) -> Iterator[tuple[Callable[[], int], dict[str, Any]]]:
        with count_sqlite_transactions() as count:
            yield count, self.target()

    def contention_target(self) -> dict[str, Any]:
        """A file made ready here (schemas, WAL), before 4 processes open it at once."""
        t = self.target()
        sq_open_raw(t["path"]).connection.close()
        coord = idemlock.connect(t["url"])
        coord.lock(LOCK).release(coord.lock(LOCK).acquire("warm") or _fail())
        coord.close()
        return t

    def raw(self, x: Ctx) -> Raw:
        return SqliteRaw(self.target()["path"], x.stack)

    def own_sql(self, x: Ctx) -> Raw:
        return SqliteOwnSql(self.target()["path"], x.stack)

    def effect(self, x: Ctx, url: str, aio: bool) -> Any:
        write = partial(
            sqlite_fenced_write, sqlite_effects(url.removeprefix("sqlite:///"), x.stack)
        )
        return (lambda key, fence: asyncio.to_thread(write, key, fence)) if aio else write

    @staticmethod
    def contender(x: Ctx) -> tuple[Any, Any]:
        """A lock row INSERTed (retried every 1 ms while another holds it), DELETEd."""
        cur = sq_open_raw(x.t["path"])
        x.stack.callback(cur.connection.close)
        owner = uuid.uuid4().hex

        def acquire(key: str) -> Any:
            while True:
                try:
                    now = time.time_ns() // 1_000_000
                    cur.execute(SQ_INSERT_LOCK, (SQ_NS, key, owner, 0, now + 30_000))
                    return key
                except sqlite3.IntegrityError:
                    time.sleep(0.001)

        return acquire, lambda key: cur.execute(SQ_DELETE_LOCK, (SQ_NS, key))
