"""An at-least-once job queue in a table, as a broker behaves.

``take`` hands the oldest visible job to a worker and makes it invisible for
``visibility`` seconds (a stalled worker's job is delivered again after that);
``finish`` acks it or makes it visible again at a given time; ``release`` makes a
dead worker's jobs visible at once (a broker does this when a consumer's connection
drops). Every delivery counts in ``deliveries``. One class for SQLite (``sqlite3``)
and PostgreSQL (``psycopg``) connections.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import Any

JOBS = """
CREATE TABLE IF NOT EXISTS jobs (
    id integer PRIMARY KEY,
    state text NOT NULL DEFAULT 'ready',           -- ready | done
    worker text,
    visible_at double precision NOT NULL,          -- epoch seconds; invisible until then
    deliveries integer NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_ready ON jobs (state, visible_at);
"""

_SQL = {
    "take": (
        "UPDATE jobs SET worker = {p}, deliveries = deliveries + 1, visible_at = {p} "
        "WHERE id = (SELECT id FROM jobs WHERE state = 'ready' AND visible_at <= {p} "
        "ORDER BY visible_at, id LIMIT 1{lock}) RETURNING id, deliveries"
    ),
    "ack": "UPDATE jobs SET state = 'done' WHERE id = {p} AND state = 'ready'",
    # only the delivery it was given: a late nack cannot hide a job delivered since
    "nack": (
        "UPDATE jobs SET visible_at = {p}, worker = NULL "
        "WHERE id = {p} AND worker = {p} AND deliveries = {p} AND state = 'ready'"
    ),
    "release": (
        "UPDATE jobs SET visible_at = {p} "
        "WHERE worker = {p} AND state = 'ready' AND visible_at > {p}"
    ),
    "busy": "SELECT DISTINCT worker FROM jobs WHERE state = 'ready' AND visible_at > {p}",
    "undone": "SELECT COUNT(*) FROM jobs WHERE state != 'done'",
    "create": "INSERT INTO jobs (id, visible_at) VALUES ({p}, {p})",
    "event": "INSERT INTO events VALUES ({p}, {p}, {p}, {p})",
}


def sqlite_connect(path: str, timeout: float = 60.0) -> sqlite3.Connection:
    # Autocommit mode: every transaction is an explicit BEGIN.
    conn = sqlite3.connect(path, timeout=timeout, isolation_level=None)
    conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL survives a killed process
    return conn


class Queue:
    """The queue over the connection ``connect()`` makes, again after ``reset()``.
    With ``events``, ``finish`` also writes what became of the job to an ``events``
    table, in the same transaction."""

    def __init__(self, connect: Callable[[], Any], postgres: bool = False, events: bool = False):
        self.connect, self.postgres, self.events = connect, postgres, events
        self.p = "%s" if postgres else "?"
        # PostgreSQL takers skip rows other takers hold; SQLite has one writer anyway
        lock = " FOR UPDATE SKIP LOCKED" if postgres else ""
        self.sql = {name: sql.format(p=self.p, lock=lock) for name, sql in _SQL.items()}
        self._conn: Any = None

    @property
    def conn(self) -> Any:
        if self._conn is None:
            self._conn = self.connect()
        return self._conn

    def reset(self) -> None:
        """Close the connection (quietly: it may be broken); the next use reconnects."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    close = reset

    @contextlib.contextmanager
    def tx(self, write: bool = True) -> Iterator[Any]:
        """A transaction (SQLite: a deferred one for reads, so a WAL reader never waits)."""
        c = self.conn
        if self.postgres:
            with c.transaction():
                yield c
            return
        c.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield c
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                c.execute("ROLLBACK")
            raise
        c.execute("COMMIT")

    def create(self, visible: list[float], schema: str = "") -> None:
        """The tables (``JOBS`` and ``schema``), one job per entry of ``visible``."""
        if self.postgres:
            self.conn.execute(JOBS + schema)
        else:
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.executescript(JOBS + schema)
        with self.tx() as c:
            c.cursor().executemany(self.sql["create"], list(enumerate(visible, 1)))

    def take(self, worker: str, visibility: float) -> tuple[int, int] | None:
        """(job, delivery number) or None when no job is visible."""
        now = time.time()
        with self.tx() as c:
            row = c.execute(self.sql["take"], (worker, now + visibility, now)).fetchone()
        return None if row is None else (int(row[0]), int(row[1]))

    def finish(self, job: int, worker: str, delivery: int, kind: str, again: float | None) -> None:
        """Ack the job (``again`` None) or deliver it again from ``again`` on."""
        with self.tx() as c:
            if again is None:
                c.execute(self.sql["ack"], (job,))
            else:
                c.execute(self.sql["nack"], (again, job, worker, delivery))
            if self.events:
                c.execute(self.sql["event"], (job, worker, kind, time.time()))

    def release(self, worker: str) -> None:
        now = time.time()
        with self.tx() as c:
            c.execute(self.sql["release"], (now, worker, now))

    def busy(self) -> set[str]:
        with self.tx(write=False) as c:
            rows = c.execute(self.sql["busy"], (time.time(),)).fetchall()
        return {str(r[0]) for r in rows if r[0] is not None}

    def undone(self) -> int:
        with self.tx(write=False) as c:
            return int(c.execute(self.sql["undone"]).fetchone()[0])


#: what ``handle(job, delivery)`` tells ``consume``: what became of the job, and when
#: to deliver it again (None: done, ack it)
Outcome = tuple[str, "float | None"]


def consume(
    queue: Queue,
    worker: str,
    visibility: float,
    handle: Callable[[int, int], Outcome],
    until_empty: bool = False,
    note: Callable[[str], None] = lambda kind: None,
    errors: tuple[type[BaseException], ...] = (),
) -> None:
    """A worker's job loop: take a job, handle it, ack or nack it, again; with
    ``until_empty`` it returns once every job is done. ``errors`` of the queue are
    noted as ``fx_error`` and the loop goes on (a job taken is delivered again after
    its visibility timeout)."""
    idle = 0.0
    while True:
        try:
            got = queue.take(worker, visibility)
            if got is None and until_empty and queue.undone() == 0:
                return
        except errors:
            note("fx_error")
            time.sleep(0.05)
            continue
        if got is None:
            idle = min(0.02, idle + 0.002)
            time.sleep(idle)
            continue
        idle = 0.0
        job, delivery = got
        kind, again = handle(job, delivery)
        note(kind)
        try:
            queue.finish(job, worker, delivery, kind, again)
        except errors:
            note("fx_error")
