"""The effects database: the at-least-once queue, the effects and their log."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import Any

from idemlock._faults.queue import JOBS_PG, JOBS_SQLITE, statements

# ---- the effects database: queue, effects, log ------------------------------------------

#: one schema for both databases: SQLite takes PostgreSQL's type names (by affinity)
#: but for the auto-numbered key, whose ids give the order of acceptance
SCHEMA = """
CREATE TABLE IF NOT EXISTS effects (
    job_id integer PRIMARY KEY,
    fence bigint NOT NULL,
    value text NOT NULL,
    worker text NOT NULL
);
CREATE TABLE IF NOT EXISTS effect_log (
    id {serial},
    job_id integer NOT NULL,
    fence bigint NOT NULL,
    worker text NOT NULL,
    accepted boolean NOT NULL
);
"""
LOCK_SCHEMA = """
CREATE TABLE IF NOT EXISTS lock_fence (
    resource text PRIMARY KEY,
    token bigint NOT NULL,                         -- the highest token accepted
    holder text NOT NULL,
    seq integer NOT NULL
);
CREATE TABLE IF NOT EXISTS lock_log (
    id {serial},                      -- SQL fences: the order of acceptance
    resource text NOT NULL,
    holder text NOT NULL,
    token bigint NOT NULL,
    seq integer NOT NULL,
    t_sent double precision NOT NULL,              -- CLOCK_MONOTONIC, before the write
    t_done double precision,                       -- after its reply (Redis gate only)
    accepted boolean,                              -- NULL: outcome unknown (store error)
    lost boolean NOT NULL,                         -- lease.lost when the write was sent
    remaining double precision NOT NULL            -- lease.remaining() then
);
CREATE TABLE IF NOT EXISTS lock_holds (
    id {serial},
    resource text NOT NULL,
    holder text NOT NULL,
    token bigint NOT NULL,
    t_before double precision NOT NULL,            -- before hold() was entered
    t_after double precision NOT NULL              -- when its body started
);
"""
PG_SCHEMA = JOBS_PG + SCHEMA.format(serial="bigserial PRIMARY KEY")
SQLITE_SCHEMA = JOBS_SQLITE + SCHEMA.format(serial="INTEGER PRIMARY KEY AUTOINCREMENT")
LOCK_PG_SCHEMA = LOCK_SCHEMA.format(serial="bigserial PRIMARY KEY")
LOCK_SQLITE_SCHEMA = LOCK_SCHEMA.format(serial="INTEGER PRIMARY KEY AUTOINCREMENT")

LOCK_LOG = (
    "INSERT INTO lock_log (resource, holder, token, seq, t_sent, t_done, accepted, lost, "
    "remaining) VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, {p})"
)
LOCK_HOLD = (
    "INSERT INTO lock_holds (resource, holder, token, t_before, t_after) "
    "VALUES ({p}, {p}, {p}, {p}, {p})"
)
#: SQLite's fenced write (PostgreSQL uses idemlock's own ``fenced_upsert``); without
#: the WHERE, plain mode's unfenced write (the checker's negative control)
LOCK_UPSERT = (
    "INSERT INTO lock_fence AS f (resource, token, holder, seq) VALUES ({p}, {p}, {p}, {p}) "
    "ON CONFLICT (resource) DO UPDATE SET token = excluded.token, holder = excluded.holder, "
    "seq = excluded.seq{where} RETURNING 1"
)
LOCK_FENCED = LOCK_UPSERT.format(p="?", where=" WHERE f.token <= excluded.token")

UPSERT = (
    "INSERT INTO effects AS e (job_id, fence, value, worker) VALUES ({p}, {p}, {p}, {p}) "
    "ON CONFLICT (job_id) DO UPDATE SET fence = excluded.fence, value = excluded.value, "
    "worker = excluded.worker{where} RETURNING 1"
)
FENCED = " WHERE e.fence <= excluded.fence"
LOG = "INSERT INTO effect_log (job_id, fence, worker, accepted) VALUES ({p}, {p}, {p}, {p})"


class FxError(Exception):
    """The effects database failed (connection lost, locked too long, ...)."""


class Fx:
    """The effects database of one run, seen from one process. A database gives
    ``connect``, ``tx`` (a write transaction), ``errors`` (its driver's), ``create``
    and ``lock_create`` (the schemas; the queue's jobs) and ``_lock_fence``."""

    kind = ""
    p = "?"  # the driver's placeholder
    skip_locked = ""  # how TAKE skips rows other takers hold (SQLite: one writer at a time)

    def __init__(self, dsn: str, supervisor: bool = False) -> None:
        self.dsn = dsn
        #: the supervisor never waits long for a lock a paused worker holds
        self.supervisor = supervisor
        self._conn: Any = None
        # the queue's statements are the fault harness's, shared with `idemlock demo`
        self.sql = statements(self.p, self.skip_locked) | {
            name: text.format(p=self.p, where="{where}")
            for name, text in {
                "upsert": UPSERT,
                "log": LOG,
                "lock_log": LOCK_LOG,
                "lock_hold": LOCK_HOLD,
            }.items()
        }

    # a failed connection is dropped (reset) and made again on next use
    @property
    def conn(self) -> Any:
        if self._conn is None:
            self._conn = self.connect()
        return self._conn

    def reset(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    @contextlib.contextmanager
    def read(self) -> Iterator[Any]:
        """A read-only transaction (never waits for writers)."""
        with self.tx() as c:
            yield c

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Driver errors become FxError and drop the connection."""
        try:
            yield
        except self.errors() as exc:
            self.reset()
            raise FxError(f"{type(exc).__name__}: {exc}") from exc

    # the queue
    def take(self, worker: str, visibility: float) -> tuple[int, int] | None:
        now = time.time()
        with self.guard(), self.tx() as c:
            row = c.execute(self.sql["take"], (worker, now + visibility, now)).fetchone()
        return None if row is None else (int(row[0]), int(row[1]))

    def ack(self, job: int) -> None:
        with self.guard(), self.tx() as c:
            c.execute(self.sql["ack"], (job,))

    def nack(self, job: int, worker: str, delivery: int, until: float) -> None:
        with self.guard(), self.tx() as c:
            c.execute(self.sql["nack"], (until, job, worker, delivery))

    def release(self, worker: str) -> None:
        now = time.time()
        with self.guard(), self.tx() as c:
            c.execute(self.sql["release"], (now, worker, now))

    def busy(self) -> set[str]:
        with self.guard(), self.read() as c:
            return {r[0] for r in c.execute(self.sql["busy"], (time.time(),)).fetchall()}

    def undone(self) -> int:
        with self.guard(), self.read() as c:
            return int(c.execute(self.sql["undone"]).fetchone()[0])

    # the side effect and its log row, in one transaction
    def _write(self, c: Any, job: int, fence: int, value: str, worker: str, fenced: bool) -> bool:
        sql = self.sql["upsert"].format(where=FENCED if fenced else "")
        accepted = c.execute(sql, (job, fence, value, worker)).fetchone() is not None
        c.execute(self.sql["log"], (job, fence, worker, accepted))
        return accepted

    def effect(self, job: int, fence: int, value: str, worker: str, fenced: bool) -> bool:
        """Write the effect (fenced: only over a row with a fence <= ours) and its log
        row; True if the effect was accepted."""
        with self.guard(), self.tx() as c:
            return self._write(c, job, fence, value, worker, fenced)

    # the lock workload
    def lock_hold(self, res: str, holder: str, token: int, before: float, after: float) -> None:
        with self.guard(), self.tx() as c:
            c.execute(self.sql["lock_hold"], (res, holder, token, before, after))

    def lock_log(self, row: tuple[Any, ...]) -> None:
        """One write attempt: (resource, holder, token, seq, t_sent, t_done, accepted,
        lost, remaining)."""
        with self.guard(), self.tx() as c:
            c.execute(self.sql["lock_log"], row)

    def lock_write(
        self,
        res: str,
        holder: str,
        token: int,
        seq: int,
        sent: float,
        lost: bool,
        left: float,
        fenced: bool = True,
    ) -> bool:
        """The fenced write (accepted only over a row with a token <= ours) and its log
        row in one transaction: the log's ids give the order of acceptance."""
        with self.guard(), self.tx() as c:
            if fenced:
                ok = self._lock_fence(c, res, holder, token, seq)
            else:
                sql = LOCK_UPSERT.format(p=self.p, where="")
                ok = c.execute(sql, (res, token, holder, seq)).fetchone() is not None
            c.execute(self.sql["lock_log"], (res, holder, token, seq, sent, None, ok, lost, left))
            return ok

    def lock_snapshot(self) -> dict[str, Any]:
        with self.guard(), self.read() as c:
            holds = c.execute(
                "SELECT resource, holder, token, t_before, t_after FROM lock_holds ORDER BY id"
            ).fetchall()
            log = c.execute(
                "SELECT id, resource, holder, token, seq, t_sent, t_done, accepted, lost, "
                "remaining FROM lock_log ORDER BY id"
            ).fetchall()
        return {"holds": holds, "log": log}

    def snapshot(self) -> dict[str, Any]:
        with self.guard(), self.read() as c:
            jobs = c.execute("SELECT id, state, deliveries FROM jobs ORDER BY id").fetchall()
            effects = c.execute("SELECT job_id, fence, value FROM effects").fetchall()
            log = c.execute(
                "SELECT id, job_id, fence, worker, accepted FROM effect_log ORDER BY id"
            ).fetchall()
        return {"jobs": jobs, "effects": effects, "log": log}


class SqliteFx(Fx):
    kind = "sqlite"

    def connect(self) -> Any:
        timeout = 0.25 if self.supervisor else 30
        conn = sqlite3.connect(self.dsn, timeout=timeout, isolation_level=None)
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def errors(self) -> tuple[type[BaseException], ...]:
        return (sqlite3.Error,)

    @contextlib.contextmanager
    def tx(self, begin: str = "BEGIN IMMEDIATE") -> Iterator[Any]:
        c = self.conn
        c.execute(begin)
        try:
            yield c
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                c.execute("ROLLBACK")
            raise
        c.execute("COMMIT")

    @contextlib.contextmanager
    def read(self) -> Iterator[Any]:
        with self.tx("BEGIN") as c:  # deferred: a WAL reader takes no lock
            yield c

    def _lock_fence(self, c: Any, res: str, holder: str, token: int, seq: int) -> bool:
        return c.execute(LOCK_FENCED, (res, token, holder, seq)).fetchone() is not None

    def lock_create(self) -> None:
        c = self.conn
        c.execute("PRAGMA journal_mode=WAL")
        c.executescript(LOCK_SQLITE_SCHEMA)

    def create(self, visible: list[float]) -> None:
        c = self.conn
        c.execute("PRAGMA journal_mode=WAL")
        c.executescript(SQLITE_SCHEMA)
        with self.tx():
            c.executemany(
                self.sql["create"],
                [(i + 1, t) for i, t in enumerate(visible)],
            )


class PgFx(Fx):
    kind = "postgres"
    p = "%s"
    skip_locked = " FOR UPDATE SKIP LOCKED"

    def connect(self) -> Any:
        import psycopg

        options = "-c lock_timeout=250" if self.supervisor else ""
        try:
            return psycopg.connect(self.dsn, autocommit=True, connect_timeout=3, options=options)
        except psycopg.Error as exc:
            raise FxError(f"connect: {exc}") from exc

    def errors(self) -> tuple[type[BaseException], ...]:
        import psycopg

        return (psycopg.Error,)

    @contextlib.contextmanager
    def tx(self) -> Iterator[Any]:
        with self.conn.transaction():
            yield self.conn

    def create(self, visible: list[float]) -> None:
        with self.guard():
            self.conn.execute(PG_SCHEMA)
            with self.tx() as c, c.cursor() as cur:
                cur.executemany(
                    self.sql["create"],
                    [(i + 1, t) for i, t in enumerate(visible)],
                )

    def lock_create(self) -> None:
        with self.guard():
            self.conn.execute(LOCK_PG_SCHEMA)

    def _lock_fence(self, c: Any, res: str, holder: str, token: int, seq: int) -> bool:
        from idemlock import FencedOut
        from idemlock.stores.postgres import fenced_upsert

        values = {"resource": res, "holder": holder, "seq": seq}
        try:
            fenced_upsert(c, "lock_fence", values, ["resource"], token, fence_column="token")
        except FencedOut:
            return False
        return True

    def effect_fenced(self, job: int, fence: int, value: str, worker: str) -> bool:
        """The effect through idemlock's own helper, ``fenced_upsert``."""
        with self.guard(), self.tx() as c:
            return self._fenced(c, job, fence, value, worker)

    def _fenced(self, c: Any, job: int, fence: int, value: str, worker: str) -> bool:
        from idemlock import FencedOut
        from idemlock.stores.postgres import fenced_upsert

        values = {"job_id": job, "value": value, "worker": worker}
        try:
            fenced_upsert(c, "effects", values, ["job_id"], fence, fence_column="fence")
            accepted = True
        except FencedOut:
            accepted = False
        c.execute(self.sql["log"], (job, fence, worker, accepted))
        return accepted

    def effect_and_complete(
        self, job: int, fence: int, value: str, worker: str, finish: Callable[[Any], None]
    ) -> bool:
        """Same-transaction mode: the effect, its log row and ``finish(conn)`` (the
        completion) commit together or not at all. A refused effect commits only its
        log row and skips ``finish``."""
        with self.guard(), self.tx() as c:
            if not self._fenced(c, job, fence, value, worker):
                return False
            finish(c)
            return True


def make_fx(kind: str, dsn: str) -> Fx:
    return SqliteFx(dsn) if kind == "sqlite" else PgFx(dsn)
