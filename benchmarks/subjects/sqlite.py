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
from typing import Any

from common import LEASE_MS, LOCK, LOCK_OP, SCALE, Make, SyncFn, _fail

import idemlock
from idemlock import FencedOut
from idemlock.stores.sqlite import _SCHEMA
from subjects.base import Adapter, count_sqlite_transactions

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

_keys = itertools.count()
Txn = tuple[str, tuple[Any, ...]]


def sq_open_raw(path: str) -> sqlite3.Cursor:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    for stmt in _SCHEMA:  # the store's own schema, indexes included
        conn.execute(stmt)
    return conn.cursor()


def sq_txn(cur: sqlite3.Cursor, sql: str, args: tuple[Any, ...]) -> None:
    cur.execute("BEGIN IMMEDIATE")
    cur.execute(sql, args)
    cur.execute("COMMIT")


def sq_pair(op: str, key: str, i: int) -> tuple[Txn, Txn]:
    """The two transactions of a pair: claim, complete; or acquire, release."""
    now = time.time_ns() // 1_000_000
    if op == LOCK_OP:
        return (SQ_INSERT_LOCK, (SQ_NS, key, "owner", i, now + 30_000)), (
            SQ_DELETE_LOCK, (SQ_NS, key))  # fmt: skip
    return (SQ_INSERT_CLAIM, (SQ_NS, key, "token", i, now + LEASE_MS)), (
        SQ_COMPLETE, (SQ_RESULT, now + SQ_TTL_MS, SQ_NS, key))  # fmt: skip


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

    def _raw(self, stack: contextlib.ExitStack) -> tuple[str, sqlite3.Cursor]:
        path = self.target()["path"]
        cur = sq_open_raw(path)
        stack.callback(cur.connection.close)
        return path, cur

    def raw_pairs(
        self, op: str, t: dict[str, Any], stack: contextlib.ExitStack, job: bool = False
    ) -> SyncFn:
        """The sync baseline; the job writes its effect between the two transactions."""
        path, cur = self._raw(stack)
        effects = sqlite_effects(path, stack) if job else None

        def run(count: int) -> None:
            for i in range(count):
                key = "shared" if op == LOCK_OP else f"k{next(_keys)}"
                first, then = sq_pair(op, key, i)
                sq_txn(cur, *first)
                if effects is not None:
                    sqlite_fenced_write(effects, key, i)
                sq_txn(cur, *then)

        return run

    async def araw_pairs(self, op: str, tasks: int, stack: contextlib.AsyncExitStack) -> Make:
        """Raw sqlite3 transactions, each in asyncio.to_thread (the store's async face
        does the same), one connection per worker thread."""
        path, local = self.target()["path"], threading.local()

        def txn(sql: str, args: tuple[Any, ...]) -> None:
            if getattr(local, "cur", None) is None:
                local.cur = sq_open_raw(path)
            sq_txn(local.cur, sql, args)

        async def make(t: int, count: int) -> None:
            for i in range(count):
                first, then = sq_pair(op, f"k{t}" if op == LOCK_OP else f"k{next(_keys)}", i)
                await asyncio.to_thread(txn, *first)
                await asyncio.to_thread(txn, *then)

        return make

    def raw_job(self, t: dict[str, Any], stack: contextlib.ExitStack) -> SyncFn:
        return self.raw_pairs("job", t, stack, job=True)

    def write(self, url: str, stack: contextlib.ExitStack) -> Callable[[str, int], Any]:
        effects = sqlite_effects(url.removeprefix("sqlite:///"), stack)
        return lambda key, fence: sqlite_fenced_write(effects, key, fence)

    def awrite(
        self, url: str, stack: contextlib.ExitStack, loop: Any
    ) -> Callable[[str, int], Awaitable[Any]]:
        effects = sqlite_effects(url.removeprefix("sqlite:///"), stack)
        return lambda key, fence: asyncio.to_thread(sqlite_fenced_write, effects, key, fence)
