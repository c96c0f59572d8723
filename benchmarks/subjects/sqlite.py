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
from collections.abc import Callable, Iterator
from typing import Any

from common import (
    BASE,
    LOCK,
    LOCK_OP,
    OURS,
    OURS_AIO,
    OURS_PORT,
    SCALE,
    Make,
    Results,
    SyncFn,
    _fail,
    new_prefix,
)

import idemlock
import idemlock.aio
from idemlock import FencedOut
from idemlock.stores.sqlite import _SCHEMA
from subjects.base import (
    LEASE_MS,
    aio_claim,
    aio_lock,
    count_sqlite_transactions,
    new_loop,
    on_loop,
    ours_ajob,
    ours_claim_pairs,
    ours_job,
    ours_lock_pairs,
    port_claim_pairs,
    port_lock_pairs,
)

SQ_NS = "bench:job"


SQ_RESULT = b'{"ok":true,"id":12345}'


SQ_TTL_MS = 86_400_000


_keys = itertools.count()


def sq_fresh_keys(n: int) -> list[str]:
    return [f"k{next(_keys)}" for _ in range(n)]


def sq_open_raw(path: str) -> sqlite3.Cursor:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    for stmt in _SCHEMA:  # the store's own schema, indexes included
        conn.execute(stmt)
    return conn.cursor()


SQ_INSERT_CLAIM = (
    "INSERT INTO claims (ns, key, state, token, fence, fp, expires_ms, result) "
    "VALUES (?, ?, 'in_flight', ?, ?, NULL, ?, NULL)"
)


SQ_COMPLETE = (
    "UPDATE claims SET state = 'completed', result = ?, expires_ms = ? WHERE ns = ? AND key = ?"
)


SQ_INSERT_LOCK = "INSERT INTO locks (ns, key, owner, token, expires_ms) VALUES (?, ?, ?, ?, ?)"


SQ_DELETE_LOCK = "DELETE FROM locks WHERE ns = ? AND key = ?"


def sq_claim_complete(cur: sqlite3.Cursor, n: int) -> float:
    keys = sq_fresh_keys(n)
    start = time.perf_counter()
    for i, key in enumerate(keys):
        now = time.time_ns() // 1_000_000
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(SQ_INSERT_CLAIM, (SQ_NS, key, "token", i, now + LEASE_MS))
        cur.execute("COMMIT")
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(SQ_COMPLETE, (SQ_RESULT, now + SQ_TTL_MS, SQ_NS, key))
        cur.execute("COMMIT")
    return time.perf_counter() - start


def sq_acquire_release(cur: sqlite3.Cursor, n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        now = time.time_ns() // 1_000_000
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(SQ_INSERT_LOCK, (SQ_NS, "shared", "owner", i, now + 30_000))
        cur.execute("COMMIT")
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(SQ_DELETE_LOCK, (SQ_NS, "shared"))
        cur.execute("COMMIT")
    return time.perf_counter() - start


SQLITE_EFFECTS = (
    "CREATE TABLE IF NOT EXISTS effects "
    "(key TEXT PRIMARY KEY, value TEXT NOT NULL, fence_token INTEGER NOT NULL)"
)


SQLITE_FENCED_UPSERT = (
    "INSERT INTO effects (key, value, fence_token) VALUES (?, ?, ?) ON CONFLICT (key) DO "
    "UPDATE SET value = excluded.value, fence_token = excluded.fence_token "
    "WHERE effects.fence_token <= excluded.fence_token"
)


def sqlite_effects(path: str) -> sqlite3.Cursor:
    """Your own table in the same file, written with a fenced upsert."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(SQLITE_EFFECTS)
    return conn.cursor()


def sqlite_fenced_write(cur: sqlite3.Cursor, key: str, fence: int) -> None:
    if cur.execute(SQLITE_FENCED_UPSERT, (key, "done", fence)).rowcount != 1:
        raise FencedOut(key, fence, None)


def sqlite_raw_job(cur: sqlite3.Cursor, effects: sqlite3.Cursor) -> SyncFn:
    def run(count: int) -> None:
        for i, key in enumerate(sq_fresh_keys(count)):
            now = time.time_ns() // 1_000_000
            cur.execute("BEGIN IMMEDIATE")
            cur.execute(SQ_INSERT_CLAIM, (SQ_NS, key, "token", i, now + LEASE_MS))
            cur.execute("COMMIT")
            sqlite_fenced_write(effects, key, i)
            cur.execute("BEGIN IMMEDIATE")
            cur.execute(SQ_COMPLETE, (SQ_RESULT, now + SQ_TTL_MS, SQ_NS, key))
            cur.execute("COMMIT")

    return run


class SqliteThreadedRaw:
    """The asyncio baseline: raw sqlite3 transactions, each in asyncio.to_thread (the
    store's async face does the same), one connection per worker thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.local = threading.local()

    def _cur(self) -> sqlite3.Cursor:
        cur = getattr(self.local, "cur", None)
        if cur is None:
            cur = self.local.cur = sq_open_raw(self.path)
        return cur

    def _txn(self, sql: str, args: tuple[Any, ...]) -> None:
        cur = self._cur()
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(sql, args)
        cur.execute("COMMIT")

    async def aclaim(self, t: int, count: int) -> None:
        for i, key in enumerate(sq_fresh_keys(count)):
            now = time.time_ns() // 1_000_000
            args = (SQ_NS, key, "token", i, now + LEASE_MS)
            await asyncio.to_thread(self._txn, SQ_INSERT_CLAIM, args)
            args = (SQ_RESULT, now + SQ_TTL_MS, SQ_NS, key)
            await asyncio.to_thread(self._txn, SQ_COMPLETE, args)

    async def alock(self, t: int, count: int) -> None:
        key = f"k{t}"
        for i in range(count):
            now = time.time_ns() // 1_000_000
            args = (SQ_NS, key, "owner", i, now + 30_000)
            await asyncio.to_thread(self._txn, SQ_INSERT_LOCK, args)
            await asyncio.to_thread(self._txn, SQ_DELETE_LOCK, (SQ_NS, key))


class SqliteBench:
    name = "sqlite"
    scale = SCALE["sqlite"]
    trips_unit = "transactions"
    kinds = (BASE, OURS)

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp

    def _file(self) -> str:
        return os.path.join(self.tmp, f"{uuid.uuid4().hex[:10]}.db")

    def target(self) -> dict[str, Any]:
        path = self._file()
        return {"path": path, "url": f"sqlite:///{path}"}

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

    def _coord(self, stack: contextlib.ExitStack) -> idemlock.Coordinator:
        coord = idemlock.connect(f"sqlite:///{self._file()}", key_prefix=new_prefix())
        stack.callback(coord.close)
        return coord

    def _raw(self, stack: contextlib.ExitStack) -> sqlite3.Cursor:
        cur = sq_open_raw(self._file())
        stack.callback(cur.connection.close)
        return cur

    def sync_fns(
        self, op: str, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        raw, coord = self._raw(stack), self._coord(stack)
        if op == LOCK_OP:
            return {
                BASE: lambda k: sq_acquire_release(raw, k),
                OURS: ours_lock_pairs(coord),
                OURS_PORT: port_lock_pairs(coord),
            }
        return {
            BASE: lambda k: sq_claim_complete(raw, k),
            OURS: ours_claim_pairs(coord),
            OURS_PORT: port_claim_pairs(coord),
        }

    async def async_fns(
        self, op: str, tasks: int, stack: contextlib.AsyncExitStack, res: Results, where: Any
    ) -> dict[str, Make]:
        raw = SqliteThreadedRaw(self._file())
        coord = idemlock.aio.connect(f"sqlite:///{self._file()}", key_prefix=new_prefix())
        stack.push_async_callback(coord.close)
        if op == LOCK_OP:
            return {BASE: raw.alock, OURS: aio_lock(coord)}
        return {BASE: raw.aclaim, OURS: aio_claim(coord)}

    def job_fns(
        self, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        fns: dict[str, SyncFn] = {}
        path = self._file()
        raw = sq_open_raw(path)
        stack.callback(raw.connection.close)
        effects = sqlite_effects(path)
        stack.callback(effects.connection.close)
        fns[BASE] = sqlite_raw_job(raw, effects)
        path = self._file()
        coord = idemlock.connect(f"sqlite:///{path}", key_prefix=new_prefix())
        stack.callback(coord.close)
        effects = sqlite_effects(path)
        stack.callback(effects.connection.close)
        fns[OURS] = ours_job(coord, lambda key, fence: sqlite_fenced_write(effects, key, fence))
        path = self._file()
        loop = new_loop(stack)
        acoord = idemlock.aio.connect(f"sqlite:///{path}", key_prefix=new_prefix())
        stack.callback(lambda: loop.run_until_complete(acoord.close()))
        effects = sqlite_effects(path)
        stack.callback(effects.connection.close)

        async def awrite(key: str, fence: int) -> None:
            await asyncio.to_thread(sqlite_fenced_write, effects, key, fence)

        fns[OURS_AIO] = on_loop(loop, ours_ajob(acoord, awrite))
        return fns
